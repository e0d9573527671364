"""Programmatic dependent launch (PDL): a launch through the driver's cuLaunchKernelEx (ctypes, as callplan's tensor
maps) with the one attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.

Such a kernel may be scheduled before the kernel ahead of it in the stream has finished: at the latest once all of
that kernel's blocks have exited (earlier where they execute griddepcontrol.launch_dependents, which ours do not), so
its launch overlaps that kernel's end. It must then wait for that kernel's writes itself (griddepcontrol.wait, sm_90+:
a no-op when the kernel was launched plainly). Used by tree_verify's split-KV combine alone, when
ops/tree_verify/split.PDL_COMBINE is on (a Step's `pdl`; runtime and hostcode launch it through `launch`).

Under CUDA-graph stream capture the launch is captured as a kernel node with a programmatic dependency edge (drivers of
CUDA 12.3 and later): nothing to do here. The structs are cuda.h's (CUDA 12.0 and later), checked against the header by
tests/test_pdl_cpu.py.
"""
from __future__ import annotations

import ctypes

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # cuda.h, CUlaunchAttributeID


class CUlaunchAttributeValue(ctypes.Union):
    """cuda.h's union: 64 bytes, 8-byte aligned (some members hold pointers); only the member we set is named."""
    _fields_ = [("pad", ctypes.c_char * 64), ("align", ctypes.c_uint64),
                ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class CUlaunchAttribute(ctypes.Structure):
    """A 4-byte id (an enum), 4 bytes of padding, the value at byte 8: 72 bytes."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(ctypes.Structure):
    """The grid, block and dynamic shared memory (unsigned int each), the stream, the attributes: 56 bytes."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_DRIVER = []      # cuLaunchKernelEx and cuGetErrorName, looked up once
_CONFIGS = {}     # (grid, block, shared memory, stream) -> its config and attribute, made once and only read after


def _driver():
    if not _DRIVER:
        lib = ctypes.CDLL("libcuda.so.1")
        try:
            fn = lib.cuLaunchKernelEx
        except AttributeError:
            raise RuntimeError("programmatic dependent launch needs cuLaunchKernelEx, a CUDA 12.0 or later driver: "
                               "turn ddtree_gen.ops.tree_verify.split.PDL_COMBINE off") from None
        fn.argtypes = [ctypes.POINTER(CUlaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        name = lib.cuGetErrorName
        name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        name.restype = ctypes.c_int
        _DRIVER.extend((fn, name))
    return _DRIVER


def config(gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int, stream: int) -> CUlaunchConfig:
    """The launch config of a programmatic dependent launch of that geometry on `stream` (memoized: a cached call
    makes the same one every time)."""
    key = (gx, gy, gz, bx, by, bz, smem, stream)
    hit = _CONFIGS.get(key)
    if hit is None:
        attrs = (CUlaunchAttribute * 1)()
        attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[0].value.programmaticStreamSerializationAllowed = 1
        cfg = CUlaunchConfig(gx, gy, gz, bx, by, bz, smem, stream, attrs, 1)
        if len(_CONFIGS) > 4096:   # many streams or shapes come and go: forget the old ones
            _CONFIGS.clear()
        hit = _CONFIGS[key] = (cfg, attrs)   # (the attribute kept alive with the config that points at it)
    return hit[0]


def error_name(rc: int) -> str:
    """The CUresult's name (CUDA_ERROR_...), or '?' where the driver does not know it."""
    s = ctypes.c_char_p()
    if (_DRIVER or _driver())[1](rc, ctypes.byref(s)) != 0 or not s.value:
        return "?"
    return s.value.decode(errors="replace")


def launch(name: str, fn: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int, stream: int,
           params: int) -> None:
    """Launch function `fn` (kernel `name`, for the error) with its kernelParams array at address `params` on `stream`
    as a programmatic dependent of the kernel before it there. A failure raises RuntimeError naming the kernel."""
    hit = _CONFIGS.get((gx, gy, gz, bx, by, bz, smem, stream))
    cfg = hit[0] if hit is not None else config(gx, gy, gz, bx, by, bz, smem, stream)
    rc = (_DRIVER or _driver())[0](ctypes.byref(cfg), fn, params, None)
    if rc != 0:
        raise RuntimeError(f"{name}: cuLaunchKernelEx (programmatic dependent launch, grid ({gx}, {gy}, {gz}), block "
                           f"({bx}, {by}, {bz}), {smem} bytes of shared memory) failed: {error_name(rc)} (CUresult "
                           f"{rc}); ddtree_gen.ops.tree_verify.split.PDL_COMBINE = False launches it plainly")

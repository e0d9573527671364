"""Runtime: compiled modules per device, the launch itself, and the per-signature call cache.

A launcher splits its work in two (FlashInfer's plan/run, Triton's specialization cache):
  * prepare(...): every check that depends on the arguments' signatures (kind, dtype, shape,
    strides, device) and on the scalar arguments, and everything derived from them (grid,
    output shapes, the kernel's argument list). It runs once per signature and is cached
    (runtime.run_call); it raises ArgumentError before anything is launched or allocated.
  * per call: the data pointers, the pointer checks (alignment, overlap), the new outputs and
    the launch on the current stream of the arrays' device.
Modules are loaded lazily per device, under a lock, so a kernel set works on any GPU of the
process and from any thread; per device, each kernel's build is the one of its targets that runs
there (archs.select: the sm_90a cubin on compute capability 9.0, the sm_80 PTX elsewhere). This
module imports nothing above it (no artifacts, no launchers).
"""
from __future__ import annotations

import ctypes
import functools
import re
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import archs
from .arrays import allocate, dlpack_only, fast_view, from_dlpack, pointer_of
from .errors import ArgumentError, BuildError

__all__ = ["Step", "IsAligned", "TensorMap", "Prepared", "run_call", "DeviceModules", "Binary", "DeviceInfo",
           "device_info"]


# ----------------------------------------------------------------------------- one call


@dataclass(frozen=True)
class Step:
    """One kernel launch of a call. `args` are the kernel's parameters: an int is the index of an
    array in the call's array list (its pointer is passed), a (index, byte offset) pair a pointer
    into it, an IsAligned(index, bytes) the int32 flag "that pointer is so aligned", anything else
    (a numpy scalar) a constant."""
    kernel: str
    grid: tuple
    args: tuple
    fmt: str = ""    # struct format of the parameters (filled in by Prepared); "[...]": one struct parameter


@dataclass(frozen=True)
class ParamStruct:
    """One kernel parameter that is a struct passed by value (e.g. an array of pointers): its
    fields as Step args, laid out contiguously with their natural alignment."""
    items: tuple


@dataclass(frozen=True)
class IsAligned:
    """A kernel parameter computed per call: 1 (int32) if array `index` is `alignment`-byte aligned, else 0."""
    index: int
    alignment: int


@dataclass(frozen=True)
class TensorMap:
    """A kernel parameter computed per call: the CUtensorMap (128 bytes, passed by value) of array `index`
    viewed as a row-major [rows, cols] tensor of 2-byte elements, read in boxes of [box_rows, box_cols]
    with the 128-byte swizzle (what TMA loads into a wgmma operand tile). Encoded on the host for the
    call's pointer (cuTensorMapEncodeTiled, no device work) and remembered per pointer."""
    index: int
    rows: int
    cols: int
    box_rows: int
    box_cols: int


TENSOR_MAP_WORDS = 16   # sizeof(CUtensorMap) / 8
_TENSOR_MAPS: dict = {}  # (pointer, TensorMap) -> its 16 words
_ENCODE = []             # cuTensorMapEncodeTiled, looked up once


def _encode_tiled():
    if not _ENCODE:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _ENCODE.append(fn)
    return _ENCODE[0]


def tensor_map_words(ptr: int, tm: TensorMap) -> tuple:
    """The 16 uint64 words of the CUtensorMap of `tm` at pointer `ptr` (memoized per pointer)."""
    key = (ptr, tm)
    words = _TENSOR_MAPS.get(key)
    if words is None:
        out = (ctypes.c_uint64 * TENSOR_MAP_WORDS)()
        dims = (ctypes.c_uint64 * 2)(tm.cols, tm.rows)          # innermost first
        strides = (ctypes.c_uint64 * 1)(tm.cols * 2)             # bytes between rows
        box = (ctypes.c_uint32 * 2)(tm.box_cols, tm.box_rows)
        step = (ctypes.c_uint32 * 2)(1, 1)
        # UINT16 elements (bf16 bits moved as they are), no interleave, 128-byte swizzle, L2 promotion of
        # 256 bytes, out-of-bound elements read as zeros
        rc = _encode_tiled()(out, 1, 2, ctypes.c_void_p(ptr), dims, strides, box, step, 0, 3, 3, 0)
        if rc != 0:
            raise ArgumentError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for array {tm.index} at {ptr:#x}: "
                                f"[{tm.rows}, {tm.cols}] in boxes of [{tm.box_rows}, {tm.box_cols}]")
        words = tuple(out)
        if len(_TENSOR_MAPS) > 4096:   # many short-lived caches: forget the old ones
            _TENSOR_MAPS.clear()
        _TENSOR_MAPS[key] = words
    return words


def _param_fmt(args) -> str:
    """Native struct format of a kernel's parameters (each aligned to its size, as CUDA lays them out);
    a ParamStruct's fields are bracketed: the driver takes one pointer per kernel parameter."""
    codes = []
    for a in args:
        if isinstance(a, ParamStruct):
            codes.append("[" + _param_fmt(a.items)[1:] + "]")
        elif isinstance(a, TensorMap):
            codes.append("[" + "Q" * TENSOR_MAP_WORDS + "]")
        elif isinstance(a, (int, tuple)):
            codes.append("Q")
        elif isinstance(a, IsAligned):
            codes.append("i")
        else:
            codes.append({np.dtype(np.int32): "i", np.dtype(np.float32): "f", np.dtype(np.int64): "q",
                          np.dtype(np.uint64): "Q"}[np.asarray(a).dtype])
    return "@" + "".join(codes)


@dataclass
class Prepared:
    """What the checks concluded for one call signature; everything except the pointers.

    arrays: the call's array list is the launcher's array arguments (inputs, then outputs; None
    where not given) in a fixed order; `new` lists (index, shape, dtype) of those to allocate when
    not given. `aligned`: (index, bytes, message); `disjoint`: (a, a_bytes, b, b_bytes, exact_ok,
    message) pairs that must not overlap (exact_ok: the same pointer is allowed, an in-place op).
    `result(arrays)` builds the launcher's return value from the final array list."""
    device: int
    kind: str                       # "torch", "cupy" or "cai": the kind of arrays to allocate
    steps: tuple
    result: Callable
    new: tuple = ()
    aligned: tuple = ()
    disjoint: tuple = ()

    def __post_init__(self):
        self.steps = tuple(Step(s.kernel, s.grid, s.args, _param_fmt(s.args)) for s in self.steps)

    def check_pointers(self, ptrs: list) -> None:
        for i, alignment, message in self.aligned:
            if ptrs[i] % alignment:
                raise ArgumentError(message.format(ptr=ptrs[i]))
        for a, na, b, nb, exact_ok, message in self.disjoint:
            pa, pb = ptrs[a], ptrs[b]
            if na and nb and pa < pb + nb and pb < pa + na and not (exact_ok and pa == pb):
                raise ArgumentError(message)


def run_call(kset, prepare: Callable, arrays: tuple, key: tuple, *, cache: bool = True):
    """Run one launcher call: the cached Prepared of this signature (prepare() on a miss), the
    pointer checks, new outputs, the launches. `prepare()` takes no arguments (a closure over the
    launcher's arguments); `key` holds the launcher's non-array arguments that prepare reads."""
    ptrs, sigs = [], []
    for i, a in enumerate(arrays):
        if a is None:
            ptrs.append(0)
            sigs.append(None)
            continue
        p, s = fast_view(a)
        if s is None:   # not cacheable: checked in full by prepare(), which names what is wrong
            cache = False
            if dlpack_only(a):   # launched through its zero-copy CuPy view, returned as that view
                arrays = (*arrays[:i], from_dlpack(a, "argument"), *arrays[i + 1:])
                p, _ = fast_view(arrays[i])
        ptrs.append(p)
        sigs.append(s)
    prepared_calls = kset.prepared_calls
    k = (prepare.__code__, key, tuple(sigs)) if cache else None
    try:
        prep = prepared_calls.get(k) if cache else None
    except TypeError:   # an unhashable scalar argument (a list as softmax_scale / kv_scale): prepare() refuses it
        cache, prep = False, None
    if prep is None:
        prep = prepare()
        if cache:
            prepared_calls[k] = prep
    prep.check_pointers(ptrs)
    if prep.new:
        arrays = list(arrays)
        for i, shape, dtype in prep.new:
            if arrays[i] is None:
                arrays[i] = allocate(prep.kind, prep.device, shape, dtype)
                ptrs[i] = pointer_of(arrays[i])
    for step in prep.steps:
        args = _values(step.args, ptrs)
        kset.launch(step.kernel, grid=step.grid, args=args, device=prep.device, kind=prep.kind, fmt=step.fmt)
    return prep.result(arrays)


def param_offsets(fmt: str) -> list:
    """Byte offset of each kernel parameter in the packed buffer of `fmt` (natural alignment; a
    bracketed struct is one parameter, aligned to its largest field)."""
    offsets, off, i = [], 0, 1
    while i < len(fmt):
        if fmt[i] == "[":
            j = fmt.index("]", i)
            fields = fmt[i + 1:j]
            align = max(struct.calcsize("@" + c) for c in fields)
            off = -(-off // align) * align
            offsets.append(off)
            off += struct.calcsize("@" + fields)
            i = j + 1
        else:
            n = struct.calcsize("@" + fmt[i])
            off = -(-off // n) * n
            offsets.append(off)
            off += n
            i += 1
    return offsets


def _values(args, ptrs) -> list:
    """A step's parameter values for this call's pointers (a ParamStruct's fields inline)."""
    out = []
    for a in args:
        t = type(a)
        if t is int:
            out.append(ptrs[a])
        elif t is tuple:
            out.append(ptrs[a[0]] + a[1])
        elif t is IsAligned:
            out.append(np.int32(ptrs[a.index] % a.alignment == 0))
        elif t is ParamStruct:
            out.extend(_values(a.items, ptrs))
        elif t is TensorMap:
            out.extend(tensor_map_words(ptrs[a.index], a))
        else:
            out.append(a)
    return out


# ----------------------------------------------------------------------- devices, launch

@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    """Streaming multiprocessors of `device` (132 on H100 / H200 SXM when it cannot be asked)."""
    try:
        import cupy
        return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    except Exception:   # no device (argument-check tests)
        return 132


_CUDA = {}   # the driver/runtime entry points a launch uses, looked up once


def _cuda() -> dict:
    if not _CUDA:
        import cupy
        from cupy.cuda import driver, runtime
        _CUDA.update(launch=driver.launchKernel, get_device=runtime.getDevice, set_device=runtime.setDevice,
                     cupy_stream=cupy.cuda.get_current_stream)
        try:
            import torch
            _CUDA["torch_stream"] = torch._C._cuda_getCurrentRawStream
        except (ImportError, AttributeError):
            pass
    return _CUDA


def current_stream(device: int, kind: str) -> int:
    """The caller's current stream on `device`: torch's for torch inputs, else CuPy's."""
    cuda = _CUDA or _cuda()
    if kind == "torch":
        return cuda["torch_stream"](device)
    return cuda["cupy_stream"](device).ptr


@dataclass(frozen=True)
class DeviceInfo:
    """What the choice of a build needs to know about a device."""
    name: str
    cc: tuple            # compute capability (major, minor)
    smem_optin: int      # shared memory per block a kernel may opt in to, bytes

    def describe(self, device: int) -> str:
        return f"device {device} ({self.name}, compute capability {archs.cc_text(self.cc)})"


@functools.lru_cache(maxsize=None)
def device_info(device: int) -> DeviceInfo:
    """The name, compute capability and opt-in shared memory limit of `device` (asked once)."""
    from cupy.cuda import runtime
    p = runtime.getDeviceProperties(device)
    name = p["name"].decode(errors="replace") if isinstance(p["name"], bytes) else str(p["name"])
    return DeviceInfo(name, (int(p["major"]), int(p["minor"])), int(p["sharedMemPerBlockOptin"]))


@dataclass(frozen=True)
class Binary:
    """One build of a kernel: the shipped binary (a cubin, or PTX text the driver JIT-compiles) and its launch geometry."""
    data: bytes
    entry: str           # extern "C" symbol
    threads: int         # threads per block
    dynamic_smem: int    # dynamic shared memory bytes per block (passed at launch)
    static_smem: int = 0   # static shared memory bytes per block


class DeviceModules:
    """The binaries of a kernel set, one per build target (archs.py), loaded per device on first use
    (thread-safe), and the launch.

    kernels: name -> {target: Binary} (or a bare Binary / (data, entry, threads, dynamic smem) tuple:
    an sm_90a build). Per kernel and device the build is archs.select(): the sm_90a cubin on compute
    capability 9.0, the sm_80 PTX on any other of 8.0 or later; `forced` (a target) makes it that one
    everywhere. A kernel whose builds do not run on a device, or need more shared memory per block
    than it allows, is not available there: unavailable() says why, and function() / launch() raise
    ArgumentError with that text."""

    def __init__(self, kernels: dict, forced: str | None = None):
        self._kernels = {name: _builds(b) for name, b in kernels.items()}
        self.forced = forced
        self._loaded: dict = {}       # (name, device) -> (module, function pointer, threads, dynamic smem)
        self._chosen: dict = {}       # (name, device) -> (target or None, reason or None)
        self._lock = threading.Lock()
        self._params: dict = {}       # parameter format -> (buffer, kernelParams address, lock, flat format, keep-alive)

    @property
    def names(self) -> list:
        return list(self._kernels)

    def archs(self, name: str) -> tuple:
        """The targets `name` is built for in this set, in preference order."""
        return archs.ordered(self._kernels.get(name, {}))

    def choose(self, name: str, device: int) -> tuple:
        """(target, None) of the build of `name` that runs on `device`, or (None, why not)."""
        hit = self._chosen.get((name, device))
        if hit is None:
            hit = self._chosen.setdefault((name, device), self._choose(name, device))
        return hit

    def _choose(self, name, device):
        info = device_info(device)
        builds = self._kernels.get(name, {})
        arch = archs.select(info.cc, builds, self.forced)
        where = f"{name}: not available on {info.describe(device)}"
        if arch is None:
            return None, f"{where}: {archs.why_not(info.cc, builds, self.forced)}"
        b = builds[arch]
        need = b.static_smem + b.dynamic_smem
        if need > info.smem_optin:
            return None, (f"{where}: its {arch} build needs {need} bytes of shared memory per block, the device "
                          f"allows {info.smem_optin}")
        return arch, None

    def arch_for(self, name: str, device: int) -> str | None:
        return self.choose(name, device)[0]

    def unavailable(self, name: str, device: int) -> str | None:
        """None if `name` can run on `device`, else why not (naming the kernel, the device and its
        compute capability)."""
        return self.choose(name, device)[1]

    def function(self, name: str, device: int) -> int:
        return self._entry(name, device)[1]

    def _entry(self, name: str, device: int):
        hit = self._loaded.get((name, device))
        if hit is not None:
            return hit
        with self._lock:
            if (name, device) not in self._loaded:
                self._loaded[(name, device)] = self._load(name, device)
            return self._loaded[(name, device)]

    def _load(self, name: str, device: int):
        import cupy
        arch, why = self.choose(name, device)
        if arch is None:
            raise ArgumentError(why)
        b = self._kernels[name][arch]
        with cupy.cuda.Device(device):
            module = cupy.cuda.function.Module()
            try:
                module.load(b.data)
            except cupy.cuda.driver.CUDADriverError as e:
                raise BuildError(_load_error(name, arch, b.data, device, e)) from None
            fn = module.get_function(b.entry)
            if b.dynamic_smem > 48 * 1024:   # above 48 KB a block gets dynamic shared memory only by opting in, per device
                drv = cupy.cuda.driver
                drv.funcSetAttribute(fn.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, b.dynamic_smem)
        return module, fn.ptr, b.threads, b.dynamic_smem   # the module object keeps the function alive

    def _param_buffer(self, fmt: str):
        """(buffer, kernelParams address, lock, flat struct format, keep-alive) for a parameter layout."""
        buf = self._params.get(fmt)
        if buf is None:
            with self._lock:
                flat = fmt.replace("[", "").replace("]", "")
                storage = ctypes.create_string_buffer(max(struct.calcsize(flat), 8))
                base = ctypes.addressof(storage)
                starts = [base + o for o in param_offsets(fmt)]
                params = (ctypes.c_void_p * max(1, len(starts)))(*starts)
                buf = self._params.setdefault(fmt, (storage, ctypes.addressof(params), threading.Lock(), flat,
                                                    params))
        return buf

    def launch(self, name: str, grid: tuple, args: list, device: int, kind: str, fmt: str) -> None:
        """Launch `name` on `device`'s current stream (switching the thread's device for the call only)."""
        cuda = _CUDA or _cuda()
        _, fn, threads, smem = self._loaded.get((name, device)) or self._entry(name, device)
        stream = current_stream(device, kind)
        storage, params, lock, flat, _ = self._params.get(fmt) or self._param_buffer(fmt)
        gx, gy, gz = (*grid, 1, 1)[:3]
        previous = cuda["get_device"]()
        if previous != device:
            cuda["set_device"](device)
        try:
            with lock:   # the parameter buffer is reused; the driver copies it at launch
                struct.pack_into(flat, storage, 0, *args)
                cuda["launch"](fn, gx, gy, gz, threads, 1, 1, smem, stream, params, 0)
        finally:
            if previous != device:
                cuda["set_device"](previous)


def _builds(b) -> dict:
    """A kernel's builds as {target: Binary} (DeviceModules' input forms)."""
    if isinstance(b, dict):
        return {a: x if isinstance(x, Binary) else Binary(*x) for a, x in b.items()}
    return {archs.PRIMARY: b if isinstance(b, Binary) else Binary(*b)}


def _ptx_header(data: bytes) -> tuple:
    """(PTX ISA version, the CUDA release that wrote it) from a PTX text's header, '?' where absent."""
    head = data[:1024].decode(errors="replace")
    isa = re.search(r"^\.version\s+(\S+)", head, re.M)
    release = re.search(r"release (\d+\.\d+)", head)
    return (isa.group(1) if isa else "?"), (release.group(1) if release else "?")


def _load_error(name: str, arch: str, data: bytes, device: int, error) -> str:
    """The message of a module that the driver refused to load."""
    where = f"{name}: the driver could not load its {arch} build on {device_info(device).describe(device)}: {error}"
    if archs.BINARY[arch] != "ptx":
        return where
    isa, release = _ptx_header(data)
    try:
        from cupy.cuda import runtime
        v = runtime.driverGetVersion()
        driver = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:   # noqa: BLE001 - only for the message
        driver = "?"
    return (f"{where}. The PTX (ISA {isa}) was written by NVRTC {release}; the driver (CUDA {driver}) JIT-compiles "
            f"only PTX of its own CUDA version or older (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): install an NVRTC no "
            f"newer than the driver (pip install 'nvidia-cuda-nvrtc=={driver}.*') and rebuild, or update the driver")

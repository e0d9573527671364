"""Runtime: loading a spec's compiled kernels and launching them on CUDA arrays.

Launchers take CuPy arrays, torch CUDA tensors, or any CUDA array speaking DLPack or
__cuda_array_interface__, without copies. Every argument is checked (kind, device, dtype,
shape, contiguity) before anything is launched; outputs are allocated of the caller's kind.
bf16 data is uint16 raw bits on the CuPy side and torch.bfloat16 on the torch side.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ArgumentError, DdtreeError

__all__ = ["ArgumentError", "KernelSet", "load"]

_TORCH_DTYPES = {"torch.int32": "int32", "torch.float32": "float32", "torch.uint32": "uint32",
                 "torch.bfloat16": "bf16", "torch.uint16": "bf16", "torch.int64": "int64",
                 "torch.float16": "float16", "torch.float64": "float64", "torch.int16": "int16"}
_NUMPY_DTYPES = {"int32": "int32", "float32": "float32", "uint32": "uint32", "uint16": "bf16",
                 "int64": "int64", "float16": "float16", "float64": "float64", "int16": "int16"}
_DTYPE_NAMES = {"bf16": "bf16 (uint16 bits on CuPy, torch.bfloat16 on torch)"}


_CAI_DTYPES = {"<i4": "int32", "<f4": "float32", "<u4": "uint32", "<u2": "bf16", "<i8": "int64",
               "<f2": "float16", "<f8": "float64", "<i2": "int16", "|u1": "uint8", "|i1": "int8"}


@dataclass
class DevArray:
    """A checked view of one CUDA array argument: what a launch needs, and the caller's object."""
    obj: Any
    ptr: int
    shape: tuple
    dtype: str
    kind: str  # "cupy", "torch" or "cai" (any __cuda_array_interface__ object)
    _device: int | None = None

    @property
    def device(self) -> int:
        if self._device is None:
            self._device = _pointer_device(self.ptr)
        return self._device


def _pointer_device(ptr: int) -> int:
    import cupy
    return cupy.cuda.runtime.pointerGetAttributes(ptr).device


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _describe(x) -> str:
    return f"{type(x).__module__}.{type(x).__name__}"


def _c_contiguous(shape, strides, itemsize) -> bool:
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _view(x, name: str) -> tuple[DevArray, bool]:
    """(DevArray, is C-contiguous) for any supported CUDA array; no copy, no GPU call."""
    if _is_torch(x):
        if not x.is_cuda:
            raise ArgumentError(f"{name}: a host torch tensor (device {x.device}); pass a CUDA tensor")
        dt = _TORCH_DTYPES.get(str(x.dtype), str(x.dtype))
        return DevArray(x, x.data_ptr(), tuple(x.shape), dt, "torch", x.device.index), x.is_contiguous()
    if isinstance(x, np.ndarray):
        raise ArgumentError(f"{name}: a host numpy array; pass a CUDA array (CuPy or torch)")
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        dt = _NUMPY_DTYPES.get(x.dtype.name, x.dtype.name)
        return DevArray(x, x.data.ptr, tuple(x.shape), dt, "cupy", x.device.id), x.flags.c_contiguous
    cai = getattr(x, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        shape = tuple(int(d) for d in cai["shape"])
        typestr = cai["typestr"]
        itemsize = int(typestr[2:])
        strides = cai.get("strides")
        contiguous = strides is None or _c_contiguous(shape, strides, itemsize)
        return DevArray(x, int(cai["data"][0]), shape, _CAI_DTYPES.get(typestr, typestr), "cai"), contiguous
    if hasattr(x, "__dlpack__"):
        import cupy
        try:
            return _view(cupy.from_dlpack(x), name)  # zero-copy view
        except ArgumentError:
            raise
        except Exception as e:
            raise ArgumentError(f"{name}: DLPack object {_describe(x)} is not a usable CUDA array ({e})") from None
    raise ArgumentError(f"{name}: expected a CUDA array (CuPy, torch, DLPack or __cuda_array_interface__), "
                        f"got {_describe(x)}")


def device_array(x, name: str, *, dtype: str, shape: tuple | None = None, ndim: int | None = None) -> DevArray:
    """Check one argument and return its DevArray; raise ArgumentError naming `name` otherwise."""
    if x is None:
        raise ArgumentError(f"{name}: required, got None")
    arr, contiguous = _view(x, name)
    if arr.dtype != dtype:
        raise ArgumentError(f"{name}: dtype {arr.dtype}, expected {_DTYPE_NAMES.get(dtype, dtype)}")
    if ndim is not None and len(arr.shape) != ndim:
        raise ArgumentError(f"{name}: {len(arr.shape)} dimensions {arr.shape}, expected {ndim}")
    if shape is not None and arr.shape != tuple(shape):
        raise ArgumentError(f"{name}: shape {arr.shape}, expected {tuple(shape)}")
    if not contiguous:
        raise ArgumentError(f"{name}: not C-contiguous; pass a contiguous array (e.g. .contiguous() / "
                            f"cupy.ascontiguousarray)")
    return arr


def same_device(*arrays: DevArray) -> int:
    dev = arrays[0].device
    for a in arrays[1:]:
        if a.device != dev:
            raise ArgumentError(f"arrays on different devices: device {dev} and device {a.device}")
    return dev


def int_arg(value, name: str, *, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ArgumentError(f"{name}: {int(value)} must be in [{lo}, {hi}]")
    return int(value)


def float_arg(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    if not math.isfinite(float(value)):
        raise ArgumentError(f"{name}: {float(value)} must be finite")
    return float(value)


def i32(v) -> np.int32:
    return np.int32(v)


def f32(v) -> np.float32:
    return np.float32(v)


def allocate(like: DevArray, shape: tuple, dtype: str):
    """A new uninitialised array of the caller's kind on the caller's device."""
    if like.kind == "torch":
        import torch
        tdt = {"bf16": torch.bfloat16, "int32": torch.int32, "float32": torch.float32,
               "uint32": torch.uint32}[dtype]
        return torch.empty(shape, dtype=tdt, device=f"cuda:{like.device}")
    import cupy  # CuPy for CuPy callers and for other __cuda_array_interface__ callers
    with cupy.cuda.Device(like.device):
        return cupy.empty(shape, dtype={"bf16": np.uint16}.get(dtype, dtype))


def outputs(out, record, shapes: dict, like: DevArray) -> list[DevArray]:
    """Check the caller's out= buffers (a `record` or anything with its fields) or allocate them."""
    arrays = []
    for field in record._fields:
        shape, dtype = shapes[field]
        if out is None:
            obj = allocate(like, shape, dtype)
        else:
            if not hasattr(out, field):
                raise ArgumentError(f"out: has no field {field!r} (expected a {record.__name__})")
            obj = getattr(out, field)
        a = device_array(obj, f"out.{field}", dtype=dtype, shape=shape)
        same_device(like, a)
        arrays.append(a)
    return arrays


def _stream(like: DevArray):
    import cupy
    if like.kind == "torch":
        import torch
        ptr = torch.cuda.current_stream(like.device).cuda_stream
        return cupy.cuda.ExternalStream(ptr, like.device) if ptr else cupy.cuda.Stream.null
    return cupy.cuda.get_current_stream()


class KernelSet:
    """The compiled kernels of one spec. Launchers are attributes: kset.tree_build(...)."""

    def __init__(self, spec, built: dict, kdefs=None):
        """`built`: kernel name -> artifacts.Built; `kdefs`: the KernelDefs (default: every registered one)."""
        import cupy
        from .kernels import all_kernels
        self.spec = spec
        self._built = built
        self._functions = {}
        self._plans = {}
        self._constants = {}
        for kdef in kdefs if kdefs is not None else all_kernels():
            if kdef.name not in built:
                continue
            module = cupy.cuda.function.Module()
            module.load(built[kdef.name].cubin)
            fn = module.get_function(kdef.entry)
            plan = kdef.plan(spec)
            dyn = plan.value(plan.dynamic_smem)
            if dyn > 48 * 1024:  # above 48 KB a block gets dynamic shared memory only by opting in
                drv = cupy.cuda.driver
                drv.funcSetAttribute(fn.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dyn)
            # launch geometry is evaluated once here: sympy has no place on the launch path
            self._functions[kdef.name] = (module, fn, (plan.value(plan.threads),), dyn)
            self._plans[kdef.name] = plan
            self._constants[kdef.name] = plan.template_constants()
            setattr(self, kdef.name, _bind(kdef.launch, self))

    @property
    def kernels(self) -> list[str]:
        return list(self._functions)

    def plan(self, name):
        return self._plans[name]

    def constants(self, name) -> dict:
        """The kernel's template constants (THREADS, BN, ...), evaluated once at load."""
        return self._constants[name]

    def launch(self, name: str, *, grid: tuple, args: list, like: DevArray, block=None, smem=None):
        """Launch kernel `name` on the caller's current stream, on the caller's device."""
        import cupy
        _, fn, default_block, default_smem = self._functions[name]
        block = block or default_block
        smem = default_smem if smem is None else smem
        raw = tuple(np.uint64(a.ptr) if isinstance(a, DevArray) else a for a in args)
        with cupy.cuda.Device(like.device):
            fn(tuple(grid), tuple(block), raw, shared_mem=smem, stream=_stream(like))

    def __repr__(self):
        return f"KernelSet({self.spec.name!r}, kernels={self.kernels})"


def _bind(launch, kset):
    def bound(*args, **kwargs):
        return launch(kset, *args, **kwargs)
    bound.__name__ = launch.__module__.rsplit(".", 1)[-1]
    bound.__doc__ = launch.__doc__
    return bound


_LOADED: dict = {}
_LOCK = threading.Lock()


def load(spec, *, kernels=None) -> KernelSet:
    """The compiled kernel set of a spec (a name from specs/, a path, or a Spec), building it if needed."""
    from . import artifacts
    from .spec import Spec
    spec = spec if isinstance(spec, Spec) else artifacts.find_spec(spec)
    key = (spec, tuple(kernels) if kernels else None)
    with _LOCK:
        if key not in _LOADED:
            built = artifacts.ensure_built(spec, kernels=kernels)
            try:
                _LOADED[key] = KernelSet(spec, built)
            except ImportError as e:
                raise DdtreeError(f"loading kernels needs CuPy with a CUDA device: {e}") from None
        return _LOADED[key]

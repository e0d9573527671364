"""The caller's CUDA arrays: zero-copy views, argument checks, signatures and new outputs.

Launchers take CuPy arrays, torch CUDA tensors, or any CUDA array speaking DLPack or
__cuda_array_interface__, without copies. bf16 data is uint16 raw bits on the CuPy side and
torch.bfloat16 on the torch side; the e4m3 KV cache of an fp8 spec is uint8 bytes on the CuPy side
and torch.float8_e4m3fn (or torch.uint8) on the torch side (kv_array).

Two views of an array:
  * view() / device_array(): a DevArray with everything the checks read (the first call of a
    signature, see runtime.run_call);
  * fast_view(): (pointer, signature), the per-call path. The signature holds what the checks
    depend on besides the pointer (kind, dtype, shape, strides, device): equal signatures pass
    or fail the same checks, so their outcome is cached per signature.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ArgumentError

_TORCH_DTYPES = {"torch.int32": "int32", "torch.float32": "float32", "torch.uint32": "uint32",
                 "torch.bfloat16": "bf16", "torch.uint16": "bf16", "torch.int64": "int64",
                 "torch.float16": "float16", "torch.float64": "float64", "torch.int16": "int16",
                 "torch.uint8": "uint8", "torch.int8": "int8", "torch.float8_e4m3fn": "fp8_e4m3"}
_NUMPY_DTYPES = {"int32": "int32", "float32": "float32", "uint32": "uint32", "uint16": "bf16",
                 "int64": "int64", "float16": "float16", "float64": "float64", "int16": "int16"}
_CAI_DTYPES = {"<i4": "int32", "<f4": "float32", "<u4": "uint32", "<u2": "bf16", "<i8": "int64",
               "<f2": "float16", "<f8": "float64", "<i2": "int16", "|u1": "uint8", "|i1": "int8"}
_DTYPE_NAMES = {"bf16": "bf16 (uint16 bits on CuPy, torch.bfloat16 on torch)"}
ITEMSIZE = {"bf16": 2, "float32": 4, "int32": 4, "uint32": 4, "int64": 8, "float16": 2, "float64": 8,
            "int16": 2, "uint8": 1, "int8": 1, "fp8_e4m3": 1}
# a KV cache per spec kv_dtype: the dtypes (as view() names them) that hold it, and how to say so
KV_CACHE_DTYPES = {"bf16": ("bf16",), "fp8_e4m3": ("uint8", "fp8_e4m3")}
KV_CACHE_NAMES = {"bf16": "bf16 (uint16 bits on CuPy, torch.bfloat16 on torch)",
                  "fp8_e4m3": "e4m3 bytes (uint8 on CuPy, torch.float8_e4m3fn or torch.uint8 on torch)"}


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

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE.get(self.dtype, 1)


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


def from_dlpack(x, name: str):
    """A zero-copy CuPy view of a DLPack-only object."""
    import cupy
    try:
        return cupy.from_dlpack(x)
    except Exception as e:
        raise ArgumentError(f"{name}: DLPack object {_describe(x)} is not a usable CUDA array ({e})") from None


def view(x, name: str) -> tuple[DevArray, bool]:
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
        return view(from_dlpack(x, name), name)
    raise ArgumentError(f"{name}: expected a CUDA array (CuPy, torch, DLPack or __cuda_array_interface__), "
                        f"got {_describe(x)}")


def _torch_fast(x):
    dev = x.get_device()
    return x.data_ptr(), ((x.dtype, x.shape, x.stride(), dev) if dev >= 0 else None)


def _cupy_fast(x):
    return x.data.ptr, (x.dtype, x.shape, x.strides, x.device.id)


_FAST = {}   # array class -> its fast view (torch.Tensor and CuPy's ndarray, found on first sight)
TORCH_TENSOR = [None]   # torch.Tensor once a torch array was seen (runtime.run_call reads its arrays inline)


def dlpack_only(x) -> bool:
    """An object that speaks DLPack but is neither torch, CuPy, numpy nor __cuda_array_interface__."""
    return (hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray) and not _is_torch(x)
            and type(x).__module__.split(".")[0] != "cupy" and not hasattr(x, "__cuda_array_interface__"))


def fast_view(x) -> tuple[int, tuple | None]:
    """(data pointer, signature) of an array argument; signature None: not cacheable (the checks
    of view() will say what is wrong with it). Cheap: no Python object is built for torch/CuPy."""
    t = type(x)
    fast = _FAST.get(t)
    if fast is not None:
        p, sig = fast(x)
        return p, (sig and (t, *sig))
    mod = t.__module__.split(".")[0]
    if mod in ("torch", "cupy"):
        _FAST[t] = _torch_fast if mod == "torch" else _cupy_fast
        if mod == "torch" and TORCH_TENSOR[0] is None:
            import torch
            TORCH_TENSOR[0] = torch.Tensor
        return fast_view(x)
    cai = getattr(x, "__cuda_array_interface__", None)
    if isinstance(cai, dict) and not isinstance(x, np.ndarray):
        ptr = int(cai["data"][0])
        strides = cai.get("strides")
        return ptr, ("cai", cai["typestr"], tuple(cai["shape"]), tuple(strides) if strides else None,
                     _pointer_device(ptr))
    return 0, None


def device_array(x, name: str, *, dtype: str, shape: tuple | None = None, ndim: int | None = None) -> DevArray:
    """Check one argument and return its DevArray; raise ArgumentError naming `name` otherwise."""
    if x is None:
        raise ArgumentError(f"{name}: required, got None")
    arr, contiguous = view(x, name)
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


def kv_array(x, name: str, spec, *, ndim: int) -> DevArray:
    """A KV cache argument of `spec`: its dtype must hold the spec's kv_dtype (KV_CACHE_DTYPES; the message
    names the argument, the dtype found and what the kv_dtype needs), then device_array's checks."""
    if x is None:
        raise ArgumentError(f"{name}: required, got None")
    arr, _ = view(x, name)
    accepted = KV_CACHE_DTYPES[spec.kv_dtype]
    if arr.dtype not in accepted:
        raise ArgumentError(f"{name}: dtype {arr.dtype}, expected {KV_CACHE_NAMES[spec.kv_dtype]} for kv_dtype "
                            f"{spec.kv_dtype!r} of spec {spec.name!r}")
    return device_array(x, name, dtype=arr.dtype, ndim=ndim)


def same_device(arrays: dict) -> int:
    """The device of every array (name -> DevArray); the message names the first one that differs."""
    names = list(arrays)
    dev = arrays[names[0]].device
    for name in names[1:]:
        if arrays[name].device != dev:
            raise ArgumentError(f"{name}: on device {arrays[name].device}, but {names[0]} is on device {dev} "
                                f"(arrays on different devices)")
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


def record_fields(out, record) -> tuple:
    """The arrays of an out= record (anything with the record's fields), checked for the fields."""
    fields = []
    for field in record._fields:
        if not hasattr(out, field):
            raise ArgumentError(f"out: has no field {field!r} (expected a {record.__name__})")
        fields.append(getattr(out, field))
    return tuple(fields)


def record_outputs(arrays, first: int, shapes: dict, given: bool, like_name: str, like: DevArray) -> tuple:
    """The outputs of a record-returning launcher, at arrays[first:] in the record's field order
    (`shapes`: field -> (shape, dtype)): when `given`, each is checked (dtype, shape, contiguity,
    like's device). Returns their (index, shape, dtype), the runtime's `new` list."""
    new = []
    for i, (field, (shape, dtype)) in enumerate(shapes.items()):
        if given:
            o = device_array(arrays[first + i], f"out.{field}", dtype=dtype, shape=shape)
            same_device({like_name: like, f"out.{field}": o})
        new.append((first + i, shape, dtype))
    return tuple(new)


_TORCH_NEW = {}      # (dtype name, device) -> torch.empty keyword arguments
_TORCH_DEVICES = {}  # device index -> torch.device("cuda", index)


def torch_dtype(dtype: str):
    """The torch dtype of an output dtype name."""
    import torch
    return {"bf16": torch.bfloat16, "int32": torch.int32, "float32": torch.float32, "uint32": torch.uint32,
            "uint8": torch.uint8}[dtype]


def torch_device(device: int):
    """torch.device("cuda", device), made once per device."""
    d = _TORCH_DEVICES.get(device)
    if d is None:
        import torch
        d = _TORCH_DEVICES[device] = torch.device("cuda", device)
    return d


def _torch_empty_kwargs(dtype: str, device: int) -> dict:
    import torch
    kw = {"dtype": torch_dtype(dtype), "device": torch_device(device)}
    _TORCH_NEW[(dtype, device)] = (torch.empty, kw)
    return _TORCH_NEW[(dtype, device)]


def allocate(kind: str, device: int, shape: tuple, dtype: str):
    """A new uninitialised array of the caller's kind on `device` (CuPy for CuPy and other callers)."""
    if kind == "torch":
        empty, kw = _TORCH_NEW.get((dtype, device)) or _torch_empty_kwargs(dtype, device)
        return empty(shape, **kw)
    import cupy
    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype={"bf16": np.uint16}.get(dtype, dtype))


def pointer_of(x) -> int:
    """The data pointer of an array we allocated (torch or CuPy)."""
    return x.data_ptr() if hasattr(x, "data_ptr") else x.data.ptr

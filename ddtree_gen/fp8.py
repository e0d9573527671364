"""e4m3 (float8_e4m3fn) data on the numpy side: the KV cache of an fp8 spec (kv_dtype = "fp8_e4m3").

An fp8 cache holds one byte per element: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, with
subnormals, no infinities, NaN = s.1111.111 (bytes 0x7f and 0xff), largest finite value 448. The value
an element stands for is e4m3(byte) * kv_scale (one per-tensor scale, a float argument of the attention
launchers). CuPy and numpy hold the bytes as uint8, torch as torch.float8_e4m3fn (or uint8);
an ml_dtypes.float8_e4m3fn array is taken as its bytes.

The conversions go through ml_dtypes, a dependency of the package (issue 19: `ddtree-gen refs` and the
references of an fp8 spec need it); it is imported on first use, so `import ddtree_gen` does not load it.
"""
from __future__ import annotations

import numpy as np

MAX = 448.0                 # the largest finite e4m3 value
NAN_BYTES = (0x7F, 0xFF)    # the only NaN encodings (no infinities)
DTYPE_NAME = "float8_e4m3fn"


def ml_dtypes():
    """The ml_dtypes module; ImportError saying how to get it when it is missing."""
    try:
        import ml_dtypes as mod
    except ImportError:
        raise ImportError("e4m3 data on the numpy side needs ml_dtypes, a dependency of ddtree-gen that is "
                          "missing here: pip install ml_dtypes (or reinstall ddtree-gen)") from None
    return mod


def is_e4m3(a) -> bool:
    """Whether a numpy array holds e4m3 data: uint8 bytes or an ml_dtypes.float8_e4m3fn array."""
    dt = np.asarray(a).dtype if not isinstance(a, np.dtype) else a
    return dt == np.uint8 or dt.name == DTYPE_NAME


def as_bytes(a) -> np.ndarray:
    """The bytes of e4m3 data (uint8 or ml_dtypes.float8_e4m3fn), as a uint8 view."""
    a = np.asarray(a)
    if not is_e4m3(a):
        raise TypeError(f"expected e4m3 data (uint8 bytes or {DTYPE_NAME}), got {a.dtype}")
    return a.view(np.uint8)


def to_float64(a) -> np.ndarray:
    """e4m3 bytes (uint8) or an ml_dtypes.float8_e4m3fn array -> float64, exactly (NaN bytes give NaN)."""
    return as_bytes(a).view(ml_dtypes().float8_e4m3fn).astype(np.float64)


def from_float(x) -> np.ndarray:
    """Float values -> e4m3 bytes (uint8), rounded to nearest, ties to even (float64 input is rounded to
    float32 first). Magnitudes past 464 become NaN bytes (ml_dtypes' rule): scale the data into +-448."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    return x.astype(ml_dtypes().float8_e4m3fn).view(np.uint8)


def dequantize(a, kv_scale: float) -> np.ndarray:
    """The values an fp8 cache stands for: e4m3(byte) * kv_scale, in float64."""
    return to_float64(a) * float(kv_scale)


# the bf16 NaN the kernels' exact conversion (templates/common.cuh.j2, fp8x2_hi_to_bf16x2) gives a NaN byte: its sign,
# then 0x7ff0 (the +-480 its fields would stand for, with the quiet-NaN bits set)
BF16_NAN = 0x7FF0


def to_bf16_bits(a) -> np.ndarray:
    """e4m3 bytes -> bf16 bits (uint16), exactly as the kernels convert them: every finite e4m3 value is a bf16
    value (subnormals, +-0 included), a NaN byte becomes its sign | BF16_NAN."""
    from .bf16 import to_bits
    table = to_bits(to_float64(np.arange(256, dtype=np.uint8)))
    table[list(NAN_BYTES)] = (BF16_NAN, 0x8000 | BF16_NAN)
    return table[as_bytes(a)]

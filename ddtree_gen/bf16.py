"""The project's one bf16 helper (numpy side).

bf16 data is carried as uint16 arrays of raw bits everywhere (CuPy has no bfloat16).

Decisions:
* Rounding is round-to-nearest, ties-to-even, on the exact input value; values at or
  beyond the bf16 overflow threshold become +-inf, +-inf stay inf, -0.0 stays -0.0,
  subnormals are kept (bf16 has float32's exponent range).
* float64 input is rounded directly, not through an ordinary float32 cast (that double
  rounding is wrong near ties, e.g. 1 + 2**-8 + 2**-40 must give 1 + 2**-7): it is first
  rounded to float32 with round-to-odd, which is exact for a second rounding to any format
  with at least 2 fewer significand bits (24 >= 8 + 2) and the same exponent range.
* NaN becomes the quiet NaN 0x7FC0 with the input's sign bit (payload dropped).
* Other float dtypes (float16, ...) go through float32 exactly; integer and bool input is
  converted to float64 first. uint16 input is refused (it already is bf16 bits), and an
  ml_dtypes.bfloat16 array is taken as its bits.
"""
import numpy as np

from .errors import ArgumentError

__all__ = ["to_bits", "from_bits", "round_to_bf16"]


def _f64_to_f32_round_to_odd(x):
    """float64 -> float32 with round-to-odd (truncate, then force the last bit to 1)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        f = x.astype(np.float32)
        inexact = (f.astype(np.float64) != x) & ~np.isnan(x)
        # A round-to-nearest result beyond x (in magnitude) steps one ulp towards zero:
        # this also turns an overflowed inf into the largest finite float32.
        too_big = inexact & (np.abs(f.astype(np.float64)) > np.abs(x))
        f = np.where(too_big, np.nextafter(f, np.float32(0)), f)
    bits = f.view(np.uint32)
    return np.where(inexact, bits | np.uint32(1), bits).astype(np.uint32)


def _f32_bits_to_bf16(bits):
    """float32 bit patterns (uint32) -> bf16 bit patterns (uint16), RNE, NaN quieted."""
    b = bits.astype(np.uint64)
    lsb = (b >> np.uint64(16)) & np.uint64(1)
    rounded = (b + np.uint64(0x7FFF) + lsb) >> np.uint64(16)
    is_nan = (b & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    quiet = ((b >> np.uint64(16)) & np.uint64(0x8000)) | np.uint64(0x7FC0)
    return np.where(is_nan, quiet, rounded).astype(np.uint16)


def to_bits(x):
    """Round `x` (array-like) to bf16; return the raw bits as a uint16 array of x's shape."""
    a = np.asarray(x)
    if a.dtype.name == "bfloat16":
        return a.view(np.uint16).copy()
    if a.dtype == np.uint16:
        raise ArgumentError("x: uint16 input already is bf16 bits; to_bits takes float values")
    if a.dtype.kind in "biu":
        a = a.astype(np.float64)
    if a.dtype.kind != "f":
        raise ArgumentError(f"x: expected a float array, got dtype {a.dtype}")
    if a.dtype.itemsize > 4:
        bits32 = _f64_to_f32_round_to_odd(a.astype(np.float64))
    else:
        bits32 = a.astype(np.float32).view(np.uint32)
    return _f32_bits_to_bf16(bits32)


def from_bits(bits):
    """bf16 raw bits (uint16 array, or an ml_dtypes.bfloat16 array) -> float32, exactly."""
    u = np.asarray(bits)
    if u.dtype.name == "bfloat16":
        u = u.view(np.uint16)
    if u.dtype != np.uint16:
        raise ArgumentError(f"bits: expected uint16 bf16 bits, got dtype {u.dtype}")
    wide = u.astype(np.uint32)
    wide <<= np.uint32(16)
    return wide.view(np.float32)


def round_to_bf16(x):
    """`x` rounded to the nearest bf16 value (RNE), as float32."""
    return from_bits(to_bits(x))

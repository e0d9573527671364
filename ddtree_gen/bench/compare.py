"""What the comparison scripts of scripts/ share (no `ddtree-gen bench NAME`; no benchmark imports it): their
--shapes values, one kernel's output brought to the host, and how far one output is from another, row by row."""
from __future__ import annotations

import argparse

import numpy as np


def parse_shape(text: str) -> tuple:
    """"B,H,L" -> (B, H, L), each a positive integer (an argparse type: a bad value is an argparse error)."""
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected B,H,L, three positive integers (e.g. 8,8,4096)")
    return values


def to_host(a) -> np.ndarray:
    """A torch tensor or a CuPy array (bf16 as uint16 bits) -> a float numpy array (bf16 decoded; other dtypes as
    they are)."""
    if hasattr(a, "detach"):
        return a.detach().float().cpu().numpy()
    import cupy

    from ..bf16 import from_bits
    h = cupy.asnumpy(a)
    return from_bits(h) if h.dtype == np.uint16 else h


def rel_rows(a, b) -> float:
    """The worst row of ||a - b|| / ||b|| over [..., R] float arrays (rows along the last axis; a zero row of b
    counts as 1e-30)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    num = np.linalg.norm(a - b, axis=-1)
    den = np.maximum(np.linalg.norm(b, axis=-1), 1e-30)
    return float(np.max(num / den))

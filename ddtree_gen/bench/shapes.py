"""Shapes drawn from the classes of served traffic, for `ddtree-gen bench tree_verify --sweep` and the schedule
sweeps of scripts/: not one table tuned against, but a seeded draw that another seed replaces.

Classes (issue "tree_verify on real traffic"), each drawn with equal probability:
  * "single": one request, 1k-256k keys (an agent's or a coder's long context: the whole GPU is its own);
  * "equal": B in {2, 4, 8, 16, 32, 64} requests of one length, 1k-128k keys;
  * "ragged": B = 2..16 requests of independent lengths, 1k-128k keys each;
  * "ragged-many": B = 17..64 requests of independent lengths, 1k-16k keys each.
Lengths are log-uniform; H is one of the shipped specs' head counts (8, 16, 64, 128: TP8 ranks and one GPU). Nq
(the node budget plus the root) is weighted to the budgets DDTree engines run (22-36 nodes): with probability
NQ_PRACTICAL_P uniform in NQ_PRACTICAL (20..40), else uniform in NQ_RANGE (16..65). A draw whose FLOPs exceed
MAX_FLOPS (~10 ms at the bf16 peak) has its lengths scaled down, so that a sweep of 24 shapes fits one device call.
The same seed gives the same shapes; a change of these rules changes every seed's draw (docs/benchmarks.md says
when: the weighted Nq and the 256k single requests replaced the uniform Nq and 128k of 2026-12-02).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLASSES = ("single", "equal", "ragged", "ragged-many")
HEADS = (8, 16, 64, 128)
NQ_RANGE = (16, 65)
NQ_PRACTICAL = (20, 40)   # Nq of the node budgets engines run (22-36 nodes plus the root), and a margin
NQ_PRACTICAL_P = 0.75     # the share of draws taken from NQ_PRACTICAL (the rest: all of NQ_RANGE)
MAX_KEYS = {"single": 262144, "equal": 131072, "ragged": 131072, "ragged-many": 16384}
MAX_FLOPS = 8e12
MIN_KEYS = 1024


@dataclass(frozen=True)
class Shape:
    cls: str
    b: int
    h: int
    nq: int
    lens: tuple

    def label(self) -> str:
        lens = np.asarray(self.lens)
        ls = (f"L={lens[0]}" if lens.min() == lens.max() else
              f"L={lens.min()}..{lens.max()} (sum {lens.sum()})")
        return f"{self.cls} B={self.b} H={self.h} Nq={self.nq} {ls}"


def flops(h: int, nq: int, lens, r: int = 512, p: int = 64) -> float:
    """The contract's FLOP count (docs/contract.md section 13) of a tree_verify call of these shapes."""
    return float(sum(2 * h * nq * (int(li) + nq) * (2 * r + p) for li in lens))


def _loguniform(rng, lo: int, hi: int, n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size=n)).astype(np.int64)


def draw_nq(rng) -> int:
    """One Nq: uniform in NQ_PRACTICAL with probability NQ_PRACTICAL_P, else uniform in NQ_RANGE (both ends
    included)."""
    lo, hi = NQ_PRACTICAL if rng.uniform() < NQ_PRACTICAL_P else NQ_RANGE
    return int(rng.integers(lo, hi + 1))


def draw(seed: int, count: int, classes=CLASSES, heads=HEADS) -> list[Shape]:
    """`count` shapes of the classes, from `seed` (the same seed, the same shapes)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        cls = classes[int(rng.integers(len(classes)))]
        h = int(heads[int(rng.integers(len(heads)))])
        nq = draw_nq(rng)
        hi = MAX_KEYS[cls]
        if cls == "single":
            lens = _loguniform(rng, MIN_KEYS, hi, 1)
        elif cls == "equal":
            b = int(rng.choice([2, 4, 8, 16, 32, 64]))
            lens = np.repeat(_loguniform(rng, MIN_KEYS, hi, 1), b)
        elif cls == "ragged":
            lens = _loguniform(rng, MIN_KEYS, hi, int(rng.integers(2, 17)))
        else:
            lens = _loguniform(rng, MIN_KEYS, hi, int(rng.integers(17, 65)))
        f = flops(h, nq, lens)
        if f > MAX_FLOPS:   # scaled down to the budget, never below MIN_KEYS a request
            lens = np.maximum(MIN_KEYS, (lens * (MAX_FLOPS / f)).astype(np.int64))
        out.append(Shape(cls, len(lens), h, nq, tuple(int(v) for v in lens)))
    return out

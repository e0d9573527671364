"""Draft-tree shapes as parent arrays, and their ancestor (attention) masks."""
from __future__ import annotations

import numpy as np

def tree_parents(kind: str, q: int, rng) -> np.ndarray:
    """parents[j] < j, parents[0] = -1: a chain, a star (all children of the root), a full binary
    tree, or a random tree (parent of node j uniform in 0..j-1, drawn in order j = 1..q-1)."""
    j = np.arange(q)
    if kind == "chain":
        p = j - 1
    elif kind == "star":
        p = np.where(j > 0, 0, -1)
    elif kind == "binary":
        p = (j - 1) // 2
    elif kind == "random":
        p = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, q)])
    else:
        raise ValueError(kind)
    p[0] = -1
    return p


def ancestor_mask(parents, words: int) -> np.ndarray:
    """[q, words] uint32: bit j of row i set iff j is i or an ancestor of i."""
    q = len(parents)
    m = np.zeros((q, words), np.uint32)
    for i in range(q):
        j = i
        while j >= 0:
            m[i, j // 32] |= np.uint32(1 << (j % 32))
            j = int(parents[j])
    return m

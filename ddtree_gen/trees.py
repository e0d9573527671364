"""Draft-tree shapes as parent arrays, and their ancestor (attention) masks: pack_tree_mask (public: numpy or torch,
batched) and ancestor_mask (one tree, the tests' helper)."""
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


def pack_tree_mask(parents, words: int | None = None, num_nodes=None):
    """The tree_mask of tree_verify (docs/contract.md section 7) from parent arrays: `[..., N, W]` uint32, bit
    `j % 32` of word `j // 32` of row i set iff node j is i or an ancestor of i.

    `parents`: `[N]` or batched `[B, N]` (any leading dimensions) integers, node 0 the root (-1), every other node's
    parent an earlier index (`parents[i] < i`, tree_build's order). A row i > 0 whose parent is negative is padding
    (an all-zero row, like tree_build's padding), and so is every row i >= `num_nodes` (`[...]`, optional). `words`:
    W, at least ceil(N / 32); the spec's `mask_words` for a kernel (default: ceil(N / 32)).

    A numpy array gives a numpy array; a torch tensor gives a `torch.uint32` tensor on its device, computed there (N
    vectorised steps over the batch; no host copy), e.g. `pack_tree_mask(tree_parents_cuda, spec.mask_words)`. A
    parent that is not an earlier index is a ValueError on numpy input (torch input is not read on the host: such a
    row gets its own bit and whatever its parent's row held)."""
    if type(parents).__module__.startswith("torch"):
        return _pack_torch(parents, words, num_nodes)
    par = np.asarray(parents)
    if par.dtype.kind not in "iu" or par.ndim < 1:
        raise ValueError(f"parents: expected an integer array [..., N], got {par.dtype} {par.shape}")
    n = par.shape[-1]
    w = -(-n // 32) if words is None else int(words)
    if w * 32 < n:
        raise ValueError(f"words: {w} words hold {32 * w} nodes, parents has N = {n}")
    lead = par.shape[:-1]
    p = par.reshape(-1, n).astype(np.int64)
    idx = np.arange(n)
    if np.any((p >= idx) & (p >= 0)):
        raise ValueError("parents: every parent must be an earlier node (parents[i] < i)")
    live = (p >= 0) | (idx == 0)
    if num_nodes is not None:
        live &= idx < np.asarray(num_nodes).reshape(-1, 1)
    vis = np.zeros((p.shape[0], n, n), bool)        # vis[b, i, j]: j is i or an ancestor of i
    rows = np.arange(p.shape[0])
    for i in range(n):
        if i:
            par_row = vis[rows, np.maximum(p[:, i], 0)]
            vis[:, i] = np.where((p[:, i] >= 0)[:, None], par_row, False)
        vis[:, i, i] = True
    vis &= live[:, :, None]
    bits = np.zeros((p.shape[0], n, w * 32), bool)
    bits[..., :n] = vis
    weights = (np.uint64(1) << np.arange(32, dtype=np.uint64))
    packed = (bits.reshape(p.shape[0], n, w, 32).astype(np.uint64) * weights).sum(-1).astype(np.uint32)
    return packed.reshape(*lead, n, w)


def _pack_torch(parents, words, num_nodes):
    import torch
    n = parents.shape[-1]
    w = -(-n // 32) if words is None else int(words)
    if w * 32 < n:
        raise ValueError(f"words: {w} words hold {32 * w} nodes, parents has N = {n}")
    lead = tuple(parents.shape[:-1])
    p = parents.reshape(-1, n).long()
    bsz, dev = p.shape[0], p.device
    idx = torch.arange(n, device=dev)
    live = (p >= 0) | (idx == 0)
    if num_nodes is not None:
        live &= idx < torch.as_tensor(num_nodes, device=dev).reshape(-1, 1)
    vis = torch.zeros((bsz, n, n), dtype=torch.bool, device=dev)
    rows = torch.arange(bsz, device=dev)
    vis[:, 0, 0] = True
    for i in range(1, n):
        has = (p[:, i] >= 0)[:, None]
        vis[:, i] = vis[rows, p[:, i].clamp(0, i - 1)] & has
        vis[:, i, i] = True
    vis &= live[:, :, None]
    bits = torch.zeros((bsz, n, w * 32), dtype=torch.int64, device=dev)
    bits[..., :n] = vis.long()
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=dev), torch.arange(32, device=dev))
    packed = (bits.reshape(bsz, n, w, 32) * weights).sum(-1)                  # in [0, 2^32): int64
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.view(torch.uint32).reshape(*lead, n, w)

"""Inputs of the kernels from a spec: valid arrays for each launcher, for the benches, tests and scripts.

tree_build_inputs (numpy), verify_inputs (on the GPU, bf16 or an fp8 spec's e4m3 cache) and accept_tree
(a tree with a known accepted path, numpy).
"""
from __future__ import annotations

import numpy as np

from .trees import ancestor_mask, tree_parents

CHAIN = 17    # accept_tree's accepted path runs through nodes CHAIN, CHAIN + 1, ...: every move is a real one


def tree_build_inputs(spec, b: int, rng, depth: int | None = None, k: int | None = None):
    d = depth or spec.max_depth
    k = k or spec.max_tree_size - 1
    ids = rng.integers(0, 150000, size=(b, d, k), dtype=np.int32)
    lps = -np.sort(rng.exponential(1.0, size=(b, d, k)).astype(np.float32), axis=-1)
    roots = rng.integers(0, 150000, size=b, dtype=np.int32)
    prefix = rng.integers(0, 100000, size=b, dtype=np.int32)
    return ids, np.ascontiguousarray(lps), roots, prefix


def verify_inputs(spec, b: int, lens, nq: int, seed: int = 0):
    """Random bf16 inputs on the GPU (cupy uint16 bits), a random-permutation block table, random trees.
    An fp8 spec's cache is the e4m3 bytes (cupy uint8, converted by torch) of the same normal samples,
    with kv_scale 1; the same seed gives the same q, table, masks and cache values for both kv_dtypes."""
    import cupy
    from .bf16 import to_bits
    rng = np.random.default_rng(seed)
    h, r, p, page = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size
    lens = np.asarray(lens, np.int32)
    per = -(-(lens + nq) // page)
    max_pages = int(per.max())
    num_pages = int(per.sum())
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((b, max_pages), np.int32)
    k = 0
    for i in range(b):
        table[i, :per[i]] = perm[k:k + per[i]]
        k += per[i]
    # random trees: parent of node j uniformly among 0..j-1 (root 0)
    mask = np.stack([ancestor_mask(tree_parents("random", nq, rng), spec.mask_words) for _ in range(b)])
    g = cupy.random.default_rng(seed)

    def bf(shape):
        return cupy.asarray(to_bits(cupy.asnumpy(g.standard_normal(shape, dtype=cupy.float32))))

    def e4m3(shape):   # normal samples -> e4m3 bytes (round to nearest even; |x| < 448 here)
        import torch
        x = torch.utils.dlpack.from_dlpack(g.standard_normal(shape, dtype=cupy.float32))
        return cupy.from_dlpack(x.to(torch.float8_e4m3fn).view(torch.uint8).contiguous())

    q_nope, q_pe = bf((b, nq, h, r)), bf((b, nq, h, p))
    kv_shape = (num_pages, page, r + p)
    out = dict(q_nope=q_nope, q_pe=q_pe, kv_cache=e4m3(kv_shape) if spec.kv_fp8 else bf(kv_shape),
               block_table=cupy.asarray(table), prefix_lens=cupy.asarray(lens),
               q_lens=cupy.full(b, nq, dtype=cupy.int32), tree_mask=cupy.asarray(mask),
               softmax_scale=192 ** -0.5)
    if spec.kv_fp8:
        out["kv_scale"] = 1.0
    return out


def accept_tree(spec, b: int):
    """A tree whose accepted path is CHAIN, CHAIN+1, ... (a chain under the root), the root's other
    children decoys; node j carries token j. Returns (tree arrays, target for a path of length a)."""
    n = spec.max_tree_size
    first = np.full(n, -1, np.int32)
    nxt = np.full(n, -1, np.int32)
    chain = list(range(CHAIN, min(n, CHAIN + spec.max_depth)))
    root_children = [j for j in range(1, n) if j not in chain[1:]]
    first[0] = root_children[0]
    for x, y in zip(root_children, root_children[1:]):
        nxt[x] = y
    for x, y in zip(chain, chain[1:]):
        first[x] = y
    tree = dict(num_nodes=np.full(b, n, np.int32), tokens=np.tile(np.arange(n, dtype=np.int32), (b, 1)),
                first_child=np.tile(first, (b, 1)), next_sibling=np.tile(nxt, (b, 1)))

    def target(a):
        t = np.full(n, -5, np.int32)        # no child carries -5: the walk stops there
        path = [0] + chain[:a]
        for x, y in zip(path, path[1:]):
            t[x] = y
        return np.tile(t, (b, 1))
    return tree, target, len(chain)



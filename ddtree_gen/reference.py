"""Numpy references of the kernels (the oracles of docs/contract.md), one function per kernel.

tree_build and tree_accept are the bit-exact oracles of the discrete kernels; the
attention references compute in float64. Float inputs may be any float dtype, an
ml_dtypes.bfloat16 array, or uint16 arrays of bf16 bits. An fp8 KV cache (kv_dtype
"fp8_e4m3") is uint8 e4m3 bytes (or an ml_dtypes.float8_e4m3fn array): the attention
references take its kv_scale and dequantize it in float64 (e4m3 * kv_scale, ddtree_gen.fp8),
tree_accept and kv_commit move its bytes. Bad arguments raise ArgumentError naming the argument.
"""
import heapq
import math
from typing import Any, NamedTuple

import numpy as np

from . import bf16, fp8
from .errors import ArgumentError
from .types import AttentionOutput, TreeAcceptOutput, TreeBuildOutput

__all__ = ["tree_build", "tree_build_heap", "tree_verify", "tree_verify_tail",
           "merge_states", "tree_accept", "kv_commit", "draft_topk", "DraftTopkOutput", "kv_dequant",
           "KvDequantOutput"]

_I32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------- helpers

def _int_scalar(value, name, lo, hi):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(f"{name}: expected an integer, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise ArgumentError(f"{name}: {value} is outside [{lo}, {hi}]")
    return value


def _int_array(x, name, ndim, lo=-2**31, hi=_I32_MAX):
    """An integer array of rank `ndim` with values in [lo, hi], returned as int64."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise ArgumentError(f"{name}: expected an integer dtype, got {a.dtype}")
    if a.ndim != ndim:
        raise ArgumentError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if a.size and (a.min() < lo or a.max() > hi):
        raise ArgumentError(f"{name}: values must lie in [{lo}, {hi}]")
    return a.astype(np.int64)


def _float_array(x, name, ndim):
    """A float (or bf16 bits) array of rank `ndim`, returned as float64."""
    a = np.asarray(x)
    if a.ndim != ndim:
        raise ArgumentError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    return _to_f64(a, name)


def _to_f64(a, name):
    if a.dtype == np.uint16 or a.dtype.name == "bfloat16":
        return bf16.from_bits(a).astype(np.float64)
    if a.dtype.kind != "f":
        raise ArgumentError(f"{name}: expected a float dtype or uint16 bf16 bits, got {a.dtype}")
    return a.astype(np.float64)


def _check_shape(a, name, shape):
    if tuple(a.shape) != tuple(shape):
        raise ArgumentError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


def _out_array(x, name, shape):
    if not isinstance(x, np.ndarray):
        raise ArgumentError(f"{name}: expected a numpy array, got {type(x).__name__}")
    _check_shape(x, name, shape)
    if not (x.dtype.kind == "f" or x.dtype == np.uint16):
        raise ArgumentError(f"{name}: expected a float dtype or uint16 bf16 bits, got {x.dtype}")
    if not x.flags.writeable:
        raise ArgumentError(f"{name}: array is read-only")
    return x


def _store(dst, index, values):
    """dst[index] = values; a uint16 destination receives bf16 bits (RNE)."""
    dst[index] = bf16.to_bits(values) if dst.dtype == np.uint16 else values


# -------------------------------------------------------------------------- tree_build

def _tree_build_args(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, max_tree_size):
    n = _int_scalar(max_tree_size, "max_tree_size", 2, _I32_MAX)
    ids = _int_array(topk_ids, "topk_ids", 3)
    b, d, k = ids.shape
    if d < 1:
        raise ArgumentError("topk_ids: depth dimension D' must be >= 1")
    if not 1 <= k <= n - 1:
        raise ArgumentError(f"topk_ids: K'={k} must lie in [1, max_tree_size-1={n - 1}]")
    lp = np.asarray(topk_logprobs)
    if lp.dtype.kind != "f":
        raise ArgumentError(f"topk_logprobs: expected a float dtype, got {lp.dtype}")
    _check_shape(lp, "topk_logprobs", ids.shape)
    roots = _int_array(root_tokens, "root_tokens", 1)
    _check_shape(roots, "root_tokens", (b,))
    prefix = _int_array(prefix_lens, "prefix_lens", 1, 0, _I32_MAX - d)
    _check_shape(prefix, "prefix_lens", (b,))
    budget = _int_scalar(budget, "budget", 0, n - 1)
    with np.errstate(all="ignore"):
        lp32 = lp.astype(np.float32)
    return ids, lp32, roots, prefix, budget, n


def _score(parent_score, lp):
    """float32 parent score + log-prob; a NaN log-prob or a NaN sum counts as -inf."""
    with np.errstate(all="ignore"):
        s = np.float32(parent_score) + np.float32(lp)
    return np.float32(-np.inf) if np.isnan(s) else s


def tree_build(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, max_tree_size):
    """Best-first draft tree expansion (docs/contract.md, tree_build), bit-exact oracle.

    Candidates are kept in creation order and the next node is found by a linear scan:
    highest score, equal scores -> the candidate created first. Popping a candidate makes
    it node i, then creates its next sibling (rank+1 < K'), then its first child
    (depth < D'). Scores are float32 sums. Decisions: a NaN log-prob counts as -inf, and
    so does a NaN sum (e.g. +inf + -inf); -inf candidates are still taken (last, in
    creation order) while budget remains. Integer ids of any integer dtype and log-probs
    of any float dtype are accepted and cast to int32 / float32.
    """
    ids, lp, roots, prefix, budget, n = _tree_build_args(
        topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, max_tree_size)
    bsz, d_max, k_max = ids.shape
    out = _empty_tree(bsz, n)
    for b in range(bsz):
        # node = (token, parent, depth, score); candidate = (score, parent, depth, rank)
        nodes = [(int(roots[b]), -1, 0, np.float32(0.0))]
        cands = [(_score(0.0, lp[b, 0, 0]), 0, 1, 0)] if budget >= 1 else []
        while len(nodes) <= budget and cands:
            best = 0
            for j in range(1, len(cands)):
                if cands[j][0] > cands[best][0]:
                    best = j
            score, parent, depth, rank = cands.pop(best)
            i = len(nodes)
            nodes.append((int(ids[b, depth - 1, rank]), parent, depth, score))
            if rank + 1 < k_max:
                cands.append((_score(nodes[parent][3], lp[b, depth - 1, rank + 1]),
                              parent, depth, rank + 1))
            if depth < d_max:
                cands.append((_score(score, lp[b, depth, 0]), i, depth + 1, 0))
        _fill_tree(out, b, nodes, int(prefix[b]))
    return out


def _empty_tree(bsz, n):
    w = (n + 31) // 32
    full = lambda: np.full((bsz, n), -1, np.int32)  # noqa: E731
    return TreeBuildOutput(
        num_nodes=np.zeros(bsz, np.int32), tokens=full(), parents=full(), depths=full(),
        positions=full(), scores=np.full((bsz, n), -np.inf, np.float32),
        tree_mask=np.zeros((bsz, n, w), np.uint32), first_child=full(), next_sibling=full())


def _fill_tree(out, b, nodes, prefix_len):
    """Write one request's node list (pop order) into the padded output arrays."""
    out.num_nodes[b] = len(nodes)
    last_child = {}
    for i, (token, parent, depth, score) in enumerate(nodes):
        out.tokens[b, i] = token
        out.parents[b, i] = parent
        out.depths[b, i] = depth
        out.positions[b, i] = prefix_len + depth
        out.scores[b, i] = score
        if parent >= 0:
            out.tree_mask[b, i] = out.tree_mask[b, parent]
            if parent in last_child:
                out.next_sibling[b, last_child[parent]] = i
            else:
                out.first_child[b, parent] = i
            last_child[parent] = i
        out.tree_mask[b, i, i // 32] |= np.uint32(1 << (i % 32))


def tree_build_heap(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, max_tree_size):
    """The same contract as tree_build, as the per-request CPU heapq builder.

    Written independently of tree_build (heap keyed on (-score, creation index), links and
    masks derived from the parent array afterwards); it is the "CPU heap" peer of the
    benchmark and a cross-check of tree_build in the tests.
    """
    ids, lp, roots, prefix, budget, n = _tree_build_args(
        topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, max_tree_size)
    bsz, d_max, k_max = ids.shape
    w = (n + 31) // 32
    num_nodes = np.zeros(bsz, np.int32)
    tokens, parents, depths, positions, first_child, next_sibling = (
        np.full((bsz, n), -1, np.int32) for _ in range(6))
    scores = np.full((bsz, n), -np.inf, np.float32)
    tree_mask = np.zeros((bsz, n, w), np.uint32)
    for b in range(bsz):
        node_score = [np.float32(0.0)]
        par, dep, tok = [-1], [0], [int(roots[b])]
        heap, created = [], 0

        def push(score, parent, depth, rank):
            nonlocal created
            score = np.float32(-np.inf) if np.isnan(score) else score
            heapq.heappush(heap, (-float(score), created, score, parent, depth, rank))
            created += 1

        with np.errstate(all="ignore"):
            if budget >= 1:
                push(np.float32(0.0) + lp[b, 0, 0], 0, 1, 0)
            while heap and len(tok) < budget + 1:
                _, _, score, parent, depth, rank = heapq.heappop(heap)
                me = len(tok)
                tok.append(int(ids[b, depth - 1, rank]))
                par.append(parent)
                dep.append(depth)
                node_score.append(score)
                if rank + 1 < k_max:
                    push(node_score[parent] + lp[b, depth - 1, rank + 1], parent, depth, rank + 1)
                if depth < d_max:
                    push(score + lp[b, depth, 0], me, depth + 1, 0)
        m = len(tok)
        num_nodes[b] = m
        tokens[b, :m], parents[b, :m], depths[b, :m] = tok, par, dep
        positions[b, :m] = prefix[b] + np.asarray(dep)
        scores[b, :m] = node_score
        for i in range(m):
            j = i
            while j >= 0:
                tree_mask[b, i, j // 32] |= np.uint32(1 << (j % 32))
                j = par[j]
            kids = [c for c in range(m) if par[c] == i]
            if kids:
                first_child[b, i] = kids[0]
            for c, c_next in zip(kids, kids[1:]):
                next_sibling[b, c] = c_next
    return TreeBuildOutput(num_nodes, tokens, parents, depths, positions, scores, tree_mask,
                           first_child, next_sibling)


# ------------------------------------------------------------------------- tree_verify

def _kv_scale(kv_cache, kv_scale):
    """The cache's dequantization: (is e4m3, kv_scale as a float or None), after the checks of both."""
    if fp8.is_e4m3(kv_cache.dtype):
        if kv_scale is None:
            raise ArgumentError(f"kv_scale: required for an e4m3 kv_cache ({kv_cache.dtype}: fp8 bytes, "
                                f"value = e4m3 * kv_scale)")
        if isinstance(kv_scale, (bool, np.bool_)) or not isinstance(
                kv_scale, (int, float, np.integer, np.floating)):
            raise ArgumentError(f"kv_scale: expected a real number, got {type(kv_scale).__name__}")
        if not (math.isfinite(kv_scale) and kv_scale > 0):
            raise ArgumentError(f"kv_scale: {kv_scale} must be finite and > 0")
        return True, float(kv_scale)
    if kv_scale is not None:
        raise ArgumentError(f"kv_scale: given ({kv_scale!r}), but kv_cache holds {kv_cache.dtype} values, not "
                            f"e4m3 bytes (uint8): only an fp8 cache takes a scale")
    _to_f64(kv_cache[:0], "kv_cache")  # dtype check only
    return False, None


def _attention(tail, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
               softmax_scale, out, lse, kv_scale=None):
    qn = _float_array(q_nope, "q_nope", 4)
    bsz, nq, h, r = qn.shape
    qp = _float_array(q_pe, "q_pe", 4)
    if qp.shape[:3] != (bsz, nq, h):
        raise ArgumentError(f"q_pe: expected shape ({bsz}, {nq}, {h}, P), got {qp.shape}")
    p = qp.shape[3]
    kv = np.asarray(kv_cache)
    if kv.ndim != 3 or kv.shape[2] != r + p:
        raise ArgumentError(f"kv_cache: expected shape (num_pages, page_size, {r + p}), "
                            f"got {kv.shape}")
    is_fp8, kv_scale = _kv_scale(kv, kv_scale)
    num_pages, page_size = kv.shape[:2]
    if page_size < 1:
        raise ArgumentError("kv_cache: page_size must be >= 1")
    table = _int_array(block_table, "block_table", 2, -2**63, 2**63 - 1)
    if table.shape[0] != bsz:
        raise ArgumentError(f"block_table: expected {bsz} rows, got shape {table.shape}")
    prefix = _int_array(prefix_lens, "prefix_lens", 1, 0)
    _check_shape(prefix, "prefix_lens", (bsz,))
    qlen = _int_array(q_lens, "q_lens", 1, 1, nq)
    _check_shape(qlen, "q_lens", (bsz,))
    mask = np.asarray(tree_mask)
    if mask.dtype == np.int32:
        mask = mask.view(np.uint32)
    mask = _int_array(mask, "tree_mask", 3, 0, 2**32 - 1)
    if mask.shape[:2] != (bsz, nq):
        raise ArgumentError(f"tree_mask: expected shape ({bsz}, {nq}, W), got {mask.shape}")
    if bsz and mask.shape[2] < (int(qlen.max()) + 31) // 32:
        raise ArgumentError(f"tree_mask: last dimension {mask.shape[2]} < ceil(q_len / 32)")
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(
            softmax_scale, (int, float, np.integer, np.floating)) \
            or not math.isfinite(softmax_scale):
        raise ArgumentError("softmax_scale: expected a finite real number")
    if out is None:
        out = np.full((bsz, nq, h, r), np.nan)
    if lse is None:
        lse = np.full((bsz, nq, h), np.nan)
    out = _out_array(out, "out", (bsz, nq, h, r))
    lse = _out_array(lse, "lse", (bsz, nq, h))

    keys_of = []  # per request: (key positions, their pages), all validated before any write
    for b in range(bsz):
        L, q = int(prefix[b]), int(qlen[b])
        if L + q > table.shape[1] * page_size:
            raise ArgumentError(f"prefix_lens/q_lens: request {b} needs {L + q} tokens, "
                                f"block_table holds {table.shape[1] * page_size}")
        t = np.arange(L if tail else 0, L + q)
        pages = table[b, t // page_size]
        if pages.min() < 0 or pages.max() >= num_pages:
            raise ArgumentError(f"block_table: request {b} uses a page outside [0, {num_pages})")
        keys_of.append((t, pages))

    for b, (t, pages) in enumerate(keys_of):
        L, q = int(prefix[b]), int(qlen[b])
        entries = kv[pages, t % page_size]
        keys = fp8.dequantize(entries, kv_scale) if is_fp8 else _to_f64(entries, "kv_cache")
        ckv, kpe = keys[:, :r], keys[:, r:]
        s = softmax_scale * (np.einsum("ihr,tr->iht", qn[b, :q], ckv)
                             + np.einsum("ihp,tp->iht", qp[b, :q], kpe))
        j = t - L  # tree node index of each key (negative: prefix)
        jj = np.maximum(j, 0)
        bits = (mask[b, :q][:, jj // 32] >> (jj % 32)) & 1  # [q, T]
        visible = np.where(j < 0, True, bits.astype(bool))  # [q, T]
        s = np.where(visible[:, None, :], s, -np.inf)
        m = s.max(axis=2, initial=-np.inf)
        empty = np.isneginf(m)
        wts = np.exp(s - np.where(empty, 0.0, m)[..., None])
        total = wts.sum(axis=2)
        o = np.einsum("iht,tr->ihr", wts, ckv) / np.where(empty, 1.0, total)[..., None]
        with np.errstate(divide="ignore"):
            row_lse = np.where(empty, -np.inf, m + np.log(total))
        _store(out, (b, slice(0, q)), np.where(empty[..., None], 0.0, o))
        _store(lse, (b, slice(0, q)), row_lse)
    return AttentionOutput(out, lse)


_VERIFY_DOC = """

    Shapes: q_nope [B,Nq,H,R], q_pe [B,Nq,H,P], kv_cache [num_pages,page_size,R+P] (latent
    first), block_table [B,max_pages], prefix_lens [B], q_lens [B] (1 <= q_len <= Nq),
    tree_mask [B,Nq,W] (uint32; int32 is taken as its bits; W >= ceil(q_len/32)).
    An e4m3 kv_cache (uint8 bytes, or ml_dtypes.float8_e4m3fn) needs kv_scale (finite, > 0):
    its keys and values are e4m3 * kv_scale in float64; any other cache refuses kv_scale.
    s = scale * (q_nope.ckv + q_pe.kpe) in float64; lse natural log; out = softmax-weighted
    ckv. A row without a visible key gets out 0, lse -inf. Rows i >= q_len are not written:
    given out/lse keep them, otherwise the returned float64 arrays hold NaN there. A uint16
    out/lse receives bf16 bits. Every page the call reads must be in [0, num_pages).
    """


def tree_verify(q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                softmax_scale, out=None, lse=None, *, kv_scale=None):
    return _attention(False, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                      tree_mask, softmax_scale, out, lse, kv_scale)


def tree_verify_tail(q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                     softmax_scale, out=None, lse=None, *, kv_scale=None):
    return _attention(True, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                      tree_mask, softmax_scale, out, lse, kv_scale)


tree_verify.__doc__ = ("Tree attention over prefix + tree: row i sees every key t < prefix_len "
                       "and tree key prefix_len + j iff bit j of tree_mask[b, i] is set."
                       + _VERIFY_DOC)
tree_verify_tail.__doc__ = ("tree_verify over the tree tail alone (keys t >= prefix_len), to be "
                            "merged with an external prefix kernel through merge_states."
                            + _VERIFY_DOC)


# ------------------------------------------------------------------------ merge_states

def merge_states(o_a, lse_a, o_b, lse_b, out=None, lse=None):
    """Merge two partial attention states (natural-log LSE), in float64.

    o_* [..., R], lse_* [...] (the same leading shape). m = max(lse_a, lse_b),
    w = exp(lse - m), o = (w_a o_a + w_b o_b) / (w_a + w_b), lse = m + log(w_a + w_b).
    Decision: a side whose lse is not finite (-inf, +inf as FlashMLA writes for empty
    rows, or NaN) is empty and drops out, its o ignored even if NaN; two empty sides give
    o = 0, lse = -inf. out/lse, if given, are written whole (uint16: bf16 bits).
    """
    lse_a = _to_f64(np.asarray(lse_a), "lse_a")
    lse_b = _to_f64(np.asarray(lse_b), "lse_b")
    o_a = _to_f64(np.asarray(o_a), "o_a")
    o_b = _to_f64(np.asarray(o_b), "o_b")
    if o_a.ndim < 1 or o_a.shape[:-1] != lse_a.shape:
        raise ArgumentError(f"o_a: expected shape {lse_a.shape} + (R,), got {o_a.shape}")
    _check_shape(lse_b, "lse_b", lse_a.shape)
    _check_shape(o_b, "o_b", o_a.shape)
    out = np.zeros(o_a.shape) if out is None else _out_array(out, "out", o_a.shape)
    lse = np.zeros(lse_a.shape) if lse is None else _out_array(lse, "lse", lse_a.shape)

    full_a, full_b = np.isfinite(lse_a), np.isfinite(lse_b)
    m = np.maximum(np.where(full_a, lse_a, -np.inf), np.where(full_b, lse_b, -np.inf))
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w_a = np.where(full_a, np.exp(np.where(full_a, lse_a, 0.0) - m_safe), 0.0)
    w_b = np.where(full_b, np.exp(np.where(full_b, lse_b, 0.0) - m_safe), 0.0)
    total = w_a + w_b
    num = (w_a[..., None] * np.where(full_a[..., None], o_a, 0.0)
           + w_b[..., None] * np.where(full_b[..., None], o_b, 0.0))
    any_full = full_a | full_b
    merged = np.where(any_full[..., None], num / np.where(any_full, total, 1.0)[..., None], 0.0)
    with np.errstate(divide="ignore"):
        merged_lse = np.where(any_full, m + np.log(np.where(any_full, total, 1.0)), -np.inf)
    _store(out, ..., merged)
    _store(lse, ..., merged_lse)
    return AttentionOutput(out, lse)


# ------------------------------------------------------------------------- tree_accept

def _slot(table_row, pos, page_size, num_pages):
    """(page, slot) of a cache position, or None when it maps outside the cache."""
    page_idx = pos // page_size
    if page_idx >= table_row.shape[0]:
        return None
    page = int(table_row[page_idx])
    if not 0 <= page < num_pages:
        return None
    return page, pos % page_size


def tree_accept(tree, target_tokens, prefix_lens, kv_cache, block_table, max_depth):
    """Walk the tree with the target's tokens, emit path + bonus token, commit the KV.

    `tree`: any object with num_nodes [B], tokens, first_child, next_sibling [B, N]
    (e.g. TreeBuildOutput); target_tokens [B, N]; accepted_nodes / out_tokens have
    max_depth + 1 columns. Walk: cur = 0; t = target_tokens[b, cur]; scan the children
    of cur (first_child, then next_sibling) and accept the first c with tokens[c] == t.
    Robustness rules (the kernel copies them exactly):
    * num_nodes[b] < 1 or > N: the walk ends at once (accept_len 0, path [0], bonus
      target_tokens[b, 0]);
    * a child link c is followed only if cur < c < num_nodes, a sibling link only if
      previous < c < num_nodes; any other value (-1 included) ends that scan;
    * the walk stops after max_depth accepted nodes.
    KV commit, in place on kv_cache (any dtype: bf16 bits, e4m3 bytes, ...): for k = 1..accept_len the
    entry (all R+P values) at position prefix_len + path[k] is copied to prefix_len + k; all sources of a
    request are read before any of its destinations is written (requests in batch order).
    A position whose page index is >= max_pages or whose block_table entry is outside
    [0, num_pages) is neither read nor written: a move with such a source or destination
    is skipped. kv_cache=None and block_table=None: the walk alone (no commit; kv_commit moves
    the entries of every layer).
    """
    d = _int_scalar(max_depth, "max_depth", 0, 2**16)
    num_nodes = _int_array(getattr(tree, "num_nodes", None), "tree.num_nodes", 1)
    bsz = num_nodes.shape[0]
    tokens = _int_array(getattr(tree, "tokens", None), "tree.tokens", 2)
    if tokens.shape[0] != bsz or tokens.shape[1] < 1:
        raise ArgumentError(f"tree.tokens: expected shape ({bsz}, N >= 1), got {tokens.shape}")
    n = tokens.shape[1]
    first_child = _int_array(getattr(tree, "first_child", None), "tree.first_child", 2)
    _check_shape(first_child, "tree.first_child", (bsz, n))
    next_sibling = _int_array(getattr(tree, "next_sibling", None), "tree.next_sibling", 2)
    _check_shape(next_sibling, "tree.next_sibling", (bsz, n))
    target = _int_array(target_tokens, "target_tokens", 2)
    _check_shape(target, "target_tokens", (bsz, n))
    prefix = _int_array(prefix_lens, "prefix_lens", 1, 0, _I32_MAX - d - 1)
    _check_shape(prefix, "prefix_lens", (bsz,))
    walk_only = kv_cache is None and block_table is None
    if not walk_only:
        table = _check_cache(kv_cache, block_table, bsz)

    accept_lens = np.zeros(bsz, np.int32)
    accepted = np.full((bsz, d + 1), -1, np.int32)
    out_tokens = np.full((bsz, d + 1), -1, np.int32)
    for b in range(bsz):
        nn = int(num_nodes[b])
        path = [0]
        if 1 <= nn <= n:
            cur = 0
            while len(path) <= d:
                want, prev, c, hit = target[b, cur], cur, int(first_child[b, cur]), -1
                while prev < c < nn:
                    if tokens[b, c] == want:
                        hit = c
                        break
                    prev, c = c, int(next_sibling[b, c])
                if hit < 0:
                    break
                path.append(hit)
                cur = hit
        k = len(path) - 1
        accept_lens[b] = k
        accepted[b, :k + 1] = path
        out_tokens[b, :k] = tokens[b, path[1:]]
        out_tokens[b, k] = target[b, path[-1]]

        if not walk_only:
            _commit(kv_cache, table[b], int(prefix[b]), path)
    new_prefix = (prefix + 1 + accept_lens).astype(np.int32)
    return TreeAcceptOutput(accept_lens, accepted, out_tokens, new_prefix)


def _check_cache(kv_cache, block_table, bsz):
    """The block table as int64, after checking one layer's cache and the table."""
    if not isinstance(kv_cache, np.ndarray) or kv_cache.ndim != 3:
        raise ArgumentError("kv_cache: expected a numpy array [num_pages, page_size, R+P]")
    if not kv_cache.flags.writeable:
        raise ArgumentError("kv_cache: array is read-only (the commit is in place)")
    if kv_cache.shape[1] < 1:
        raise ArgumentError("kv_cache: page_size must be >= 1")
    table = _int_array(block_table, "block_table", 2, -2**63, 2**63 - 1)
    if table.shape[0] != bsz:
        raise ArgumentError(f"block_table: expected {bsz} rows, got shape {table.shape}")
    return table


def _commit(kv_cache, table_row, prefix_len, path):
    """One request's commit in one layer: for k = 1..len(path)-1 the entry at prefix_len + path[k]
    moves to prefix_len + k; all sources are read before any destination is written; a move in
    place (path[k] == k) or whose source or destination maps outside the cache is skipped."""
    num_pages, page_size = kv_cache.shape[:2]
    moves = []
    for i in range(1, len(path)):
        if path[i] == i:
            continue
        src = _slot(table_row, prefix_len + path[i], page_size, num_pages) if path[i] >= 0 else None
        dst = _slot(table_row, prefix_len + i, page_size, num_pages)
        if src is not None and dst is not None:
            moves.append((dst, kv_cache[src].copy()))
    for dst, entry in moves:
        kv_cache[dst] = entry


def kv_commit(accepted, prefix_lens, kv_caches, block_table):
    """tree_accept's commit in every layer: `accepted` has accept_lens [B] and accepted_nodes
    [B, D+1] (the walk's outputs); kv_caches is a sequence of per-layer caches or one stacked
    [layers, num_pages, page_size, R+P] array, moved in place. accept_len is clamped to
    [0, D] and a negative path entry is a skipped move (the kernel's rules for any device value)."""
    lens = _int_array(getattr(accepted, "accept_lens", None), "accepted.accept_lens", 1)
    bsz = lens.shape[0]
    nodes = _int_array(getattr(accepted, "accepted_nodes", None), "accepted.accepted_nodes", 2)
    if nodes.shape[0] != bsz:
        raise ArgumentError(f"accepted.accepted_nodes: expected {bsz} rows, got shape {nodes.shape}")
    d = nodes.shape[1] - 1
    prefix = _int_array(prefix_lens, "prefix_lens", 1)
    _check_shape(prefix, "prefix_lens", (bsz,))
    layers = list(kv_caches) if isinstance(kv_caches, (list, tuple)) else [kv_caches[i] for i in range(len(kv_caches))]
    for layer, kv in enumerate(layers):
        table = _check_cache(kv, block_table, bsz)
        for b in range(bsz):
            a = min(max(int(lens[b]), 0), d)
            _commit(kv, table[b], int(prefix[b]), [int(x) for x in nodes[b, :a + 1]])


# ----------------------------------------------------------------------------- draft_topk

MAX_VOCAB = 262144   # draft_topk: the largest vocabulary (the last dimension of logits)
FLT32_MAX = float(np.finfo(np.float32).max)   # draft_topk: -FLT32_MAX is the floor of a finite logit's log-prob


class DraftTopkOutput(NamedTuple):
    """draft_topk's record (the launcher's and this reference's; its order is tree_build's first two arguments)."""
    topk_ids: Any         # [B, D', k] int32: token ids, by descending logit, equal logits lowest id first
    topk_logprobs: Any    # [B, D', k] float32 (float64 here): log-softmax over the vocabulary


def temperature_arg(temperature) -> tuple[float, float, float]:
    """(temperature, fl32(1 / temperature), fl32(log2(e) / temperature)) of draft_topk, or ArgumentError
    naming `temperature`: a real number, finite and > 0, whose two float32 scale factors are finite normal
    numbers (the kernels scale by them): about 4.3e-39 < temperature <= 8.5e37."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer,
                                                                                   np.floating)):
        raise ArgumentError(f"temperature: expected a float, got {type(temperature).__name__} {temperature!r}")
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ArgumentError(f"temperature: {t!r} must be finite and > 0")
    with np.errstate(over="ignore"):
        inv, c = float(np.float32(1.0 / t)), float(np.float32(math.log2(math.e) / t))
    tiny = float(np.finfo(np.float32).tiny)
    if not (math.isfinite(c) and inv >= tiny):
        raise ArgumentError(f"temperature: {t!r} is outside the float32 range (1/temperature and "
                            f"log2(e)/temperature must be finite normal float32 numbers)")
    return t, inv, c


def draft_topk(logits, k, temperature=1.0):
    """The drafter's top-k per depth, tree_build's input: logits [B, D', V] (float, ml_dtypes.bfloat16 or
    uint16 bf16 bits) -> DraftTopkOutput(topk_ids [B, D', k] int32, topk_logprobs [B, D', k] float64).

    Order: descending logit, equal logits lowest token id first (+0 and -0 equal); a NaN logit counts
    as -inf. The log-probs are log_softmax(logits / temperature) over the whole row in float64, as
    (x - M) / T - log(sum exp((x_i - M) / T)) with M the row's maximum; a finite logit's log-prob is at least
    -FLT32_MAX (the most negative float32: a log-prob below the float32 range is that, not -inf). A row
    whose largest logit is -inf (all -inf / NaN) gives -inf log-probs; a row with +inf logits gives each
    +inf entry -log(count of +inf) and every other entry -inf (the limit of a large finite logit)."""
    x = _float_array(logits, "logits", 3)
    bsz, dp, v = x.shape
    if not 1 <= v <= MAX_VOCAB:
        raise ArgumentError(f"logits: V = {v} (dimension 2) must be in [1, {MAX_VOCAB}]")
    k = _int_scalar(k, "k", 1, v)
    t = temperature_arg(temperature)[0]
    x = np.where(np.isnan(x), -np.inf, x)
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]          # stable: equal logits by ascending id
    top = np.take_along_axis(x, order, axis=-1)
    m = x.max(axis=-1, keepdims=True)
    lp = np.full((bsz, dp, k), -np.inf)
    finite = np.isfinite(m[..., 0])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        if finite.any():
            # the gap to the maximum first, in the logit domain (x - M of float32 / bf16 values is exact or one
            # float64 rounding), then / T: x / T - max(x / T) loses the gap against a huge x / T (T = 1e-12)
            mf = m[finite]
            lse = np.log(np.exp((x[finite] - mf) / t).sum(axis=-1, keepdims=True))
            lp[finite] = (top[finite] - mf) / t - lse
            # a finite logit's log-prob below the float32 range is the most negative float32 (contract 5a)
            lp[finite] = np.where(np.isfinite(top[finite]), np.maximum(lp[finite], -FLT32_MAX), -np.inf)
        plus = m[..., 0] == np.inf
        if plus.any():
            count = (x[plus] == np.inf).sum(axis=-1, keepdims=True)
            lp[plus] = np.where(top[plus] == np.inf, -np.log(count), -np.inf)
    return DraftTopkOutput(order.astype(np.int32), lp)


# ------------------------------------------------------------------------------ kv_dequant

class KvDequantOutput(NamedTuple):
    """kv_dequant's record (the launcher's and this reference's): the bf16 workspace cache and its block table."""
    kv_cache: Any         # [B * max_pages, page_size, R + P] bf16 bits (uint16): request b's page j at b * max_pages + j
    block_table: Any      # [B, max_pages] int32: b * max_pages + j where the page was converted, else -1


def kv_dequant(kv_cache, block_table, prefix_lens, q_lens, out=None) -> KvDequantOutput:
    """The dequantize pre-pass of tree_verify's fp8 path "dequant" (docs/contract.md 4b), bit-exact: for request b
    with q_len >= 1 and prefix_len >= 0, each page index j with j * page_size < prefix_len + q_len whose block-table
    entry p lies in [0, num_pages) is converted whole, e4m3 -> bf16 exactly (fp8.to_bf16_bits: NaN bytes become
    sign | 0x7ff0, values unscaled), into workspace page b * max_pages + j, and block_table[b, j] of the result is
    that page; every other entry of the result's table is -1 and its page is not written. kv_cache: [num_pages,
    page_size, R + P] e4m3 bytes (uint8 or ml_dtypes.float8_e4m3fn). `out`: a KvDequantOutput of numpy arrays
    (uint16 kv_cache, int32 block_table) written in place (pages not converted keep their contents); without it
    they are new, the pages not converted zero."""
    kv = np.asarray(kv_cache)
    if not fp8.is_e4m3(kv):
        raise ArgumentError(f"kv_cache: expected e4m3 bytes (uint8 or float8_e4m3fn), got {kv.dtype}")
    if kv.ndim != 3:
        raise ArgumentError(f"kv_cache: expected 3 dimensions, got shape {kv.shape}")
    num_pages, page, row = kv.shape
    table = _int_array(block_table, "block_table", 2)
    b, max_pages = table.shape
    prefix = _int_array(prefix_lens, "prefix_lens", 1)
    qlens = _int_array(q_lens, "q_lens", 1)
    if prefix.shape != (b,) or qlens.shape != (b,):
        raise ArgumentError(f"prefix_lens / q_lens: shapes {prefix.shape} / {qlens.shape}, expected ({b},)")
    if out is None:
        out = KvDequantOutput(np.zeros((b * max_pages, page, row), np.uint16), np.empty((b, max_pages), np.int32))
    if out.kv_cache.shape != (b * max_pages, page, row) or out.kv_cache.dtype != np.uint16:
        raise ArgumentError(f"out.kv_cache: expected uint16 {(b * max_pages, page, row)}")
    if out.block_table.shape != (b, max_pages) or out.block_table.dtype != np.int32:
        raise ArgumentError(f"out.block_table: expected int32 {(b, max_pages)}")
    convert = fp8.to_bf16_bits(np.arange(256, dtype=np.uint8))
    for r in range(b):
        keys = int(prefix[r]) + int(qlens[r])
        served = qlens[r] >= 1 and prefix[r] >= 0
        for j in range(max_pages):
            w = r * max_pages + j
            p = int(table[r, j])
            if served and j * page < keys and 0 <= p < num_pages:
                out.kv_cache[w] = convert[fp8.as_bytes(kv[p])]
                out.block_table[r, j] = w
            else:
                out.block_table[r, j] = -1
    return out

"""The device loop's backends: CupyOps (float32 CuPy), NumpyOps (its float32 numpy emulation) and
ReferenceKernels (the numpy references behind a KernelSet's launchers)."""
from __future__ import annotations

import numpy as np

from .. import bf16, reference
from .cuda_source import CUDA_SOURCE, KERNEL_NAMES
from .numpy_model import _mm, _rmsnorm, _rope, _silu
from .sampling import draft_topk, seed_key, select_tokens


class CupyOps:
    """float32 CuPy backend of the device loop: the kernels of CUDA_SOURCE on the current stream.

    No call synchronises or copies to the host, and none uses cuBLAS / cuRAND / CUB (cuBLAS and
    cuRAND calls are refused by CuPy during stream capture), so a step is capturable."""

    def __init__(self):
        import cupy
        self.xp = cupy
        self._module = cupy.RawModule(code=CUDA_SOURCE, options=("--std=c++17",))
        self._k = {name: self._module.get_function(name) for name in KERNEL_NAMES}

    def _elementwise(self, name, args, n):
        if n:
            self._k[name](((n + 255) // 256,), (256,), (*args, np.int64(n)))

    def mm(self, x, w):
        """x [..., K] @ w [K, Nn], or x [M, H, K] @ w [H, K, Nn] per head."""
        cp = self.xp
        if w.ndim == 2:
            h, (k, nn) = 1, w.shape
        else:
            h, k, nn = w.shape
            assert x.shape[-2:] == (h, k), (x.shape, w.shape)
        assert x.shape[-1] == k and x.flags.c_contiguous and w.flags.c_contiguous
        out = cp.empty(x.shape[:-1] + (nn,), cp.float32)
        mh = x.size // k
        if mh:
            self._k["dd_mm"]((mh, (nn + 127) // 128), (128,),
                             (x, w, out, np.int32(mh), np.int32(h), np.int32(k), np.int32(nn)))
        return out

    def rmsnorm(self, x, w, eps):
        k = x.shape[-1]
        m = x.size // k
        out = self.xp.empty_like(x)
        if m:
            self._k["dd_rmsnorm"](((m + 3) // 4,), (128,), (x, w, out, np.int32(m), np.int32(k), np.float32(eps)))
        return out

    def q_rope(self, q, rope_pos, inv_freq, dn):
        """q [M, H, Dn + P] -> (q_nope [M, H, Dn] float32, q_pe [M, H, P] bf16 bits)."""
        cp = self.xp
        m, h, width = q.shape
        p = width - dn
        q_nope = cp.empty((m, h, dn), cp.float32)
        q_pe = cp.empty((m, h, p), cp.uint16)
        total = m * h * (dn + p // 2)
        if total:
            self._k["dd_q_rope"](((total + 255) // 256,), (256,),
                                 (q, rope_pos, inv_freq, q_nope, q_pe, np.int32(m), np.int32(h), np.int32(dn),
                                  np.int32(p)))
        return q_nope, q_pe

    def write_kv(self, kv, norm_w, rope_pos, inv_freq, slot_base, slot_offset, nq, block_table, cache, eps):
        m, width = kv.shape
        r = norm_w.shape[0]
        num_pages, page_size, _ = cache.shape
        if m:
            self._k["dd_write_kv"](((m + 3) // 4,), (128,),
                                   (kv, norm_w, rope_pos, inv_freq, slot_base, np.int32(slot_offset), np.int32(nq),
                                    block_table, np.int32(block_table.shape[1]), cache, np.int32(num_pages),
                                    np.int32(page_size), np.int32(m), np.int32(r), np.int32(width - r),
                                    np.float32(eps)))

    def to_bits(self, x):
        y = self.xp.empty(x.shape, self.xp.uint16)
        self._elementwise("dd_to_bf16", (x, y), x.size)
        return y

    def from_bits(self, x):
        y = self.xp.empty(x.shape, self.xp.float32)
        self._elementwise("dd_from_bf16", (x, y), x.size)
        return y

    def silu_mul(self, g, u):
        y = self.xp.empty_like(g)
        self._elementwise("dd_silu_mul", (g, u, y), g.size)
        return y

    def embed(self, table, tokens):
        return self.xp.take(table, self.xp.maximum(tokens, 0), axis=0)

    def select(self, logits, pos, pos_add, nq, sampling, out):
        m, v = logits.shape
        if m:
            self._k["dd_select"](((m + 3) // 4,), (128,),
                                 (logits, pos, np.int32(pos_add), np.int32(m), np.int32(v), np.int32(nq),
                                  np.uint32(seed_key(sampling.seed)), np.float32(sampling.inv_temp),
                                  np.int32(0 if sampling.greedy else 1), out))

    def draft_topk(self, draft_logits, base_pos, drafter, sampling, ids, lps):
        b, dp, v = draft_logits.shape
        k = ids.shape[2]
        assert k <= v
        if b:
            self._k["dd_draft_topk"]((b * dp,), (128,),
                                     (draft_logits, np.int32(v), np.int32(dp), np.int32(k), base_pos,
                                      np.uint32(seed_key(drafter.seed)), np.float32(drafter.noise),
                                      np.float32(sampling.inv_temp), ids, lps), shared_mem=4 * (v + 1))

    def commit(self, accept_lens, out_tokens, new_prefix, use_new_prefix, state):
        b = state.prefix.shape[0]
        self._k["dd_commit"](((b + 127) // 128,), (128,),
                             (np.int32(b), accept_lens, out_tokens, np.int32(out_tokens.shape[1]), new_prefix,
                              np.int32(1 if use_new_prefix else 0), state.prefix, state.root, state.gen,
                              np.int32(state.gen.shape[1]), state.count, np.int32(state.target), state.steps,
                              state.accepted))


class NumpyOps:
    """The same operations as CupyOps on numpy arrays (float32 storage; each op computed in
    float64 and rounded once, row by row independent of the batch shape). With ReferenceKernels
    it runs the device loop's exact orchestration on a CPU."""

    xp = np

    def mm(self, x, w):
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        if w.ndim == 2:
            return _mm(x64, w64).astype(np.float32)
        return np.einsum("mhk,hkn->mhn", x64, w64).astype(np.float32)

    def rmsnorm(self, x, w, eps):
        return _rmsnorm(x.astype(np.float64), w.astype(np.float64), eps).astype(np.float32)

    def q_rope(self, q, rope_pos, inv_freq, dn):
        pos = np.maximum(rope_pos, 0)[:, None]
        q_pe = _rope(q[..., dn:].astype(np.float64), pos, inv_freq.astype(np.float64))
        return np.ascontiguousarray(q[..., :dn]), bf16.to_bits(q_pe.astype(np.float32))

    def write_kv(self, kv, norm_w, rope_pos, inv_freq, slot_base, slot_offset, nq, block_table, cache, eps):
        m, width = kv.shape
        r = norm_w.shape[0]
        num_pages, page_size, _ = cache.shape
        kv64 = kv.astype(np.float64)
        row = np.concatenate([_rmsnorm(kv64[:, :r], norm_w.astype(np.float64), eps),
                              _rope(kv64[:, r:], np.maximum(rope_pos, 0), inv_freq.astype(np.float64))], axis=-1)
        bits = bf16.to_bits(row.astype(np.float32))
        for i in range(m):
            b, j = divmod(i, nq)
            pos = int(slot_base[b]) + slot_offset + j
            if pos < 0 or pos // page_size >= block_table.shape[1]:
                continue
            page = int(block_table[b, pos // page_size])
            if 0 <= page < num_pages:
                cache[page, pos % page_size] = bits[i]

    def to_bits(self, x):
        return bf16.to_bits(x)

    def from_bits(self, x):
        return bf16.from_bits(x)

    def silu_mul(self, g, u):
        g64 = g.astype(np.float64)
        return (_silu(g64) * u).astype(np.float32)

    def embed(self, table, tokens):
        return table[np.maximum(tokens, 0)]

    def select(self, logits, pos, pos_add, nq, sampling, out):
        m = logits.shape[0]
        out.reshape(m)[...] = select_tokens(logits.astype(np.float64), np.arange(m) // nq,
                                            pos.reshape(m).astype(np.int64) + pos_add, sampling)

    def draft_topk(self, draft_logits, base_pos, drafter, sampling, ids, lps):
        i, lp = draft_topk(draft_logits.astype(np.float64), base_pos, ids.shape[2], drafter, sampling)
        ids[...], lps[...] = i, lp

    def commit(self, accept_lens, out_tokens, new_prefix, use_new_prefix, state):
        cap = state.gen.shape[1]
        for b in range(state.prefix.shape[0]):
            c = int(state.count[b])
            if c >= state.target:
                continue
            a = min(max(int(accept_lens[b]), 0), out_tokens.shape[1] - 1)
            n = min(a + 1, cap - c)
            state.gen[b, c:c + n] = out_tokens[b, :n]
            state.count[b] = c + a + 1
            state.prefix[b] = new_prefix[b] if use_new_prefix else state.prefix[b] + a + 1
            state.root[b] = out_tokens[b, a]
            state.steps[b] += 1
            state.accepted[b] += a


class ReferenceKernels:
    """The numpy references behind the launcher signatures of a KernelSet (out= buffers filled in
    place), so the device loop runs on a CPU."""

    def __init__(self, spec):
        self.spec = spec

    @staticmethod
    def _into(out, r):
        """The reference's record r, or copied into the caller's out= record (as the launchers fill it)."""
        if out is None:
            return r
        for dst, src in zip(out, r):
            dst[...] = src
        return out

    def tree_build(self, topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, out=None):
        return self._into(out, reference.tree_build(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget,
                                                    self.spec.max_tree_size))

    def tree_verify(self, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                    out=None, lse=None):
        if out is None:  # like the launcher: bf16 bits and float32 (zeros here, not poison)
            out = np.zeros(np.shape(q_nope), np.uint16)
        if lse is None:
            lse = np.zeros(np.shape(q_nope)[:3], np.float32)
        return reference.tree_verify(q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                     softmax_scale, out=out, lse=lse)

    def tree_accept(self, tree, target_tokens, prefix_lens, kv_cache=None, block_table=None, out=None):
        return self._into(out, reference.tree_accept(tree, target_tokens, prefix_lens, kv_cache, block_table,
                                                     self.spec.max_depth))

    def kv_commit(self, accepted, prefix_lens, kv_caches, block_table):
        reference.kv_commit(accepted, prefix_lens, kv_caches, block_table)

"""The float64 oracle model (NumpyMLA) and its numpy building blocks (also used by NumpyOps)."""
from __future__ import annotations

import numpy as np

from .. import bf16, reference
from .cache import chain_mask
from .config import ModelConfig
from .weights import init_weights


def _rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, inv_freq):
    """Rotate-half RoPE of x [..., P] at integer positions pos (broadcast to x[..., 0])."""
    half = x.shape[-1] // 2
    ang = np.asarray(pos, np.float64)[..., None] * inv_freq
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _bf16_bits(x):
    """bf16 bits of a float64 model value, rounded first to float32 (the precision in which the
    GPU model holds every value before storing it as bf16), then by the project's helper.
    Both numpy paths round this way, so they see identical caches and queries."""
    return bf16.to_bits(np.asarray(x, np.float64).astype(np.float32))


def _mm(x, w):
    """x [..., K] @ w [K, N] by np.einsum: no BLAS (whose threads crawl on a busy small CI box),
    and a row's result does not depend on how many rows there are."""
    return np.einsum("...k,kn->...n", x, w)


def _silu(x):
    return x / (1.0 + np.exp(-x))


class NumpyMLA:
    """The float64 model. `forward` writes the KV of its tokens into the paged cache (bf16 bits)
    and attends through reference.tree_verify in every layer.

    all_reduce: None (the whole model), or, for a tensor-parallel rank holding some heads
    (tensor_parallel.shard_weights), a callable that sums its o_proj partial [B, Nq, d] over
    the ranks and returns the sum; it is applied before the residual add of every layer."""

    def __init__(self, cfg: ModelConfig, weights: dict | None = None, all_reduce=None):
        self.cfg = cfg
        self.w = init_weights(cfg) if weights is None else weights
        self.all_reduce = all_reduce

    def new_cache(self, num_pages: int) -> list:
        c = self.cfg
        return [np.zeros((num_pages, c.page_size, c.kv_lora_rank + c.qk_rope_head_dim), np.uint16)
                for _ in range(c.num_layers)]

    def forward(self, kv, block_table, tokens, rope_pos, slot_pos, prefix_lens, q_lens, tree_mask, *,
                smooth: bool = False, hook=None):
        """logits [B, Nq, V] float64.

        tokens, rope_pos, slot_pos [B, Nq]: token ids, RoPE positions (prefix_len + depth) and
        cache positions the rows' KV is written to (-1: not written); prefix_lens, q_lens [B] and
        tree_mask [B, Nq, W] go to tree_verify. kv: the per-layer caches (written in place).

        smooth=True: no bf16 rounding of this call's cache rows, queries and attention outputs (kv must then
        be float64 caches): a differentiable function, for the near-tie sensitivity (model.near_tie).
        hook(layer, att [B, Nq, H, R], o_proj [B, Nq, d]) -> o_proj, if given, replaces each layer's o_proj.
        """
        c, w = self.cfg, self.w
        h_, r, p, dn, dv = c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
        tokens, rope_pos, slot_pos = (np.asarray(a, np.int64) for a in (tokens, rope_pos, slot_pos))
        b, nq = tokens.shape
        inv_freq = c.inv_freq
        rows_b, rows_j = np.nonzero(slot_pos >= 0)
        slots = slot_pos[rows_b, rows_j]
        pages = block_table[rows_b, slots // c.page_size]
        rnd = (lambda a: np.asarray(a, np.float64)) if smooth else _bf16_bits  # noqa: E731
        x_h = w["embed"][np.maximum(tokens, 0)]                                  # [B, Nq, d]
        for layer, lw in enumerate(w["layers"]):
            x = _rmsnorm(x_h, lw["attn_norm"], c.rms_eps)
            q = _mm(_rmsnorm(_mm(x, lw["wq_a"]), lw["q_norm"], c.rms_eps), lw["wq_b"]).reshape(b, nq, h_, dn + p)
            q_pe = _rope(q[..., dn:], rope_pos[:, :, None], inv_freq)
            q_abs = np.einsum("bnhd,hdr->bnhr", q[..., :dn], lw["w_uk_t"])      # [B, Nq, H, R]
            kva = _mm(x, lw["wkv_a"])
            row = np.concatenate([_rmsnorm(kva[..., :r], lw["kv_norm"], c.rms_eps),
                                  _rope(kva[..., r:], rope_pos, inv_freq)], axis=-1)
            kv[layer][pages, slots % c.page_size] = rnd(row[rows_b, rows_j])
            # attention in float64 (the reference), its output kept as the kernel's: float32 -> bf16
            att = reference.tree_verify(rnd(q_abs), rnd(q_pe), kv[layer], block_table,
                                        prefix_lens, q_lens, tree_mask, c.softmax_scale,
                                        out=np.zeros((b, nq, h_, r), np.float64 if smooth else np.float32)).out
            att = np.asarray(att, np.float64) if smooth else bf16.from_bits(_bf16_bits(att)).astype(np.float64)
            o = np.einsum("bnhr,hrv->bnhv", att, lw["w_uv"]).reshape(b, nq, h_ * dv)
            o_proj = _mm(o, lw["wo"])
            if hook is not None:
                o_proj = hook(layer, att, o_proj)
            if self.all_reduce is not None:   # tensor parallel: sum the heads of every rank
                o_proj = self.all_reduce(o_proj)
            x_h = x_h + o_proj
            x2 = _rmsnorm(x_h, lw["mlp_norm"], c.rms_eps)
            x_h = x_h + _mm(_silu(_mm(x2, lw["w_gate"])) * _mm(x2, lw["w_up"]), lw["w_down"])
        return _mm(_rmsnorm(x_h, w["final_norm"], c.rms_eps), w["lm_head"])

    def prefill(self, kv, block_table, prompts, chunk: int, words: int):
        """Commit prompt[:-1] of every request in causal chunks of <= chunk tokens (tree_verify
        with a chain mask); the last prompt token is the first root."""
        for b, prompt in enumerate(prompts):
            ctx = np.asarray(prompt[:-1], np.int64)
            for s in range(0, len(ctx), chunk):
                toks = ctx[s:s + chunk][None]
                q = toks.shape[1]
                pos = (s + np.arange(q))[None]
                self.forward(kv, block_table[b:b + 1], toks, pos, pos, np.array([s]), np.array([q]),
                             chain_mask(q, words)[None])

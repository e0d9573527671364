"""A tiny MLA decoder with random weights: the end-to-end proof that the kernels compose losslessly.

The attention is DeepSeek-V3 MLA at a spec's dimensions (H heads, latent rank R, rope dim P,
page size); everything else is tiny (vocab, hidden size, two layers, a small MLP). The same
weights run three ways:

* **numpy, float64** (`NumpyMLA`, `generate_numpy`): the oracle. Plain decoding (one token per
  step) and the DDTree speculative loop on the numpy references (`reference.tree_build`,
  `reference.tree_verify` in every layer, `reference.tree_accept`).
* **device loop** (`DeviceDecoder`): the loop an engine runs, on preallocated buffers with no
  host synchronisation inside a step. Its backend is either `CupyOps` (float32 CuPy, custom
  row-deterministic kernels for the model's matmuls and norms, and the generated kernels
  `kset.tree_build` / `kset.tree_verify` / `kset.tree_accept`), or `NumpyOps` (a float32 numpy
  emulation of the same kernels with the numpy references as the kernel set; CI runs the GPU
  loop's exact orchestration this way, without a GPU).
* On the GPU a step can be captured in a CUDA graph and replayed (`DeviceDecoder.capture_step`).

MLA, per layer (weights `[in, out]`, x @ W):
    x = rmsnorm(h);  q = rmsnorm(x @ wq_a) @ wq_b -> [H, Dn + P];  q_pe = rope(q[Dn:], pos)
    q_nope_absorbed[h] = W_UK[h] @ q_nope[h]  (w_uk_t[h] is [Dn, R])  -> [H, R]
    kv = x @ wkv_a -> [R + P];  c_kv = rmsnorm(kv[:R]);  k_pe = rope(kv[R:], pos)
    cache row (bf16) = [c_kv | k_pe];  queries rounded to bf16 too
    attn = tree_verify(...) -> [H, R] (bf16, as the kernel's);  o = (attn[h] @ w_uv[h]) -> [H * Dv] @ wo
    h += o;  h += (silu(x2 @ w_gate) * (x2 @ w_up)) @ w_down;  logits = rmsnorm(h) @ lm_head
RoPE (rotate-half) at position prefix_len + depth: the absolute position of the token.
softmax_scale = (qk_nope_head_dim + P) ** -0.5. Every value stored as bf16 (cache rows,
queries, attention output) is float32 first, as on the GPU (the numpy model rounds its float64
value to float32, then to bf16 with ddtree_gen.bf16), so both numpy paths see identical caches.
Tree node j's KV is written at cache position prefix_len + j (RoPE at prefix_len + depth_j);
tree_accept moves the accepted nodes' entries to prefix_len + 1 .. prefix_len + accept_len.

Token choice: greedy = argmax (lowest index among equal maxima); sampled = Gumbel-max,
argmax(logits / T + g) with g = gumbel(seed, request, position, vocab index), a counter-based
hash of the request index, the absolute position of the token being chosen and the vocab
index, so plain and speculative decoding draw the same noise for the same token.

Drafter (acceptance only changes speed, never the tokens): from the root, the target itself is
rolled out D' steps along its own chosen tokens (each step a q_len 1 pass that writes scratch
cache slots beyond the committed prefix, overwritten by the tree pass); depth d's draft
distribution is log_softmax(logits_d / T + noise * g'), g' a Gumbel draw of a separate seed;
the top K per depth, sorted, feed tree_build. Depth d's distribution does not depend on the
parent chosen in the tree, as in DDTree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import bf16, reference
from .types import TreeAcceptOutput, TreeBuildOutput

__all__ = ["ModelConfig", "Sampling", "Drafter", "Generation", "init_weights", "make_block_table",
           "gumbel", "NumpyMLA", "generate_numpy", "NumpyOps", "CupyOps", "ReferenceKernels",
           "DeviceDecoder", "CapturedStep", "generate_device", "CUDA_SOURCE"]


# ============================================================================ configuration

@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of the tiny MLA model; the attention ones come from a Spec (`from_spec`)."""
    num_heads: int                 # H
    kv_lora_rank: int              # R
    qk_rope_head_dim: int          # P
    page_size: int
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    q_lora_rank: int = 48
    qk_nope_head_dim: int = 32     # Dn
    v_head_dim: int = 32           # Dv
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    logit_std: float = 4.0         # spread of the logits (lm_head scale)
    seed: int = 0                  # weights

    @classmethod
    def from_spec(cls, spec, **overrides) -> "ModelConfig":
        return cls(num_heads=spec.num_heads, kv_lora_rank=spec.kv_lora_rank,
                   qk_rope_head_dim=spec.qk_rope_head_dim, page_size=spec.page_size, **overrides)

    @property
    def softmax_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    @property
    def inv_freq(self) -> np.ndarray:
        p = self.qk_rope_head_dim
        return self.rope_theta ** (-np.arange(0, p, 2, dtype=np.float64) / p)


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy. Otherwise Gumbel-max with the counter-based noise of `seed`."""
    temperature: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def inv_temp(self) -> float:
        return 1.0 if self.greedy else 1.0 / self.temperature


GREEDY = Sampling()


@dataclass(frozen=True)
class Drafter:
    """The self-rollout drafter: D' = depth (None: the spec's max_depth), Gumbel noise of scale
    `noise` (0: the exact target distribution; large: a useless drafter)."""
    noise: float = 0.5
    seed: int = 12345
    depth: int | None = None


@dataclass
class Generation:
    tokens: np.ndarray        # [B, new_tokens] int32
    steps: int                # loop iterations (speculative steps or plain steps)
    active_steps: int         # (request, step) pairs where the request was still generating
    accepted: int             # draft tokens accepted over those pairs
    margins: np.ndarray | None = None  # plain greedy only, if asked: top1 - top2 logit per token

    @property
    def mean_accept(self) -> float:
        """Mean accepted draft tokens per step (excluding the bonus token)."""
        return self.accepted / max(self.active_steps, 1)

    @property
    def tokens_per_step(self) -> float:
        return 1.0 + self.mean_accept


# ===================================================================== counter-based noise

_GOLD = 0x9E3779B9


def _mix32_int(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def seed_key(seed: int) -> int:
    """The uint32 key of a seed (passed to the device kernels as is)."""
    return _mix32_int((int(seed) & 0xFFFFFFFF) ^ _GOLD)


def _mix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def gumbel(seed: int, request, position, index) -> np.ndarray:
    """Gumbel(0, 1) noise, a pure function of (seed, request, position, index) (broadcast).

    h = mix(mix(mix(key(seed) ^ r) ^ p) ^ v), u = ((h >> 9) + 0.5) * 2**-23 (exact in float32),
    g = -log(-log(u)). The CUDA kernels compute the same h and u (then g in float32).
    """
    r, p, v = np.broadcast_arrays(*(np.atleast_1d(np.asarray(a, dtype=np.int64)) for a in
                                    (request, position, index)))
    u32 = lambda a: (a & 0xFFFFFFFF).astype(np.uint32)  # noqa: E731
    h = np.full(r.shape, seed_key(seed), np.uint32)
    h = _mix32(h ^ u32(r))
    h = _mix32(h ^ u32(p))
    h = _mix32(h ^ u32(v))
    u = ((h >> np.uint32(9)).astype(np.float64) + 0.5) * 2.0 ** -23
    return -np.log(-np.log(u))


def select_tokens(logits: np.ndarray, request: np.ndarray, position: np.ndarray,
                  sampling: Sampling) -> np.ndarray:
    """The target's token after each row: logits [..., V]; request, position [...] (the absolute
    position of the token being chosen). Ties: the lowest index (np.argmax)."""
    if sampling.greedy:
        return np.argmax(logits, axis=-1).astype(np.int32)
    v = np.arange(logits.shape[-1])
    g = gumbel(sampling.seed, np.asarray(request)[..., None], np.asarray(position)[..., None], v)
    return np.argmax(logits * sampling.inv_temp + g, axis=-1).astype(np.int32)


def draft_topk(draft_logits: np.ndarray, base_pos: np.ndarray, k: int, drafter: Drafter,
               sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """topk_ids [B, D', K] int32, topk_logprobs [B, D', K] float32 (descending; ties: lower id).

    Depth index d (0-based) drafts the token at absolute position base_pos + d + 1."""
    b, dp, v = draft_logits.shape
    pos = np.asarray(base_pos, np.int64)[:, None] + 1 + np.arange(dp)
    s = draft_logits * sampling.inv_temp + drafter.noise * gumbel(
        drafter.seed, np.arange(b)[:, None, None], pos[..., None], np.arange(v))
    m = s.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True))
    order = np.argsort(-s, axis=-1, kind="stable")[..., :k]
    lps = np.take_along_axis(s, order, axis=-1) - lse
    return order.astype(np.int32), lps.astype(np.float32)


# ================================================================================ weights

LAYER_WEIGHTS = ("attn_norm", "wq_a", "q_norm", "wq_b", "w_uk_t", "wkv_a", "kv_norm", "w_uv", "wo",
                 "mlp_norm", "w_gate", "w_up", "w_down")


def init_weights(cfg: ModelConfig) -> dict:
    """Seeded random float64 weights: {"embed", "final_norm", "lm_head", "layers": [dict, ...]}."""
    rng = np.random.default_rng(cfg.seed)
    d, h, r, p = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv, qr, f, v = (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.intermediate_size,
                        cfg.vocab_size)

    def lin(*shape, fan_in):
        return rng.standard_normal(shape) / math.sqrt(fan_in)

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    layers = []
    for _ in range(cfg.num_layers):
        layers.append({
            "attn_norm": norm(d), "wq_a": lin(d, qr, fan_in=d), "q_norm": norm(qr),
            "wq_b": lin(qr, h * (dn + p), fan_in=qr),
            "w_uk_t": lin(h, dn, r, fan_in=r),          # k_nope[h] = c_kv @ w_uk_t[h].T
            "wkv_a": lin(d, r + p, fan_in=d), "kv_norm": norm(r),
            "w_uv": lin(h, r, dv, fan_in=r), "wo": lin(h * dv, d, fan_in=h * dv),
            "mlp_norm": norm(d), "w_gate": lin(d, f, fan_in=d), "w_up": lin(d, f, fan_in=d),
            "w_down": lin(f, d, fan_in=f),
        })
    return {"embed": rng.standard_normal((v, d)), "layers": layers, "final_norm": norm(d),
            "lm_head": lin(d, v, fan_in=d) * cfg.logit_std}


# ============================================================================ paged cache

def make_block_table(batch: int, tokens_per_request: int, page_size: int, seed: int = 0):
    """(block_table [B, max_pages] int32, num_pages): every request gets its own pages, in a
    shuffled order (pages of a request are not contiguous), plus one page nobody uses."""
    max_pages = -(-tokens_per_request // page_size)
    num_pages = batch * max_pages + 1
    perm = np.random.default_rng(seed).permutation(num_pages)[:batch * max_pages]
    return perm.reshape(batch, max_pages).astype(np.int32), num_pages


def chain_mask(q: int, words: int) -> np.ndarray:
    """[q, words] uint32: row i sees columns 0..i (a causal chunk for prefill)."""
    m = np.zeros((q, words), np.uint32)
    for i in range(q):
        for j in range(i + 1):
            m[i, j // 32] |= np.uint32(1 << (j % 32))
    return m


def _capacity(spec, prompts, new_tokens) -> int:
    """Cache positions a request may touch: prompt, new tokens, the last step's overshoot (D) and
    the scratch slots of a tree (N) or rollout (D') beyond the committed prefix."""
    return max(len(p) for p in prompts) + new_tokens + spec.max_depth + spec.max_tree_size + 1


def _check_prompts(prompts, vocab):
    if not prompts:
        raise ValueError("prompts: at least one request")
    for i, p in enumerate(prompts):
        if len(p) < 1:
            raise ValueError(f"prompts[{i}]: empty (the last prompt token is the first root)")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompts[{i}]: token ids must lie in [0, {vocab})")


def _tree_sizes(spec, cfg, budget, drafter):
    n, d = spec.max_tree_size, spec.max_depth
    budget = n - 1 if budget is None else int(budget)
    if not 0 <= budget <= n - 1:
        raise ValueError(f"budget: {budget} must lie in [0, max_tree_size - 1 = {n - 1}]")
    dp = d if drafter.depth is None else int(drafter.depth)
    if not 1 <= dp <= d:
        raise ValueError(f"drafter.depth: {dp} must lie in [1, max_depth = {d}]")
    k = max(1, min(budget, cfg.vocab_size, n - 1))
    return budget, dp, k


# ============================================================================ numpy model

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
    and attends through reference.tree_verify in every layer."""

    def __init__(self, cfg: ModelConfig, weights: dict | None = None):
        self.cfg = cfg
        self.w = init_weights(cfg) if weights is None else weights

    def new_cache(self, num_pages: int) -> list:
        c = self.cfg
        return [np.zeros((num_pages, c.page_size, c.kv_lora_rank + c.qk_rope_head_dim), np.uint16)
                for _ in range(c.num_layers)]

    def forward(self, kv, block_table, tokens, rope_pos, slot_pos, prefix_lens, q_lens, tree_mask):
        """logits [B, Nq, V] float64.

        tokens, rope_pos, slot_pos [B, Nq]: token ids, RoPE positions (prefix_len + depth) and
        cache positions the rows' KV is written to (-1: not written); prefix_lens, q_lens [B] and
        tree_mask [B, Nq, W] go to tree_verify. kv: the per-layer caches (written in place).
        """
        c, w = self.cfg, self.w
        h_, r, p, dn, dv = c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
        tokens, rope_pos, slot_pos = (np.asarray(a, np.int64) for a in (tokens, rope_pos, slot_pos))
        b, nq = tokens.shape
        inv_freq = c.inv_freq
        rows_b, rows_j = np.nonzero(slot_pos >= 0)
        slots = slot_pos[rows_b, rows_j]
        pages = block_table[rows_b, slots // c.page_size]
        x_h = w["embed"][np.maximum(tokens, 0)]                                  # [B, Nq, d]
        for layer, lw in enumerate(w["layers"]):
            x = _rmsnorm(x_h, lw["attn_norm"], c.rms_eps)
            q = _mm(_rmsnorm(_mm(x, lw["wq_a"]), lw["q_norm"], c.rms_eps), lw["wq_b"]).reshape(b, nq, h_, dn + p)
            q_pe = _rope(q[..., dn:], rope_pos[:, :, None], inv_freq)
            q_abs = np.einsum("bnhd,hdr->bnhr", q[..., :dn], lw["w_uk_t"])      # [B, Nq, H, R]
            kva = _mm(x, lw["wkv_a"])
            row = np.concatenate([_rmsnorm(kva[..., :r], lw["kv_norm"], c.rms_eps),
                                  _rope(kva[..., r:], rope_pos, inv_freq)], axis=-1)
            kv[layer][pages, slots % c.page_size] = _bf16_bits(row[rows_b, rows_j])
            # attention in float64 (the reference), its output kept as the kernel's: float32 -> bf16
            att = reference.tree_verify(_bf16_bits(q_abs), _bf16_bits(q_pe), kv[layer], block_table,
                                        prefix_lens, q_lens, tree_mask, c.softmax_scale,
                                        out=np.zeros((b, nq, h_, r), np.float32)).out
            att = bf16.from_bits(_bf16_bits(att)).astype(np.float64)
            o = np.einsum("bnhr,hrv->bnhv", att, lw["w_uv"]).reshape(b, nq, h_ * dv)
            x_h = x_h + _mm(o, lw["wo"])
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


def generate_numpy(model: NumpyMLA, spec, prompts, new_tokens: int, *, speculative: bool = True,
                   sampling: Sampling = GREEDY, drafter: Drafter = Drafter(), budget: int | None = None,
                   page_seed: int = 0) -> Generation:
    """Decode `new_tokens` tokens per request with the float64 model and the numpy references.

    speculative=False: plain decoding, one token per request per step (tree_verify with q_len 1).
    speculative=True: DDTree steps (rollout drafter, tree_build, one tree_verify pass per layer
    over the tree, tree_accept per layer's cache). Requests that have their tokens stop changing
    state (their prefix stays put) while the others finish.
    """
    cfg = model.cfg
    _check_prompts(prompts, cfg.vocab_size)
    n, d, w = spec.max_tree_size, spec.max_depth, spec.mask_words
    budget, dp, k = _tree_sizes(spec, cfg, budget, drafter)
    bsz = len(prompts)
    table, num_pages = make_block_table(bsz, _capacity(spec, prompts, new_tokens), cfg.page_size, page_seed)
    kv = model.new_cache(num_pages)
    model.prefill(kv, table, prompts, n, w)
    prefix = np.array([len(p) - 1 for p in prompts], np.int64)
    root = np.array([p[-1] for p in prompts], np.int64)
    req = np.arange(bsz)
    ones = np.ones(bsz, np.int64)
    one_mask = np.zeros((bsz, 1, w), np.uint32)
    one_mask[:, 0, 0] = 1
    out = [[] for _ in range(bsz)]
    steps = active_steps = accepted = 0
    while min(len(o) for o in out) < new_tokens:
        active = np.array([len(o) < new_tokens for o in out])
        if speculative:
            # 1. draft: roll the target out D' steps from the root (scratch slots prefix + d)
            cur, draft = root.copy(), np.empty((bsz, dp, cfg.vocab_size))
            for dd in range(dp):
                pos = prefix + dd
                logits = model.forward(kv, table, cur[:, None], pos[:, None], pos[:, None], pos, ones,
                                       one_mask)[:, 0]
                draft[:, dd] = logits
                cur = select_tokens(logits, req, pos + 1, sampling)
            ids, lps = draft_topk(draft, prefix, k, drafter, sampling)
            # 2. tree_build
            tree = reference.tree_build(ids, lps, root, prefix, budget, n)
            # 3. one target pass over the tree; node j's KV at position prefix + j
            nq = int(tree.num_nodes.max())
            j = np.arange(nq)
            valid = j[None] < tree.num_nodes[:, None]
            rope = np.where(valid, tree.positions[:, :nq], 0)
            logits = model.forward(kv, table, np.where(valid, tree.tokens[:, :nq], 0), rope,
                                   np.where(valid, prefix[:, None] + j, -1), prefix, tree.num_nodes,
                                   tree.tree_mask[:, :nq])
            target = np.full((bsz, n), -1, np.int32)
            target[:, :nq] = np.where(valid, select_tokens(logits, req[:, None], rope + 1, sampling), -1)
            # 4. tree_accept, once per layer's cache (the walk is the same; each call moves its KV)
            for layer_kv in kv:
                acc = reference.tree_accept(tree, target, prefix, layer_kv, table, d)
            lens, toks, new_prefix = acc.accept_lens, acc.out_tokens, acc.new_prefix_lens
        else:
            logits = model.forward(kv, table, root[:, None], prefix[:, None], prefix[:, None], prefix, ones,
                                   one_mask)[:, 0]
            lens = np.zeros(bsz, np.int64)
            toks = select_tokens(logits, req, prefix + 1, sampling)[:, None]
            new_prefix = prefix + 1
        for b in np.flatnonzero(active):
            a = int(lens[b])
            out[b].extend(int(t) for t in toks[b, :a + 1])
            prefix[b] = new_prefix[b]
            root[b] = toks[b, a]
            active_steps += 1
            accepted += a
        steps += 1
    tokens = np.array([o[:new_tokens] for o in out], np.int32)
    return Generation(tokens, steps, active_steps, accepted)


# ====================================================================== device-loop backends

CUDA_SOURCE = r"""
#define DD_FULL 0xffffffffu
#define DD_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned int dd_mix32(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

// Gumbel noise of (key, request, position, index); key = mix32(seed ^ 0x9e3779b9) (host side).
__device__ __forceinline__ float dd_gumbel(unsigned int key, int r, int p, int v) {
    unsigned int h = dd_mix32(key ^ (unsigned int)r);
    h = dd_mix32(h ^ (unsigned int)p);
    h = dd_mix32(h ^ (unsigned int)v);
    float u = ((float)(h >> 9) + 0.5f) * 1.1920928955078125e-07f;   // 2^-23, exact
    return -logf(-logf(u));
}

// float32 -> bf16 bits, round to nearest even; NaN -> quiet NaN with the sign (as ddtree_gen.bf16)
__device__ __forceinline__ unsigned short dd_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float dd_warp_sum(float s) {
    // xor butterfly: every lane ends with the same value (each step adds the same two operands)
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(DD_FULL, s, o);
    return s;
}

extern "C" {

// out[mh, n] = sum_k x[mh, k] * w[mh % H, k, n], k in order: a row's result does not depend on
// how many rows the call has (unlike a BLAS GEMM), so a token's numbers are the same in a
// q_len 1 pass and in a tree pass. grid (M*H, ceil(Nn / 128)), block 128.
__global__ void dd_mm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                      int MH, int H, int K, int Nn) {
    int mh = blockIdx.x;
    int n = blockIdx.y * blockDim.x + threadIdx.x;
    if (mh >= MH || n >= Nn) return;
    const float* xr = x + (size_t)mh * K;
    const float* wc = w + (size_t)(mh % H) * K * Nn + n;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc = fmaf(xr[k], wc[(size_t)k * Nn], acc);
    out[(size_t)mh * Nn + n] = acc;
}

// one warp per row: out = x * rsqrt(mean(x^2) + eps) * w
__global__ void dd_rmsnorm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                           int M, int K, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= M) return;                                   // warp-uniform
    const float* xr = x + (size_t)row * K;
    float s = 0.f;
    for (int k = lane; k < K; k += 32) s = fmaf(xr[k], xr[k], s);
    s = dd_warp_sum(s);
    float r = rsqrtf(s / (float)K + eps);
    for (int k = lane; k < K; k += 32) out[(size_t)row * K + k] = xr[k] * r * w[k];
}

// q [M, H, Dn + P] -> q_nope [M, H, Dn] float32 and q_pe [M, H, P] bf16 bits (rotate-half RoPE at
// rope_pos[m], negative positions taken as 0). One thread per (m, h, i), i < Dn + P/2.
__global__ void dd_q_rope(const float* __restrict__ q, const int* __restrict__ rope_pos,
                          const float* __restrict__ inv_freq, float* __restrict__ q_nope,
                          unsigned short* __restrict__ q_pe, int M, int H, int Dn, int P) {
    int half = P >> 1, per = Dn + half;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)M * H * per) return;
    int mh = (int)(t / per);
    int i = (int)(t - (long long)mh * per);
    const float* src = q + (size_t)mh * (Dn + P);
    if (i < Dn) { q_nope[(size_t)mh * Dn + i] = src[i]; return; }
    i -= Dn;
    float a = (float)max(rope_pos[mh / H], 0) * inv_freq[i];
    float c = cosf(a), s = sinf(a);
    float x1 = src[Dn + i], x2 = src[Dn + half + i];
    q_pe[(size_t)mh * P + i] = dd_bf16(x1 * c - x2 * s);
    q_pe[(size_t)mh * P + half + i] = dd_bf16(x2 * c + x1 * s);
}

// One warp per row m = b * Nq + j of kv [M, R + P]: c_kv = rmsnorm(kv[:R]) * norm_w, k_pe =
// rope(kv[R:], rope_pos[m]), rounded to bf16 and written to cache position
// slot_base[b] + slot_offset + j through the block table. Positions outside the table are skipped.
__global__ void dd_write_kv(const float* __restrict__ kv, const float* __restrict__ norm_w,
                            const int* __restrict__ rope_pos, const float* __restrict__ inv_freq,
                            const int* __restrict__ slot_base, int slot_offset, int Nq,
                            const int* __restrict__ block_table, int max_pages,
                            unsigned short* __restrict__ cache, int num_pages, int page_size,
                            int M, int R, int P, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= M) return;                                   // warp-uniform
    int b = row / Nq, j = row - b * Nq;
    long long pos = (long long)slot_base[b] + slot_offset + j;
    if (pos < 0) return;
    long long pidx = pos / page_size;
    if (pidx >= max_pages) return;
    int page = block_table[(size_t)b * max_pages + pidx];
    if (page < 0 || page >= num_pages) return;
    unsigned short* dst = cache + ((size_t)page * page_size + (size_t)(pos % page_size)) * (size_t)(R + P);
    const float* src = kv + (size_t)row * (R + P);
    float s = 0.f;
    for (int k = lane; k < R; k += 32) s = fmaf(src[k], src[k], s);
    s = dd_warp_sum(s);
    float r = rsqrtf(s / (float)R + eps);
    for (int k = lane; k < R; k += 32) dst[k] = dd_bf16(src[k] * r * norm_w[k]);
    int half = P >> 1;
    float fp = (float)max(rope_pos[row], 0);
    for (int i = lane; i < half; i += 32) {
        float a = fp * inv_freq[i];
        float c = cosf(a), sn = sinf(a);
        float x1 = src[R + i], x2 = src[R + half + i];
        dst[R + i] = dd_bf16(x1 * c - x2 * sn);
        dst[R + half + i] = dd_bf16(x2 * c + x1 * sn);
    }
}

__global__ void dd_to_bf16(const float* __restrict__ x, unsigned short* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = dd_bf16(x[i]);
}

__global__ void dd_from_bf16(const unsigned short* __restrict__ x, float* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __uint_as_float(((unsigned int)x[i]) << 16);
}

__global__ void dd_silu_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
                            long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float a = g[i]; y[i] = a / (1.f + expf(-a)) * u[i]; }
}

// One warp per row m = b * Nq + j: out[m] = argmax_v score (lowest v among equal maxima), score =
// logits (greedy) or logits * inv_temp + gumbel(key, b, pos[m] + pos_add, v) (sampled).
__global__ void dd_select(const float* __restrict__ logits, const int* __restrict__ pos, int pos_add,
                          int M, int V, int Nq, unsigned int key, float inv_temp, int sampled,
                          int* __restrict__ out) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= M) return;                                   // warp-uniform
    int b = row / Nq;
    int p = pos[row] + pos_add;
    float best = DD_NEG_INF;
    int bi = 0x7fffffff;
    for (int v = lane; v < V; v += 32) {
        float s = logits[(size_t)row * V + v];
        if (sampled) s = s * inv_temp + dd_gumbel(key, b, p, v);
        if (s > best) { best = s; bi = v; }                 // v ascending: the first maximum stays
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(DD_FULL, best, o);
        int oi = __shfl_xor_sync(DD_FULL, bi, o);
        if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
    }
    if (lane == 0) out[row] = (bi == 0x7fffffff) ? 0 : bi;
}

// One block per row (b, d) of logits [B * Dp, V]: s = logits * inv_temp + noise * gumbel(key, b,
// base_pos[b] + d + 1, v); the K best (descending, ties: lower v) with their log-softmax.
// Dynamic shared memory: (V + 1) floats. Needs K <= V.
__global__ void dd_draft_topk(const float* __restrict__ logits, int V, int Dp, int K,
                              const int* __restrict__ base_pos, unsigned int key, float noise,
                              float inv_temp, int* __restrict__ ids, float* __restrict__ lps) {
    extern __shared__ float dd_sm[];
    float* s = dd_sm;
    int row = blockIdx.x;
    int b = row / Dp, d = row - b * Dp;
    int p = base_pos[b] + d + 1;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        s[v] = logits[(size_t)row * V + v] * inv_temp + noise * dd_gumbel(key, b, p, v);
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = DD_NEG_INF;
        for (int v = 0; v < V; ++v) m = fmaxf(m, s[v]);
        float z = 0.f;
        for (int v = 0; v < V; ++v) z += expf(s[v] - m);
        s[V] = m + logf(z);
    }
    __syncthreads();
    float lse = s[V];
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float sv = s[v];
        int rank = 0;
        for (int u = 0; u < V; ++u) {
            float su = s[u];
            rank += (su > sv) || (su == sv && u < v);
        }
        if (rank < K) {
            ids[(size_t)row * K + rank] = v;
            lps[(size_t)row * K + rank] = sv - lse;
        }
    }
}

// One thread per request: append out_tokens[b, :a+1] (a = accept_lens[b]) to gen[b], advance the
// prefix (new_prefix[b], or prefix + a + 1 when use_new_prefix is 0) and the root (the bonus
// token). A request that already has `target` tokens keeps its state (its step is redone).
__global__ void dd_commit(int B, const int* __restrict__ accept_lens, const int* __restrict__ out_tokens,
                          int out_cols, const int* new_prefix, int use_new_prefix,
                          int* prefix, int* __restrict__ root, int* __restrict__ gen, int cap,
                          int* __restrict__ count, int target, int* __restrict__ steps,
                          int* __restrict__ accepted) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    int c = count[b];
    if (c >= target) return;
    int a = accept_lens[b];
    a = a < 0 ? 0 : (a > out_cols - 1 ? out_cols - 1 : a);
    for (int i = 0; i <= a; ++i)
        if (c + i < cap) gen[(size_t)b * cap + c + i] = out_tokens[(size_t)b * out_cols + i];
    count[b] = c + a + 1;
    prefix[b] = use_new_prefix ? new_prefix[b] : prefix[b] + a + 1;
    root[b] = out_tokens[(size_t)b * out_cols + a];
    steps[b] += 1;
    accepted[b] += a;
}

}  // extern "C"
"""

KERNEL_NAMES = ("dd_mm", "dd_rmsnorm", "dd_q_rope", "dd_write_kv", "dd_to_bf16", "dd_from_bf16",
                "dd_silu_mul", "dd_select", "dd_draft_topk", "dd_commit")


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

    def tree_build(self, topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, out=None):
        r = reference.tree_build(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, self.spec.max_tree_size)
        if out is None:
            return r
        for dst, src in zip(out, r):
            dst[...] = src
        return out

    def tree_verify(self, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                    out=None, lse=None):
        if out is None:  # like the launcher: bf16 bits and float32 (zeros here, not poison)
            out = np.zeros(np.shape(q_nope), np.uint16)
        if lse is None:
            lse = np.zeros(np.shape(q_nope)[:3], np.float32)
        return reference.tree_verify(q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                     softmax_scale, out=out, lse=lse)

    def tree_accept(self, tree, target_tokens, prefix_lens, kv_cache, block_table, out=None):
        r = reference.tree_accept(tree, target_tokens, prefix_lens, kv_cache, block_table, self.spec.max_depth)
        if out is None:
            return r
        for dst, src in zip(out, r):
            dst[...] = src
        return out


# ============================================================================== device loop

@dataclass
class DecodeState:
    """Per-request state on the device, updated in place by every step (graph-replay safe)."""
    prefix: Any      # [B] int32: committed cache length; the root sits at position prefix
    root: Any        # [B] int32: the last emitted token, not yet in the cache
    gen: Any         # [B, cap] int32: emitted tokens (-1 padded)
    count: Any       # [B] int32: emitted tokens so far
    steps: Any       # [B] int32: steps taken while generating
    accepted: Any    # [B] int32: accepted draft tokens
    target: int      # tokens wanted per request


class DeviceDecoder:
    """The decoding loop an engine runs, on preallocated device buffers.

    `step()` launches one step (speculative: rollout drafter, draft top-k, kset.tree_build, one
    model pass over the tree with kset.tree_verify in every layer, token choice, kset.tree_accept
    for every layer's cache, commit; plain: one q_len 1 pass and commit) with no host
    synchronisation; its only host inputs are Python constants, so it can be captured in a CUDA
    graph (`capture_step`, CuPy backend) and replayed. `run()` loops until every request has
    `new_tokens` tokens, synchronising between steps to decide termination.

    ops: CupyOps() (GPU; kernels = ddtree_gen.load(spec)) or NumpyOps() (CPU; kernels =
    ReferenceKernels(spec)). weights: init_weights(cfg) (float64; cast to float32 here).
    """

    def __init__(self, cfg: ModelConfig, spec, prompts, new_tokens: int, *, ops, kernels, weights=None,
                 speculative: bool = True, sampling: Sampling = GREEDY, drafter: Drafter = Drafter(),
                 budget: int | None = None, page_seed: int = 0, stream=None):
        _check_prompts(prompts, cfg.vocab_size)
        if (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.page_size) != (
                spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size):
            raise ValueError("cfg: attention dimensions differ from the spec's")
        self.cfg, self.spec, self.ops, self.kernels = cfg, spec, ops, kernels
        self.speculative, self.sampling, self.drafter = speculative, sampling, drafter
        self.budget, self.dp, self.k = _tree_sizes(spec, cfg, budget, drafter)
        self.new_tokens = int(new_tokens)
        self.timer = None          # a list: (name, start event, end event) per kernel call (CuPy only)
        self.stream = stream
        self._is_cupy = ops.xp is not np
        if self._is_cupy and self.stream is None:
            self.stream = ops.xp.cuda.Stream(non_blocking=True)   # capturable (not the legacy stream)
        with self._on_stream():
            self._allocate(prompts, weights if weights is not None else init_weights(cfg), page_seed)

    # ------------------------------------------------------------------ setup (not captured)
    def _on_stream(self):
        import contextlib
        return self.stream if self._is_cupy else contextlib.nullcontext()

    def _allocate(self, prompts, weights, page_seed):
        xp, cfg, spec = self.ops.xp, self.cfg, self.spec
        f32 = lambda a: xp.asarray(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
        self.w = {"embed": f32(weights["embed"]), "final_norm": f32(weights["final_norm"]),
                  "lm_head": f32(weights["lm_head"]),
                  "layers": [{k: f32(lw[k]) for k in LAYER_WEIGHTS} for lw in weights["layers"]]}
        self.inv_freq = f32(cfg.inv_freq)
        bsz = len(prompts)
        n, d, w, h, r, p = (spec.max_tree_size, spec.max_depth, spec.mask_words, cfg.num_heads, cfg.kv_lora_rank,
                            cfg.qk_rope_head_dim)
        self.batch = bsz
        table, num_pages = make_block_table(bsz, _capacity(spec, prompts, self.new_tokens), cfg.page_size,
                                            page_seed)
        self.block_table = xp.asarray(table)
        self.kv = [xp.zeros((num_pages, cfg.page_size, r + p), xp.uint16) for _ in range(cfg.num_layers)]
        i32 = lambda a: xp.asarray(np.asarray(a, np.int32))  # noqa: E731
        cap = self.new_tokens + d + 1
        self.state = DecodeState(prefix=i32([len(q) - 1 for q in prompts]), root=i32([q[-1] for q in prompts]),
                                 gen=i32(np.full((bsz, cap), -1)), count=i32(np.zeros(bsz)),
                                 steps=i32(np.zeros(bsz)), accepted=i32(np.zeros(bsz)), target=self.new_tokens)
        # constant inputs
        self.ones_b = i32(np.ones(bsz))
        self.zeros_b = i32(np.zeros(bsz))
        one_mask = np.zeros((bsz, 1, w), np.uint32)
        one_mask[:, 0, 0] = 1
        self.one_mask = xp.asarray(one_mask)
        # out= buffers of the kernels (reused by every step: fixed addresses for a graph)
        self.att = {nq: (xp.zeros((bsz, nq, h, r), xp.uint16), xp.zeros((bsz, nq, h), xp.float32))
                    for nq in ((1, n) if self.speculative else (1,))}
        self.next_tok = xp.empty((bsz, 1), xp.int32)
        if self.speculative:
            self.roll_tok = xp.empty((bsz,), xp.int32)
            self.draft_logits = xp.empty((bsz, self.dp, cfg.vocab_size), xp.float32)
            self.topk_ids = xp.empty((bsz, self.dp, self.k), xp.int32)
            self.topk_lps = xp.empty((bsz, self.dp, self.k), xp.float32)
            self.tree = TreeBuildOutput(
                num_nodes=xp.empty((bsz,), xp.int32), tokens=xp.empty((bsz, n), xp.int32),
                parents=xp.empty((bsz, n), xp.int32), depths=xp.empty((bsz, n), xp.int32),
                positions=xp.empty((bsz, n), xp.int32), scores=xp.empty((bsz, n), xp.float32),
                tree_mask=xp.empty((bsz, n, w), xp.uint32), first_child=xp.empty((bsz, n), xp.int32),
                next_sibling=xp.empty((bsz, n), xp.int32))
            self.target_tokens = xp.empty((bsz, n), xp.int32)
            self.acc = TreeAcceptOutput(accept_lens=xp.empty((bsz,), xp.int32),
                                        accepted_nodes=xp.empty((bsz, d + 1), xp.int32),
                                        out_tokens=xp.empty((bsz, d + 1), xp.int32),
                                        new_prefix_lens=xp.empty((bsz,), xp.int32))
        self._prefill(prompts)

    def _prefill(self, prompts):
        """Commit prompt[:-1] per request in causal chunks of <= N tokens (not part of a step)."""
        xp, spec = self.ops.xp, self.spec
        n, w = spec.max_tree_size, spec.mask_words
        for b, prompt in enumerate(prompts):
            ctx = np.asarray(prompt[:-1], np.int32)
            for s in range(0, len(ctx), n):
                toks = ctx[s:s + n]
                q = len(toks)
                pos = xp.asarray((s + np.arange(q, dtype=np.int32))[None])
                base = xp.asarray(np.array([s], np.int32))
                self._forward(xp.asarray(toks[None]), pos, base, 0, base, xp.asarray(np.array([q], np.int32)),
                              xp.asarray(chain_mask(q, w)[None]), self.block_table[b:b + 1], None)

    # --------------------------------------------------------------------- the model (device)
    def _kernel(self, name, fn, *args, **kwargs):
        if self.timer is None:
            return fn(*args, **kwargs)
        ev = self.ops.xp.cuda.Event
        start, end = ev(), ev()
        start.record()
        result = fn(*args, **kwargs)
        end.record()
        self.timer.append((name, start, end))
        return result

    def _forward(self, tokens, rope_pos, slot_base, slot_offset, attn_prefix, q_lens, mask, block_table, att):
        """logits [B * Nq, V] float32 of tokens [B, Nq] at RoPE positions rope_pos [B, Nq]; the rows'
        KV goes to cache positions slot_base[b] + slot_offset + j; attention through
        kset.tree_verify(prefix_lens=attn_prefix, q_lens, tree_mask=mask) into the out= buffers att."""
        ops, cfg, w = self.ops, self.cfg, self.w
        b, nq = tokens.shape
        m = b * nq
        h, r, p, dn, dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        rope = rope_pos.reshape(m)
        x_h = ops.embed(w["embed"], tokens.reshape(m))                          # [M, d]
        for layer, lw in enumerate(w["layers"]):
            x = ops.rmsnorm(x_h, lw["attn_norm"], cfg.rms_eps)
            q = ops.mm(ops.rmsnorm(ops.mm(x, lw["wq_a"]), lw["q_norm"], cfg.rms_eps), lw["wq_b"])
            q_nope, q_pe = ops.q_rope(q.reshape(m, h, dn + p), rope, self.inv_freq, dn)
            q_abs = ops.to_bits(ops.mm(q_nope, lw["w_uk_t"]))                   # [M, H, R] bf16
            ops.write_kv(ops.mm(x, lw["wkv_a"]), lw["kv_norm"], rope, self.inv_freq, slot_base, slot_offset, nq,
                         block_table, self.kv[layer], cfg.rms_eps)
            out, lse = att if att is not None else (None, None)
            name = "tree_verify (q_len 1)" if nq == 1 else f"tree_verify (Nq {nq})"
            out, _ = self._kernel(name, self.kernels.tree_verify, q_abs.reshape(b, nq, h, r),
                                  q_pe.reshape(b, nq, h, p), self.kv[layer], block_table, attn_prefix, q_lens, mask,
                                  cfg.softmax_scale, out=out, lse=lse)
            o = ops.mm(ops.from_bits(out).reshape(m, h, r), lw["w_uv"]).reshape(m, h * dv)
            x_h = x_h + ops.mm(o, lw["wo"])
            x2 = ops.rmsnorm(x_h, lw["mlp_norm"], cfg.rms_eps)
            x_h = x_h + ops.mm(ops.silu_mul(ops.mm(x2, lw["w_gate"]), ops.mm(x2, lw["w_up"])), lw["w_down"])
        return ops.mm(ops.rmsnorm(x_h, w["final_norm"], cfg.rms_eps), w["lm_head"])

    # ------------------------------------------------------------------------------ one step
    def step(self):
        """Launch one decoding step on the decoder's stream (no host sync)."""
        with self._on_stream():
            if self.speculative:
                self._speculative_step()
            else:
                self._plain_step()

    def _plain_step(self):
        st, ops = self.state, self.ops
        bsz = self.batch
        logits = self._forward(st.root.reshape(bsz, 1), st.prefix.reshape(bsz, 1), st.prefix, 0, st.prefix,
                               self.ones_b, self.one_mask, self.block_table, self.att[1])
        ops.select(logits, st.prefix, 1, 1, self.sampling, self.next_tok)
        ops.commit(self.zeros_b, self.next_tok, st.prefix, False, st)
        return logits

    def _speculative_step(self):
        st, ops, kern = self.state, self.ops, self.kernels
        bsz, n = self.batch, self.spec.max_tree_size
        # 1. draft: the target rolled out D' steps from the root, into scratch slots prefix + d
        self.roll_tok[...] = st.root
        for d in range(self.dp):
            pos = st.prefix + np.int32(d)                           # device temporary, int32
            logits = self._forward(self.roll_tok.reshape(bsz, 1), pos.reshape(bsz, 1), st.prefix, d, pos,
                                   self.ones_b, self.one_mask, self.block_table, self.att[1])
            self.draft_logits[:, d, :] = logits
            if d + 1 < self.dp:
                ops.select(logits, pos, 1, 1, self.sampling, self.roll_tok)
        ops.draft_topk(self.draft_logits, st.prefix, self.drafter, self.sampling, self.topk_ids, self.topk_lps)
        # 2. tree_build
        tree = self._kernel("tree_build", kern.tree_build, self.topk_ids, self.topk_lps, st.root, st.prefix,
                            self.budget, out=self.tree)
        # 3. target pass over the N tree rows (q_len = num_nodes); node j's KV at prefix + j
        logits = self._forward(tree.tokens, tree.positions, st.prefix, 0, st.prefix, tree.num_nodes,
                               tree.tree_mask, self.block_table, self.att[n])
        ops.select(logits, tree.positions.reshape(bsz * n), 1, n, self.sampling, self.target_tokens.reshape(bsz * n))
        # 4. tree_accept on every layer's cache (same walk, same outputs; each moves its layer's KV)
        for layer_kv in self.kv:
            acc = self._kernel("tree_accept", kern.tree_accept, tree, self.target_tokens, st.prefix, layer_kv,
                               self.block_table, out=self.acc)
        # 5. commit: append the accepted tokens + bonus, advance prefix and root
        ops.commit(acc.accept_lens, acc.out_tokens, acc.new_prefix_lens, True, st)

    # ------------------------------------------------------------------------- driving loops
    def snapshot(self) -> dict:
        """Host copies (a sync) of the state and of every layer's cache, for comparisons."""
        host = (lambda a: a.get(stream=self.stream)) if self._is_cupy else np.array  # noqa: E731
        st = self.state
        snap = {k: host(getattr(st, k)) for k in ("prefix", "root", "gen", "count", "steps", "accepted")}
        snap["kv"] = [host(layer_kv) for layer_kv in self.kv]
        return snap

    def done(self) -> bool:
        """Host check between steps (a sync)."""
        count = self.state.count
        count = count.get(stream=self.stream) if self._is_cupy else count
        return bool(np.min(count) >= self.new_tokens)

    def result(self, steps: int) -> Generation:
        get = (lambda a: a.get(stream=self.stream)) if self._is_cupy else (lambda a: np.array(a))  # noqa: E731
        st = self.state
        return Generation(get(st.gen)[:, :self.new_tokens].astype(np.int32), steps, int(get(st.steps).sum()),
                          int(get(st.accepted).sum()))

    def run(self, *, graph: bool = False, max_steps: int | None = None, keep_margins: bool = False) -> Generation:
        """Step until every request has new_tokens tokens. graph=True (CuPy): the first step runs
        eagerly as the warm-up, the second is captured and every later step replays the graph.
        keep_margins (plain, eager): record top1 - top2 of the scores behind every token."""
        max_steps = max_steps or (self.new_tokens + 1) * 2
        captured, steps = None, 0
        margins = [[] for _ in range(self.batch)] if keep_margins else None
        while not self.done():
            if steps >= max_steps:
                raise RuntimeError(f"no progress after {steps} steps")
            if graph and steps == 1:
                captured = self.capture_step(warmup=False)
            if captured is not None:
                captured.replay()
            elif graph:
                with self._private_pool():
                    self.step()
            elif keep_margins:
                self._margin_step(margins)
            else:
                self.step()
            steps += 1
        gen = self.result(steps)
        if keep_margins:
            gen.margins = np.array([row[:self.new_tokens] for row in margins], np.float32)
        return gen

    def _margin_step(self, margins):
        """A plain step that also records, per active request, the top1 - top2 gap of the scores
        its token was chosen from (host side: a sync; for the near-tie diagnosis of tests)."""
        if self.speculative:
            raise ValueError("keep_margins: plain decoding only")
        host = (lambda a: a.get(stream=self.stream)) if self._is_cupy else np.array  # noqa: E731
        st = self.state
        active = host(st.count) < self.new_tokens
        prefix = host(st.prefix).astype(np.int64)
        with self._on_stream():
            logits = self._plain_step()
            scores = host(logits).astype(np.float64)
        if not self.sampling.greedy:
            scores = scores * self.sampling.inv_temp + gumbel(
                self.sampling.seed, np.arange(self.batch)[:, None], prefix[:, None] + 1,
                np.arange(scores.shape[-1]))
        top = np.sort(scores, axis=-1)
        for b in np.flatnonzero(active):
            margins[b].append(float(top[b, -1] - top[b, -2]))

    # ------------------------------------------------------------------------ CUDA graphs
    def _private_pool(self):
        """Temporaries of captured steps come from a pool of their own: after the capture, the
        graph owns those addresses, and no later allocation may be handed one of them."""
        import contextlib
        if not self._is_cupy:
            return contextlib.nullcontext()
        if getattr(self, "_pool", None) is None:
            self._pool = self.ops.xp.cuda.MemoryPool()
        return self.ops.xp.cuda.using_allocator(self._pool.malloc)

    def capture_step(self, *, warmup: bool = True) -> "CapturedStep":
        """Capture one step into a CUDA graph (CuPy backend). warmup=True first runs one real step
        eagerly (it advances the state like any step) so that every kernel is compiled and loaded
        and the private pool holds the step's temporaries before the capture."""
        if not self._is_cupy:
            raise RuntimeError("capture_step: CUDA graphs need the CuPy backend")
        if self.timer is not None:
            raise RuntimeError("capture_step: per-kernel timing (events) cannot be captured; set timer = None")
        with self._private_pool():
            if warmup:
                self.step()
            self.stream.synchronize()
            with self.stream:
                self.stream.begin_capture()
                try:
                    self.step()
                except BaseException:
                    try:
                        self.stream.end_capture()   # leave capture mode; the first error is the one
                    except Exception:
                        pass
                    raise
                graph = self.stream.end_capture()
        graph.upload(self.stream)
        return CapturedStep(graph, self.stream, self._pool)


class CapturedStep:
    """One captured decoding step: replay() launches it on the decoder's stream (no sync). It
    reads and updates the decoder's state buffers in place, so each replay is the next step."""

    def __init__(self, graph, stream, pool):
        self.graph, self.stream, self._pool = graph, stream, pool  # the pool owns the graph's temporaries

    def replay(self):
        self.graph.launch(self.stream)


def generate_device(cfg: ModelConfig, spec, prompts, new_tokens: int, *, kernels=None, ops=None,
                    graph: bool = False, **kwargs) -> Generation:
    """Run the device loop: on the GPU by default (ops = CupyOps(), kernels = ddtree_gen.load(spec));
    pass ops=NumpyOps(), kernels=ReferenceKernels(spec) for the CPU emulation."""
    if ops is None:
        ops = CupyOps()
    if kernels is None:
        if ops.xp is np:
            kernels = ReferenceKernels(spec)
        else:
            from .runtime import load
            kernels = load(spec)
    dec = DeviceDecoder(cfg, spec, prompts, new_tokens, ops=ops, kernels=kernels, **kwargs)
    return dec.run(graph=graph)


"""Tensor parallelism of the tiny MLA model over its attention heads (Megatron style).

The full model has H heads; rank r of a TP group of size T keeps heads
[r * H/T, (r + 1) * H/T) and runs a spec with H/T heads (`rank_spec`: an existing spec in
specs/ whose other fields match, e.g. deepseek-v3-tp8 (H=16) -> kimi-k2.6-tp8 (H=8) for T=2).

Per layer, which weights are sharded (`SHARDED`) and which are replicated:

    wq_b    [q_lora, H * (Dn + P)]  column-parallel: rank r keeps its heads' columns
    w_uk_t  [H, Dn, R]              rank r keeps its heads (W_UK absorption is per head)
    w_uv    [H, R, Dv]              rank r keeps its heads
    wo      [H * Dv, d]             row-parallel: rank r keeps its heads' rows, so
                                    o_proj = sum over ranks of (o_r @ wo_r): the one reduction
    everything else                 replicated (embed, norms, wq_a, q_norm, wkv_a, kv_norm, the MLP,
                                    lm_head). wkv_a / kv_norm make the latent KV row, which all
                                    heads share in MLA: every rank holds the full latent cache.

The only quantity summed over heads is o_proj, so the only collective is one all-reduce (SUM)
of the o_proj partials per layer and pass, before the residual add: `NumpyMLA(all_reduce=...)`,
`DeviceDecoder(all_reduce=...)`. After it every rank holds the same hidden state, hence the
same logits, the same tree (tree_build is replicated), the same target tokens and the same
tree_accept walk on its own copy of the latent cache.

Equality with TP = 1 is up to float summation order: TP = 1 sums the H * Dv products of o_proj
in one dot product, TP = T in T partial dot products whose results the all-reduce adds. The
decoding is the same function; its tokens may differ only where the top-2 scores nearly tie
(`compare_tokens`, the near-tie rule of the single-GPU check).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..spec import FIELDS
from .config import ModelConfig

SHARDED = ("wq_b", "w_uk_t", "w_uv", "wo")


def head_range(num_heads: int, rank: int, tp: int) -> tuple[int, int]:
    """[lo, hi): the heads of `rank` in a TP group of `tp` ranks (contiguous, equal blocks)."""
    if tp < 1 or num_heads % tp:
        raise ValueError(f"tp={tp}: the {num_heads} heads must split into equal blocks")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    n = num_heads // tp
    return rank * n, (rank + 1) * n


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The per-rank config: num_heads H / tp, every other field the full model's."""
    lo, hi = head_range(cfg.num_heads, 0, tp)
    return dataclasses.replace(cfg, num_heads=hi - lo)


def shard_weights(weights: dict, cfg: ModelConfig, rank: int, tp: int) -> dict:
    """Rank `rank`'s weights, sliced out of the full model's `weights` (init_weights(cfg) with the
    same seed on every rank): its heads of wq_b, w_uk_t, w_uv, wo; the rest shared (not copied)."""
    lo, hi = head_range(cfg.num_heads, rank, tp)
    h, dn, p, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    layers = []
    for lw in weights["layers"]:
        s = dict(lw)
        qr = lw["wq_b"].shape[0]
        s["wq_b"] = np.ascontiguousarray(lw["wq_b"].reshape(qr, h, dn + p)[:, lo:hi].reshape(qr, -1))
        s["w_uk_t"] = np.ascontiguousarray(lw["w_uk_t"][lo:hi])
        s["w_uv"] = np.ascontiguousarray(lw["w_uv"][lo:hi])
        s["wo"] = np.ascontiguousarray(lw["wo"][lo * dv:hi * dv])
        layers.append(s)
    return {**weights, "layers": layers}


# what a rank's spec shares with the whole model's: every field but the name, the heads (H / tp) and the build
# targets (a rank's own)
_MATCH = tuple(f.name for f in FIELDS if f.name not in ("name", "num_heads", "archs"))


def rank_spec(spec, tp: int, specs=None):
    """The spec a rank runs: one of `specs` (default: every spec in specs/) with num_heads
    H / tp and the same R, P, page size, N, D and kv_dtype (every field of _MATCH) as `spec`. None there: a Spec of those values
    named '<spec>-tp<tp>-rank' (ddtree_gen.load compiles it through the cache)."""
    lo, hi = head_range(spec.num_heads, 0, tp)
    if tp == 1:
        return spec
    if specs is None:
        from ..spec import all_specs
        specs = all_specs()
    for s in specs:
        if s.num_heads == hi - lo and all(getattr(s, f) == getattr(spec, f) for f in _MATCH):
            return s
    from ..spec import parse_spec
    return parse_spec({**spec.as_dict(), "name": f"{spec.name}-tp{tp}-rank", "num_heads": hi - lo},
                      "ddtree_gen.model.tensor_parallel.rank_spec")


# ------------------------------------------------------------------ the near-tie rule

@dataclass
class Comparison:
    """`tokens` against `reference` tokens under the near-tie rule (see compare_tokens)."""
    identical: bool                                   # every request bit-identical
    near_ties: list = field(default_factory=list)     # (request, token, margin): allowed divergences
    violations: list = field(default_factory=list)    # (request, token, margin): divergences at margin >= bar
    partings: list = field(default_factory=list)      # (request, token): where each differing request first parts

    @property
    def ok(self) -> bool:
        return not self.violations

    def describe(self) -> str:
        if self.identical:
            return "identical"
        if any(not isinstance(x, tuple) for x in self.near_ties + self.violations):   # TieCheck entries
            parts = []
            if self.near_ties:
                parts.append("near-tie divergence " + ", ".join(map(str, self.near_ties)))
            if self.violations:
                parts.append("DIVERGENCE outside the bar's bound " + ", ".join(map(str, self.violations)))
            return "; ".join(parts)
        parts = []
        if self.near_ties:
            parts.append("near-tie divergence (request, token, margin) " +
                         ", ".join(f"({b}, {i}, {m:.2g})" for b, i, m in self.near_ties))
        if self.violations:
            parts.append("DIVERGENCE at an ordinary token (request, token, margin) " +
                         ", ".join(f"({b}, {i}, {m:.3g})" for b, i, m in self.violations))
        return "; ".join(parts)


def compare_tokens(reference: np.ndarray, tokens: np.ndarray, margins, near_tie: float) -> Comparison:
    """Per request, `tokens` must equal `reference`, except that they may part at the first
    token i where the reference's top-2 score margin margins[b, i] is below `near_tie` (a
    near-tie that float rounding can flip); after that the continuations differ and are not
    compared. `margins`: [B, T] array, or a callable (b, i) -> margin (computed on demand),
    or None (then any divergence is a violation)."""
    reference, tokens, out = _first_partings(reference, tokens)
    for b, i in out.partings:
        if margins is None:
            m = float("inf")
        elif callable(margins):
            m = float(margins(b, i))
        else:
            m = float(np.asarray(margins)[b, i])
        (out.near_ties if m < near_tie else out.violations).append((b, i, m))
    return out


def judge_tokens(reference: np.ndarray, tokens: np.ndarray, judge) -> Comparison:
    """`tokens` against `reference` under the float64 near-tie rule (model.near_tie): per request, the
    sequences must be equal, except that they may part at the first token i where judge(b, i, a, c) (a the
    reference's token there, c the other's; a near_tie.TieCheck) says near_tie; after it the continuations
    differ and are not compared. Comparison's lists then hold the TieChecks."""
    reference, tokens, out = _first_partings(reference, tokens)
    for b, i in out.partings:
        check = judge(b, i, int(reference[b, i]), int(tokens[b, i]))
        (out.near_ties if check.near_tie else out.violations).append(check)
    return out


def _first_partings(reference, tokens):
    """(reference, tokens) as arrays of one shape (ValueError otherwise) and an empty Comparison whose `partings`
    lists (request, first token where the two differ), in request order."""
    reference, tokens = np.asarray(reference), np.asarray(tokens)
    if reference.shape != tokens.shape:
        raise ValueError(f"token shapes differ: {reference.shape} vs {tokens.shape}")
    partings = [(b, int(np.flatnonzero(reference[b] != tokens[b])[0])) for b in range(reference.shape[0])
                if (reference[b] != tokens[b]).any()]
    return reference, tokens, Comparison(identical=bool(np.array_equal(reference, tokens)), partings=partings)

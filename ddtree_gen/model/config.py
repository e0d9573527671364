"""Configuration of the tiny model and its decoding loops (dimensions, sampling, drafter, result),
and the checks of a loop's arguments against them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


# ================================================================= a loop's arguments

def _check_prompts(prompts, vocab):
    """ValueError unless every prompt is a non-empty list of token ids in [0, vocab)."""
    if not prompts:
        raise ValueError("prompts: at least one request")
    for i, p in enumerate(prompts):
        if len(p) < 1:
            raise ValueError(f"prompts[{i}]: empty (the last prompt token is the first root)")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompts[{i}]: token ids must lie in [0, {vocab})")


def _tree_sizes(spec, cfg, budget, drafter):
    """(budget, D', K) of a speculative loop, checked against the spec: budget defaults to N - 1,
    D' to max_depth; K is the drafter's top-K per depth."""
    n, d = spec.max_tree_size, spec.max_depth
    budget = n - 1 if budget is None else int(budget)
    if not 0 <= budget <= n - 1:
        raise ValueError(f"budget: {budget} must lie in [0, max_tree_size - 1 = {n - 1}]")
    dp = d if drafter.depth is None else int(drafter.depth)
    if not 1 <= dp <= d:
        raise ValueError(f"drafter.depth: {dp} must lie in [1, max_depth = {d}]")
    k = max(1, min(budget, cfg.vocab_size, n - 1))
    return budget, dp, k

"""The tiny model's seeded random float64 weights."""
from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


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

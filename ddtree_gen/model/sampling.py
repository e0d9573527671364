"""Token choice: counter-based Gumbel noise, the target's token (greedy or Gumbel-max) and the
drafter's top-K per depth."""
from __future__ import annotations

import numpy as np

from .config import Drafter, Sampling


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

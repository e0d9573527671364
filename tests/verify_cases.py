"""Input builders for the GPU tree_verify tests (test_gpu_tree_verify.py: the CUDA-core and the
tensor-core kernels).

make_inputs() builds a batch: random bf16 q / kv (the distribution is the `bf16` argument:
random_bf16_bounded by default, random_bf16_normal for the tensor-core tests), ancestor masks of
the given tree kinds, pages from a random permutation of a cache larger than needed, unused
block-table entries garbage. For an fp8 spec (kv_dtype "fp8_e4m3") the cache holds the e4m3 bytes
of N(0, 1) samples (ml_dtypes; no NaN bytes) and the batch a random kv_scale in [0.01, 2]: the
references dequantize the same bytes with it (e4m3 x kv_scale), so the numerical bar is the bf16 one.
"""
from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass

import numpy as np

from ddtree_gen import fp8
from ddtree_gen.trees import ancestor_mask, tree_parents

__all__ = ["to_device", "to_host", "fresh_seed", "random_bf16_bounded", "random_bf16_normal", "bf16_nan",
           "random_e4m3_normal", "random_kv_scale", "random_cache_bits", "kv_np_dtype", "kv_torch",
           "tree_parents", "ancestor_mask", "VerifyInputs", "make_inputs"]


def to_device(x):
    import cupy
    return cupy.asarray(x)


def to_host(x):
    import cupy
    return cupy.asnumpy(x)


def fresh_seed() -> int:
    env = os.environ.get("DDTREE_TEST_SEED")
    return int(env) if env else secrets.randbits(32)


def random_bf16_bounded(rng, shape) -> np.ndarray:
    """Random bf16 bits: random sign and mantissa, exponent 124..127, i.e. values +-[0.125, 2)
    (RMS about 1). Drawn as raw 64-bit words (fast: B = 64 requests of 128 heads is 272 M values)."""
    n = math.prod(shape)
    bits = rng.integers(0, 2**64 - 1, -(-n // 4), dtype=np.uint64, endpoint=True).view(np.uint16)[:n]
    bits = bits.reshape(shape)
    bits &= np.uint16(0x81FF)   # sign, the 2 low exponent bits, mantissa
    bits |= np.uint16(0x3E00)   # exponent 0b011111xx = 124..127
    return bits


def random_bf16_normal(rng, shape) -> np.ndarray:
    """bf16 bits of N(0, 1) samples (truncated: the bits are the data, the reference reads the same)."""
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_nan(bits) -> np.ndarray:
    return (bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)


def random_e4m3_normal(rng, shape) -> np.ndarray:
    """e4m3 bytes (uint8) of N(0, 1) float32 samples, rounded to nearest even (|x| < 448: no NaN byte)."""
    return fp8.from_float(rng.standard_normal(shape, dtype=np.float32))


def random_kv_scale(rng) -> float:
    """A kv_scale in [0.01, 2], exactly a float32 (the kernels apply it in fp32)."""
    return float(np.float32(rng.uniform(0.01, 2.0)))


def kv_np_dtype(spec):
    """The numpy dtype of the spec's cache on the host: uint16 bf16 bits, or uint8 e4m3 bytes."""
    return np.uint8 if spec.kv_fp8 else np.uint16


def random_cache_bits(rng, spec, shape) -> np.ndarray:
    """Any bit patterns of the spec's cache elements (the discrete kernels only move them)."""
    return rng.integers(0, 1 << (8 * np.dtype(kv_np_dtype(spec)).itemsize), shape, dtype=kv_np_dtype(spec))


def kv_torch(spec, a, device="cuda"):
    """A host cache as the torch tensor an engine would pass: torch.bfloat16, or torch.float8_e4m3fn."""
    import torch
    t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16) if not spec.kv_fp8 else np.ascontiguousarray(a))
    return t.to(device).view(torch.float8_e4m3fn if spec.kv_fp8 else torch.bfloat16)


@dataclass
class VerifyInputs:
    """One batch on the host (bf16 as uint16 bits); .device() gives the launcher's arguments."""
    q_nope: np.ndarray       # [B, Nq, H, R]
    q_pe: np.ndarray         # [B, Nq, H, P]
    kv_cache: np.ndarray     # [num_pages, page, R + P]
    block_table: np.ndarray  # [B, max_pages] int32
    prefix_lens: np.ndarray  # [B] int32
    q_lens: np.ndarray       # [B] int32
    tree_mask: np.ndarray    # [B, Nq, W] uint32
    kv_scale: float | None = None   # an fp8 cache's scale (None: a bf16 cache)
    seed: int = 0

    @property
    def shape(self):
        return self.q_nope.shape

    def host(self, **replace) -> dict:
        """The launchers' and the references' keyword arguments (kv_scale included), on the host."""
        d = dict(q_nope=self.q_nope, q_pe=self.q_pe, kv_cache=self.kv_cache, block_table=self.block_table,
                 prefix_lens=self.prefix_lens, q_lens=self.q_lens, tree_mask=self.tree_mask, kv_scale=self.kv_scale)
        d.update(replace)
        return d

    def device(self, **replace) -> dict:
        return {k: to_device(v) if isinstance(v, np.ndarray) else v for k, v in self.host(**replace).items()}


def make_inputs(spec, rng, prefix_lens, q_lens, trees, *, nq=None, extra_pages=5, junk_bits=False,
                seed=0, bf16=random_bf16_bounded) -> VerifyInputs:
    """A batch: random bf16 q / kv drawn with `bf16(rng, shape)`, ancestor masks of the given tree
    kinds, pages from a random permutation of a cache larger than needed, unused block-table
    entries garbage. junk_bits sets random mask bits at and past q_len (they name keys outside the
    call: ignored) and fills rows >= q_len with random words. `seed` is only recorded. An fp8 spec's
    cache is random_e4m3_normal, with a random_kv_scale."""
    h, r, p, page, w = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size, spec.mask_words
    b = len(prefix_lens)
    nq = spec.max_tree_size if nq is None else nq
    prefix_lens = np.asarray(prefix_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    need = [-(-(int(L) + int(q)) // page) for L, q in zip(prefix_lens, q_lens)]
    num_pages = sum(need) + extra_pages
    max_pages = max(need) + 1
    perm = rng.permutation(num_pages).astype(np.int32)
    garbage = np.array([-1, -7, num_pages, 2**31 - 1, -2**31], np.int32)
    table = rng.choice(garbage, size=(b, max_pages)).astype(np.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    mask = np.zeros((b, nq, w), np.uint32)
    if junk_bits:
        mask[:] = rng.integers(0, 2**32, size=mask.shape, dtype=np.uint32)
    for i, (q, kind) in enumerate(zip(q_lens, trees)):
        tree = ancestor_mask(tree_parents(kind, int(q), rng), w)
        if junk_bits:  # keep the random bits at positions >= q
            keep = np.array([sum(1 << k for k in range(32) if 32 * word + k >= q) for word in range(w)], np.uint32)
            mask[i, :q] = (mask[i, :q] & keep) | tree
        else:
            mask[i, :q] = tree
    q_nope, q_pe = bf16(rng, (b, nq, h, r)), bf16(rng, (b, nq, h, p))
    kv_shape = (num_pages, page, r + p)
    kv = random_e4m3_normal(rng, kv_shape) if spec.kv_fp8 else bf16(rng, kv_shape)
    return VerifyInputs(q_nope=q_nope, q_pe=q_pe, kv_cache=kv, block_table=table, prefix_lens=prefix_lens,
                        q_lens=q_lens, tree_mask=mask, kv_scale=random_kv_scale(rng) if spec.kv_fp8 else None,
                        seed=seed)

"""Input builders for the GPU tree_verify tests (test_gpu_tree_verify.py: the CUDA-core and the
tensor-core kernels), over the package's input factory (ddtree_gen/inputs.py).

make_inputs() builds a batch: random bf16 q / kv (the distribution is the `bf16` argument:
random_bf16_bounded by default, random_bf16_normal for the tensor-core tests), ancestor masks of
the given tree kinds, pages from a random permutation of a cache larger than needed, unused
block-table entries garbage. For an fp8 spec (kv_dtype "fp8_e4m3") the cache holds the e4m3 bytes
of N(0, 1) samples (ml_dtypes; no NaN bytes) and the batch a random kv_scale in [0.01, 2]: the
references dequantize the same bytes with it (e4m3 x kv_scale), so the numerical bar is the bf16 one.
"""
from __future__ import annotations

import os
import secrets

import numpy as np

from ddtree_gen import inputs
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


# the value samplers and the tree_verify batch come from the input factory (ddtree_gen/inputs.py)
random_bf16_bounded = inputs.bf16_bounded
random_bf16_normal = inputs.bf16_normal
random_e4m3_normal = inputs.e4m3_normal
random_kv_scale = inputs.kv_scale
kv_np_dtype = inputs.kv_dtype
random_cache_bits = inputs.cache_bits
VerifyInputs = inputs.VerifyInputs


def bf16_nan(bits) -> np.ndarray:
    return (bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)


def kv_torch(spec, a, device="cuda"):
    """A host cache as the torch tensor an engine would pass: torch.bfloat16, or torch.float8_e4m3fn."""
    import torch
    t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16) if not spec.kv_fp8 else np.ascontiguousarray(a))
    return t.to(device).view(torch.float8_e4m3fn if spec.kv_fp8 else torch.bfloat16)


def make_inputs(spec, rng, prefix_lens, q_lens, trees, *, nq=None, extra_pages=5, junk_bits=False,
                seed=0, bf16=random_bf16_bounded) -> VerifyInputs:
    """A batch: random bf16 q / kv drawn with `bf16(rng, shape)`, ancestor masks of the given tree
    kinds, pages from a random permutation of a cache larger than needed, unused block-table
    entries garbage (and one spare column of them). junk_bits sets random mask bits at and past q_len
    (they name keys outside the call: ignored) and fills rows >= q_len with random words. `seed` is only
    recorded. An fp8 spec's cache is random_e4m3_normal, with a random_kv_scale (inputs.tree_verify)."""
    return inputs.tree_verify(spec, rng, prefix_lens, q_lens, trees, nq=nq, extra_pages=extra_pages, spare_columns=1,
                              unused="garbage", junk_bits=junk_bits, values=bf16, seed=seed)

"""The paged KV cache of the loops: block tables, causal prefill masks and capacity."""
from __future__ import annotations

import numpy as np

from ..inputs import block_table


def make_block_table(batch: int, tokens_per_request: int, page_size: int, seed: int = 0):
    """(block_table [B, max_pages] int32, num_pages): every request gets its own pages, in a
    shuffled order (pages of a request are not contiguous), plus one page nobody uses."""
    return block_table(np.random.default_rng(seed), [tokens_per_request] * batch, page_size, extra_pages=1)


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

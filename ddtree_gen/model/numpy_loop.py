"""The float64 decoding loop on the numpy references: plain and DDTree speculative
(generate_numpy)."""
from __future__ import annotations

import numpy as np

from .. import reference
from .cache import _capacity, make_block_table
from .config import GREEDY, Drafter, Generation, Sampling, _check_prompts, _tree_sizes
from .numpy_model import NumpyMLA
from .sampling import draft_topk, select_tokens


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

"""The launchers as torch custom ops (torch.ops.ddtree.*), for torch.compile and CUDA graphs.

    import ddtree_gen.torch_ops   # registers the ops (torch is needed here, nowhere else)
    ids, lps = torch.ops.ddtree.draft_topk("kimi-k2.6-tp8", logits, 64)      # logits [B, D', V] bf16 / float32
    tree = torch.ops.ddtree.tree_build("kimi-k2.6-tp8", topk_ids, topk_logprobs, roots, prefix_lens, 64)
    out, lse = torch.ops.ddtree.tree_verify("kimi-k2.6-tp8", q_nope, q_pe, kv_cache, block_table,
                                            prefix_lens, q_lens, tree[6], softmax_scale, "auto")
    acc = torch.ops.ddtree.tree_accept("kimi-k2.6-tp8", tree[0], tree[1], tree[7], tree[8], target_tokens,
                                       prefix_lens, kv_cache, block_table)   # moves kv_cache in place
    # an fp8 spec (kv_dtype "fp8_e4m3"): kv_cache is torch.float8_e4m3fn (or uint8), tree_verify takes kv_scale
    out, lse = torch.ops.ddtree.tree_verify("kimi-k2.6-tp8-fp8", q_nope, q_pe, kv_fp8, block_table, prefix_lens,
                                            q_lens, tree[6], softmax_scale, "auto", kv_scale)

The first argument names the spec (as ddtree_gen.load takes it). Each op returns the fields of the
plain launcher's record as a tuple, in the record's order (DraftTopkOutput, TreeBuildOutput, AttentionOutput,
TreeAcceptOutput). Every op has a fake (meta) implementation, so torch.compile traces it without
running it; tree_accept's schema declares the KV cache it moves (Tensor(a!)). The ops call the
plain launchers: same checks, same kernels, on the current stream of the inputs' device.
"""
from __future__ import annotations

import functools

import torch

from .kernel_set import load
from .types import AttentionOutput, DraftTopkOutput, TreeAcceptOutput, TreeBuildOutput

@functools.lru_cache(maxsize=None)
def _kset(spec: str):
    return load(spec)


@functools.lru_cache(maxsize=None)
def _dims(spec: str) -> tuple[int, int, int]:
    """(N, W, D + 1) of a spec, for the fake implementations (no build needed)."""
    from .spec import find_spec
    s = find_spec(spec)
    return s.max_tree_size, s.mask_words, s.max_depth + 1


# Defined through torch.library.Library rather than the torch.library.custom_op decorator: the
# decorator adds a Python autograd layer to every call (tens of microseconds), and these ops have
# no gradient. The schema below is what custom_op would infer; "(a!)" marks the cache tree_accept
# writes.
_LIB = torch.library.Library("ddtree", "DEF")
_ATTENTION_ARGS = ("Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor prefix_lens, "
                   "Tensor q_lens, Tensor tree_mask, float softmax_scale, str impl='auto', float? kv_scale=None")
SCHEMAS = {
    "tree_build": "tree_build(str spec, Tensor topk_ids, Tensor topk_logprobs, Tensor root_tokens, "
                  "Tensor prefix_lens, int budget) -> (" + ", ".join(["Tensor"] * 9) + ")",
    "tree_verify": f"tree_verify(str spec, {_ATTENTION_ARGS}) -> (Tensor, Tensor)",
    "tree_verify_tail": f"tree_verify_tail(str spec, {_ATTENTION_ARGS}) -> (Tensor, Tensor)",
    "merge_states": "merge_states(str spec, Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b) -> (Tensor, Tensor)",
    "tree_accept": "tree_accept(str spec, Tensor num_nodes, Tensor tokens, Tensor first_child, Tensor next_sibling, "
                   "Tensor target_tokens, Tensor prefix_lens, Tensor(a!) kv_cache, Tensor block_table) "
                   "-> (Tensor, Tensor, Tensor, Tensor)",
    "tree_walk": "tree_walk(str spec, Tensor num_nodes, Tensor tokens, Tensor first_child, Tensor next_sibling, "
                 "Tensor target_tokens, Tensor prefix_lens) -> (Tensor, Tensor, Tensor, Tensor)",
    "draft_topk": "draft_topk(str spec, Tensor logits, int k, float temperature=1.0) -> (Tensor, Tensor)",
    "kv_commit": "kv_commit(str spec, Tensor accept_lens, Tensor accepted_nodes, Tensor prefix_lens, "
                 "Tensor(a!)[] kv_caches, Tensor block_table) -> ()",
}


def _op(name: str):
    """Register `name` (its schema above): the decorated function is the CUDA implementation, and
    `.fake` registers the shape function torch.compile traces with."""
    def register(impl):
        _LIB.define(SCHEMAS[name])
        _LIB.impl(name, impl, "CUDA")
        impl.fake = lambda fake: torch.library.register_fake(f"ddtree::{name}", lib=_LIB)(fake)
        return impl
    return register


@_op("tree_build")
def tree_build(spec, topk_ids, topk_logprobs, root_tokens, prefix_lens, budget):
    return tuple(_kset(spec).tree_build(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget))


@tree_build.fake
def _(spec, topk_ids, topk_logprobs, root_tokens, prefix_lens, budget):
    n, w, _ = _dims(spec)
    b = topk_ids.shape[0]
    i32 = dict(dtype=torch.int32)
    return (topk_ids.new_empty((b,), **i32), *(topk_ids.new_empty((b, n), **i32) for _ in range(4)),
            topk_ids.new_empty((b, n), dtype=torch.float32), topk_ids.new_empty((b, n, w), dtype=torch.uint32),
            topk_ids.new_empty((b, n), **i32), topk_ids.new_empty((b, n), **i32))


def _attention_fake(spec, q_nope, *args):
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:3], dtype=torch.float32)


@_op("tree_verify")
def tree_verify(spec, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                impl="auto", kv_scale=None):
    return tuple(_kset(spec).tree_verify(q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                         softmax_scale, impl=impl, kv_scale=kv_scale))


tree_verify.fake(_attention_fake)


@_op("tree_verify_tail")
def tree_verify_tail(spec, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                     impl="auto", kv_scale=None):
    return tuple(_kset(spec).tree_verify_tail(q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                              softmax_scale, impl=impl, kv_scale=kv_scale))


tree_verify_tail.fake(_attention_fake)


@_op("merge_states")
def merge_states(spec, o_a, lse_a, o_b, lse_b):
    return tuple(_kset(spec).merge_states(o_a, lse_a, o_b, lse_b))


@merge_states.fake
def _(spec, o_a, lse_a, o_b, lse_b):
    return o_a.new_empty(o_a.shape), lse_a.new_empty(lse_a.shape)


@_op("tree_accept")
def tree_accept(spec, num_nodes, tokens, first_child, next_sibling, target_tokens, prefix_lens, kv_cache,
                block_table):
    tree = TreeBuildOutput(num_nodes, tokens, None, None, None, None, None, first_child, next_sibling)
    return tuple(_kset(spec).tree_accept(tree, target_tokens, prefix_lens, kv_cache, block_table))


@tree_accept.fake
def _(spec, num_nodes, tokens, first_child, next_sibling, target_tokens, prefix_lens, kv_cache, block_table):
    _, _, d1 = _dims(spec)
    b = tokens.shape[0]
    return (tokens.new_empty((b,)), tokens.new_empty((b, d1)), tokens.new_empty((b, d1)), tokens.new_empty((b,)))


@_op("tree_walk")
def tree_walk(spec, num_nodes, tokens, first_child, next_sibling, target_tokens, prefix_lens):
    """tree_accept without a cache: the walk alone (kv_commit then moves every layer's entries)."""
    tree = TreeBuildOutput(num_nodes, tokens, None, None, None, None, None, first_child, next_sibling)
    return tuple(_kset(spec).tree_accept(tree, target_tokens, prefix_lens))


@tree_walk.fake
def _(spec, num_nodes, tokens, first_child, next_sibling, target_tokens, prefix_lens):
    _, _, d1 = _dims(spec)
    b = tokens.shape[0]
    return (tokens.new_empty((b,)), tokens.new_empty((b, d1)), tokens.new_empty((b, d1)), tokens.new_empty((b,)))


@_op("kv_commit")
def kv_commit(spec, accept_lens, accepted_nodes, prefix_lens, kv_caches, block_table):
    acc = TreeAcceptOutput(accept_lens, accepted_nodes, None, None)
    _kset(spec).kv_commit(acc, prefix_lens, list(kv_caches), block_table)


@kv_commit.fake
def _(spec, accept_lens, accepted_nodes, prefix_lens, kv_caches, block_table):
    return None


@_op("draft_topk")
def draft_topk(spec, logits, k, temperature=1.0):
    return tuple(_kset(spec).draft_topk(logits, k, temperature))


@draft_topk.fake
def _(spec, logits, k, temperature=1.0):
    b, dp = logits.shape[:2]
    return (logits.new_empty((b, dp, k), dtype=torch.int32), logits.new_empty((b, dp, k), dtype=torch.float32))


OPS = {"draft_topk": (draft_topk, DraftTopkOutput), "tree_build": (tree_build, TreeBuildOutput), "tree_verify": (tree_verify, AttentionOutput),
       "tree_verify_tail": (tree_verify_tail, AttentionOutput), "merge_states": (merge_states, AttentionOutput),
       "tree_accept": (tree_accept, TreeAcceptOutput), "tree_walk": (tree_walk, TreeAcceptOutput),
       "kv_commit": (kv_commit, None)}

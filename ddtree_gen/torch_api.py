"""The torch path with named records: the kernel-set calls of the CuPy path, on torch tensors, through the torch ops.

    import ddtree_gen.torch_api
    ks = ddtree_gen.torch_api.load("kimi-k2.6-tp8")      # the spec's torch ops, bound to its name
    tree = ks.tree_build(topk_ids, topk_logprobs, root_tokens, prefix_lens, 64)      # a TreeBuildOutput
    out, lse = ks.tree_verify(q_nope, q_pe, kv_cache, block_table, prefix_lens, tree.num_nodes, tree.tree_mask,
                              softmax_scale)                                          # an AttentionOutput
    acc = ks.tree_accept(tree, target_tokens, prefix_lens)   # the walk (tree_walk); a TreeAcceptOutput
    ks.kv_commit(acc, prefix_lens, kv_caches, block_table)   # every layer (a list, or one stacked tensor)

A torch custom op returns a plain tuple (torch.library has no named outputs), so torch.ops.ddtree.tree_build's
outputs are read by index; this module is the thin layer above the ops that names them, with the records the CuPy
launchers and the numpy references return (ddtree_gen.types, reference.DraftTopkOutput) and the launchers' argument
forms (a tree record for tree_accept, an accept record for kv_commit). Each method calls one op and builds one
namedtuple, so torch.compile(fullgraph=True) traces through it to the same graph as the bare ops
(tests/test_torch_api_cpu.py), and a CUDA graph captures it as it captures them.

The calls go through the ops' direct entries (torch_ops.direct: the op's implementation in an eager call, without
the dispatcher's 3-5 us; the op itself under torch.compile, a dispatch mode or a tensor subclass);
load(spec, dispatcher=True) calls torch.ops.ddtree.* in every case.
"""
from __future__ import annotations

import torch

from . import torch_ops
from .errors import ArgumentError
from .reference import DraftTopkOutput
from .spec import Spec, find_spec
from .types import AttentionOutput, TreeAcceptOutput, TreeBuildOutput

_TREE = ("num_nodes", "tokens", "first_child", "next_sibling")   # what tree_accept reads of a tree record


class TorchKernels:
    """A spec's torch ops, returning named records (load(spec)). The methods take what the CuPy kernel set's
    methods take, on torch CUDA tensors (bf16 as torch.bfloat16, an fp8 cache as torch.float8_e4m3fn or uint8,
    the tree mask as torch.uint32 or int32), without out= (the ops allocate their outputs)."""

    def __init__(self, spec: str, *, dispatcher: bool = False):
        if not isinstance(spec, str):
            raise ArgumentError(f"spec: {type(spec).__name__}, expected a spec's name or the path of its .toml (the "
                                f"torch ops find a spec by its file; a spec made in code: ddtree_gen.load(spec))")
        self.name = spec
        self.spec: Spec = find_spec(spec)   # a typo fails here, not at the first call
        self.ops = torch.ops.ddtree if dispatcher else torch_ops.direct

    def __repr__(self):
        via = "torch.ops.ddtree" if self.ops is torch.ops.ddtree else "torch_ops.direct"
        return f"<ddtree_gen.torch_api.TorchKernels {self.name!r} via {via}>"

    def draft_topk(self, logits, k: int, temperature: float = 1.0) -> DraftTopkOutput:
        """The drafter's logits [B, D', V] -> DraftTopkOutput(topk_ids, topk_logprobs) [B, D', k]."""
        return DraftTopkOutput(*self.ops.draft_topk(self.name, logits, k, temperature))

    def tree_build(self, topk_ids, topk_logprobs, root_tokens, prefix_lens, budget: int) -> TreeBuildOutput:
        """One draft tree per request: TreeBuildOutput(num_nodes, tokens, ..., tree_mask, first_child,
        next_sibling)."""
        return TreeBuildOutput(*self.ops.tree_build(self.name, topk_ids, topk_logprobs, root_tokens, prefix_lens,
                                                    budget))

    def tree_verify(self, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale, *,
                    impl: str = "auto", kv_scale: float | None = None, fp8_path: str | None = None) -> AttentionOutput:
        """Tree attention over prefix + tree: AttentionOutput(out [B, Nq, H, R] bf16, lse [B, Nq, H] float32)."""
        return AttentionOutput(*self.ops.tree_verify(self.name, q_nope, q_pe, kv_cache, block_table, prefix_lens,
                                                     q_lens, tree_mask, softmax_scale, impl, kv_scale, fp8_path))

    def tree_verify_tail(self, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale, *,
                         impl: str = "auto", kv_scale: float | None = None) -> AttentionOutput:
        """tree_verify over the tree tail alone (to merge with a prefix kernel's state through merge_states)."""
        return AttentionOutput(*self.ops.tree_verify_tail(self.name, q_nope, q_pe, kv_cache, block_table,
                                                          prefix_lens, q_lens, tree_mask, softmax_scale, impl,
                                                          kv_scale))

    def merge_states(self, o_a, lse_a, o_b, lse_b) -> AttentionOutput:
        """Two attention states merged (natural-log LSE): AttentionOutput(out, lse)."""
        return AttentionOutput(*self.ops.merge_states(self.name, o_a, lse_a, o_b, lse_b))

    def tree_accept(self, tree, target_tokens, prefix_lens, kv_cache=None, block_table=None) -> TreeAcceptOutput:
        """Walk each tree with the target's tokens: TreeAcceptOutput(accept_lens, accepted_nodes, out_tokens,
        new_prefix_lens). `tree`: anything with num_nodes, tokens, first_child, next_sibling (tree_build's record,
        hf.tree_record's). With kv_cache and block_table the accepted KV of that one layer's cache is moved too
        (the op tree_accept); without them the walk alone (tree_walk), for kv_commit of every layer after it."""
        missing = next((f for f in _TREE if not hasattr(tree, f)), None)
        if missing is not None:
            raise ArgumentError(f"tree: has no field {missing!r} (expected the tree_build outputs)")
        fields = (tree.num_nodes, tree.tokens, tree.first_child, tree.next_sibling)
        if kv_cache is None and block_table is None:
            return TreeAcceptOutput(*self.ops.tree_walk(self.name, *fields, target_tokens, prefix_lens))
        if kv_cache is None or block_table is None:
            absent = "kv_cache" if kv_cache is None else "block_table"
            raise ArgumentError(f"{absent}: required with the other (pass both for walk + commit, neither for the "
                                f"walk alone)")
        return TreeAcceptOutput(*self.ops.tree_accept(self.name, *fields, target_tokens, prefix_lens, kv_cache,
                                                      block_table))

    def kv_commit(self, accepted, prefix_lens, kv_caches, block_table) -> None:
        """Move the accepted KV of every layer to the positions after each request's prefix. `accepted`: anything
        with accept_lens and accepted_nodes (tree_accept's record); kv_caches: a list of the layers' caches (the op
        kv_commit), or one [layers, num_pages, page_size, R+P] tensor (kv_commit_stacked, the cheaper call)."""
        for name in ("accept_lens", "accepted_nodes"):
            if not hasattr(accepted, name):
                raise ArgumentError(f"accepted: has no field {name!r} (expected the tree_accept outputs)")
        op = self.ops.kv_commit if isinstance(kv_caches, (list, tuple)) else self.ops.kv_commit_stacked
        op(self.name, accepted.accept_lens, accepted.accepted_nodes, prefix_lens,
           list(kv_caches) if isinstance(kv_caches, tuple) else kv_caches, block_table)


def load(spec: str, *, dispatcher: bool = False) -> TorchKernels:
    """The torch ops of `spec` (a name from specs/ or a .toml path, as the ops take it), returning named records.
    Nothing is built here: the ops load the spec's kernel set at their first call (ddtree_gen.load). dispatcher=True:
    every call through torch.ops.ddtree (the default: torch_ops.direct, the same ops without the dispatcher in eager
    calls)."""
    return TorchKernels(spec, dispatcher=dispatcher)

"""Launchers of tree_verify on Hopper's warpgroup tensor cores: tree_verify_wgmma and _tail_wgmma.

The peer of kernels/tree_verify_mma.py: same contract, signature, split-KV policy, workspace and combine
kernel, all in the launch path both share (kernels/tensor_core.py); plans/tree_verify_wgmma.py has the
resource plan and the schedules.
kset.tree_verify / kset.tree_verify_tail launch these kernels when they are loaded (impl="auto"),
or with impl="wgmma"; kset.tree_verify_wgmma calls them directly.
"""
from __future__ import annotations

from .. import reference
from ..plans import tree_verify_wgmma as plans
from ..plans.declaration import Declaration
from ..plans.tree_verify import tensor_core_sanitizer_cases
from ..plans.tree_verify_wgmma import DEQUANT_PARTS
from ..types import AttentionOutput
from .tensor_core import attention, attention_dequant, tensor_core_declaration


def tree_verify(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                out=None, lse=None, *, validate=False, workspace=None, num_splits=None,
                kv_scale=None) -> AttentionOutput:
    """Tree attention over the prefix and the tree (docs/contract.md tree_verify) with wgmma.

    Arguments, outputs, device-value behaviour, workspace and num_splits as
    tree_verify_mma.tree_verify (needs tree_verify_mma_combine loaded for split-KV); an fp8 spec's
    e4m3 cache with its kv_scale (required there, refused for bf16)."""
    return attention(kset, "tree_verify_wgmma", False, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                     tree_mask, softmax_scale, out, lse, validate, workspace, num_splits, kv_scale)


def tree_verify_tail(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                     out=None, lse=None, *, validate=False, workspace=None, num_splits=None,
                     kv_scale=None) -> AttentionOutput:
    """tree_verify_wgmma over the tree tail alone (keys prefix_len + j with mask bit j set), for merging
    with an external prefix kernel through merge_states. Same arguments as tree_verify_wgmma."""
    return attention(kset, "tree_verify_tail_wgmma", True, q_nope, q_pe, kv_cache, block_table, prefix_lens,
                     q_lens, tree_mask, softmax_scale, out, lse, validate, workspace, num_splits, kv_scale)


def tree_verify_parts(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                      out=None, lse=None, *, validate=False, workspace=None, num_splits=None,
                      kv_scale=None) -> AttentionOutput:
    """tree_verify_wgmma_parts by name: the seesaw on the balanced parts grid (a block per (row tile, part) of the
    batch's key tiles), what kset.tree_verify runs at B >= plans.tree_verify_wgmma.PARTS_MIN_B where it is loaded.
    num_splits here is the part count (default: parts_for, one wave of blocks). Same arguments otherwise."""
    return attention(kset, "tree_verify_wgmma_parts", False, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                     tree_mask, softmax_scale, out, lse, validate, workspace, num_splits, kv_scale)


def tree_verify_dequant(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                        out=None, lse=None, *, validate=False, workspace=None, num_splits=None, kv_scale=None,
                        kv_workspace=None) -> AttentionOutput:
    """An fp8 spec's tree_verify by the dequantize path, what kset.tree_verify(..., fp8_path="dequant") runs:
    kv_dequant converts the e4m3 pages the call reads into kv_workspace (bf16 pages and their block table; allocated
    when not given: plans.kv_dequant.workspace_elems), then tree_verify_wgmma_dequant (the bf16-cache seesaw) reads
    it with kv_scale in fp32: the bits of the fused kernel (tree_verify_wgmma). Same arguments otherwise."""
    return attention_dequant(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                             out, lse, validate, workspace, num_splits, kv_scale, kv_workspace)


def tree_verify_dequant_parts(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                              out=None, lse=None, *, validate=False, workspace=None, num_splits=None, kv_scale=None,
                              kv_workspace=None) -> AttentionOutput:
    """tree_verify_wgmma_dequant_parts by name: the dequantize path with its attention kernel on the balanced parts grid,
    what kset.tree_verify of an fp8 spec's dequantize path runs at B >= plans.tree_verify_wgmma.PARTS_MIN_B where it is
    loaded. num_splits here is the part count (default: parts_for). Same arguments as tree_verify_dequant."""
    return attention_dequant(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                             out, lse, validate, workspace, num_splits, kv_scale, kv_workspace, name=DEQUANT_PARTS)


DECLARATIONS = [
    tensor_core_declaration(plans.KERNELS[0], tree_verify, reference.tree_verify),
    tensor_core_declaration(plans.KERNELS[1], tree_verify_tail, reference.tree_verify_tail),
    # not a `serves` of its own: tree_verify(fp8_path="dequant") runs it (with kv_dequant before it)
    Declaration(plans.KERNELS[2], launcher=tree_verify_dequant, reference=reference.tree_verify,
                output=AttentionOutput, sanitize=tensor_core_sanitizer_cases,
                missing={"torch_ops": "served by the torch op of tree_verify (fp8_path='dequant'), which runs it",
                         "bundles": "the math of tree_verify: its bundles (refs/<spec>/tree_verify-*.kdtr) hold the "
                                    "inputs and outputs of this kernel too"}),
    # not a `serves` of its own either: tree_verify (impl "auto" / "wgmma", num_splits not given) runs it at B >= PARTS_MIN_B
    Declaration(plans.KERNELS[3], launcher=tree_verify_parts, reference=reference.tree_verify,
                output=AttentionOutput, sanitize=tensor_core_sanitizer_cases,
                missing={"torch_ops": "served by the torch op of tree_verify, which runs it at B >= PARTS_MIN_B",
                         "bundles": "the math of tree_verify: its bundles (refs/<spec>/tree_verify-*.kdtr) hold the "
                                    "inputs and outputs of this kernel too"}),
    # the dequantize path (fp8_path "dequant", or None where it takes that path) runs it at B >= PARTS_MIN_B
    Declaration(plans.KERNELS[4], launcher=tree_verify_dequant_parts,
                reference=reference.tree_verify, output=AttentionOutput, sanitize=tensor_core_sanitizer_cases,
                missing={"torch_ops": "served by the torch op of tree_verify (an fp8 spec's dequantize path), which "
                                      "runs it at B >= PARTS_MIN_B",
                         "bundles": "the math of tree_verify: its bundles (refs/<spec>/tree_verify-*.kdtr) hold the "
                                    "inputs and outputs of this kernel too"}),
]

"""Launchers of tree_verify on Hopper's warpgroup tensor cores: tree_verify_wgmma and _tail_wgmma.

The peer of ops/tree_verify/mma_launch.py: same contract, signature, split-KV policy, workspace and combine kernel, and the
one route of every tree_verify call (ops/tree_verify/route.py); ops/tree_verify/wgmma.py has the resource plan, the
schedules and the kernel's builds as typed records (WgmmaBuild: the chunks grid by default, "parts", "dequant",
"dequant_parts"). kset.tree_verify / kset.tree_verify_tail launch these kernels when they are loaded (impl="auto"), or
with impl="wgmma"; kset.tree_verify_wgmma calls them directly (an fp8 spec's cache read by the fused kernel unless
build= names a dequantize build).
"""
from __future__ import annotations

from ... import reference
from . import wgmma as plans
from .tensor_core import tensor_core_declaration
from .launch import family_launcher

tree_verify = family_launcher("tree_verify", "wgmma", """Tree attention over the prefix and the tree (docs/contract.md
    tree_verify) with wgmma: kset.tree_verify(..., impl="wgmma") with an fp8 spec's cache read by the fused kernel.

    Arguments, outputs, device-value behaviour, workspace and num_splits as ops.tree_verify.launch.tree_verify (needs
    tree_verify_mma_combine loaded for split-KV); an fp8 spec's e4m3 cache with its kv_scale (required there, refused
    for bf16). build: one of the kernel's builds by name ("default": the chunks grid, "parts": the balanced parts grid,
    num_splits then the part count; an fp8 spec's "dequant" / "dequant_parts": the dequantize path); None: the
    route's choice by the builds' records (ops/tree_verify/route.route).""")

tree_verify_tail = family_launcher("tree_verify_tail", "wgmma", """tree_verify_wgmma over the tree tail alone (keys
    prefix_len + j with mask bit j set), for merging with an external prefix kernel through merge_states. Same
    arguments as tree_verify_wgmma (its only build: "default").""")


DECLARATIONS = [
    tensor_core_declaration(plans.KERNELS[0], tree_verify, reference.tree_verify),
    tensor_core_declaration(plans.KERNELS[1], tree_verify_tail, reference.tree_verify_tail),
]

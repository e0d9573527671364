"""Launchers of the mma.sync tree_verify kernels: tree_verify_mma and tree_verify_tail_mma.

The peer of ops/tree_verify/wgmma_launch.py: same contract, signature, split-KV policy, workspace and combine kernel, and the
one route of every tree_verify call (ops/tree_verify/launch.py: `verify`); ops/tree_verify/mma.py has the resource plan
and the tuned configuration. Not built for an fp8 spec (an ArgumentError naming the kernel and the kv_dtype).
kset.tree_verify / kset.tree_verify_tail launch these kernels with impl="mma" (or "auto" where the wgmma ones do not
run); kset.tree_verify_mma calls them directly.
"""
from __future__ import annotations

from ... import reference
from . import mma as plans
from .tensor_core import tensor_core_declaration
from .launch import family_launcher

tree_verify = family_launcher("tree_verify", "mma", """Tree attention over the prefix and the tree (docs/contract.md
    tree_verify) with mma.sync: kset.tree_verify(..., impl="mma").

    Arguments, outputs and device-value behaviour as ops.tree_verify.launch.tree_verify, plus:
    q_nope, q_pe (and kv_cache) must be 16-byte aligned; workspace: float32 CUDA array of at least
    workspace_elems(spec, B, Nq, splits) elements for split-KV (allocated when None and needed);
    num_splits: key chunks per request (None: chosen from the shapes and the tuning table).
    Not built for an fp8 spec (ArgumentError); kv_scale is there for the common signature.""")

tree_verify_tail = family_launcher("tree_verify_tail", "mma", """tree_verify_mma over the tree tail alone (keys
    prefix_len + j with mask bit j set), for merging with an external prefix kernel through merge_states. Same
    arguments as tree_verify_mma.""")


DECLARATIONS = [
    tensor_core_declaration(plans.KERNELS[0], tree_verify, reference.tree_verify),
    tensor_core_declaration(plans.KERNELS[1], tree_verify_tail, reference.tree_verify_tail),
]

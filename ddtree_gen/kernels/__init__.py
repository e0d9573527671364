"""The launchers, one module per kernel family; LAUNCHERS maps a kernel name to its launcher.

A launcher is `launch(kset, *args, **kwargs)`: it checks its arguments (kernels/checks.py, once
per call signature) and launches through the runtime. The build data of each kernel (template,
entry, resource plan) is in ddtree_gen.plans, which imports nothing from here.
"""
from __future__ import annotations

from . import draft_topk, kv_commit, tree_accept, tree_build, tree_verify, tree_verify_mma, tree_verify_wgmma

LAUNCHERS = {
    "tree_build": tree_build.launch,
    "tree_verify": tree_verify.tree_verify,
    "tree_verify_tail": tree_verify.tree_verify_tail,
    "merge_states": tree_verify.merge_states,
    "tree_verify_mma": tree_verify_mma.tree_verify,
    "tree_verify_tail_mma": tree_verify_mma.tree_verify_tail,
    "tree_verify_mma_combine": tree_verify_mma.combine,
    "tree_verify_wgmma": tree_verify_wgmma.tree_verify,
    "tree_verify_tail_wgmma": tree_verify_wgmma.tree_verify_tail,
    "tree_accept": tree_accept.launch,
    "kv_commit": kv_commit.launch,
    "draft_topk": draft_topk.launch,
}

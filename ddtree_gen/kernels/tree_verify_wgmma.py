"""tree_verify on Hopper's warpgroup tensor cores: tree_verify_wgmma and tree_verify_tail_wgmma.

Same contract, launcher signature, split-KV policy and workspace as tree_verify_mma.py (whose
combine kernel, tree_verify_mma_combine, merges the chunks); the kernels use wgmma.mma_async
(sm_90a) instead of mma.sync: each warpgroup reads its operands once from shared memory instead
of every warp re-reading them. templates/tree_verify_wgmma.cu.j2 has the design, docs/perf.md the
performance model and the measurements.

* Fixed configuration: two warpgroups, BM = 64 query rows, BN = 64 keys per tile, 2 cp.async
  stages; tiles stored in the 128-byte swizzle of the wgmma descriptors.
* kset.tree_verify / kset.tree_verify_tail (tree_verify.py) launch these kernels when they are
  loaded (impl="auto"), or with impl="wgmma"; kset.tree_verify_wgmma calls them directly.
"""
from __future__ import annotations

import sympy

from ..resources import P, R, Plan
from . import KernelDef
from . import tree_verify_mma as mma

BN = 64
STAGES = 2
THREADS = 256              # two warpgroups
SLABS = sympy.ceiling((R + P) / 64)                # 64-column slabs of a tile row
TILE = SLABS * 64 * 128                            # one 64-row tile, 128-byte rows per slab
SMEM = ((1 + STAGES) * TILE                        # Q tile, key tiles
        + mma.BM * BN * 2                          # P tile
        + 2 * mma.BM * 4                           # row maxima of both key halves
        + STAGES * BN * 4)                         # per-key "staged" flags
# V read as the MN-major B operand of wgmma: byte stride between 64-column slabs (LBO) and between
# groups of 8 keys (SBO) in the tile layout above
V_DESC = {"V_LBO": 64 * 128, "V_SBO": 8 * 128}


def verify_plan(spec, kernel="tree_verify_wgmma") -> Plan:
    mma._check_spec(spec, kernel)   # R a multiple of 128 and at most 512: each warpgroup owns R / 2 columns
    return Plan(kernel=kernel, spec=spec, threads=sympy.Integer(THREADS), min_blocks=1,
                static_smem=sympy.Integer(0), dynamic_smem=SMEM,
                consts={"BM": sympy.Integer(mma.BM), "BN": sympy.Integer(BN), "STAGES": sympy.Integer(STAGES),
                        "SLABS": SLABS, **{k: sympy.Integer(v) for k, v in V_DESC.items()}})


def tail_plan(spec) -> Plan:
    return verify_plan(spec, "tree_verify_tail_wgmma")


def tree_verify(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                out=None, lse=None, *, validate=False, workspace=None, num_splits=None):
    """Tree attention over the prefix and the tree (DESIGN.md tree_verify) with wgmma.

    Arguments, outputs, device-value behaviour, workspace and num_splits as
    tree_verify_mma.tree_verify (needs tree_verify_mma_combine loaded for split-KV)."""
    return mma._attention(kset, "tree_verify_wgmma", False, q_nope, q_pe, kv_cache, block_table, prefix_lens,
                          q_lens, tree_mask, softmax_scale, out, lse, validate, workspace, num_splits)


def tree_verify_tail(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                     out=None, lse=None, *, validate=False, workspace=None, num_splits=None):
    """tree_verify_wgmma over the tree tail alone (keys prefix_len + j with mask bit j set), for merging
    with an external prefix kernel through merge_states. Same arguments as tree_verify_wgmma."""
    return mma._attention(kset, "tree_verify_tail_wgmma", True, q_nope, q_pe, kv_cache, block_table, prefix_lens,
                          q_lens, tree_mask, softmax_scale, out, lse, validate, workspace, num_splits)


KERNELS = [
    KernelDef(name="tree_verify_wgmma", template="tree_verify_wgmma.cu.j2", entry="ddtree_tree_verify_wgmma",
              plan=verify_plan, launch=tree_verify, context={"tail": False}),
    KernelDef(name="tree_verify_tail_wgmma", template="tree_verify_wgmma.cu.j2",
              entry="ddtree_tree_verify_tail_wgmma", plan=tail_plan, launch=tree_verify_tail, context={"tail": True}),
]

"""Resource plan of tree_verify on Hopper's warpgroup tensor cores (tree_verify_wgmma, _tail_wgmma).

Same contract, split-KV policy, workspace and combine kernel as the mma.sync family
(plans/tree_verify_mma.py); the kernels use wgmma.mma_async (sm_90a): each warpgroup reads its
operands once from shared memory instead of every warp re-reading them.
templates/tree_verify_wgmma.cu.j2 has the design, docs/perf.md the performance model.

Fixed configuration: two warpgroups, BM = 64 query rows, BN = 64 keys per tile, 2 cp.async
stages; tiles stored in the 128-byte swizzle of the wgmma descriptors.
"""
from __future__ import annotations

import sympy

from ..resources import P, R, Plan
from . import tree_verify_mma as mma
from .kernel_def import KernelDef

BN = 64
STAGES = 2
THREADS = 256              # two warpgroups
SLABS = sympy.ceiling((R + P) / 64)                # 64-column slabs of a tile row
TILE = SLABS * 64 * 128                            # one 64-row tile, 128-byte rows per slab
SMEM = ((1 + STAGES) * TILE                        # Q tile, key tiles
        + mma.BM * BN * 2                          # P tile
        + 2 * mma.BM * 4                           # row maxima of both key halves
        + STAGES * BN * 4)                         # per-key "staged" flags
# FP8 cache: the stages hold e4m3 bytes (half a bf16 tile each), converted into one bf16 key tile; the
# flags of the converted tile and of every stage are live at once
SMEM_FP8 = (2 * TILE                               # Q tile, the converted bf16 key tile
            + mma.BM * BN * 2                      # P tile
            + STAGES * BN * (R + P)                # e4m3 stages
            + 2 * mma.BM * 4                       # row maxima of both key halves
            + (STAGES + 1) * BN * 4)               # per-key "staged" flags
# V read as the MN-major B operand of wgmma: byte stride between 64-column slabs (LBO) and between
# groups of 8 keys (SBO) in the tile layout above
V_DESC = {"V_LBO": 64 * 128, "V_SBO": 8 * 128}


def uses_tma(spec, kernel: str) -> bool:
    """Whether `kernel` of `spec` loads its key tiles with TMA: the full kernel (its tiles start on multiples
    of BN) of a bf16 cache whose pages hold whole tiles (page_size % BN == 0), so that a tile is one
    rectangle of the cache: 9 boxes of 64 keys x 64 columns. Otherwise cp.async (the tail kernel's tiles
    start at prefix_len; an fp8 stage is converted by the threads anyway)."""
    return kernel == "tree_verify_wgmma" and not spec.kv_fp8 and spec.page_size % BN == 0


def verify_plan(spec, kernel="tree_verify_wgmma") -> Plan:
    mma.check_spec(spec, kernel)   # R a multiple of 128 and at most 512: each warpgroup owns R / 2 columns
    tma = uses_tma(spec, kernel)
    smem = SMEM_FP8 if spec.kv_fp8 else SMEM + (8 * STAGES if tma else 0)   # TMA: one mbarrier per stage
    return Plan(kernel=kernel, spec=spec, threads=sympy.Integer(THREADS), min_blocks=1,
                static_smem=sympy.Integer(0), dynamic_smem=smem,
                consts={"BM": sympy.Integer(mma.BM), "BN": sympy.Integer(BN), "STAGES": sympy.Integer(STAGES),
                        "SLABS": SLABS, "USE_TMA": sympy.Integer(1 if tma else 0),
                        **{k: sympy.Integer(v) for k, v in V_DESC.items()}})


def tail_plan(spec) -> Plan:
    return verify_plan(spec, "tree_verify_tail_wgmma")


ARCHS = ("sm_90a",)        # wgmma.mma_async exists on sm_90a only: no sm_80 (PTX) build

KERNELS = [
    KernelDef(name="tree_verify_wgmma", template="tree_verify_wgmma.cu.j2", entry="ddtree_tree_verify_wgmma",
              plan=verify_plan, context={"tail": False}, archs=ARCHS),
    KernelDef(name="tree_verify_tail_wgmma", template="tree_verify_wgmma.cu.j2",
              entry="ddtree_tree_verify_tail_wgmma", plan=tail_plan, context={"tail": True}, archs=ARCHS),
]

"""tree_build's resource plan: best-first DDTree draft-tree expansion, one warp per request."""
from __future__ import annotations

import sympy

from ..resources import D, N, Plan
from .kernel_def import KernelDef

CANDIDATES = 2 * N - 1  # the root's first child, then at most a sibling and a child per pop


def plan(spec) -> Plan:
    table = D * (N - 1)  # staged top-k table: D' <= D rows of K' <= N-1
    static_smem = (4 + 4) * table + 4 * 4 * N  # top-k table + node score/token/parent/depth
    return Plan(kernel="tree_build", spec=spec, threads=sympy.Integer(32), min_blocks=16,
                static_smem=static_smem,
                consts={"CANDIDATES": CANDIDATES, "CANDIDATES_PER_LANE": sympy.ceiling(CANDIDATES / 32),
                        "NODE_ROUNDS": sympy.ceiling(N / 32),
                        # loads in flight per lane while staging the table (2 batches for D=15, N=65)
                        "STAGE_BATCH": sympy.Min(16, sympy.ceiling(table / 32))})


KERNELS = [KernelDef(name="tree_build", template="tree_build.cu.j2", entry="ddtree_tree_build", plan=plan)]

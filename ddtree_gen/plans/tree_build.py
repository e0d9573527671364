"""tree_build's resource plan: best-first DDTree draft-tree expansion, one warp per request."""
from __future__ import annotations

import sympy

from ..resources import D, N, Plan
from .kernel_def import KernelDef
from .declaration import Bundles, Declaration, TorchOp

CANDIDATES = 2 * N - 1  # the root's first child, then at most a sibling and a child per pop
THREADS = 128           # 4 warps stage the table and write the outputs; warp 0 runs the pops
COPIES = 32             # the pop loop keeps one private copy of the candidate fields per lane (no shared words)


def plan(spec) -> Plan:
    table = D * (N - 1)  # staged top-k table: D' <= D rows of K' <= N-1
    # candidates (float4 + meta, one spare, a copy per lane) + nodes (int4) + top-k table + the node count,
    # padded to 16 bytes; dynamic shared memory (above 48 KB for N = 64)
    smem = 16 * sympy.ceiling(((16 + 4) * (CANDIDATES + 1) * COPIES + 16 * N + (4 + 4) * table + 4) / 16)
    return Plan(kernel="tree_build", spec=spec, threads=sympy.Integer(THREADS), min_blocks=2,
                static_smem=sympy.Integer(0), dynamic_smem=smem,
                consts={"CANDIDATES": CANDIDATES, "CANDIDATES_PER_LANE": sympy.ceiling(CANDIDATES / 32),
                        "NODE_ROUNDS": sympy.ceiling(N / THREADS),
                        # loads in flight per thread while staging the table (one batch for D=15, N=65)
                        "STAGE_BATCH": sympy.Min(16, sympy.ceiling(table / THREADS))})


KERNELS = [KernelDef(name="tree_build", template="tree_build.cu.j2", entry="ddtree_tree_build", plan=plan)]


DECLARATIONS = [Declaration(
    KERNELS[0], launcher="kernels.tree_build:launch", reference="reference:tree_build", output="types:TreeBuildOutput",
    torch_ops=(TorchOp("tree_build(str spec, Tensor topk_ids, Tensor topk_logprobs, Tensor root_tokens, "
                       "Tensor prefix_lens, int budget) -> (" + ", ".join(["Tensor"] * 9) + ")",
                       fake="torch_ops:tree_build_fake"),),
    sanitize="sanitize:_tree_build_cases",
    bundles=Bundles("bundles:_tree_build_inputs", ("full", "ties", "nan-inf", "chain", "budget0"),
                    run="bundles:_run_tree_build"))]

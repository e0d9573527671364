"""tree_build: best-first DDTree draft-tree expansion, one warp per request."""
from __future__ import annotations

import sympy

from .. import runtime as rt
from ..resources import D, N, Plan
from ..types import TreeBuildOutput
from . import KernelDef

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


def launch(kset, topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, out=None) -> TreeBuildOutput:
    """Build one draft tree per request on the current stream. See DESIGN.md, tree_build."""
    spec = kset.spec
    n, w = spec.max_tree_size, spec.mask_words
    ids = rt.device_array(topk_ids, "topk_ids", dtype="int32", ndim=3)
    b, dp, kp = ids.shape
    lps = rt.device_array(topk_logprobs, "topk_logprobs", dtype="float32", shape=(b, dp, kp))
    roots = rt.device_array(root_tokens, "root_tokens", dtype="int32", shape=(b,))
    prefix = rt.device_array(prefix_lens, "prefix_lens", dtype="int32", shape=(b,))
    rt.same_device(ids, lps, roots, prefix)
    if not 1 <= dp <= spec.max_depth:
        raise rt.ArgumentError(f"topk_ids: D' = {dp} (dimension 1) must be in [1, max_depth = {spec.max_depth}]")
    if not 1 <= kp <= n - 1:
        raise rt.ArgumentError(f"topk_ids: K' = {kp} (dimension 2) must be in [1, max_tree_size - 1 = {n - 1}]")
    budget = rt.int_arg(budget, "budget", lo=0, hi=n - 1)
    shapes = {"num_nodes": ((b,), "int32"), "tokens": ((b, n), "int32"), "parents": ((b, n), "int32"),
              "depths": ((b, n), "int32"), "positions": ((b, n), "int32"), "scores": ((b, n), "float32"),
              "tree_mask": ((b, n, w), "uint32"), "first_child": ((b, n), "int32"),
              "next_sibling": ((b, n), "int32")}
    outs = rt.outputs(out, TreeBuildOutput, shapes, like=ids)
    if b:
        kset.launch("tree_build", grid=(b,), args=[ids, lps, roots, prefix, rt.i32(dp), rt.i32(kp), rt.i32(budget),
                                                  *outs], like=ids)
    return TreeBuildOutput(*(o.obj for o in outs))


KERNELS = [KernelDef(name="tree_build", template="tree_build.cu.j2", entry="ddtree_tree_build",
                     plan=plan, launch=launch)]

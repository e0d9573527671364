"""tree_build's resource plan (best-first DDTree draft-tree expansion, one warp per request), and the inputs of its
sanitizer cases and bundles (its declaration: ops/tree_build/launch.py)."""
from __future__ import annotations

import numpy as np
import sympy

from ... import reference
from ...build.resources import D, N, Plan
from ...build.kernel_def import KernelDef

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



# ---------------------------------------------------------------------------------- sanitizer cases

def sanitizer_cases(spec, rng):
    """`ddtree-gen sanitize`'s cases: budget 0 and N-1, NaN / +-inf log-probs, D' = K' = 1, a chain."""
    n, d = spec.max_tree_size, spec.max_depth

    def topk(b, dp, kp, lps=None):
        ids = rng.integers(0, 32000, (b, dp, kp), dtype=np.int32)
        if lps is None:
            lps = -np.sort(rng.exponential(1.0, (b, dp, kp)), axis=2)
        return ids, lps.astype(np.float32)

    roots = np.array([1, 2, 3], np.int32)
    prefix = np.array([0, 63, 65], np.int32)
    ids, lps = topk(3, d, n - 1)
    yield "budget 0", dict(topk_ids=ids, topk_logprobs=lps, root_tokens=roots, prefix_lens=prefix, budget=0)
    yield "budget N-1", dict(topk_ids=ids, topk_logprobs=lps, root_tokens=roots, prefix_lens=prefix,
                             budget=n - 1)
    odd = lps.copy()
    odd[0, :, 1::2] = np.nan
    odd[1, 2:, :] = -np.inf
    odd[1, 0, 0] = np.inf
    odd[2] = np.nan
    yield "NaN/-inf/+inf log-probs", dict(topk_ids=ids, topk_logprobs=odd, root_tokens=roots, prefix_lens=prefix,
                                          budget=n - 1)
    ids1, lps1 = topk(2, 1, 1)
    yield "D'=1 K'=1 budget N-1", dict(topk_ids=ids1, topk_logprobs=lps1, root_tokens=roots[:2],
                                       prefix_lens=prefix[:2], budget=n - 1)
    ids2, lps2 = topk(2, d, 1)
    yield "chain D'=D K'=1", dict(topk_ids=ids2, topk_logprobs=lps2, root_tokens=roots[:2], prefix_lens=prefix[:2],
                                  budget=n - 1)


# ------------------------------------------------------------------------------------------ bundles

BUNDLE_CASES = ("full", "ties", "nan-inf", "chain", "budget0")


def _topk(rng, b, dp, kp, mode):
    ids = rng.integers(0, 32000, size=(b, dp, kp), dtype=np.int32)
    if mode == "ties":
        lps = np.full((b, dp, kp), -1.0, np.float32)
    else:
        lps = -np.sort(rng.exponential(1.0, size=(b, dp, kp)).astype(np.float32), axis=-1)
        lps = np.ascontiguousarray(lps)
    if mode == "nan-inf":
        lps[:, :, 1::3] = -np.inf
        lps[:, 1::2, 2::4] = np.nan
    return ids, lps


def bundle_inputs(spec, rng, case):
    """The inputs of bundle `case` (BUNDLE_CASES): 3 requests, prefix lengths 0, 63 and 100000."""
    n, d = spec.max_tree_size, spec.max_depth
    b = 3
    dp, kp, budget, mode = {"full": (d, n - 1, n - 1, "plain"), "ties": (d, 4, n - 1, "ties"),
                            "nan-inf": (d, 8, n - 1, "nan-inf"), "chain": (d, 1, n - 1, "plain"),
                            "budget0": (2, 2, 0, "plain")}[case]
    ids, lps = _topk(rng, b, dp, kp, mode)
    return {"topk_ids": ids, "topk_logprobs": lps, "root_tokens": rng.integers(0, 32000, b, dtype=np.int32),
            "prefix_lens": np.array([0, 63, 100000], np.int32), "budget": np.array(budget, np.int32)}


def bundle_run(spec, a):
    """The reference's outputs of a bundle's inputs `a`."""
    out = reference.tree_build(a["topk_ids"], a["topk_logprobs"], a["root_tokens"], a["prefix_lens"],
                               int(a["budget"]), max_tree_size=spec.max_tree_size)
    return dict(out._asdict())

"""draft_topk's resource plan: the drafter's top-k per depth, one block per chunk of a row, then a merge per row."""
from __future__ import annotations

import sympy

from ..resources import N, Plan
from .kernel_def import KernelDef

THREADS = 256
NVEC = 8                     # 16-byte vectors per thread and chunk
CHUNK = {"bf16": THREADS * NVEC * 8, "float32": THREADS * NVEC * 4}   # logits per block: 16384, 8192
MAX_VOCAB = 262144
CAP = 1024                   # candidate slots of a chunk
CMAX = MAX_VOCAB // CHUNK["float32"]   # the most chunks of a row: 32
assert CMAX <= 32 and THREADS % 32 == 0 and THREADS & (THREADS - 1) == 0   # the merge reduces a row's chunks in one warp
KMAX = N - 1                 # the largest k
KP = 2 ** sympy.ceiling(sympy.log(KMAX, 2))   # a list in the merge: KMAX rounded up to a power of two


def chunks(v: int, dtype: str) -> int:
    """Blocks per row of V logits of `dtype` ("bf16" or "float32")."""
    return -(-v // CHUNK[dtype])


def plan(spec) -> Plan:
    warps = THREADS // 32
    stage0 = 8 * CAP + 8 * KP + 4 * (2 * warps + 2 * warps + warps + warps) + 16   # candidates, list, sums
    stage1 = 8 * CMAX * KP + 16                                                     # the chunks' lists, M and S
    return Plan(kernel="draft_topk", spec=spec, threads=sympy.Integer(THREADS), min_blocks=3,
                static_smem=sympy.Max(stage0, stage1),
                consts={"KMAX": KMAX, "KP": KP, "CAP": sympy.Integer(CAP), "CMAX": sympy.Integer(CMAX),
                        "NVEC": sympy.Integer(NVEC)})


KERNELS = [KernelDef(name="draft_topk", template="draft_topk.cu.j2", entry="ddtree_draft_topk", plan=plan)]

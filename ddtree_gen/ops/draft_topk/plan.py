"""draft_topk's build data (docs/adding-a-kernel.md; its declaration: ops/draft_topk/launch.py): its resource plan (the drafter's top-k per depth: one block per
row where there are 1.5 rows an SM and a row holds 4 chunks (ops/draft_topk/launch.ROWS_PER_SM, ROWS_MIN_CHUNKS), else one block per chunk of a row and a merge per row; SCHEDULES below), and the
inputs of its bundles and sanitizer cases (its output record, DraftTopkOutput, is beside its numpy reference)."""
from __future__ import annotations

import numpy as np
import sympy

from ...bf16 import to_bits
from ...errors import SpecError
from ...build.resources import N, Plan
from ...build.kernel_def import KernelDef

THREADS = 256
NVEC = 8                     # 16-byte vectors per thread and chunk
CHUNK = {"bf16": THREADS * NVEC * 8, "float32": THREADS * NVEC * 4}   # logits per block: 16384, 8192
MAX_VOCAB = 262144
CAP = 1024                   # candidate slots of a chunk
CMAX = MAX_VOCAB // CHUNK["float32"]   # the most chunks of a row: 32
assert CMAX <= 32 and THREADS % 32 == 0 and THREADS & (THREADS - 1) == 0   # the merge reduces a row's chunks in one warp
KMAX = N - 1                 # the largest k
KP = 2 ** sympy.ceiling(sympy.log(KMAX, 2))   # a list in the merge: KMAX rounded up to a power of two
# the build option `schedule` (build/variant.py; templates/draft_topk.cu.j2 says how each works):
# "chunks": one block per chunk of a row, then a merge per row.
# "rows" (the default): one block per row, its warps streaming the row with their next loads in flight, a threshold shared by the
# block, the row's top-k selected by the block, one launch and no workspace, where there are enough rows
# (ops/draft_topk/launch.ROWS_PER_SM) and the rows are long (ROWS_MIN_CHUNKS); otherwise the chunks schedule, in the same build. Its log-probs differ from the
# chunks schedule's by the rounding of another order of the sums (the same ids).
# (schedule "stream" and the rows' row_end "warps" measured slower: removed in issue 40; docs/perf/journal-kernels.md has the figures)
SCHEDULES = ("chunks", "rows")
OPTIONS = ("schedule", "min_blocks")   # the build options (plan's config)
MIN_BLOCKS = 4               # blocks per SM (__launch_bounds__: 64 registers; docs/perf/journal-kernels.md "The end of a row selected by the
                             # block"), where their shared memory fits an SM, else 3 (N - 1 above 128: 70 KB a block); the
                             # build option `min_blocks` ("auto", or 1-4)
SM_SMEM = 227 * 1024         # the shared memory an H100 / H200 SM gives its blocks
NV = 4                       # rows: 16-byte vectors per lane and round (the next round's are in flight meanwhile)
CAPV = 512                   # rows: a warp's passing-vector entries (compacted when a step could overflow them)
HPASS = 4                    # rows, the end of a row: radix passes of 8-bit digits over a 32-bit key, at most


def policy(spec, arch: str = "sm_90a") -> dict:
    """The default build configuration (build/variant.default_config): the rows schedule with the block's end
    (docs/perf/journal-kernels.md, "The end of a row selected by the block": 111 us against the chunks schedule's 158 at B = 64,
    V = 129280; the chunks schedule's own stages below 1.5 rows an SM)."""
    # min_blocks "auto": 4 where they fit an H100 / H200 SM (plan); an A100's 164 KB hold 3 of the default's 46 KB
    return {"schedule": "rows", "min_blocks": "auto" if arch == "sm_90a" else 3}


def spell(config) -> tuple:
    """A configuration's part of the variant name: draft_topk (rows, the default), draft_topk.chunks,
    draft_topk.mbN (min_blocks N given: sm_80's default is mb3)."""
    name = () if config["schedule"] == "rows" else (config["schedule"],)
    if config["min_blocks"] != "auto":
        name += (f"mb{config['min_blocks']}",)
    return name


def chunks(v: int, dtype: str) -> int:
    """Blocks per row of V logits of `dtype` ("bf16" or "float32")."""
    return -(-v // CHUNK[dtype])


def plan(spec, config=None) -> Plan:
    cfg = config or policy(spec)
    unknown = [key for key in cfg if key not in OPTIONS]
    if unknown:
        raise SpecError(f"draft_topk: no build option {unknown[0]!r}, its options: {', '.join(OPTIONS)}")
    schedule, min_blocks = cfg["schedule"], cfg.get("min_blocks", "auto")
    if schedule not in SCHEDULES:
        raise SpecError(f"draft_topk: schedule {schedule!r}, one of {', '.join(SCHEDULES)}")
    if min_blocks not in ("auto", 1, 2, 3, 4):
        raise SpecError(f"draft_topk: min_blocks {min_blocks!r}, 'auto' or one of 1, 2, 3, 4 (256 threads a block)")
    rows = schedule == "rows"
    if spec.max_tree_size - 1 > THREADS:   # tau: the k-th largest of THREADS thread maxima
        raise SpecError(f"spec {spec.name!r}, kernel draft_topk: N - 1 = {spec.max_tree_size - 1} above {THREADS}")
    warps = THREADS // 32
    stage0 = 8 * CAP + 8 * KP + 4 * (2 * warps + 2 * warps + warps + warps) + 16   # candidates, list, sums
    stage1 = 8 * CMAX * KP + 16                                                     # the chunks' lists, M and S
    # rows: RowsShared (entries, the block's candidates, the radix passes' counts, the warps' ranges, the block's
    # list, (M, S), the threshold), in dynamic shared memory that stages 0 and 1 reuse as DraftTopkShared; the
    # block's candidates share their bytes with the warps' radix counts (1 KB a warp, used before them)
    bcap = 16 * KP           # rows, the block's candidates: < 8 per entry above the k-th, and each warp's k ties
    rows_smem = (8 * warps * CAPV + sympy.Max(8 * bcap, 4 * 256 * warps) + 4 * HPASS * 256 + 12 * warps + 8
                 + 8 * KP + 8 * warps + 16)
    consts = {"KMAX": KMAX, "KP": KP, "CAP": sympy.Integer(CAP), "CMAX": sympy.Integer(CMAX),
              "NVEC": sympy.Integer(NVEC), "ROWS": sympy.Integer(int(rows)),
              "NV": sympy.Integer(NV), "CAPV": sympy.Integer(CAPV), "BCAP": bcap, "HPASS": sympy.Integer(HPASS)}
    smem = sympy.Max(rows_smem, stage0, stage1) if rows else sympy.Max(stage0, stage1)
    if min_blocks == "auto":   # the most that fit by shared memory, at most MIN_BLOCKS (at the spec's largest k)
        need = int(smem.subs(N, spec.max_tree_size))
        min_blocks = MIN_BLOCKS if MIN_BLOCKS * need <= SM_SMEM else MIN_BLOCKS - 1
    if rows:
        return Plan(kernel="draft_topk", spec=spec, threads=sympy.Integer(THREADS), min_blocks=min_blocks,
                    static_smem=sympy.Integer(0), dynamic_smem=smem, consts=consts)
    return Plan(kernel="draft_topk", spec=spec, threads=sympy.Integer(THREADS), min_blocks=min_blocks,
                static_smem=smem, consts=consts)


KERNELS = [KernelDef(name="draft_topk", template="draft_topk.cu.j2", entry="ddtree_draft_topk", plan=plan,
                     policy=policy, spell=spell)]


BUNDLE_CASES = ("bf16", "edges")


def bundle_inputs(spec, rng, case) -> dict:
    """The inputs of refs/<spec>/draft_topk-<case>.kdtr: "bf16" (a vocabulary above one chunk: the merge) or
    "edges" (float32 rows of ties, NaN and -inf, all -inf, +inf, +-0; k = N-1)."""
    k = spec.max_tree_size - 1
    if case == "bf16":        # two requests, 3 depths, a vocabulary above one chunk (16384): the merge
        logits = to_bits(rng.standard_normal((2, 3, 20000)) * 3)
        return {"logits": logits, "k": np.array(k, np.int32), "temperature": np.array(0.8, np.float64)}
    # float32 edge rows: ties (a few values), NaN and -inf, all -inf, +inf, k = V at the end
    v = max(k, 300)
    x = rng.integers(-4, 4, size=(1, 6, v)).astype(np.float32)
    x[0, 1, ::5] = np.nan
    x[0, 1, 1::7] = -np.inf
    x[0, 2] = -np.inf
    x[0, 2, 3::11] = np.nan
    x[0, 3, [5, 77, 200]] = np.inf
    x[0, 4] = rng.standard_normal(v).astype(np.float32)
    x[0, 5] = 0.0
    x[0, 5, ::2] = -0.0
    return {"logits": x, "k": np.array(k, np.int32), "temperature": np.array(1.0, np.float64)}


def sanitizer_cases(spec, rng):
    """`ddtree-gen sanitize`: bf16 and float32 rows of one and of several chunks (the merge), a vocabulary that is
    not a multiple of the 16-byte vector (scalar loads), ties that overflow the candidate list (a constant row),
    NaN / -inf / all -inf / +inf rows, k = 1 and N-1, a temperature."""
    kmax = spec.max_tree_size - 1

    def rows(b, dp, v, scale=3.0):
        return rng.standard_normal((b, dp, v)) * scale

    yield "bf16, V = 129280", dict(logits=to_bits(rows(1, 2, 129280)), k=kmax)
    yield "float32, V = 40001, T = 0.7", dict(logits=rows(2, 2, 40001).astype(np.float32), k=kmax, temperature=0.7)
    yield "bf16, V = 1001 (scalar loads), k = 1", dict(logits=to_bits(rows(3, 1, 1001)), k=1)
    edge = rows(1, 5, 40000).astype(np.float32)
    edge[0, 0] = 0.0                        # a constant row: ties overflow the candidates
    edge[0, 1] = -np.inf                    # all -inf
    edge[0, 1, 7::13] = np.nan
    edge[0, 2, ::3] = np.nan
    edge[0, 3, [3, 20000, 39999]] = np.inf
    edge[0, 4] = np.sort(edge[0, 4])        # ascending: the candidates sit in few threads
    yield "float32 edge rows", dict(logits=edge, k=kmax)
    yield "bf16 edge rows", dict(logits=to_bits(edge), k=kmax)
    yield "k = V", dict(logits=rows(1, 1, kmax).astype(np.float32), k=kmax)


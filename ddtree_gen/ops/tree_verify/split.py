"""What the tensor-core tree_verify families share: their shape rule, the split-KV policy, the wave model,
the workspace format, the tuning table and the combine kernel.

Both families (tree_verify_mma: mma.sync; tree_verify_wgmma: Hopper warpgroup MMA) take BM = 64 query rows
per block and 8 warps, and cut a request's keys into chunks the same way; neither family module imports
the other, both import this one.

* Split-KV: the number of key chunks comes from shapes only (B, Nq, H, max_pages, the SM count), never from
  device values: CUDA-graph friendly. The chunk boundaries are computed in the kernel from the request's
  prefix_len. choose_splits takes a backend's tuned table and model as values (each kernel's
  KernelDef.split_rule: the mma.sync table and the wave model, wave_model; the wgmma kernels' makespan model,
  makespan_model): the table's count by shape class, else the model's.
* The tuning table (TUNING_FILE, written by scripts/tune_tree_verify.py and scripts/sweep_splits.py on a
  GPU): per spec the mma.sync configuration and split table, and the wgmma split table.
* The workspace: fp32 partials of every chunk (or seesaw part) and their lse, then the seesaw kernel's
  request spans (workspace_elems, parts_workspace_elems).
* The combine kernel (tree_verify_mma_combine: the name of its launcher, binaries and generated file; its
  template is templates/tree_verify_combine.cu.j2) merges the partials of either family. Its declaration, and the
  helper of the tensor-core kernels' declarations: ops/tree_verify/tensor_core.py.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import sympy

from ...errors import SpecError
from ...build.resources import SM90_MAX_REGS_PER_THREAD, R, Plan, evaluate
from ...build.kernel_def import KernelDef

TUNING_FILE = Path(__file__).with_name("tree_verify_tuning.json")
COMBINE = "tree_verify_mma_combine"   # the split-KV combine of both tensor-core families

BM = 64                 # query rows per block (4 row groups of 16), both families
WARPS = 8               # both families: 8 warps (the wgmma kernels: two warpgroups)
MAX_SPLITS = 32
MAX_PARTS = 264         # the parts grid's part count: two waves of one-row-tile blocks on a 132-SM GPU
COMBINE_ROWS_PER_BLOCK = 4   # (4 rather than 8: twice the blocks for a small batch's few rows)
DEFAULT_SMS = 132       # H100 / H200 SXM, used when the device cannot be asked
O_REGS = BM * R / (32 * WARPS)                   # fp32 output accumulators per thread (R / 4)


def check_spec(spec, kernel) -> None:
    """Refuse a spec whose kv_lora_rank the tensor-core kernels cannot split over their warps."""
    where = f"spec {spec.name!r}, kernel {kernel}"
    r = spec.kv_lora_rank
    if r % (WARPS * 16):
        raise SpecError(f"{where}: field 'kv_lora_rank' = {r} must be a multiple of {WARPS * 16} "
                        f"(each of the {WARPS} warps owns a multiple of 16 output columns)")
    regs = evaluate(O_REGS, spec)
    if regs > 128:
        raise SpecError(f"{where}: field 'kv_lora_rank' = {r} needs {regs} fp32 accumulator registers per "
                        f"thread (R / 4, formula {O_REGS}); at most 128 leave room for the rest within "
                        f"{SM90_MAX_REGS_PER_THREAD}")


# ------------------------------------------------------------------------- the tuning table

@functools.lru_cache(maxsize=None)   # read once per process: the launch path never touches the file
def tuning() -> dict:
    """spec name -> tuned entry, from TUNING_FILE."""
    try:
        data = json.loads(TUNING_FILE.read_text())
    except (OSError, ValueError):
        return {}
    specs = data.get("specs", {}) if isinstance(data, dict) else {}
    return specs if isinstance(specs, dict) else {}


# ------------------------------------------------------------------------- split-KV

def shape_class(base_blocks: int) -> str:
    """Tuning-table key of a launch: base blocks (B x row tiles) rounded up to a power of two."""
    return str(1 << max(0, (int(base_blocks) - 1).bit_length()))


def choose_splits(spec, b: int, nq: int, max_keys: int, bn: int, sms: int = DEFAULT_SMS, table: tuple = (),
                  model: Callable | None = None) -> int:
    """_choose_splits's count under the current ONE_WAVE (a key of its cache: a script or test that turns it on gets
    its own entries)."""
    return _choose_splits(spec, b, nq, max_keys, bn, sms, table, model, ONE_WAVE)


@functools.lru_cache(maxsize=4096)   # on every launch: shapes only, so cached
def _choose_splits(spec, b: int, nq: int, max_keys: int, bn: int, sms: int, table: tuple, model: Callable | None,
                   one_wave: bool) -> int:
    """Key chunks per (request, row tile), from shapes only, by a backend's split rule given as values: `table`, its
    tuned counts as (shape class, count) pairs (measured on an H200: the mma.sync one, scripts/tune_tree_verify.py,
    for the sm_90a build of the tuned configuration), else `model`(base blocks, SMs, key tiles, most) (default: the
    wave model, wave_model; the wgmma kernels' makespan_model at every length). Never more chunks than the largest
    possible key range fills with two tiles each (max_keys: Nq for the tail, max_pages * page_size otherwise), nor more
    than MAX_SPLITS (with ONE_WAVE on: up to one wave of blocks past it, one_wave_splits, where the rows are few)."""
    base = b * -(-nq * spec.num_heads // BM)
    if base <= 0:
        return 1
    useful = max(1, -(-int(max_keys) // (2 * bn)))
    tiles = max(1, -(-int(max_keys) // bn))
    most = min(max(MAX_SPLITS, one_wave_splits(spec, base, nq, sms)) if one_wave else MAX_SPLITS, useful)
    s = dict(table).get(shape_class(base))
    if isinstance(s, int) and s >= 1:
        return max(1, min(s, most))
    return (model or wave_model)(base, sms, tiles, most)


# Off until measured on a GPU (issue 45; docs/perf/journal-tree-verify.md "One wave for a request of few rows": built on
# 2026-12-07 when no device time was left to run it; scripts/compare_one_wave.py and tests/test_gpu_tree_verify.py's
# test_one_wave_of_chunks turn it on for their own calls): the automatic chunk count past MAX_SPLITS
ONE_WAVE = False


# Off until measured on a GPU (built on a machine without one; scripts/compare_pdl.py and tests/test_gpu_pdl.py turn it
# on for their own calls): the combine launched as a programmatic dependent of the attention kernel (launch/pdl.py:
# cuLaunchKernelEx with programmatic stream serialization), so that its launch overlaps that kernel's end instead of
# following it. A key of tree_verify's call cache (route.VerifyCall.key), so a script or test may turn it on and off.
PDL_COMBINE = False
PDL_TARGETS = ("sm_90a",)   # the combine builds that wait for the partials themselves (griddepcontrol.wait: sm_90+)


def pdl_combine(target: str | None) -> bool:
    """Whether the combine's launch is a programmatic dependent one: PDL_COMBINE on and the build that runs (`target`)
    one that waits for the attention kernel (its sm_80 PTX has no griddepcontrol.wait, so it is launched plainly)."""
    return PDL_COMBINE and target in PDL_TARGETS


def one_wave_splits(spec, base: int, nq: int, sms: int) -> int:
    """The chunk count past MAX_SPLITS that the automatic choice may take: one wave of blocks (base x s <= SMs), so that
    a request of few rows fills the GPU (B = 1, H = 8, Nq = 22: 3 row tiles, 44 chunks on 132 SMs, not 32 chunks and 36
    idle SMs: issue 45's sweep, 1.38x FlashMLA at 193k keys), while its partials still fit the workspace an engine sizes
    for MAX_SPLITS chunks of max_tree_size rows (s Nq <= MAX_SPLITS N: workspace_elems(spec, B, N, MAX_SPLITS))."""
    return min(sms // max(1, base), MAX_SPLITS * spec.max_tree_size // max(1, nq))


# The wave model of an untuned shape (a spec of the user's, a bench variant): blocks run one per SM, so a
# launch of base x s equal chunks takes ceil(base s / SMs) waves of 1/s of the keys each; the combine reads
# s partials per row, COMBINE_COST of a wave's time per wave of partial blocks (fitted to the H200 sweep of
# scripts/sweep_splits.py, docs/bench/sweep_splits_wgmma.txt: its choice runs within 8 % of the measured best on
# every shape there, within 2 % on most).
COMBINE_COST = 0.04
WAVE_SPLIT_BASE = 4    # at base >= 4 waves of blocks, splitting gains less than the combine costs: 1


# Short contexts (the wgmma family, fewer than LONG_TILES key tiles a request): a block's fixed cost (its prologue, Q,
# epilogue: BLOCK_FIXED_TILES key tiles' time) is paid per block whatever its share of the keys, so more waves of
# shorter blocks lose where the wave model above would split; fitted to scripts/sweep_splits.py at L = 64..1984 on the
# H200 (docs/perf/journal-tree-verify.md "Short contexts": 1.72 us a key tile, 10.7 us a block; the combine, 3-7 us in a graph of its own,
# costs less behind the attention kernel)
LONG_TILES = 32
BLOCK_FIXED_TILES = 6.0
COMBINE_TILES = 1.0


def short_splits(base: int, sms: int, tiles: int, most: int) -> int:
    """The split count the fixed-cost model predicts fastest for `base` blocks of `tiles` key tiles on `sms` SMs:
    waves x (fixed + tiles / s), plus the combine (COMBINE_TILES a wave of partial blocks) when s > 1; one chunk where
    the blocks fill half the SMs already (measured best at every such short shape; the model chose 2 at B=16 L=960,
    82.0 us against 77.8 for one chunk)."""
    if 2 * base >= sms:
        return 1
    def cost(s):
        waves = -(-base * s // sms)
        return waves * (BLOCK_FIXED_TILES + tiles / s) + (COMBINE_TILES * max(1.0, base * s / sms) if s > 1 else 0.0)
    return min(range(1, max(1, most) + 1), key=lambda s: (cost(s), s))


def makespan(blocks_per_piece: int, pieces: int, sms: int, units: int, fixed: float = BLOCK_FIXED_TILES) -> float:
    """The makespan model, in key-tile times: `blocks_per_piece` x `pieces` blocks, one per SM at a time, each doing
    1 / pieces of `units` key tiles plus a fixed cost, wave after wave; then the combine of the pieces' partials
    (COMBINE_TILES a wave of partial blocks) when there are several."""
    blocks = blocks_per_piece * pieces
    waves = -(-blocks // sms)
    return (waves * (-(-units // pieces) + fixed)
            + (COMBINE_TILES * max(1.0, blocks / sms) if pieces > 1 else 0.0))


def best_count(blocks_per_piece: int, sms: int, units: int, most: int, fixed: float = BLOCK_FIXED_TILES) -> int:
    """The piece count (chunks of each request, or parts of the batch) of `units` key tiles that the makespan model
    predicts fastest, 1..most (the fewest on a tie): at H = 8, Nq = 65 (9 row tiles a request) and 64k keys, 14 pieces
    (one wave of 126 blocks) against the 16 of the L = 4096 table (144 blocks: two waves, 236 against 139 us at B = 1
    on the H200)."""
    return min(range(1, max(1, most) + 1), key=lambda s: (makespan(blocks_per_piece, s, sms, units, fixed), s))


def wave_model(base: int, sms: int, tiles: int, most: int) -> int:
    """The mma.sync kernels' model of an untuned shape (choose_splits): the wave model."""
    return wave_splits(base, sms, most)


def makespan_model(base: int, sms: int, tiles: int, most: int) -> int:
    """The wgmma kernels' model at every length (their table was fitted at L = 4096 only: at 64k keys its 16 chunks
    took two waves): the fixed-cost model of short contexts, else one chunk at WAVE_SPLIT_BASE waves of blocks or more
    (splitting gains less than the combine costs: the wave model's rule), else the makespan model's best count."""
    if tiles < LONG_TILES:
        return short_splits(base, sms, tiles, most)
    return 1 if base >= WAVE_SPLIT_BASE * sms else best_count(base, sms, tiles, most)


def wave_splits(base: int, sms: int, most: int) -> int:
    """The split count the wave model predicts fastest for `base` blocks on `sms` SMs (at most `most`)."""
    if base >= WAVE_SPLIT_BASE * sms:
        return 1
    def cost(s):
        return -(-base * s // sms) / s + (COMBINE_COST * base * s / sms if s > 1 else 0.0)
    return min(range(1, max(1, most) + 1), key=lambda s: (cost(s), s))


# ------------------------------------------------------------------------- the workspace

def workspace_elems(spec, b: int, nq: int, splits: int) -> int:
    """float32 elements of split-KV scratch for `splits` chunks (or parts): partial outputs [splits, rows, R], their
    lse [splits, rows], then 2 B + 1 int32 (the seesaw kernel's request spans: ops/tree_verify/wgmma.py). The
    seesaw kernel uses the first (B + splits - 1) Nq H (R + 1) of the partials' part (parts_workspace_elems)."""
    if splits <= 1:
        return 0
    rows = b * nq * spec.num_heads
    return splits * rows * (spec.kv_lora_rank + 1) + 2 * b + 1


def parts_workspace_elems(spec, b: int, nq: int, parts: int) -> int:
    """float32 elements the seesaw kernel's `parts` need: partials in B + parts - 1 slots of Nq H rows (slot
    b + part; output [slots, Nq H, R] then lse [slots, Nq H]), then the 2 B + 1 int32 request spans."""
    if parts <= 1:
        return 0
    return (b + parts - 1) * nq * spec.num_heads * (spec.kv_lora_rank + 1) + 2 * b + 1


# ------------------------------------------------------------------------- the combine kernel

def combine_plan(spec) -> Plan:
    return Plan(kernel=COMBINE, spec=spec, threads=sympy.Integer(32 * COMBINE_ROWS_PER_BLOCK),
                min_blocks=4, static_smem=sympy.Integer(0),
                consts={"ROWS_PER_BLOCK": sympy.Integer(COMBINE_ROWS_PER_BLOCK), "F4_PER_LANE": sympy.ceiling(R / 128)})


# fp32 partials: built for every spec and target
COMBINE_DEF = KernelDef(name=COMBINE, template="tree_verify_combine.cu.j2", entry="ddtree_tree_verify_mma_combine",
                        plan=combine_plan)
KERNELS = [COMBINE_DEF]


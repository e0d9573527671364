"""Resource plan of tree_verify on Hopper's warpgroup tensor cores (tree_verify_wgmma, _tail_wgmma).

Same contract as the mma.sync family (ops/tree_verify/mma.py, its peer); the split-KV policy, the
workspace and the combine kernel they share are in ops/tree_verify/split.py. The kernels use wgmma.mma_async
(sm_90a): each warpgroup reads its operands once from shared memory instead of every warp re-reading them.
templates/tree_verify_wgmma.cu.j2 has the design, docs/perf.md the performance model.

Fixed configuration: two warpgroups, BM = 64 query rows, BN = 64 keys per tile; tiles stored in the
128-byte swizzle of the wgmma descriptors. A variant's config (build/variant.py; the policy `variant_config`) holds
the schedule, whether key tiles come by TMA (`tma`) and the measurement knobs (KNOBS). Two schedules
(`schedule_for` picks the default):
* "seesaw" (templates/tree_verify_seesaw.cu.j2): each warpgroup owns half of the output columns and
  computes S of alternate key tiles, so one warpgroup's softmax runs under the other's products; key
  tiles by TMA, two tile buffers; needs a bf16 cache with 64-key-aligned pages, R = 512 and P = 64
  (Q's rope slab is held in registers and its shared memory holds the odd tile's P).
* "lockstep" (templates/tree_verify_wgmma.cu.j2): both warpgroups split S by keys and P.V by columns,
  softmax in between, 2 key stages (TMA or cp.async); every other variant (fp8, the tail kernel, other
  page sizes or dims).
"""
from __future__ import annotations

import functools

import sympy

from ...archs import PRIMARY
from ...errors import SpecError
from ...build.resources import P, R, Plan
from . import split as split_kv
from ...build.kernel_def import DEFAULT_BUILD, Build, KernelDef
from .split import BM, MAX_PARTS, check_spec

BN = 64
STAGES = 2
THREADS = 256              # two warpgroups
SLABS = sympy.ceiling((R + P) / 64)                # 64-column slabs of a tile row
TILE = SLABS * 64 * 128                            # one 64-row tile, 128-byte rows per slab
SMEM = ((1 + STAGES) * TILE                        # Q tile, key tiles
        + BM * BN * 2                              # P tile
        + 2 * BM * 4                               # row maxima of both key halves
        + STAGES * BN * 4)                         # per-key "staged" flags
# FP8 cache: the stages hold e4m3 bytes (half a bf16 tile each), converted into one bf16 key tile; the
# flags of the converted tile and of every stage are live at once
SMEM_FP8 = (2 * TILE                               # Q tile, the converted bf16 key tile
            + BM * BN * 2                          # P tile
            + STAGES * BN * (R + P)                # e4m3 stages
            + 2 * BM * 4                           # row maxima of both key halves
            + (STAGES + 1) * BN * 4)               # per-key "staged" flags
# V read as the MN-major B operand of wgmma: byte stride between 64-column slabs (LBO) and between
# groups of 8 keys (SBO) in the tile layout above
V_DESC = {"V_LBO": 64 * 128, "V_SBO": 8 * 128}


# tree_verify_wgmma ships several builds (plans/kernel_def.Build; a kernel set's key of each: "tree_verify_wgmma/<build>"),
# and `pick` (below) chooses one per call. The builds besides the default (the chunks grid: a block per request, chunk
# and row tile):
# The fp8 spec's dequantize path (tree_verify(..., fp8_path="dequant")): the kv_dequant pre-pass writes the e4m3 pages
# a call reads into a bf16 workspace, then this build of the full kernel, the bf16-cache seesaw built for the fp8
# spec (kv_scale in fp32 as the fused fp8 build: scale_log2, v_scale), reads it (ops/kv_dequant/plan.py; knob kv_source
# "workspace")
DEQUANT = "tree_verify_wgmma/dequant"
# The seesaw on the balanced parts grid (grid "parts"), the build that tree_verify's launcher takes instead of
# the chunks grid: a bf16 cache, any H, B >= PARTS_MIN_B (a batch of several requests, whose lengths
# the host does not know: the parts are cut on the device from them, balanced whatever they are; one request is the
# chunks grid's, whose blocks skip the parts' scan), the launcher's own part count (num_splits not given; parts_for).
# docs/perf.md "tree_verify on real traffic"
PARTS_KERNEL = "tree_verify_wgmma/parts"
PARTS_MIN_B = 2
# ... and, below a block table of PARTS_MIN_KEYS keys a request (no request long enough to set the pace of the chunks
# grid alone), only where the makespan model says the parts pay (parts_pay): the chunks grid's blocks skip the parts'
# scan and segment loop (~4 us a block): at B = 2, H = 8, L = 4096 the chunks grid 37.0 us against the parts' 44.7, at
# B = 8, Nq = 16 38.0 against 41.9; but at B = 8, H = 64, Nq = 21, L = 3229 the chunks grid's 4 waves took 185.6 us
# where FlashMLA's one balanced wave took 133 (docs/perf.md "tree_verify on real traffic")
PARTS_MIN_KEYS = 8192
# the parts count's fixed cost of a wave of blocks in key tiles (the makespan model, split_kv.best_count): a second
# wave of parts measured dearer than a block's prologue alone (B = 4, H = 8, 64k keys: 14 parts 493 us, 29 parts 541)
PARTS_WAVE_TILES = 12
ONE_WAVE_FILL = 0.95
# The dequantize path's kernel on the parts grid: an fp8 spec's, where its calls take the parts
# grid by the rule of PARTS_KERNEL (docs/perf.md "The dequantize path on the bf16 default's build": 0.76 -> 0.83x of
# bf16 at B = 8 H = 8). The bits of the bf16 parts build in the fused build's slab order on the dequantized cache
DEQUANT_PARTS = "tree_verify_wgmma/dequant_parts"
WORKSPACE_READERS = (DEQUANT, DEQUANT_PARTS)     # the builds that read kv_dequant's bf16 workspace
DEQUANT_BUILDS = ("dequant", "dequant_parts")   # (their build names)
FULL_KERNELS = ("tree_verify_wgmma", DEQUANT, PARTS_KERNEL, DEQUANT_PARTS)


def build_key(build: str) -> str:
    """The kernel set's key of a build of tree_verify_wgmma ("default": the kernel's own name)."""
    return "tree_verify_wgmma" if build == DEFAULT_BUILD else f"tree_verify_wgmma/{build}"


def reads_fp8(spec, kernel: str) -> bool:
    """Whether `kernel`'s build for `spec` reads e4m3 tiles: an fp8 spec's, except the dequantize path's kernels
    (WORKSPACE_READERS), which read the bf16 workspace."""
    return spec.kv_fp8 and kernel not in WORKSPACE_READERS


def uses_tma(spec, kernel: str) -> bool:
    """Whether `kernel` of `spec` can load its key tiles with TMA: the full kernel (its tiles start on multiples
    of BN) of a cache whose pages hold whole tiles (page_size % BN == 0), so that a tile is one rectangle of
    the cache: 9 boxes of 64 keys x 64 columns (bf16: 128-byte rows in the wgmma swizzle; fp8: 64-byte rows of
    e4m3 bytes, which only the seesaw takes: its converter warpgroup turns them into bf16 slabs). Otherwise
    cp.async (the tail kernel's tiles start at prefix_len; the lockstep fp8 stages are converted by its threads)."""
    return kernel in FULL_KERNELS and spec.page_size % BN == 0


def lockstep_tma(spec, kernel: str) -> bool:
    """TMA key tiles in the lockstep schedule: a bf16 cache only (its fp8 stages come by cp.async)."""
    return uses_tma(spec, kernel) and not reads_fp8(spec, kernel)


# Seesaw: Q, two key tiles, the even tile's P (the odd tile's lives in Q's rope slab), the row max and the two
# rescale factors and the row sums of both warpgroups (5 x BM floats), one mbarrier per slab of each tile buffer;
# an fp8 cache: a second mbarrier per slab (its bf16 slab is converted) and a third, converter warpgroup (its e4m3
# bytes land in the upper half of their bf16 slab group and are converted in place)
SEESAW_SMEM = 3 * TILE + BM * BN * 2 + 5 * BM * 4 + 2 * SLABS * 8
SEESAW_SMEM_FP8 = SEESAW_SMEM + 2 * SLABS * 8
SEG_BYTES = 16 * 4          # the parts grid's segment state (the template's SEG_WORDS ints)
SCHEDULES = ("seesaw", "lockstep")
# the seesaw's rescale modes -> (RESCALE_SKIP, MAX_SLACK, EXP_FMA) of templates/tree_verify_seesaw.cu.j2; "lazy" is
# the default (docs/perf.md, "fewer instructions per tile")
RESCALES = {"exact": (0, 0, 0), "skip": (1, 0, 0), "lazy": (1, 8, 1), "lazy4": (1, 4, 1)}
def seesaw_fits(spec, kernel: str) -> bool:
    """Whether the seesaw schedule can serve `kernel` of `spec`: TMA tiles (uses_tma: bf16 or fp8) and R = 512,
    P = 64."""
    return uses_tma(spec, kernel) and spec.kv_lora_rank == 512 and spec.qk_rope_head_dim == 64


def schedule_for(spec, kernel: str) -> str:
    """The default schedule: the seesaw wherever it fits, else lockstep."""
    return "seesaw" if seesaw_fits(spec, kernel) else "lockstep"


# the knobs of a build besides the schedule and TMA, at their values in the default build (variant_config):
# ablate (seesaw only): bit 0 leaves out the S products, bit 1 the P.V ones; fp8: bit 2 the converter's conversion, bit 3
# its fences, bit 4 its arithmetic (wrong results on purpose, for timing);
# l2_hint "evict_first": the seesaw's key-tile loads carry that L2 hint; grid "parts" (seesaw only): the balanced
# parts of the batch's key tiles (parts_for) instead of per-request chunks; s_order "slab": WG1's S in slab order
# rather than in the order its slabs were loaded; sync_handoffs: the warpgroups' hand-offs as bar.sync on both
# sides (for racecheck: scripts/racecheck_seesaw.py); rescale (seesaw only, RESCALES): "exact" (the first seesaw),
# "skip" or "lazy" (the default); p_store (seesaw only): "sts" (32-bit stores, the default) or "stmatrix" for the
# P tiles the other warpgroup reads (the same results, within +-2 % of the time: docs/perf.md); rope_early (seesaw):
# the rope slab loaded and multiplied with the early group (V_L's slabs) instead of the late one (an fp8 cache: always,
# its in-place conversion needs it; a bf16 one with it gives the fp8 build's bits on the dequantized cache)
# convert_sync (fp8 seesaw, CONVERT_SYNCS): how the converter warpgroup synchronises ("slab", "lean", "group" or "pairs":
# two slabs per step, the default: docs/perf.md "FP8 on the seesaw, built"); seg_cost (the parts grid): a segment's fixed
# cost in key tiles when the batch's work is cut into parts (SEG_COST of templates/tree_verify_seesaw.cu.j2: each request
# costs seg_cost + its tiles; docs/perf.md "tree_verify on real traffic").
# Retired (measured slower, their code in git history, their figures in docs/perf/journal-fp8.md): fp8_mma and
# vt_stages ("FP8 products, built": 0.61-1.02x of the exact path, ~4 % output error) and convert "inline" ("The
# converter inside the parts kernel, built": 0.77x of bf16 against the pre-pass path's 0.84x)
# kv_source "workspace": the build reads kv_dequant's bf16 workspace (the dequantize path's builds), not the spec's cache.
KNOBS = {"ablate": 0, "l2_hint": None, "grid": "chunks", "s_order": "loaded", "sync_handoffs": False,
         "rescale": "lazy", "p_store": "sts", "rope_early": False, "convert_sync": "pairs", "seg_cost": 6,
         "kv_source": "cache"}
KV_SOURCES = ("cache", "workspace")
RETIRED = {"fp8_mma": 'docs/perf/journal-fp8.md "FP8 products, built"',
           "vt_stages": 'docs/perf/journal-fp8.md "FP8 products, built"',
           "convert": 'docs/perf/journal-fp8.md "The converter inside the parts kernel, built"'}
# the fp8 seesaw's convert_sync modes -> (CONV_BARS, GROUP_FENCE, CONV_PAIRS) of templates/tree_verify_seesaw.cu.j2
CONVERT_SYNCS = {"slab": (0, 0, 0), "lean": (1, 0, 0), "group": (1, 1, 0), "pairs": (1, 0, 1)}
P_STORES = ("sts", "stmatrix")


def variant_config(spec, arch: str = "sm_90a", kernel: str = "tree_verify_wgmma") -> dict:
    """The policy (plans/variant.default_config): the schedule of schedule_for, TMA key tiles wherever they
    can be used (uses_tma), every other knob off."""
    sched = schedule_for(spec, kernel)
    return {"schedule": sched, "tma": uses_tma(spec, kernel) if sched == "seesaw" else lockstep_tma(spec, kernel),
            **KNOBS}


def parts_config(spec, arch: str = "sm_90a") -> dict:
    """The policy of PARTS_KERNEL: the default seesaw build on the parts grid."""
    return {**variant_config(spec, arch), "grid": "parts"}


def dequant_config(spec, arch: str = "sm_90a") -> dict:
    """The policy of DEQUANT: the seesaw on TMA tiles in the fused fp8 build's slab order (rope_early, s_order "slab"),
    every other knob at the fused build's value, so that its bits are the fused fp8 build's (the conversion is
    exact, and kv_scale enters both the same way)."""
    return {"schedule": "seesaw", "tma": True, **KNOBS, "rope_early": True, "s_order": "slab", "kv_source": "workspace"}


def dequant_parts_config(spec, arch: str = "sm_90a") -> dict:
    """The policy of DEQUANT_PARTS: DEQUANT's build on the parts grid (the slab order measured the same there)."""
    return {**dequant_config(spec, arch), "grid": "parts"}


def spell(config) -> tuple:
    """A configuration's part of a variant's name (build/variant.py): tree_verify_wgmma.seesaw.tma,
    tree_verify_wgmma.lockstep.cpasync.ablate3 (each knob that is not at its default value after the schedule)."""
    parts = [config["schedule"], "tma" if config["tma"] else "cpasync"]
    if config.get("ablate"):
        parts.append(f"ablate{int(config['ablate'])}")
    if config.get("l2_hint"):
        parts.append(f"l2-{config['l2_hint'].replace('_', '-')}")
    for knob in ("grid", "s_order"):
        if config.get(knob, KNOBS[knob]) != KNOBS[knob]:
            parts.append(f"{knob.replace('_', '-')}-{config[knob]}")
    if config.get("sync_handoffs"):
        parts.append("sync-handoffs")
    for knob in ("rescale", "p_store", "convert_sync", "seg_cost"):
        if config.get(knob, KNOBS[knob]) != KNOBS[knob]:
            parts.append(f"{knob.replace('_', '-')}-{config[knob]}")
    if config.get("rope_early"):
        parts.append("rope-early")
    if config.get("kv_source", KNOBS["kv_source"]) != KNOBS["kv_source"]:
        parts.append(config["kv_source"])
    return tuple(parts)


def verify_plan(spec, kernel="tree_verify_wgmma", config=None) -> Plan:
    """The plan of a build of `kernel` (tree_verify_wgmma or its tail) with `config` (None: the kernel's default build);
    the build is its config: grid "parts", kv_source "workspace" (the dequantize path)."""
    check_spec(spec, kernel)   # R a multiple of 128 and at most 512: each warpgroup owns R / 2 columns
    if config is None:
        config = variant_config(spec, kernel=kernel)
    kv_source = config.get("kv_source", KNOBS["kv_source"])
    if kv_source not in KV_SOURCES:
        raise SpecError(f"kv_source {kv_source!r}: one of {', '.join(KV_SOURCES)}")
    dequant = kv_source == "workspace"
    if dequant and (not spec.kv_fp8 or kernel != "tree_verify_wgmma"):
        raise SpecError(f"spec {spec.name!r}, kernel {kernel}: the dequantize path (kv_source 'workspace') is an fp8 "
                        f"spec's full kernel (kv_dtype 'fp8_e4m3'); a bf16 cache is read by tree_verify_wgmma itself")
    if config.get("grid") == "parts" and not seesaw_fits(spec, kernel):
        raise SpecError(f"spec {spec.name!r}, kernel {kernel}: the parts grid is built for the seesaw (page_size % {BN} "
                        f"== 0, R = 512, P = 64)")
    fp8 = spec.kv_fp8 and not dequant
    sched = config["schedule"]
    if sched not in SCHEDULES or (sched == "seesaw" and not seesaw_fits(spec, kernel)):
        raise SpecError(f"spec {spec.name!r}, kernel {kernel}: schedule {sched!r} is not one it can take "
                        f"(seesaw needs page_size % {BN} == 0, R = 512, P = 64, the full kernel)")
    rescale, p_store = config.get("rescale", KNOBS["rescale"]), config.get("p_store", KNOBS["p_store"])
    if rescale not in RESCALES:
        raise SpecError(f"rescale {rescale!r}: one of {', '.join(RESCALES)}")
    if p_store not in P_STORES:
        raise SpecError(f"p_store {p_store!r}: one of {', '.join(P_STORES)}")
    convert_sync = config.get("convert_sync", KNOBS["convert_sync"])
    if convert_sync not in CONVERT_SYNCS:
        raise SpecError(f"convert_sync {convert_sync!r}: one of {', '.join(CONVERT_SYNCS)}")
    retired = sorted(k for k in RETIRED if k in config)
    if retired:
        raise SpecError(f"{retired[0]}: a retired build knob, measured slower ({RETIRED[retired[0]]}; its code is in git "
                        f"history)")
    seg_cost = config.get("seg_cost", KNOBS["seg_cost"])
    if not isinstance(seg_cost, int) or isinstance(seg_cost, bool) or not 0 <= seg_cost <= 64:
        raise SpecError(f"seg_cost {seg_cost!r}: a whole number of key tiles, 0..64")
    seg_cost = seg_cost if sched == "seesaw" and config.get("grid") == "parts" else 0   # the parts grid only
    if not fp8 and (convert_sync != KNOBS["convert_sync"] or int(config.get("ablate", 0)) & 28):
        raise SpecError(f"spec {spec.name!r}, kernel {kernel} reads a bf16 cache: convert_sync and ablate bits 2-4 are the fp8 seesaw's "
                        f"converter's")
    ablate = int(config.get("ablate", 0))
    if ablate & 28 and convert_sync == "pairs":
        raise SpecError("ablate bits 2-4 (the converter's) are the per-slab converter's: with convert_sync 'slab', "
                        "'lean' or 'group'")
    tma = bool(config["tma"])
    if tma and not (uses_tma(spec, kernel) if sched == "seesaw" else lockstep_tma(spec, kernel)):
        raise SpecError(f"spec {spec.name!r}, kernel {kernel}: TMA key tiles need the full kernel, page_size % {BN} "
                        f"== 0 and (lockstep schedule) a bf16 cache")
    if sched == "seesaw" and not tma:
        raise SpecError(f"spec {spec.name!r}, kernel {kernel}: the seesaw schedule loads its key tiles by TMA (tma=False "
                        f"is the lockstep schedule's)")
    if sched == "seesaw" and fp8 and config.get("grid", "chunks") != "chunks":
        raise SpecError(f"spec {spec.name!r}: the fp8 seesaw runs the grid 'chunks' only (grid {config['grid']!r})")
    # fp8: the converter warpgroup
    threads = THREADS + 128 if sched == "seesaw" and fp8 else THREADS
    if sched == "seesaw":
        smem = SEESAW_SMEM_FP8 if fp8 else SEESAW_SMEM + (SEG_BYTES if config.get("grid") == "parts" else 0)
    else:
        smem = SMEM_FP8 if fp8 else SMEM + (8 * STAGES if tma else 0)   # TMA: one mbarrier per stage
    return Plan(kernel=kernel, spec=spec, threads=sympy.Integer(threads), min_blocks=1,
                static_smem=sympy.Integer(0), dynamic_smem=smem,
                consts={"BM": sympy.Integer(BM), "BN": sympy.Integer(BN), "STAGES": sympy.Integer(STAGES),
                        "SLABS": SLABS, "USE_TMA": sympy.Integer(1 if tma else 0),
                        "SEESAW": sympy.Integer(1 if sched == "seesaw" else 0),
                        "ABLATE": sympy.Integer(int(config.get("ablate", 0))),
                        "L2_EVICT_FIRST": sympy.Integer(1 if config.get("l2_hint") == "evict_first" else 0),
                        "PARTS": sympy.Integer(1 if sched == "seesaw" and config.get("grid") == "parts" else 0),
                        "SEG_COST": sympy.Integer(seg_cost),
                        "S_LOADED_ORDER": sympy.Integer(0 if config.get("s_order") == "slab" else 1),
                        "SYNC_HANDOFFS": sympy.Integer(1 if config.get("sync_handoffs") else 0),
                        **({k: sympy.Integer(v) for k, v in      # the seesaw's own knobs (its template only)
                            zip(("RESCALE_SKIP", "MAX_SLACK", "EXP_FMA", "P_STMATRIX", "ROPE_EARLY", "CONV_BARS",
                                 "GROUP_FENCE", "CONV_PAIRS"),
                                (*RESCALES[rescale], int(p_store == "stmatrix"),
                                 int(bool(fp8 or config.get("rope_early"))), *CONVERT_SYNCS[convert_sync]))}
                           if sched == "seesaw" else {}),
                        **{k: sympy.Integer(v) for k, v in V_DESC.items()},
                        # the dequantize path's builds read bf16 tiles whatever the spec's cache holds
                        **({"KV_FP8": sympy.Integer(0)} if dequant else {})})


def tail_plan(spec, config=None) -> Plan:
    return verify_plan(spec, "tree_verify_tail_wgmma", config)


ARCHS = ("sm_90a",)        # wgmma.mma_async exists on sm_90a only: no sm_80 (PTX) build

# the further builds of tree_verify_wgmma (its default: the chunks grid of variant_config), each picked by `pick`
BUILDS = (
    # a bf16 spec's: the seesaw on the parts grid, which tree_verify takes at B >= PARTS_MIN_B
    Build("parts", parts_config, kv_dtypes=("bf16",), why="the balanced parts grid (B >= PARTS_MIN_B)"),
    # an fp8 spec's only: the bf16-cache seesaw (KV_FP8 off) over kv_dequant's bf16 workspace
    Build("dequant", dequant_config, kv_dtypes=("fp8_e4m3",), why="the dequantize path (fp8_path 'dequant')"),
    # an fp8 spec's: the dequantize path on the parts grid, which it takes at B >= PARTS_MIN_B
    Build("dequant_parts", dequant_parts_config, kv_dtypes=("fp8_e4m3",),
          why="the dequantize path on the parts grid"),
)


def pick(spec, *, fp8_path, b: int, nq: int, max_keys: int, sms: int, num_splits, runnable: frozenset,
         workspace: int | None) -> str:
    """The build of tree_verify_wgmma a call runs (a build name, plans/kernel_def.Build): the dequantize path's
    ("dequant") where fp8_path is "dequant", else the default (the chunks grid); and that one's parts-grid build
    ("parts", "dequant_parts") where num_splits is not given, B >= PARTS_MIN_B, the block table spans at least
    PARTS_MIN_KEYS keys (or fewer and the makespan model says the parts pay: parts_pay), the build is in `runnable`
    (loaded in the kernel set and running on the call's device) and a caller's workspace (`workspace`: its float32
    elements, None: not given) holds the partials of parts_for's count: one sized for the chunks grid need not,
    and then the chunks grid runs, as the caller sized it for."""
    base = "dequant" if fp8_path == "dequant" else DEFAULT_BUILD
    grid = "dequant_parts" if base == "dequant" else "parts"
    if not (num_splits is None and b >= PARTS_MIN_B and grid in runnable
            and (max_keys >= PARTS_MIN_KEYS or parts_pay(spec, b, nq, max_keys, sms))):
        return base
    parts = parts_for(spec, b, nq, max_keys, sms)
    return grid if workspace is None or workspace >= split_kv.parts_workspace_elems(spec, b, nq, parts) else base


KERNELS = [
    KernelDef(name="tree_verify_wgmma", template="tree_verify_wgmma.cu.j2", entry="ddtree_tree_verify_wgmma",
              plan=verify_plan, context={"tail": False}, archs=ARCHS, policy=variant_config, spell=spell,
              builds=BUILDS, pick=pick, serves=("tree_verify", "wgmma")),
    KernelDef(name="tree_verify_tail_wgmma", template="tree_verify_wgmma.cu.j2",
              entry="ddtree_tree_verify_tail_wgmma", plan=tail_plan, context={"tail": True}, archs=ARCHS,
              policy=functools.partial(variant_config, kernel="tree_verify_tail_wgmma"), spell=spell,
              serves=("tree_verify_tail", "wgmma")),
]


def parts_for(spec, b: int, nq: int, max_keys: int, sms: int, seg_cost: int = KNOBS["seg_cost"]) -> int:
    """The parts grid's part count, from shapes only (the parts' boundaries come from the lengths, on the device): one
    wave of row_tiles x parts blocks where it fills at least ONE_WAVE_FILL of the SMs (H = 8, Nq = 65: 9 row tiles x 14
    parts = 126 blocks; measured faster than two waves at B = 4..8, H = 8); else the count the makespan model
    (split_kv.best_count) predicts fastest over the batch's work at its largest (B requests of max_keys keys, seg_cost +
    tiles units each): several waves where one leaves SMs idle (H = 128, Nq = 35: 70 row tiles, 9 parts). Never more
    parts than units, nor split_kv.MAX_PARTS."""
    row_tiles = -(-nq * spec.num_heads // BM)
    units = max(1, b) * (max(1, -(-int(max_keys) // BN)) + seg_cost)
    most = min(MAX_PARTS, units)
    one_wave = sms // row_tiles
    if one_wave >= 1 and row_tiles * one_wave >= ONE_WAVE_FILL * sms:
        return max(1, min(one_wave, most))
    return split_kv.best_count(row_tiles, sms, units, most, PARTS_WAVE_TILES)


def parts_pay(spec, b: int, nq: int, max_keys: int, sms: int, seg_cost: int = KNOBS["seg_cost"]) -> bool:
    """Whether the parts grid is predicted faster than the chunks grid for these shapes with every request at max_keys
    (the makespan model of each at its own count; the parts' waves at PARTS_WAVE_TILES): the rule below PARTS_MIN_KEYS."""
    row_tiles = -(-nq * spec.num_heads // BM)
    tiles = max(1, -(-int(max_keys) // BN))
    base = b * row_tiles
    s = split_kv.choose_splits(spec, b, nq, max_keys, BN, sms, PRIMARY, "wgmma")
    p = parts_for(spec, b, nq, max_keys, sms, seg_cost)
    chunks = split_kv.makespan(base, s, sms, tiles)
    parts = split_kv.makespan(row_tiles, p, sms, b * (tiles + seg_cost), PARTS_WAVE_TILES)
    return parts < chunks


def split_table(spec, arch: str = PRIMARY) -> dict:
    """The family's tuned split counts by shape class: the tuning table's "wgmma" -> "splits" of the spec
    (scripts/sweep_splits.py --write), for the sm_90a build ({}: none; choose_splits takes the wave model)."""
    return split_kv.tuning().get(spec.name, {}).get("wgmma", {}).get("splits", {}) if arch == PRIMARY else {}


split_kv.register_family("wgmma", split_table)


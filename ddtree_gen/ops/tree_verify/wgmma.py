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
  computes S of alternate key tiles, so one warpgroup's softmax runs under the other's products; two tile
  buffers, key tiles by TMA (seesaw_tma: pages that hold whole tiles, or pages of 16 or 32 keys: a box per page)
  or gathered row by row by cp.async (pages of 1 to 8 keys, or not dividing 64); R = 512 and P = 64 (Q's rope
  slab is held in registers and its shared memory holds the odd tile's P); a bf16 or an fp8 cache.
* "lockstep" (templates/tree_verify_wgmma.cu.j2): both warpgroups split S by keys and P.V by columns,
  softmax in between, 2 key stages (TMA or cp.async); every other variant (the tail kernel, other dims).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import sympy

from ...archs import PRIMARY
from ...errors import SpecError
from ...build.resources import P, R, Plan
from . import split as split_kv
from .params import ATTENTION, KV_MAP, SPANS, signature
from ...build.kernel_def import Build, KernelDef
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


# tree_verify_wgmma ships several builds (build/kernel_def.Build; each a WgmmaBuild record, below), and the route
# (ops/tree_verify/route.py) chooses one per call by what the records say (reads_workspace, parts), never by name. Its
# rule for the parts grid: a batch of B >= PARTS_MIN_B requests (whose lengths the host does not know: the parts are
# cut on the device from them, balanced whatever they are; one request is the chunks grid's, whose blocks skip the
# parts' scan), the launcher's own part count (num_splits not given; parts_for). docs/perf/journal-tree-verify.md "tree_verify on real
# traffic"
PARTS_MIN_B = 2
# ... and, below a block table of PARTS_MIN_KEYS keys a request (no request long enough to set the pace of the chunks
# grid alone), only where the makespan model says the parts pay (parts_pay): the chunks grid's blocks skip the parts'
# scan and segment loop (~4 us a block): at B = 2, H = 8, L = 4096 the chunks grid 37.0 us against the parts' 44.7, at
# B = 8, Nq = 16 38.0 against 41.9; but at B = 8, H = 64, Nq = 21, L = 3229 the chunks grid's 4 waves took 185.6 us
# where FlashMLA's one balanced wave took 133 (docs/perf/journal-tree-verify.md "tree_verify on real traffic")
PARTS_MIN_KEYS = 8192
# the parts count's fixed cost of a wave of blocks in key tiles (the makespan model, split_kv.best_count): a second
# wave of parts measured dearer than a block's prologue alone (B = 4, H = 8, 64k keys: 14 parts 493 us, 29 parts 541)
PARTS_WAVE_TILES = 12
ONE_WAVE_FILL = 0.95


def uses_tma(spec, *, tail: bool = False) -> bool:
    """Whether tree_verify_wgmma's lockstep schedule (`tail`: the tail kernel's) of `spec` can load its key tiles with
    TMA: the full kernel (its tiles start on multiples of BN) of a cache whose pages hold whole tiles (page_size % BN
    == 0), so that a tile is one rectangle of the cache: 9 boxes of 64 keys x 64 columns (bf16: 128-byte rows in the
    wgmma swizzle). Otherwise cp.async (the tail kernel's tiles start at prefix_len; the lockstep fp8 stages are
    converted by its threads). The seesaw's rule is seesaw_tma (fp8 too: 64-byte rows of e4m3 bytes, which its
    converter warpgroup turns into bf16 slabs)."""
    return not tail and spec.page_size % BN == 0


def seesaw_fits(spec, *, tail: bool = False) -> bool:
    """Whether the seesaw schedule can serve the kernel of `spec`: the full kernel (its tiles start on multiples of BN),
    R = 512, P = 64, at every page size (seesaw_tma says how its tiles are loaded)."""
    return not tail and spec.kv_lora_rank == 512 and spec.qk_rope_head_dim == 64


def seesaw_tma(spec) -> bool:
    """Whether the seesaw loads its key tiles by TMA: a page holds whole tiles (one box per slab), or a tile whole pages
    of 16 or 32 keys (a box per page and slab, at its rows' place in the slab: whole 8-row swizzle atoms). Other page
    sizes (1 to 8, or not dividing 64) are gathered: the loading warpgroup copies each key row by cp.async (pages of 8
    by TMA: 8 boxes a slab, and the fp8 build spilled)."""
    page = spec.page_size
    return page % BN == 0 or (BN % page == 0 and page % 16 == 0)


def schedule_for(spec, *, tail: bool = False) -> str:
    """The default schedule: the seesaw wherever it fits, else lockstep."""
    return "seesaw" if seesaw_fits(spec, tail=tail) else "lockstep"


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
# two slabs per step, the default: docs/perf/journal-fp8.md "FP8 on the seesaw, built"); seg_cost (the parts grid): a segment's fixed
# cost in key tiles when the batch's work is cut into parts (SEG_COST of templates/tree_verify_seesaw.cu.j2: each request
# costs seg_cost + its tiles; docs/perf/journal-tree-verify.md "tree_verify on real traffic").
# Retired (measured slower, their code in git history, their figures in docs/perf/journal-fp8.md): fp8_mma and
# vt_stages ("FP8 products, built": 0.61-1.02x of the exact path, ~4 % output error) and convert "inline" ("The
# converter inside the parts kernel, built": 0.77x of bf16 against the pre-pass path's 0.84x)
# kv_source "workspace": the build reads kv_dequant's bf16 workspace (the dequantize path's builds), not the spec's cache.
KV_SOURCES = ("cache", "workspace")
GRIDS = ("chunks", "parts")
RETIRED = {"fp8_mma": 'docs/perf/journal-fp8.md "FP8 products, built"',
           "vt_stages": 'docs/perf/journal-fp8.md "FP8 products, built"',
           "convert": 'docs/perf/journal-fp8.md "The converter inside the parts kernel, built"'}
# the fp8 seesaw's convert_sync modes -> (CONV_BARS, GROUP_FENCE, CONV_PAIRS) of templates/tree_verify_seesaw.cu.j2
CONVERT_SYNCS = {"slab": (0, 0, 0), "lean": (1, 0, 0), "group": (1, 1, 0), "pairs": (1, 0, 1)}
P_STORES = ("sts", "stmatrix")
# page_loads (a seesaw build whose tiles are loaded page by page: the gather, or TMA at pages of 16 or 32): "serial"
# (the measured default: a thread pair a key row in the gather, one thread issuing every page's boxes) or "spread"
# (a row's 16-byte chunks by side-by-side lanes, a warp per page's boxes; built 2026-12-08, not yet run on a GPU:
# docs/perf/journal-tree-verify.md "The loads separated, and two fixes of the producer's instructions") or "producer" (a bf16
# tile seesaw build's third warpgroup loads the tiles, a warp per buffer and slab group, while the two computing
# warpgroups only free the slabs: the loads off the computing warps, and on the parts grid the next segment's first tiles
# loaded under this one's epilogue; every page size, TMA too; built 2026-12-08, not yet run: "A producer warpgroup")
PAGE_LOADS = ("serial", "spread", "producer")
PRODUCER_FREE_BYTES = 6 * 8     # its mbarriers: a buffer's two slab groups free (FREE), Q landed and read (parts)


@dataclass(frozen=True)
class WgmmaBuild:
    """One build of tree_verify_wgmma (or its tail) as a typed record: the schedule, TMA key tiles, and the knobs above
    at their default build's values. Checked when made (the checks that need no spec; verify_plan adds the spec's);
    the variant layer holds it as its config (`config()`, `from_config`), its name spells its non-default fields
    (`spell`), and the plan, the route and the launch plan read its properties (seesaw, parts, reads_workspace)."""
    schedule: str
    tma: bool
    ablate: int = 0
    l2_hint: str | None = None
    grid: str = "chunks"
    s_order: str = "loaded"
    sync_handoffs: bool = False
    rescale: str = "lazy"
    p_store: str = "sts"
    convert_sync: str = "pairs"
    seg_cost: int = 6
    rope_early: bool = False
    kv_source: str = "cache"
    page_loads: str = "serial"

    def __post_init__(self):
        for knob, domain in (("schedule", SCHEDULES), ("grid", GRIDS), ("rescale", RESCALES), ("p_store", P_STORES),
                             ("convert_sync", CONVERT_SYNCS), ("kv_source", KV_SOURCES),
                             ("page_loads", PAGE_LOADS)):
            if getattr(self, knob) not in domain:
                raise SpecError(f"{knob} {getattr(self, knob)!r}: one of {', '.join(domain)}")
        if not isinstance(self.seg_cost, int) or isinstance(self.seg_cost, bool) or not 0 <= self.seg_cost <= 64:
            raise SpecError(f"seg_cost {self.seg_cost!r}: a whole number of key tiles, 0..64")
        if int(self.ablate) & 28 and self.convert_sync == "pairs":
            raise SpecError("ablate bits 2-4 (the converter's) are the per-slab converter's: with convert_sync 'slab', "
                            "'lean' or 'group'")

    @classmethod
    def from_config(cls, config: dict) -> "WgmmaBuild":
        """The record of a variant's config (build/variant.py); a retired or unknown knob is a SpecError."""
        retired = sorted(k for k in RETIRED if k in config)
        if retired:
            raise SpecError(f"{retired[0]}: a retired build knob, measured slower ({RETIRED[retired[0]]}; its code is "
                            f"in git history)")
        unknown = sorted(set(config) - set(cls.__dataclass_fields__))
        if unknown:
            raise SpecError(f"{unknown[0]}: no such knob of tree_verify_wgmma (its knobs: "
                            f"{', '.join(cls.__dataclass_fields__)})")
        return cls(**config)

    def config(self) -> dict:
        """The variant layer's config: every field by name (the manifest's "config")."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def seesaw(self) -> bool:
        return self.schedule == "seesaw"

    @property
    def parts(self) -> bool:
        """A grid of balanced parts (the seesaw's grids besides "chunks"): the batch's key tiles cut into parts on the
        device (parts_for counts them), partials in the parts' workspace layout (split_kv.parts_workspace_elems)."""
        return self.seesaw and self.grid != "chunks"

    @property
    def params(self) -> tuple:
        """Its kernel's parameter list (ops/tree_verify/params.py): the attention kernels', then the parts grid's request
        spans, then a TMA build's tensor map."""
        return (*ATTENTION, *((SPANS,) if self.parts else ()), *((KV_MAP,) if self.tma else ()))

    def launch_grid(self, b: int, count: int, row_tiles: int, sms: int) -> tuple:
        """(blocks, the grid's own launch values by parameter name) of a launch of `count` pieces: the parts grid a
        block per (row tile, part), the chunks grid a block per (request, chunk, row tile)."""
        return (count * row_tiles if self.parts else b * count * row_tiles), {}

    @property
    def reads_workspace(self) -> bool:
        """The dequantize path's build: it reads kv_dequant's bf16 workspace, not the spec's cache."""
        return self.kv_source == "workspace"

    def reads_fp8(self, spec) -> bool:
        """Whether it reads e4m3 tiles: an fp8 spec's cache, unless it reads the bf16 workspace."""
        return spec.kv_fp8 and not self.reads_workspace

    def spell(self) -> tuple:
        """Its part of a variant's name (build/variant.py): tree_verify_wgmma.seesaw.tma,
        tree_verify_wgmma.lockstep.cpasync.ablate3 (each field not at its default after the schedule and TMA)."""
        default = WgmmaBuild(self.schedule, self.tma)
        parts = [self.schedule, "tma" if self.tma else "cpasync"]
        for f in fields(self)[2:]:
            value = getattr(self, f.name)
            if value == getattr(default, f.name):
                continue
            if f.name == "ablate":
                parts.append(f"ablate{int(value)}")
            elif f.name == "l2_hint":
                parts.append(f"l2-{value.replace('_', '-')}")
            elif isinstance(value, bool):
                parts.append(f.name.replace("_", "-"))
            elif f.name == "kv_source":
                parts.append(value)
            else:
                parts.append(f"{f.name.replace('_', '-')}-{value}")
        return tuple(parts)


# the knobs' values in the default build (the record's defaults): for scripts that list or vary them
KNOBS = {f.name: f.default for f in fields(WgmmaBuild)[2:]}


# The page_loads a seesaw build takes by default, by how its tiles are loaded: "gather" (cp.async rows: pages of 1 to 8
# or not dividing 64), "tma_pages" (a TMA box per page: 16, 32), "tma_tiles" (a box per tile: 64 and its multiples).
# "serial" everywhere: the only loads measured on a GPU so far; the spread and producer builds wait for the next device
# call (scripts/device_queue.sh; docs/perf/journal-tree-verify.md "A producer warpgroup"), whose winners go here. A
# fused fp8 build takes "serial" where this says "producer" (its third warpgroup converts).
DEFAULT_PAGE_LOADS = {"gather": "serial", "tma_pages": "serial", "tma_tiles": "serial"}


def loads_kind(spec, tma: bool) -> str:
    """How a seesaw build of `spec` loads its tiles: a key of DEFAULT_PAGE_LOADS."""
    return "gather" if not tma else "tma_pages" if spec.page_size % BN else "tma_tiles"


def default_page_loads(spec, tma: bool, *, fp8: bool) -> str:
    """The page_loads of a seesaw build (DEFAULT_PAGE_LOADS); `fp8`: it reads e4m3 tiles (no producer warpgroup).
    A value the build cannot take falls back to "serial": the producer on e4m3 tiles, spread on whole-tile boxes."""
    kind = loads_kind(spec, tma)
    loads = DEFAULT_PAGE_LOADS[kind]
    if (loads == "producer" and fp8) or (loads == "spread" and kind == "tma_tiles"):
        return "serial"
    return loads


def default_build(spec, *, tail: bool = False) -> WgmmaBuild:
    """The policy: the schedule of schedule_for, TMA key tiles wherever they can be used, the seesaw's page_loads of
    DEFAULT_PAGE_LOADS, every other knob at its default."""
    sched = schedule_for(spec, tail=tail)
    if sched != "seesaw":
        return WgmmaBuild(sched, uses_tma(spec, tail=tail) and not spec.kv_fp8)
    tma = seesaw_tma(spec)
    return WgmmaBuild(sched, tma, page_loads=default_page_loads(spec, tma, fp8=spec.kv_fp8))


def variant_config(spec, arch: str = "sm_90a") -> dict:
    """The policy as a variant's config (build/variant.default_config): default_build's."""
    return default_build(spec).config()


def parts_config(spec, arch: str = "sm_90a") -> dict:
    """The parts build: the default seesaw build on the parts grid."""
    return replace(default_build(spec), grid="parts").config()


def dequant_config(spec, arch: str = "sm_90a") -> dict:
    """The dequantize path's build: the seesaw (its tiles loaded as seesaw_tma says) in the fused fp8 build's slab
    order (rope_early, s_order "slab"), every other knob at the fused build's value, so that its bits are the fused
    fp8 build's (the conversion is exact, and kv_scale enters both the same way), over kv_dequant's bf16 workspace."""
    tma = seesaw_tma(spec)
    return WgmmaBuild("seesaw", tma, rope_early=True, s_order="slab", kv_source="workspace",
                      page_loads=default_page_loads(spec, tma, fp8=False)).config()


def dequant_parts_config(spec, arch: str = "sm_90a") -> dict:
    """The dequantize path's build on the parts grid (the slab order measured the same there)."""
    return {**dequant_config(spec, arch), "grid": "parts"}


def spell(config) -> tuple:
    """A configuration's part of a variant's name (KernelDef.spell): its record's (WgmmaBuild.spell)."""
    return WgmmaBuild.from_config(config).spell()


def verify_plan(spec, kernel="tree_verify_wgmma", config=None, *, tail: bool = False) -> Plan:
    """The plan of a build of `kernel` (tree_verify_wgmma, or its tail: `tail`) with `config` (a variant's config, its
    WgmmaBuild record's; None: the kernel's default build): the record's own checks, then the spec's."""
    check_spec(spec, kernel)   # R a multiple of 128 and at most 512: each warpgroup owns R / 2 columns
    where = f"spec {spec.name!r}, kernel {kernel}"
    try:
        build = default_build(spec, tail=tail) if config is None else WgmmaBuild.from_config(config)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    if build.reads_workspace and (not spec.kv_fp8 or tail):
        raise SpecError(f"{where}: the dequantize path (kv_source 'workspace') is an fp8 spec's full kernel (kv_dtype "
                        f"'fp8_e4m3'); a bf16 cache is read by tree_verify_wgmma itself")
    if build.grid != "chunks" and not seesaw_fits(spec, tail=tail):
        raise SpecError(f"{where}: the parts grid is built for the seesaw (R = 512, P = 64, the full kernel)")
    fp8 = build.reads_fp8(spec)
    if build.seesaw and not seesaw_fits(spec, tail=tail):
        raise SpecError(f"{where}: schedule {build.schedule!r} is not one it can take (seesaw needs R = 512, P = 64, "
                        f"the full kernel)")
    if not fp8 and (build.convert_sync != KNOBS["convert_sync"] or int(build.ablate) & 28):
        raise SpecError(f"{where} reads a bf16 cache: convert_sync and ablate bits 2-4 are the fp8 seesaw's "
                        f"converter's")
    if build.tma and not (seesaw_tma(spec) if build.seesaw else uses_tma(spec, tail=tail) and not fp8):
        raise SpecError(f"{where}: TMA key tiles need the full kernel and page_size % {BN} == 0 (the seesaw: or a page "
                        f"size of 16 or 32) and (lockstep schedule) a bf16 cache")
    if build.seesaw and fp8 and build.grid != "chunks":
        raise SpecError(f"spec {spec.name!r}: the fp8 seesaw runs the grid 'chunks' only (grid {build.grid!r})")
    if build.page_loads == "spread" and not (build.seesaw and (not build.tma or spec.page_size % BN)):
        raise SpecError(f"{where}: page_loads {build.page_loads!r} is a seesaw build's that loads its tiles page by "
                        f"page (the gather, or TMA at a page size of 16 or 32; this one: page_size {spec.page_size}, "
                        f"schedule {build.schedule!r}, tma {build.tma})")
    producer = build.page_loads == "producer"
    if producer and not build.seesaw:
        raise SpecError(f"{where}: page_loads 'producer' is the seesaw's (schedule {build.schedule!r})")
    if producer and fp8:
        raise SpecError(f"{where}: page_loads 'producer' is a bf16 tile build's (an fp8 cache's seesaw has its converter "
                        f"warpgroup; its dequantize path, kv_source 'workspace', reads bf16 tiles)")
    # fp8: the converter warpgroup; page_loads "producer": the producer warpgroup
    threads = THREADS + 128 if build.seesaw and (fp8 or producer) else THREADS
    if build.seesaw:
        smem = (SEESAW_SMEM_FP8 if fp8 else SEESAW_SMEM + (SEG_BYTES if build.parts else 0)
                + (PRODUCER_FREE_BYTES if producer else 0))
    else:
        smem = SMEM_FP8 if fp8 else SMEM + (8 * STAGES if build.tma else 0)   # TMA: one mbarrier per stage
    return Plan(kernel=kernel, spec=spec, threads=sympy.Integer(threads), min_blocks=1,
                static_smem=sympy.Integer(0), dynamic_smem=smem,
                consts={"BM": sympy.Integer(BM), "BN": sympy.Integer(BN), "STAGES": sympy.Integer(STAGES),
                        "SLABS": SLABS, "USE_TMA": sympy.Integer(1 if build.tma else 0),
                        "SEESAW": sympy.Integer(1 if build.seesaw else 0),
                        "ABLATE": sympy.Integer(int(build.ablate)),
                        "L2_EVICT_FIRST": sympy.Integer(1 if build.l2_hint == "evict_first" else 0),
                        "PARTS": sympy.Integer(1 if build.parts else 0),
                        "SEG_COST": sympy.Integer(build.seg_cost if build.parts else 0),   # the parts grid only
                        "S_LOADED_ORDER": sympy.Integer(0 if build.s_order == "slab" else 1),
                        "SYNC_HANDOFFS": sympy.Integer(1 if build.sync_handoffs else 0),
                        **({k: sympy.Integer(v) for k, v in      # the seesaw's own knobs (its template only)
                            zip(("RESCALE_SKIP", "MAX_SLACK", "EXP_FMA", "P_STMATRIX", "ROPE_EARLY", "CONV_BARS",
                                 "GROUP_FENCE", "CONV_PAIRS", "SPREAD_LOADS", "PRODUCER_LOADS"),
                                (*RESCALES[build.rescale], int(build.p_store == "stmatrix"),
                                 int(bool(fp8 or build.rope_early)), *CONVERT_SYNCS[build.convert_sync],
                                 int(build.page_loads == "spread"), int(producer)))}
                           if build.seesaw else {}),
                        **{k: sympy.Integer(v) for k, v in V_DESC.items()},
                        # the dequantize path's builds read bf16 tiles whatever the spec's cache holds
                        **({"KV_FP8": sympy.Integer(0)} if build.reads_workspace else {})},
                build=build)


def tail_plan(spec, config=None) -> Plan:
    return verify_plan(spec, "tree_verify_tail_wgmma", config, tail=True)


ARCHS = ("sm_90a",)        # wgmma.mma_async exists on sm_90a only: no sm_80 (PTX) build

# the further builds of tree_verify_wgmma (its default: the chunks grid of default_build); the route
# (ops/tree_verify/route.py) takes one by its record's properties (reads_workspace, parts)
BUILDS = (
    # a bf16 spec's: the seesaw on the parts grid, which tree_verify takes at B >= PARTS_MIN_B
    Build("parts", parts_config, kv_dtypes=("bf16",), why="the balanced parts grid (B >= PARTS_MIN_B)"),
    # an fp8 spec's only: the bf16-cache seesaw (KV_FP8 off) over kv_dequant's bf16 workspace
    Build("dequant", dequant_config, kv_dtypes=("fp8_e4m3",), why="the dequantize path (fp8_path 'dequant')"),
    # an fp8 spec's: the dequantize path on the parts grid, which it takes at B >= PARTS_MIN_B
    Build("dequant_parts", dequant_parts_config, kv_dtypes=("fp8_e4m3",),
          why="the dequantize path on the parts grid"),
)


def split_rule(spec, arch: str = PRIMARY) -> tuple:
    """The family's split rule as values for split_kv.choose_splits: no table (the tuning table's "wgmma" -> "splits",
    scripts/sweep_splits.py --write, was fitted at L = 4096 only) and the makespan model at every length."""
    return (), split_kv.makespan_model


def tail_config(spec, arch: str = "sm_90a") -> dict:
    """The tail kernel's policy: default_build of the tail."""
    return default_build(spec, tail=True).config()


KERNELS = [
    KernelDef(name="tree_verify_wgmma", template="tree_verify_wgmma.cu.j2", entry="ddtree_tree_verify_wgmma",
              plan=verify_plan, context={"tail": False}, archs=ARCHS, policy=variant_config, spell=spell,
              record=WgmmaBuild.from_config, split_rule=split_rule, signature=signature, builds=BUILDS,
              serves=("tree_verify", "wgmma")),
    KernelDef(name="tree_verify_tail_wgmma", template="tree_verify_wgmma.cu.j2",
              entry="ddtree_tree_verify_tail_wgmma", plan=tail_plan, context={"tail": True}, archs=ARCHS,
              policy=tail_config, spell=spell, record=WgmmaBuild.from_config, split_rule=split_rule,
              signature=signature, serves=("tree_verify_tail", "wgmma")),
]
# the kernel set's keys of the further builds (derived from the declaration: "tree_verify_wgmma/<build>"), for tests,
# benches and scripts that name one; the package itself reads the records
PARTS_KERNEL, DEQUANT, DEQUANT_PARTS = (d.name for d in KERNELS[0].build_defs()[1:4])   # (BUILDS' first three)


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
    s = split_kv.choose_splits(spec, b, nq, max_keys, BN, sms, *split_rule(spec))
    p = parts_for(spec, b, nq, max_keys, sms, seg_cost)
    chunks = split_kv.makespan(base, s, sms, tiles)
    parts = split_kv.makespan(row_tiles, p, sms, b * (tiles + seg_cost), PARTS_WAVE_TILES)
    return parts < chunks

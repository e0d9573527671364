"""Resource plans and tuned configuration of the mma.sync tree_verify kernels (tree_verify_mma, _tail_mma).

What both tensor-core families share (BM, the shape rule, the split-KV policy, the wave model, the
workspace, the tuning table, the combine kernel) is in ops/tree_verify/split.py; this module is the mma.sync
family's peer of ops/tree_verify/wgmma.py.

* Compile-time configuration per spec: BN (keys per tile) and STAGES (cp.async pipeline depth); BM = 64
  query rows and 8 warps are structural. The policy (config_for) takes the configuration from the tuning
  table (split_kv.TUNING_FILE, written by scripts/tune_tree_verify.py on a GPU) and falls back to
  DEFAULT_CONFIG, so a fresh build without a GPU reproduces the tuned choice.
* Per build target (archs.py): the sm_90a build takes that configuration; the sm_80 (PTX) build
  takes it too if its shared memory fits an A100 (SM80_SMEM_PER_BLOCK, 163 KB), else the first
  candidate that does (BN = 32, STAGES = 2 for R + P = 576: 150 KB), so that one PTX serves A100
  as well as Blackwell; GPUs with 99 KB per block (L4, L40S, RTX cards) fit neither, and the
  kernel set falls back to the CUDA-core kernel there (ops/tree_verify/launch.py).
* Its split table: the tuning table's "splits" of the spec, for the sm_90a build of the tuned
  configuration only (split_table).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy

from ...archs import PRIMARY
from ...errors import SpecError
from ...build.resources import SM80_SMEM_PER_BLOCK, SM90_SMEM_PER_BLOCK, H, P, R, Plan, evaluate
from . import split as split_kv
from .params import ATTENTION, signature
from ...build.kernel_def import KernelDef
from .split import BM, O_REGS, WARPS, check_spec

THREADS = 32 * WARPS
DEFAULT_CONFIG = {"BN": 64, "STAGES": 2}
# every configuration the tuner tries, best first by the model (docs/perf.md)
CANDIDATES = ({"BN": 64, "STAGES": 2}, {"BN": 32, "STAGES": 3}, {"BN": 32, "STAGES": 4}, {"BN": 32, "STAGES": 2})

# ------------------------------------------------------------------------ resource model

BN_, STAGES_ = sympy.symbols("BN STAGES", positive=True, integer=True)
SROW = 64 * sympy.ceiling((R + P) / 64)          # smem row length (bf16): the swizzle unit is 64
PROW = BN_ + 8                                   # P tile row length (bf16), padded
SMEM = (BM * SROW * 2                            # Q tile
        + STAGES_ * BN_ * SROW * 2               # key tiles
        + BM * PROW * 2                          # P tile
        + 2 * BM * 4 + BM * 4                    # row maxima of both key halves, row factors
        + STAGES_ * BN_ * 4)                     # per-key "staged" flags

# Work and traffic of one call (B requests, L prefix keys, Nq tree rows), for docs/perf.md and the tuner.
B_, L_, NQ_ = sympy.symbols("B L Nq", positive=True, integer=True)
FLOPS = 2 * B_ * H * NQ_ * (L_ + NQ_) * (2 * R + P)                 # the contract's count (all keys, every row)
HBM_BYTES = (B_ * (L_ + NQ_) * (R + P) * 2                          # kv rows, read once from HBM
             + B_ * NQ_ * H * (R + P) * 2                           # q
             + B_ * NQ_ * H * (R * 2 + 4))                          # out + lse
L2_BYTES = B_ * sympy.ceiling(NQ_ * H / BM) * (L_ + NQ_) * (R + P) * 2   # kv tile loads of all blocks



def _normalise(config) -> dict:
    cfg = {"BN": int(config["BN"]), "STAGES": int(config["STAGES"])}
    if cfg["BN"] not in (32, 64) or not 2 <= cfg["STAGES"] <= 8:
        raise SpecError(f"tree_verify_mma: configuration {config} is not one the template supports "
                        f"(BN in {{32, 64}}, STAGES in [2, 8])")
    return cfg


def smem_bytes(spec, config) -> int:
    cfg = _normalise(config)
    return evaluate(SMEM.subs({BN_: cfg["BN"], STAGES_: cfg["STAGES"]}), spec)


def fits(spec, config) -> bool:
    return smem_bytes(spec, config) <= SM90_SMEM_PER_BLOCK


def candidates(spec) -> list[dict]:
    """The configurations the tuner tries for a spec: those whose shared memory fits."""
    return [dict(c) for c in CANDIDATES if fits(spec, c)]


# shared memory per block a target's configuration must fit (the sm_80 PTX: an A100's)
ARCH_SMEM = {"sm_90a": SM90_SMEM_PER_BLOCK, "sm_80": SM80_SMEM_PER_BLOCK}


@functools.lru_cache(maxsize=None)  # no sympy on the launch path
def config_for(spec, arch: str = PRIMARY) -> dict:
    """The compiled configuration of a spec for a target: on sm_90a the tuned one if it fits, else the
    first candidate that fits; on sm_80 that one if it fits ARCH_SMEM["sm_80"], else the first candidate
    that does (else the sm_90a one: then it runs only where a device allows its shared memory)."""
    if arch != PRIMARY:
        base = config_for(spec, PRIMARY)
        limit = ARCH_SMEM.get(arch, SM90_SMEM_PER_BLOCK)
        for c in (base, *CANDIDATES):
            if smem_bytes(spec, c) <= limit:
                return dict(c)
        return base
    tuned = split_kv.tuning().get(spec.name, {}).get("config")
    if tuned:
        try:
            cfg = _normalise(tuned)
            if fits(spec, cfg):
                return cfg
        except (KeyError, TypeError, ValueError, SpecError):
            pass
    for c in (DEFAULT_CONFIG, *CANDIDATES):
        if fits(spec, c):
            return dict(c)
    return dict(DEFAULT_CONFIG)   # Plan.check_fits refuses it with the formula


def verify_plan(spec, kernel="tree_verify_mma", config=None, arch=PRIMARY) -> Plan:
    check_spec(spec, kernel)
    cfg = _normalise(config) if config is not None else config_for(spec, arch)
    sub = {BN_: cfg["BN"], STAGES_: cfg["STAGES"]}
    return Plan(kernel=kernel, spec=spec, threads=sympy.Integer(THREADS), min_blocks=1,
                static_smem=sympy.Integer(0), dynamic_smem=SMEM.subs(sub),
                consts={"WARPS": sympy.Integer(WARPS), "BM": sympy.Integer(BM), "BN": sympy.Integer(cfg["BN"]),
                        "STAGES": sympy.Integer(cfg["STAGES"]), "SROW": SROW, "PROW": PROW.subs(sub),
                        "O_REGS": O_REGS},
                build=MmaBuild(cfg["BN"], cfg["STAGES"]))


def tail_plan(spec, config=None, arch=PRIMARY) -> Plan:
    return verify_plan(spec, "tree_verify_tail_mma", config, arch)


def predict(spec, b, L, nq=None, *, tflops=760.0, tbps=4.2) -> dict:
    """FLOPs, HBM bytes and the compute / memory floor times (ms) of one call."""
    nq = spec.max_tree_size if nq is None else nq
    vals = {B_: b, L_: L, NQ_: nq}
    flops = evaluate(FLOPS.subs(vals), spec)
    hbm = evaluate(HBM_BYTES.subs(vals), spec)
    return {"flops": flops, "hbm_bytes": hbm, "l2_bytes": evaluate(L2_BYTES.subs(vals), spec),
            "compute_ms": flops / (tflops * 1e12) * 1e3, "memory_ms": hbm / (tbps * 1e12) * 1e3}


def split_table(spec, arch: str = PRIMARY) -> dict:
    """The family's tuned split counts by shape class: the tuning table's "splits" of the spec, for the
    sm_90a build of the tuned configuration only ({}: none; choose_splits then takes the wave model)."""
    tuned = split_kv.tuning().get(spec.name, {})
    if arch == PRIMARY and tuned.get("config") and _normalise(tuned["config"]) == config_for(spec):
        return tuned.get("splits", {})
    return {}


def split_rule(spec, arch: str = PRIMARY) -> tuple:
    """The family's split rule as values for split_kv.choose_splits: its tuned table's (shape class, count) pairs and
    the wave model."""
    return tuple(sorted(split_table(spec, arch).items())), split_kv.wave_model


# the mma.sync kernels read bf16 caches only: an fp8 spec (kv_dtype "fp8_e4m3") does not get them, its
# tree_verify is the wgmma kernel (Hopper) or the CUDA-core one; the combine kernel (fp32 partials) is built
# for every spec
MMA_KV_DTYPES = ("bf16",)


@dataclass(frozen=True)
class MmaBuild:
    """A build of the mma.sync kernels as a typed record (KernelDef.record): its BN and STAGES; the grid is always the
    chunks grid, the cache the spec's, the key tiles by cp.async (what the route and the launch plan read)."""
    BN: int
    STAGES: int
    parts = False             # the chunks grid: a request's keys cut into chunks
    reads_workspace = False   # the spec's cache
    tma = False
    schedule = None

    grid = "chunks"
    params = ATTENTION        # its kernels' parameter list (ops/tree_verify/params.py)

    def launch_grid(self, b: int, count: int, row_tiles: int, sms: int) -> tuple:
        """(blocks, no values of its own): a block per (request, chunk, row tile)."""
        return b * count * row_tiles, {}

    @classmethod
    def from_config(cls, config: dict) -> "MmaBuild":
        return cls(**_normalise(config))


def spell(config) -> tuple:
    """A configuration's part of a variant's name (build/variant.py): tree_verify_mma.bn64.s2."""
    return (f"bn{config['BN']}", f"s{config['STAGES']}")


KERNELS = [   # mma.sync, ldmatrix, cp.async: sm_80 instructions, so both targets (the configuration per target: config_for)
    KernelDef(name="tree_verify_mma", template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_mma",
              plan=verify_plan, context={"tail": False}, kv_dtypes=MMA_KV_DTYPES,
              policy=config_for, spell=spell, record=MmaBuild.from_config, split_rule=split_rule, signature=signature,
              serves=("tree_verify", "mma")),
    KernelDef(name="tree_verify_tail_mma", template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_tail_mma",
              plan=tail_plan, context={"tail": True}, kv_dtypes=MMA_KV_DTYPES,
              policy=config_for, spell=spell, record=MmaBuild.from_config, split_rule=split_rule, signature=signature,
              serves=("tree_verify_tail", "mma")),
]


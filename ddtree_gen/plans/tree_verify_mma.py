"""Resource plans, tuning table and split-KV policy of the tensor-core tree_verify kernels.

Both tensor-core families (tree_verify_mma: mma.sync; tree_verify_wgmma: Hopper warpgroup MMA)
take BM = 64 query rows per block and share the split-KV policy, the workspace format and the
combine kernel defined here (tree_verify_mma_combine).

* Compile-time configuration of the mma.sync kernels per spec: BN (keys per tile) and STAGES
  (cp.async pipeline depth); BM = 64 query rows and 8 warps are structural. The plan takes the
  configuration from tree_verify_mma_tuning.json (written by scripts/tune_tree_verify.py on a GPU)
  and falls back to DEFAULT_CONFIG, so a fresh build without a GPU reproduces the tuned choice.
* Per build target (archs.py): the sm_90a build takes that configuration; the sm_80 (PTX) build
  takes it too if its shared memory fits an A100 (SM80_SMEM_PER_BLOCK, 163 KB), else the first
  candidate that does (BN = 32, STAGES = 2 for R + P = 576: 150 KB), so that one PTX serves A100
  as well as Blackwell; GPUs with 99 KB per block (L4, L40S, RTX cards) fit neither, and the
  kernel set falls back to the CUDA-core kernel there (kernels/tree_verify.py).
* Split-KV: the number of key chunks comes from shapes only (B, Nq, H, max_pages, the SM count),
  never from device values: CUDA-graph friendly. The chunk boundaries are computed in the kernel
  from the request's prefix_len.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import sympy

from ..archs import PRIMARY
from ..errors import SpecError
from ..resources import SM80_SMEM_PER_BLOCK, SM90_MAX_REGS_PER_THREAD, SM90_SMEM_PER_BLOCK, H, P, R, Plan, evaluate
from .kernel_def import KernelDef
from .declaration import Declaration

TUNING_FILE = Path(__file__).with_name("tree_verify_mma_tuning.json")
COMBINE = "tree_verify_mma_combine"   # the split-KV combine of both tensor-core families

BM = 64                 # query rows per block (4 row groups of 16)
WARPS = 8
THREADS = 32 * WARPS
DEFAULT_CONFIG = {"BN": 64, "STAGES": 2}
# every configuration the tuner tries, best first by the model (docs/perf.md)
CANDIDATES = ({"BN": 64, "STAGES": 2}, {"BN": 32, "STAGES": 3}, {"BN": 32, "STAGES": 4}, {"BN": 32, "STAGES": 2})
MAX_SPLITS = 32
COMBINE_ROWS_PER_BLOCK = 8
DEFAULT_SMS = 132       # H100 / H200 SXM, used when the device cannot be asked

# ------------------------------------------------------------------------ resource model

BN_, STAGES_ = sympy.symbols("BN STAGES", positive=True, integer=True)
SROW = 64 * sympy.ceiling((R + P) / 64)          # smem row length (bf16): the swizzle unit is 64
PROW = BN_ + 8                                   # P tile row length (bf16), padded
SMEM = (BM * SROW * 2                            # Q tile
        + STAGES_ * BN_ * SROW * 2               # key tiles
        + BM * PROW * 2                          # P tile
        + 2 * BM * 4 + BM * 4                    # row maxima of both key halves, row factors
        + STAGES_ * BN_ * 4)                     # per-key "staged" flags
O_REGS = BM * R / THREADS                        # fp32 output accumulators per thread (R / 4)

# Work and traffic of one call (B requests, L prefix keys, Nq tree rows), for docs/perf.md and the tuner.
B_, L_, NQ_ = sympy.symbols("B L Nq", positive=True, integer=True)
FLOPS = 2 * B_ * H * NQ_ * (L_ + NQ_) * (2 * R + P)                 # the contract's count (all keys, every row)
HBM_BYTES = (B_ * (L_ + NQ_) * (R + P) * 2                          # kv rows, read once from HBM
             + B_ * NQ_ * H * (R + P) * 2                           # q
             + B_ * NQ_ * H * (R * 2 + 4))                          # out + lse
L2_BYTES = B_ * sympy.ceiling(NQ_ * H / BM) * (L_ + NQ_) * (R + P) * 2   # kv tile loads of all blocks



@functools.lru_cache(maxsize=None)   # read once per process: the launch path never touches the file
def _tuning() -> dict:
    """spec name -> tuned entry, from TUNING_FILE."""
    try:
        data = json.loads(TUNING_FILE.read_text())
    except (OSError, ValueError):
        return {}
    specs = data.get("specs", {}) if isinstance(data, dict) else {}
    return specs if isinstance(specs, dict) else {}


def _normalise(config) -> dict:
    cfg = {"BN": int(config["BN"]), "STAGES": int(config["STAGES"])}
    if cfg["BN"] not in (32, 64) or not 2 <= cfg["STAGES"] <= 8:
        raise SpecError(f"tree_verify_mma: configuration {config} is not one the template supports "
                        f"(BN in {{32, 64}}, STAGES in [2, 8])")
    return cfg


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
    tuned = _tuning().get(spec.name, {}).get("config")
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
                        "O_REGS": O_REGS})


def tail_plan(spec, config=None, arch=PRIMARY) -> Plan:
    return verify_plan(spec, "tree_verify_tail_mma", config, arch)


def combine_plan(spec) -> Plan:
    return Plan(kernel="tree_verify_mma_combine", spec=spec, threads=sympy.Integer(32 * COMBINE_ROWS_PER_BLOCK),
                min_blocks=4, static_smem=sympy.Integer(0),
                consts={"ROWS_PER_BLOCK": sympy.Integer(COMBINE_ROWS_PER_BLOCK), "F4_PER_LANE": sympy.ceiling(R / 128)})


def predict(spec, b, L, nq=None, *, tflops=760.0, tbps=4.2) -> dict:
    """FLOPs, HBM bytes and the compute / memory floor times (ms) of one call."""
    nq = spec.max_tree_size if nq is None else nq
    vals = {B_: b, L_: L, NQ_: nq}
    flops = evaluate(FLOPS.subs(vals), spec)
    hbm = evaluate(HBM_BYTES.subs(vals), spec)
    return {"flops": flops, "hbm_bytes": hbm, "l2_bytes": evaluate(L2_BYTES.subs(vals), spec),
            "compute_ms": flops / (tflops * 1e12) * 1e3, "memory_ms": hbm / (tbps * 1e12) * 1e3}


# ------------------------------------------------------------------------- split-KV

def shape_class(base_blocks: int) -> str:
    """Tuning-table key of a launch: base blocks (B x row tiles) rounded up to a power of two."""
    return str(1 << max(0, (int(base_blocks) - 1).bit_length()))


@functools.lru_cache(maxsize=4096)   # on every launch: shapes only, so cached
def choose_splits(spec, b: int, nq: int, max_keys: int, bn: int, sms: int = DEFAULT_SMS, arch: str = PRIMARY,
                  family: str = "mma") -> int:
    """Key chunks per (request, row tile), from shapes only.

    Each family has its own tuned table (by shape class; measured on an H200): the mma.sync one
    ("splits", scripts/tune_tree_verify.py) for the sm_90a build of the tuned configuration, the wgmma
    one ("wgmma" -> "splits", scripts/sweep_splits.py --write). Without an entry: the wave model
    (wave_splits). Never more chunks than the largest
    possible key range fills with two tiles each (max_keys: Nq for the tail, max_pages * page_size
    otherwise)."""
    base = b * -(-nq * spec.num_heads // BM)
    if base <= 0:
        return 1
    tuned = _tuning().get(spec.name, {})
    if family == "wgmma":
        table = tuned.get("wgmma", {}).get("splits", {}) if arch == PRIMARY else {}
    else:
        table = (tuned.get("splits", {}) if arch == PRIMARY and tuned.get("config")
                 and _normalise(tuned["config"]) == config_for(spec) else {})
    useful = max(1, -(-int(max_keys) // (2 * bn)))
    s = table.get(shape_class(base)) if isinstance(table, dict) else None
    if not isinstance(s, int) or s < 1:
        s = wave_splits(base, sms, min(MAX_SPLITS, useful))
    return max(1, min(int(s), MAX_SPLITS, useful))


# The wave model of an untuned shape (a spec of the user's, a bench variant): blocks run one per SM, so a
# launch of base x s equal chunks takes ceil(base s / SMs) waves of 1/s of the keys each; the combine reads
# s partials per row, COMBINE_COST of a wave's time per wave of partial blocks (fitted to the H200 sweep of
# scripts/sweep_splits.py, docs/bench/sweep_splits_wgmma.txt: its choice runs within 8 % of the measured best on
# every shape there, within 2 % on most).
COMBINE_COST = 0.04
WAVE_SPLIT_BASE = 4    # at base >= 4 waves of blocks, splitting gains less than the combine costs: 1


def wave_splits(base: int, sms: int, most: int) -> int:
    """The split count the wave model predicts fastest for `base` blocks on `sms` SMs (at most `most`)."""
    if base >= WAVE_SPLIT_BASE * sms:
        return 1
    def cost(s):
        return -(-base * s // sms) / s + (COMBINE_COST * base * s / sms if s > 1 else 0.0)
    return min(range(1, max(1, most) + 1), key=lambda s: (cost(s), s))


def workspace_elems(spec, b: int, nq: int, splits: int) -> int:
    """float32 elements of split-KV scratch for `splits` chunks (or parts): partial outputs [splits, rows, R], their
    lse [splits, rows], then 2 B + 1 int32 (the seesaw kernel's request spans: plans/tree_verify_wgmma). The
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


# the mma.sync kernels read bf16 caches only: an fp8 spec (kv_dtype "fp8_e4m3") does not get them, its
# tree_verify is the wgmma kernel (Hopper) or the CUDA-core one; the combine kernel (fp32 partials) is built
# for every spec
MMA_KV_DTYPES = ("bf16",)


def spell(config) -> tuple:
    """A configuration's part of a variant's name (plans/variant.py): tree_verify_mma.bn64.s2."""
    return (f"bn{config['BN']}", f"s{config['STAGES']}")


KERNELS = [   # mma.sync, ldmatrix, cp.async: sm_80 instructions, so both targets (the configuration per target: config_for)
    KernelDef(name="tree_verify_mma", template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_mma",
              plan=verify_plan, context={"tail": False, "combine": False}, kv_dtypes=MMA_KV_DTYPES,
              policy=config_for, spell=spell),
    KernelDef(name="tree_verify_tail_mma", template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_tail_mma",
              plan=tail_plan, context={"tail": True, "combine": False}, kv_dtypes=MMA_KV_DTYPES,
              policy=config_for, spell=spell),
    KernelDef(name=COMBINE, template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_mma_combine",
              plan=combine_plan, context={"tail": False, "combine": True}),
]


_SERVED = ("served by the torch op of {0} (impl='{1}'), which dispatches to it")
_SAME_BUNDLES = ("the math of {0}: its bundles (refs/<spec>/{0}-*.kdtr) hold the inputs and outputs of this "
                 "kernel too")


def _tensor_core(kdef, launcher, public, impl, sanitize):
    """The declaration of a tensor-core kernel serving `public`(impl=`impl`) (also the wgmma family's)."""
    return Declaration(kdef, launcher=launcher, reference=f"reference:{public}", output="types:AttentionOutput",
                       serves=(public, impl), sanitize=sanitize,
                       missing={"torch_ops": _SERVED.format(public, impl), "bundles": _SAME_BUNDLES.format(public)})


DECLARATIONS = [
    _tensor_core(KERNELS[0], "kernels.tree_verify_mma:tree_verify", "tree_verify", "mma", "sanitize:_verify_mma_cases"),
    _tensor_core(KERNELS[1], "kernels.tree_verify_mma:tree_verify_tail", "tree_verify_tail", "mma",
                 "sanitize:_verify_mma_cases"),
    Declaration(KERNELS[2], launcher="kernels.tree_verify_mma:combine", output="types:AttentionOutput",
                missing={"reference": "a step of the tensor-core tree_verify kernels with num_splits > 1 (checked "
                                      "through their references); its math is merge_states' over the chunks",
                         "torch_ops": "a step of the tensor-core tree_verify kernels, not an op of its own",
                         "sanitize": "launched by the tensor-core tree_verify kernels' cases with num_splits > 1",
                         "bundles": "a step of the tensor-core tree_verify kernels (their bundles are tree_verify's)"}),
]

"""tree_verify on the tensor cores: tree_verify_mma, tree_verify_tail_mma and their split-KV combine.

Same contract and launcher signature as the CUDA-core tree_verify / tree_verify_tail
(DESIGN.md "tree_verify"); see templates/tree_verify_mma.cu.j2 for the kernel design and
docs/perf.md for the performance model.

* Compile-time configuration per spec: BN (keys per tile) and STAGES (cp.async pipeline depth);
  BM = 64 query rows and 8 warps are structural. The plan takes the configuration from
  tree_verify_mma_tuning.json (written by scripts/tune_tree_verify.py on a GPU) and falls back
  to DEFAULT_CONFIG, so a fresh build without a GPU reproduces the tuned choice.
* Split-KV: the launcher picks the number of key chunks from shapes only (B, Nq, H, max_pages,
  the SM count), never from device values: CUDA-graph friendly. The chunk boundaries are
  computed in the kernel from the request's prefix_len. splits > 1 writes fp32 partials to a
  workspace (allocated if not given) and launches tree_verify_mma_combine.
* Device-side values behave as in the CUDA-core kernels: a request with q_len outside [1, Nq]
  or a negative prefix_len writes nothing; keys past the block table or on a page outside
  [0, num_pages) are not visible. validate=True checks them on the host first (a sync).
* The argument checks are tree_verify.py's (one implementation for both), with the tensor-core
  kernel's own limits: q_nope / q_pe 16-byte aligned (cp.async 16-byte units) and
  num_pages x page_size < 2**31 (32-bit cache-row indices).
* kset.tree_verify / kset.tree_verify_tail (tree_verify.py) launch these kernels by default
  (impl="auto" when they are loaded, or impl="mma"); kset.tree_verify_mma calls them directly.
"""
from __future__ import annotations

import functools
import inspect
import json
import math
from pathlib import Path

import numpy as np
import sympy

from .. import runtime as rt
from ..errors import ArgumentError, SpecError
from ..resources import SM90_MAX_REGS_PER_THREAD, SM90_SMEM_PER_BLOCK, H, P, R, Plan, evaluate
from ..types import AttentionOutput
from . import KernelDef
from .tree_verify import (_INT32_MAX, _aligned, _check_inputs, _check_outputs, _given_outputs, _new_outputs,
                          _validate)
from .tree_verify import MMA_COMBINE as COMBINE   # the split-KV combine of both tensor-core families

TUNING_FILE = Path(__file__).with_name("tree_verify_mma_tuning.json")

BM = 64                 # query rows per block (4 row groups of 16)
WARPS = 8
THREADS = 32 * WARPS
DEFAULT_CONFIG = {"BN": 64, "STAGES": 2}
# every configuration the tuner tries, best first by the model (docs/perf.md)
CANDIDATES = ({"BN": 64, "STAGES": 2}, {"BN": 32, "STAGES": 3}, {"BN": 32, "STAGES": 4}, {"BN": 32, "STAGES": 2})
MAX_SPLITS = 32
COMBINE_ROWS_PER_BLOCK = 8
DEFAULT_SMS = 132       # H100 / H200 SXM, used when the device cannot be asked
READER = "tensor-core kernel"   # in alignment messages
Q_ALIGN = 16            # q_nope / q_pe alignment in bytes (read in cp.async 16-byte units)

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
FLOPS = 2 * B_ * H * NQ_ * (L_ + NQ_) * (2 * R + P)                 # DESIGN.md's count (all keys, every row)
HBM_BYTES = (B_ * (L_ + NQ_) * (R + P) * 2                          # kv rows, read once from HBM
             + B_ * NQ_ * H * (R + P) * 2                           # q
             + B_ * NQ_ * H * (R * 2 + 4))                          # out + lse
L2_BYTES = B_ * sympy.ceiling(NQ_ * H / BM) * (L_ + NQ_) * (R + P) * 2   # kv tile loads of all blocks


_TUNING_CACHE: dict = {}


def _tuning() -> dict:
    """spec name -> tuned entry, from TUNING_FILE (re-read only when the file changes: a stat per call)."""
    try:
        st = TUNING_FILE.stat()
        key = (st.st_mtime_ns, st.st_size)
    except OSError:
        return {}
    if _TUNING_CACHE.get("key") != key:
        try:
            data = json.loads(TUNING_FILE.read_text())
            specs = data.get("specs", {}) if isinstance(data, dict) else {}
        except (OSError, ValueError):
            specs = {}
        _TUNING_CACHE.update(key=key, specs=specs if isinstance(specs, dict) else {})
    return _TUNING_CACHE["specs"]


def _normalise(config) -> dict:
    cfg = {"BN": int(config["BN"]), "STAGES": int(config["STAGES"])}
    if cfg["BN"] not in (32, 64) or not 2 <= cfg["STAGES"] <= 8:
        raise SpecError(f"tree_verify_mma: configuration {config} is not one the template supports "
                        f"(BN in {{32, 64}}, STAGES in [2, 8])")
    return cfg


def _check_spec(spec, kernel) -> None:
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


@functools.lru_cache(maxsize=None)  # read on every launch (choose_splits): no sympy on the launch path
def config_for(spec) -> dict:
    """The compiled configuration of a spec: the tuned one if it fits, else the first candidate that fits."""
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


def verify_plan(spec, kernel="tree_verify_mma", config=None) -> Plan:
    _check_spec(spec, kernel)
    cfg = _normalise(config) if config is not None else config_for(spec)
    sub = {BN_: cfg["BN"], STAGES_: cfg["STAGES"]}
    return Plan(kernel=kernel, spec=spec, threads=sympy.Integer(THREADS), min_blocks=1,
                static_smem=sympy.Integer(0), dynamic_smem=SMEM.subs(sub),
                consts={"WARPS": sympy.Integer(WARPS), "BM": sympy.Integer(BM), "BN": sympy.Integer(cfg["BN"]),
                        "STAGES": sympy.Integer(cfg["STAGES"]), "SROW": SROW, "PROW": PROW.subs(sub),
                        "O_REGS": O_REGS})


def tail_plan(spec, config=None) -> Plan:
    return verify_plan(spec, "tree_verify_tail_mma", config)


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

@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    try:
        import cupy
        return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    except Exception:   # no device (argument-check tests), or an old CuPy
        return DEFAULT_SMS


def shape_class(base_blocks: int) -> str:
    """Tuning-table key of a launch: base blocks (B x row tiles) rounded up to a power of two."""
    return str(1 << max(0, (int(base_blocks) - 1).bit_length()))


def choose_splits(spec, b: int, nq: int, max_keys: int, bn: int, sms: int = DEFAULT_SMS) -> int:
    """Key chunks per (request, row tile), from shapes only.

    The tuned table (by shape class) wins; otherwise split only when B x row tiles leaves SMs
    idle, into floor(SMs / blocks) chunks. Never more chunks than the largest possible key range
    fills with two tiles each (max_keys: Nq for the tail, max_pages * page_size otherwise)."""
    base = b * -(-nq * spec.num_heads // BM)
    if base <= 0:
        return 1
    tuned = _tuning().get(spec.name, {})
    table = tuned.get("splits", {}) if tuned.get("config") and _normalise(tuned["config"]) == config_for(spec) else {}
    s = table.get(shape_class(base))
    if not isinstance(s, int) or s < 1:
        s = 1 if base >= sms else max(1, sms // base)
    useful = max(1, -(-int(max_keys) // (2 * bn)))
    return max(1, min(int(s), MAX_SPLITS, useful))


def workspace_elems(spec, b: int, nq: int, splits: int) -> int:
    """float32 elements of split-KV scratch: partial outputs [splits, rows, R] then lse [splits, rows]."""
    if splits <= 1:
        return 0
    rows = b * nq * spec.num_heads
    return splits * rows * (spec.kv_lora_rank + 1)


# ----------------------------------------------------------------------------- launchers

def _attention(kset, name, tail, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
               softmax_scale, out, lse, validate, workspace, num_splits) -> AttentionOutput:
    spec = kset.spec
    # the checks of the CUDA-core launchers (tree_verify.py), with 16-byte q and 32-bit cache-row indices
    inputs, scale_log2 = _check_inputs(spec, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                       softmax_scale, q_align=Q_ALIGN, reader=READER, row_indices32=True)
    qn, pl, ql = inputs["q_nope"], inputs["prefix_lens"], inputs["q_lens"]
    b, nq, h, r = qn.shape
    num_pages, max_pages = inputs["kv_cache"].shape[0], inputs["block_table"].shape[1]
    bn = kset.constants(name)["BN"]
    row_tiles = -(-nq * h // BM)
    rows_total = b * nq * h
    if num_splits is None:
        max_keys = nq if tail else max_pages * spec.page_size
        splits = choose_splits(spec, b, nq, max_keys, bn, _sm_count(qn.device) if b else DEFAULT_SMS)
    else:
        splits = rt.int_arg(num_splits, "num_splits", lo=1, hi=MAX_SPLITS)
    loaded = inspect.getattr_static(kset, "kernels", None)   # (static: a test stand-in may answer any name)
    if splits > 1 and loaded is not None and COMBINE not in kset.kernels:
        raise ArgumentError(f"num_splits: {splits} key chunks need {COMBINE}, not loaded in this kernel set of "
                            f"spec {spec.name!r} (load it, or pass num_splits=1)")
    if b * splits * row_tiles > _INT32_MAX:
        raise ArgumentError(f"q_nope: batch size {b} too large for one launch")
    # the caller's buffers are checked before anything is allocated or copied
    oa, la = _given_outputs(out, lse, (b, nq, h, r), (b, nq, h))
    need = workspace_elems(spec, b, nq, splits)
    wa = None
    if workspace is not None and need:
        wa, contiguous = rt._view(workspace, "workspace")
        if wa.dtype != "float32":
            raise ArgumentError(f"workspace: dtype {wa.dtype}, expected float32")
        if not contiguous:
            raise ArgumentError("workspace: not C-contiguous")
        if math.prod(wa.shape) < need:
            raise ArgumentError(f"workspace: {math.prod(wa.shape)} float32 elements, {splits} key chunks need "
                                f"{need} (workspace_elems(spec, B, Nq, splits))")
        wa = rt.DevArray(wa.obj, wa.ptr, (need,), "float32", wa.kind, wa._device)   # the part the kernels use
        _aligned(wa, "workspace", 16, READER)
    _check_outputs(inputs, {"out": oa, "lse": la, "workspace": wa}, reader=READER)
    if validate and b:
        _validate(tail, inputs, spec.page_size)
    oa, la = _new_outputs(qn, oa, la, (b, nq, h, r), (b, nq, h))
    if need and wa is None:
        wa = rt.device_array(rt.allocate(qn, (need,), "float32"), "workspace", dtype="float32", shape=(need,))
    if b:
        part_o = wa.ptr if need else 0
        part_lse = wa.ptr + splits * rows_total * r * 4 if need else 0
        kset.launch(name, grid=(b * splits * row_tiles,),
                    args=[*inputs.values(), rt.f32(scale_log2), rt.i32(nq), rt.i32(max_pages), rt.i32(num_pages),
                          rt.i32(splits), np.int64(rows_total), oa, la, np.uint64(part_o), np.uint64(part_lse)],
                    like=qn)
        if splits > 1:
            _launch_combine(kset, np.uint64(part_o), np.uint64(part_lse), pl, ql, nq, splits, rows_total, oa, la, qn)
    return AttentionOutput(oa.obj, la.obj)


def _launch_combine(kset, part_o, part_lse, pl, ql, nq, splits, rows_total, oa, la, like) -> None:
    blocks = -(-rows_total // COMBINE_ROWS_PER_BLOCK)
    if blocks > _INT32_MAX:
        raise ArgumentError(f"q_nope: {rows_total} rows are too many for one launch")
    kset.launch(COMBINE, grid=(blocks,),
                args=[part_o, part_lse, pl, ql, rt.i32(nq), rt.i32(splits), np.int64(rows_total), oa, la], like=like)


def tree_verify(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                out=None, lse=None, *, validate=False, workspace=None, num_splits=None) -> AttentionOutput:
    """Tree attention over the prefix and the tree (DESIGN.md tree_verify) on the tensor cores.

    Arguments, outputs and device-value behaviour as ddtree_gen.kernels.tree_verify.tree_verify, plus:
    q_nope, q_pe (and kv_cache) must be 16-byte aligned; workspace: float32 CUDA array of at least
    workspace_elems(spec, B, Nq, splits) elements for split-KV (allocated when None and needed);
    num_splits: key chunks per request (None: chosen from the shapes and the tuning table).
    """
    return _attention(kset, "tree_verify_mma", False, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                      tree_mask, softmax_scale, out, lse, validate, workspace, num_splits)


def tree_verify_tail(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                     out=None, lse=None, *, validate=False, workspace=None, num_splits=None) -> AttentionOutput:
    """tree_verify_mma over the tree tail alone (keys prefix_len + j with mask bit j set), for merging
    with an external prefix kernel through merge_states. Same arguments as tree_verify_mma."""
    return _attention(kset, "tree_verify_tail_mma", True, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                      tree_mask, softmax_scale, out, lse, validate, workspace, num_splits)


def combine(kset, workspace, prefix_lens, q_lens, splits, out, lse) -> AttentionOutput:
    """Low level: merge the `splits` partials in `workspace` (as left by a tree_verify_mma launch with
    num_splits=splits) into out [B, Nq, H, R] bf16 and lse [B, Nq, H] float32."""
    spec = kset.spec
    oa = rt.device_array(out, "out", dtype="bf16", ndim=4)
    b, nq, h, r = oa.shape
    if (h, r) != (spec.num_heads, spec.kv_lora_rank):
        raise ArgumentError(f"out: shape {oa.shape} does not match spec {spec.name!r} (H, R)")
    la = rt.device_array(lse, "lse", dtype="float32", shape=(b, nq, h))
    pl = rt.device_array(prefix_lens, "prefix_lens", dtype="int32", shape=(b,))
    ql = rt.device_array(q_lens, "q_lens", dtype="int32", shape=(b,))
    splits = rt.int_arg(splits, "splits", lo=2, hi=MAX_SPLITS)
    need = workspace_elems(spec, b, nq, splits)
    wa, contiguous = rt._view(workspace, "workspace")
    if wa.dtype != "float32" or not contiguous or math.prod(wa.shape) < need:
        raise ArgumentError(f"workspace: need a contiguous float32 array of >= {need} elements")
    rt.same_device(oa, la, pl, ql, wa)
    _aligned(wa, "workspace", 16, READER)
    _aligned(oa, "out", 4, READER)
    rows = b * nq * h
    if rows:
        _launch_combine(kset, np.uint64(wa.ptr), np.uint64(wa.ptr + splits * rows * r * 4), pl, ql, nq, splits, rows,
                        oa, la, oa)
    return AttentionOutput(oa.obj, la.obj)


KERNELS = [
    KernelDef(name="tree_verify_mma", template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_mma",
              plan=verify_plan, launch=tree_verify, context={"tail": False, "combine": False}),
    KernelDef(name="tree_verify_tail_mma", template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_tail_mma",
              plan=tail_plan, launch=tree_verify_tail, context={"tail": True, "combine": False}),
    KernelDef(name="tree_verify_mma_combine", template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_mma_combine",
              plan=combine_plan, launch=combine, context={"tail": False, "combine": True}),
]


# ----------------------------------------------------------------- variants (the tuner)

def variant_defs(config) -> list[KernelDef]:
    """KernelDefs of one configuration (same names and entries as the registered ones)."""
    cfg = _normalise(config)
    return [KernelDef(name="tree_verify_mma", template="tree_verify_mma.cu.j2", entry="ddtree_tree_verify_mma",
                      plan=functools.partial(verify_plan, kernel="tree_verify_mma", config=cfg), launch=tree_verify,
                      context={"tail": False, "combine": False}),
            KernelDef(name="tree_verify_tail_mma", template="tree_verify_mma.cu.j2",
                      entry="ddtree_tree_verify_tail_mma", plan=functools.partial(tail_plan, config=cfg),
                      launch=tree_verify_tail, context={"tail": True, "combine": False}),
            KERNELS[2]]


def variant_set(spec, config):
    """A KernelSet of one configuration (for the tuner): compiled through the cache, with
    `.config` and `.reports` (kernel name -> (plan, ptxas report)).

    vs = variant_set(spec, {"BN": 32, "STAGES": 3}); vs.tree_verify_mma(...)
    """
    from .. import artifacts
    config = _normalise(config)
    defs = variant_defs(config)
    built = {k.name: artifacts.compile_variant(spec, k) for k in defs}
    vs = rt.KernelSet(spec, built, kdefs=defs)
    vs.config = config
    vs.reports = {k.name: (k.plan(spec), built[k.name].report) for k in defs}
    return vs



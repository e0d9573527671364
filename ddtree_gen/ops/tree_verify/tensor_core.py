"""The launch path both tensor-core tree_verify families share (mma.sync: ops/tree_verify/mma_launch.py, wgmma:
ops/tree_verify/wgmma_launch.py, peers that import this module and not each other), and the launcher of the
split-KV combine kernel.

Same contract and signature as the CUDA-core launchers (ops/tree_verify/launch.py, docs/contract.md
"tree_verify"), plus workspace= and num_splits=. The split-KV policy, the workspace format and the
combine's plan are in ops/tree_verify/split.py, each family's resource plan in ops/tree_verify/mma.py and
ops/tree_verify/wgmma.py; templates/tree_verify_mma.cu.j2 and templates/tree_verify_wgmma.cu.j2 hold the
kernel designs, templates/tree_verify_combine.cu.j2 the combine, docs/perf.md the performance model.

* The number of key chunks comes from shapes only (never device values: CUDA-graph friendly);
  splits > 1 writes fp32 partials to a workspace (allocated if not given) and launches
  tree_verify_mma_combine.
* Device-side values behave as in the CUDA-core kernels; validate=True checks them on the host.
* The argument checks are launch/checks.py's, with the tensor-core kernels' own limits: q_nope /
  q_pe 16-byte aligned (cp.async 16-byte units) and num_pages x page_size < 2**31 (32-bit
  cache-row indices).
* kv_scale: required for an fp8 spec (its cache holds e4m3 bytes), refused for a bf16 one; the kernels
  take scale_log2 = softmax_scale x kv_scale x log2(e) and v_scale = kv_scale (1 for bf16), the factor
  of their output, both in fp32. The mma.sync kernels are not built for an fp8 spec (an ArgumentError
  naming the kernel and the kv_dtype); the wgmma ones read its e4m3 tiles.
* The kernel must run on the arrays' device (runtime.DeviceOffer.require: the wgmma kernels have an sm_90a
  build only, the mma.sync kernels' sm_80 build needs 150 KB of shared memory per block): an
  ArgumentError names the kernel, the device and why, before anything is allocated. BN (and the
  tuned split table) are those of the build that runs there (ops/tree_verify/split.py).
"""
from __future__ import annotations

import math

import numpy as np

from ...launch import arrays as ar
from ...errors import ArgumentError
from .. import all_builds
from . import split as _split
from .split import BM, COMBINE, COMBINE_ROWS_PER_BLOCK, DEFAULT_SMS, MAX_PARTS, MAX_SPLITS, choose_splits
from .split import COMBINE_DEF, parts_workspace_elems, pdl_combine, workspace_elems
from ...build.declaration import Declaration
from .simple import tensor_core_sanitizer_cases
from ..kv_dequant.plan import workspace_layout as dequant_layout
from .wgmma import parts_for
from ...launch.runtime import Prepared, Step, TensorMap, run_call, sm_count
from ...types import AttentionOutput
from ..kv_dequant.launch import dequant_step
from .route import KVW, WS
from ...launch.checks import (ATTENTION_ARRAYS, INT32_MAX, PointerChecks, check_outputs, validate_attention_values)

READER = "tensor-core kernel"   # in alignment messages
Q_ALIGN = 16                    # q_nope / q_pe alignment in bytes (read in cp.async 16-byte units)
KV_DEQUANT = "kv_dequant"       # the dequantize path's pre-pass (ops/kv_dequant/plan.py)
# build -> its kernel's split-KV rule as values (KernelDef.split_rule: the table and model choose_splits takes)
_SPLIT_RULES = {k.name: k.split_rule for k in all_builds() if k.split_rule is not None}
# the call's array positions by name (checks.check_attention_call's index for these kernels)
INDEX_TC = {name: i for i, name in enumerate((*ATTENTION_ARRAYS, "workspace", "kv_workspace"))}
# what the tensor-core kernels ask of their inputs beyond the CUDA-core kernel (checks.check_attention_call)
TENSOR_CORE_CHECKS = {"q_align": Q_ALIGN, "reader": READER, "row_indices32": True}


def _kv_workspace(spec, arrays, ptrs, b: int, max_pages: int):
    """fp8_path "dequant": the caller's kv_workspace as a DevArray of the elements the call uses (None: not given, the
    launcher allocates it), after its checks; and the layout (pages, table byte offset, elements)."""
    from ..kv_dequant.launch import check_workspace_pages
    check_workspace_pages(spec, b, max_pages)
    layout = dequant_layout(spec, b, max_pages)
    if len(arrays) <= KVW or arrays[KVW] is None:
        return None, layout
    ka = _given_scratch(ptrs, arrays[KVW], "kv_workspace", "bf16", "bf16 (uint16 bits on CuPy, torch.bfloat16 on torch)",
                        layout[2], lambda n: f"{n} bf16 elements, B = {b} requests x max_pages = {max_pages} need "
                                             f"{layout[2]} (ops.kv_dequant.plan.workspace_elems(spec, B, max_pages))")
    return ka, layout


def _given_scratch(ptrs, array, name: str, dtype: str, expected: str, need: int, too_small) -> ar.DevArray:
    """A caller's scratch array (workspace, kv_workspace) checked: `dtype` (`expected` names it in the error),
    C-contiguous, at least `need` elements (`too_small(n)` says why not), 16-byte aligned; as the DevArray of the
    `need` elements the kernels use."""
    sa, contiguous = ar.view(array, name)
    if sa.dtype != dtype:
        raise ArgumentError(f"{name}: dtype {sa.dtype}, expected {expected}")
    if not contiguous:
        raise ArgumentError(f"{name}: not C-contiguous")
    if math.prod(sa.shape) < need:
        raise ArgumentError(f"{name}: {too_small(math.prod(sa.shape))}")
    sa = ar.DevArray(sa.obj, sa.ptr, (need,), dtype, sa.kind, sa._device)   # the part the kernels use
    ptrs.align(sa, name, 16, READER)
    return sa


def pieces(offer, name: str, tail: bool, b: int, nq: int, max_pages: int, num_splits, arch: str):
    """(parts, count) of a call of tensor-core build `name` (the route's choice already) on the offer's device: parts
    True for a build whose record says it cuts the batch's work into `count` balanced parts on the device (record.parts:
    ops/tree_verify/wgmma.WgmmaBuild), else `count` chunks a request (choose_splits with the kernel's split rule).
    From shapes only (num_splits: the caller's count, checked)."""
    spec = offer.spec
    consts = offer.constants(name)
    record = offer.record(name)   # the build's typed record (ops/tree_verify/wgmma.WgmmaBuild, ...)
    parts = record.parts
    if num_splits is not None:
        return parts, ar.int_arg(num_splits, "num_splits", lo=1, hi=MAX_PARTS if parts else MAX_SPLITS)
    max_keys = nq if tail else max_pages * spec.page_size
    sms = sm_count(offer.device) if b else DEFAULT_SMS
    if parts:
        return parts, parts_for(spec, b, nq, max_keys, sms, record.seg_cost)
    # the dequantize path's kernel takes the fused wgmma kernel's split count (the same rule): the same bits
    return parts, choose_splits(spec, b, nq, max_keys, consts["BN"], sms, *_SPLIT_RULES[name](spec, arch))


def prepare_attention(offer, name, tail, arrays, checked, validate, num_splits) -> Prepared:
    """The checks and launch plan of one call signature (runtime.Prepared) of tensor-core build `name`
    (ops/tree_verify/route.route's choice: tree_verify_wgmma, its parts build, tree_verify_tail_mma, ...), on what the
    kernel set offers on the arrays' device (runtime.DeviceOffer), read from the build's typed record (offer.record:
    its grid, workspace source, TMA, parameter list)."""
    spec = offer.spec
    ptrs, inputs, scale_log2, v_scale, oa, la = checked   # checks.check_attention_call's, with TENSOR_CORE_CHECKS
    qn = inputs["q_nope"]
    b, nq, h, r = qn.shape
    num_pages, max_pages = inputs["kv_cache"].shape[0], inputs["block_table"].shape[1]
    if offer.device != qn.device:   # (the offer is of q_nope's device; the checks found every array on it)
        raise AssertionError(f"the offer of device {offer.device}, the call's arrays on {qn.device}")
    arch = offer.require(name)
    consts = offer.constants(name)
    record = offer.record(name)   # the build's typed record (ops/tree_verify/wgmma.WgmmaBuild, ...)
    dequant = record.reads_workspace   # the dequantize path's build
    if dequant:   # fp8_path "dequant": its pre-pass too (the checks of the caller's kv_workspace: below)
        if KV_DEQUANT not in offer.builds:
            raise ArgumentError(f"fp8_path: 'dequant' needs {KV_DEQUANT}, not loaded in this kernel set of spec "
                                f"{spec.name!r} (load it, or pass fp8_path=None)")
        offer.require(KV_DEQUANT)
    bn = consts["BN"]
    parts, splits = pieces(offer, name, tail, b, nq, max_pages, num_splits, arch)
    row_tiles = -(-nq * h // BM)
    rows_total = b * nq * h
    max_keys = nq if tail else max_pages * spec.page_size
    sms = sm_count(qn.device) if b else DEFAULT_SMS
    if parts and b * (-(-max_keys // bn) + record.seg_cost) > INT32_MAX:
        raise ArgumentError(f"block_table: {b} requests x {max_pages} pages are too many key tiles for one launch")
    if splits > 1 and COMBINE not in offer.builds:
        raise ArgumentError(f"num_splits: {splits} key chunks need {COMBINE}, not loaded in this kernel set of "
                            f"spec {spec.name!r} (load it, or pass num_splits=1)")
    # the combine a programmatic dependent of the attention kernel where split.PDL_COMBINE says so (its sm_90a build)
    pdl = splits > 1 and pdl_combine(offer.require(COMBINE))
    if b * splits * row_tiles > INT32_MAX:
        raise ArgumentError(f"q_nope: batch size {b} too large for one launch")
    # the caller's buffers are checked before anything is allocated or copied
    need = parts_workspace_elems(spec, b, nq, splits) if parts else workspace_elems(spec, b, nq, splits)
    wa = None
    if arrays[WS] is not None and need:
        wa = _given_scratch(ptrs, arrays[WS], "workspace", "float32", "float32", need,
                            lambda n: f"{n} float32 elements, {splits} key chunks need {need} "
                                      f"(at most workspace_elems(spec, B, Nq, splits))")
    ka, layout = _kv_workspace(spec, arrays, ptrs, b, max_pages) if dequant else (None, None)
    check_outputs(ptrs, inputs, {"out": oa, "lse": la, "workspace": wa, **({"kv_workspace": ka} if dequant else {})},
                  reader=READER)
    if validate and b:
        validate_attention_values(tail, inputs, spec.page_size)
    new = [(7, (b, nq, h, r), "bf16"), (8, (b, nq, h), "float32")]
    steps = []
    if b:
        slots = (b + splits - 1) * nq * h if parts else splits * rows_total   # partial rows in the workspace
        part_o, part_lse, spans = (((WS, 0), (WS, slots * r * 4), (WS, slots * (r + 1) * 4)) if need else
                                   (np.uint64(0), np.uint64(0), np.uint64(0)))
        # a TMA build (ops/tree_verify/wgmma.uses_tma) also takes the cache's tensor map, made per call:
        # boxes of one key tile's rows by one 64-column slab (bf16: 128 bytes, swizzled; e4m3: 64 bytes, as they are)
        # the dequantize path: kv_dequant writes the bf16 pages and their block table into the kv workspace, which
        # the kernel then reads as its cache (B * max_pages pages; the table after them)
        kv, table, pages = (KVW, (KVW, layout[1]), layout[0]) if dequant else (2, 3, num_pages)
        if dequant:
            if max_pages:   # (none: the kernel reads no key, nor the table)
                steps.append(dequant_step(2, 3, 4, 5, kv, table, b, max_pages, num_pages,
                                          offer.constants(KV_DEQUANT)))
            new.append((KVW, (layout[2],), "bf16"))
        rows, cols = pages * spec.page_size, r + spec.qk_rope_head_dim
        # (pages smaller than a tile: a box per page, its rows; ops/tree_verify/wgmma.seesaw_tma)
        tma = ((TensorMap(kv, rows, cols, min(bn, spec.page_size), 64,
                          *((1, 0) if spec.kv_fp8 and not dequant else ())),)
               if record.tma else ())
        # the grid (the record's: blocks and its own values), the launch's values by parameter name, bound in the
        # order the build declares (ops/tree_verify/params.py)
        blocks, grid_values = record.launch_grid(b, splits, row_tiles, sms)
        values = {**grid_values, "q_nope": 0, "q_pe": 1, "kv_cache": kv, "block_table": table, "prefix_lens": 4,
                  "q_lens": 5, "tree_mask": 6, "scale_log2": scale_log2, "v_scale": v_scale, "Nq": nq, "max_pages": max_pages,
                  "num_pages": pages, "splits": splits, "rows_total": rows_total, "out": 7, "lse": 8,
                  "part_o": part_o, "part_lse": part_lse, "spans": spans, "kv_map": tma[0] if tma else None}
        steps.append(Step(name, (blocks,), bind(record.params, values)))
        if need:
            new.append((WS, (need,), "float32"))
        if splits > 1:
            steps.append(combine_step(part_o, part_lse, 4, 5, nq, splits, rows_total, 7, 8,
                                      spans if parts else np.uint64(0), pdl=pdl))
    return Prepared(device=qn.device, kind=qn.kind, steps=tuple(steps), new=tuple(new), aligned=tuple(ptrs.aligned),
                    disjoint=tuple(ptrs.disjoint), scratch=(WS, KVW) if dequant else (WS,),
                    returns=(AttentionOutput, (7, 8)))


# C scalar types -> the numpy type a launch passes (pointers: array indexes or (index, byte offset) as given)
SCALARS = {"int": np.int32, "long long": np.int64, "float": np.float32}


def bind(plist, values: dict) -> tuple:
    """A launch's arguments in the order of a build's parameter list (ops/tree_verify/params.Param), each by name from
    `values` (scalars as their C type's numpy type); a parameter without a value is an error naming it."""
    missing = [p.name for p in plist if p.name not in values]
    if missing:
        raise AssertionError(f"the launch gives no value of kernel parameter(s) {', '.join(missing)}")
    return tuple(SCALARS[p.ctype](values[p.name]) if p.ctype in SCALARS else values[p.name] for p in plist)


def combine_step(part_o, part_lse, pl, ql, nq, splits, rows_total, out, lse, spans=np.uint64(0), *,
                 pdl: bool = False) -> Step:
    """The combine of `splits` chunks ([splits, rows_total] partials), or of the seesaw kernel's parts (`spans`:
    the request spans it wrote, partials in slots b + part). pdl: launched as a programmatic dependent of the kernel
    before it (split.pdl_combine: only a build that waits for that kernel's partials)."""
    blocks = -(-rows_total // COMBINE_ROWS_PER_BLOCK)
    if blocks > INT32_MAX:
        raise ArgumentError(f"q_nope: {rows_total} rows are too many for one launch")
    return Step(COMBINE, (blocks,), (part_o, part_lse, pl, ql, np.int32(nq), np.int32(splits), np.int64(rows_total),
                                     out, lse, spans), pdl=pdl)


def combine(kset, workspace, prefix_lens, q_lens, splits, out, lse) -> AttentionOutput:
    """Low level: merge the `splits` partials in `workspace` (as left by a tensor-core tree_verify launch
    with num_splits=splits) into out [B, Nq, H, R] bf16 and lse [B, Nq, H] float32."""
    spec = kset.spec
    oa = ar.device_array(out, "out", dtype="bf16", ndim=4)
    b, nq, h, r = oa.shape
    if (h, r) != (spec.num_heads, spec.kv_lora_rank):
        raise ArgumentError(f"out: shape {oa.shape} does not match spec {spec.name!r} (H, R)")
    la = ar.device_array(lse, "lse", dtype="float32", shape=(b, nq, h))
    pl = ar.device_array(prefix_lens, "prefix_lens", dtype="int32", shape=(b,))
    ql = ar.device_array(q_lens, "q_lens", dtype="int32", shape=(b,))
    splits = ar.int_arg(splits, "splits", lo=2, hi=MAX_SPLITS)
    need = workspace_elems(spec, b, nq, splits)
    wa, contiguous = ar.view(workspace, "workspace")
    if wa.dtype != "float32" or not contiguous or math.prod(wa.shape) < need:
        raise ArgumentError(f"workspace: need a contiguous float32 array of >= {need} elements")
    device = ar.same_device({"out": oa, "lse": la, "prefix_lens": pl, "q_lens": ql, "workspace": wa})
    ptrs = PointerChecks({"workspace": 0, "out": 3})
    ptrs.align(wa, "workspace", 16, READER)
    ptrs.align(oa, "out", 4, READER)
    rows = b * nq * h
    # (the switch read per call: this launcher is not cached)
    pdl = bool(rows) and _split.PDL_COMBINE and pdl_combine(kset.require(COMBINE, device))
    steps = (combine_step((0, 0), (0, splits * rows * r * 4), 1, 2, nq, splits, rows, 3, 4, pdl=pdl),) if rows else ()
    arrays = (wa.obj, pl.obj, ql.obj, oa.obj, la.obj)
    prep = Prepared(device=device, kind=oa.kind, steps=steps, aligned=tuple(ptrs.aligned),
                    returns=(AttentionOutput, (3, 4)))
    # a low-level call: checked every time (not cached)
    return run_call(kset, lambda: prep, arrays, (), cache=False)



# ------------------------------------------------------------------------- declarations

_SERVED = ("served by the torch op of {0} (impl='{1}'), which dispatches to it")
_SAME_BUNDLES = ("the math of {0}: its bundles (refs/<spec>/{0}-*.kdtr) hold the inputs and outputs of this "
                 "kernel too")


def tensor_core_declaration(kdef, launcher, reference) -> Declaration:
    """The declaration of a tensor-core kernel serving `public`(impl=`impl`) (its build's serves), of either family:
    `reference` is public's; its cases the tree_verify cases with forced split-KV; its op and bundles public's."""
    public, impl = kdef.serves
    return Declaration(kdef, launcher=launcher, reference=reference, output=AttentionOutput,
                       sanitize=tensor_core_sanitizer_cases,
                       missing={"torch_ops": _SERVED.format(public, impl), "bundles": _SAME_BUNDLES.format(public)})


DECLARATIONS = [
    Declaration(COMBINE_DEF, launcher=combine, output=AttentionOutput,
                missing={"reference": "a step of the tensor-core tree_verify kernels with num_splits > 1 (checked "
                                      "through their references); its math is merge_states' over the chunks",
                         "torch_ops": "a step of the tensor-core tree_verify kernels, not an op of its own",
                         "sanitize": "launched by the tensor-core tree_verify kernels' cases with num_splits > 1",
                         "bundles": "a step of the tensor-core tree_verify kernels (their bundles are tree_verify's)"}),
]

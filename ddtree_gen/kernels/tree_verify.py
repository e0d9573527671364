"""tree_verify, tree_verify_tail and merge_states: MLA tree attention for DDTree verification.

See DESIGN.md ("tree_verify", "merge_states"). Three implementations share the launchers
tree_verify / tree_verify_tail (kset.tree_verify(..., impl="auto"|"wgmma"|"mma"|"simple")):
  * "wgmma": the Hopper warpgroup tensor-core kernels of tree_verify_wgmma.py
    (tree_verify_wgmma / tree_verify_tail_wgmma, split-KV with tree_verify_mma_combine), the
    fastest; they take workspace= and num_splits=;
  * "mma": the mma.sync tensor-core kernels of tree_verify_mma.py (tree_verify_mma /
    tree_verify_tail_mma, same split-KV, workspace and num_splits);
  * "simple": the CUDA-core kernels of this module: one block per (request, query row, group of
    heads), keys streamed through shared memory in double-buffered tiles with an online softmax,
    so any prefix length runs in fixed shared memory;
  * "auto" (the default): the first of wgmma, mma whose kernels (with the combine kernel) the
    kernel set has loaded, else the CUDA-core one.

Decision: values that live on the device are not read on the host by default. An engine
captures these launches in CUDA graphs, where a host copy of prefix_lens / q_lens /
block_table would be a sync (and illegal in capture). The kernels are instead safe for any
values:
  * a request whose q_len is outside [1, Nq] or whose prefix_len is negative writes nothing
    (neither out nor lse, for any row);
  * a key whose page index is >= max_pages, or whose block_table entry is outside
    [0, num_pages), is treated as not visible (never read); a row left with no visible key
    gets out = 0, lse = -inf, like any empty row.
Pass validate=True to have the launcher copy prefix_lens, q_lens and block_table to the host
(a synchronizing copy) and raise ArgumentError before launch for q_len outside [1, Nq],
prefix_len < 0, prefix_len + q_len > max_pages * page_size, or a block_table entry that the
call would use outside [0, num_pages); the message names the argument, request and value.

Shapes, dtypes, contiguity, devices, the spec's H / R / P / page_size / W, alignment and
overlap of outputs with inputs are always checked on the host (no device access). These checks
live here and serve every implementation (tree_verify_mma.py imports them); what differs per
kernel is a parameter: the alignment of q_nope / q_pe (4 bytes here, 16 for the tensor cores)
and the 32-bit limits (the tensor-core kernel also needs num_pages * page_size < 2**31).
merge_states allows out to be o_a or o_b, and lse to be lse_a or lse_b (in-place merge);
any other overlap between an output and an input is refused.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import sympy

from .. import runtime as rt
from ..errors import ArgumentError, SpecError
from ..resources import SM90_STATIC_SMEM, H, P, R, Plan
from ..types import AttentionOutput
from . import KernelDef

_ITEMSIZE = {"bf16": 2, "float32": 4, "int32": 4, "uint32": 4}
_INT32_MAX = 2**31 - 1
_LOG2E = 1.4426950408889634
_MAX_LIVE = 180   # registers per thread the verify kernel may spend on q and accumulators


# ------------------------------------------------------------------------------- plans

def _verify_tiles(spec):
    """(heads per warp, keys per tile) with HPW * TK = 32: the smallest HPW whose two tiles fit."""
    row = spec.kv_lora_rank + spec.qk_rope_head_dim
    for hpw in (2, 4, 8):
        tk = 32 // hpw
        if 2 * tk * row * 2 + 2 * tk * 4 <= SM90_STATIC_SMEM:
            return hpw, tk
    return 8, 4  # does not fit: Plan.check_fits refuses the spec with the formula


def verify_plan(spec, kernel="tree_verify") -> Plan:
    hpw, tk = _verify_tiles(spec)
    warps = sympy.Min(8, sympy.ceiling(H / hpw))      # up to 8 warps of hpw heads
    heads_per_block = warps * hpw
    threads = 32 * warps
    # two key tiles of tk rows (R + P bf16) + two tiles of per-key visibility flags (int)
    static_smem = 2 * tk * (R + P) * 2 + 2 * tk * 4
    nwarps = int(warps.subs({H: spec.num_heads}))
    # q (2 (RW + PW)) and output accumulators (2 RW) per head live in registers in every lane
    live = hpw * (4 * -(-spec.kv_lora_rank // 64) + 2 * -(-spec.qk_rope_head_dim // 64))
    if live > _MAX_LIVE:
        raise SpecError(f"spec {spec.name!r}, kernel {kernel}: kv_lora_rank = {spec.kv_lora_rank} with "
                        f"qk_rope_head_dim = {spec.qk_rope_head_dim} needs {live} query/accumulator registers per "
                        f"thread ({hpw} heads per warp); this kernel holds at most {_MAX_LIVE}")
    # up to 72 of them (R = 512, P = 64: 68) fit 128 registers: 16 warps per SM; beyond, one block
    min_blocks = max(1, 16 // nwarps) if live <= 72 else 1
    return Plan(kernel=kernel, spec=spec, threads=threads, min_blocks=min_blocks,
                static_smem=static_smem,
                consts={"WARPS": warps, "HEADS_PER_WARP": sympy.Integer(hpw), "TILE_KEYS": sympy.Integer(tk),
                        "HEADS_PER_BLOCK": heads_per_block, "HEAD_GROUPS": sympy.ceiling(H / heads_per_block),
                        "RANK_WORDS_PER_LANE": sympy.ceiling(R / 64), "ROPE_WORDS_PER_LANE": sympy.ceiling(P / 64)})


def tail_plan(spec) -> Plan:
    return verify_plan(spec, "tree_verify_tail")


MERGE_WARPS = 8


def merge_plan(spec) -> Plan:
    return Plan(kernel="merge_states", spec=spec, threads=sympy.Integer(32 * MERGE_WARPS), min_blocks=4,
                static_smem=sympy.Integer(0),
                consts={"ROWS_PER_BLOCK": sympy.Integer(MERGE_WARPS), "RANK_WORDS_PER_LANE": sympy.ceiling(R / 64)})


# ------------------------------------------------ argument checks (shared with tree_verify_mma)

def _span(a: rt.DevArray) -> tuple[int, int]:
    return a.ptr, a.ptr + math.prod(a.shape) * _ITEMSIZE.get(a.dtype, 1)


def _overlap(a: rt.DevArray, b: rt.DevArray) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1


def _no_overlap(outputs: dict, inputs: dict, allowed: dict | None = None) -> None:
    """Outputs must not share memory with inputs or each other; `allowed` maps an output name to
    the input names it may alias exactly (same pointer, same shape: an in-place operation)."""
    allowed = allowed or {}
    for oname, o in outputs.items():
        for iname, a in inputs.items():
            if not _overlap(o, a):
                continue
            if iname in allowed.get(oname, ()) and o.ptr == a.ptr and o.shape == a.shape:
                continue
            raise ArgumentError(f"{oname}: overlaps {iname} in memory"
                                + (f" (only {' or '.join(allowed[oname])} may be passed as {oname} exactly)"
                                   if oname in allowed else " (outputs must not share memory with inputs)"))
    names = list(outputs)
    for x in range(len(names)):
        for y in range(x + 1, len(names)):
            if _overlap(outputs[names[x]], outputs[names[y]]):
                raise ArgumentError(f"{names[y]}: overlaps {names[x]} in memory")


def _same_device(arrays: dict) -> None:
    """Every array on the first one's device; the message names the odd one."""
    names = list(arrays)
    dev = arrays[names[0]].device
    for name in names[1:]:
        if arrays[name].device != dev:
            raise ArgumentError(f"{name}: on device {arrays[name].device}, but {names[0]} is on device {dev}")


def _aligned(a: rt.DevArray, name: str, alignment: int, reader: str = "kernel") -> None:
    """`reader`: who reads it, for the message ("kernel", "tensor-core kernel")."""
    if a.ptr % alignment:
        raise ArgumentError(f"{name}: data pointer {a.ptr:#x} is not {alignment}-byte aligned "
                            f"(the {reader} reads it in {alignment}-byte units)")


def _host(a: rt.DevArray) -> np.ndarray:
    """A synchronizing host copy (validate=True only)."""
    if a.kind == "torch":
        return a.obj.detach().cpu().numpy()
    import cupy
    with cupy.cuda.Device(a.device):
        return cupy.asnumpy(cupy.asarray(a.obj))


def _check_inputs(spec, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale, *,
                  q_align: int, reader: str = "kernel", row_indices32: bool = False) -> tuple[dict, float]:
    """Shapes, dtypes, contiguity, devices, alignment and the spec's H / R / P / page_size / W (host only).

    q_align: the alignment of q_nope and q_pe in bytes (kv_cache: always 16). row_indices32: the
    kernel indexes cache rows (page x page_size + offset) in 32 bits, so num_pages x page_size
    must be < 2**31 (else only num_pages and max_pages, passed as int, must be).
    Returns (the inputs by name, in the kernels' argument order, as DevArrays; softmax_scale x log2(e)).
    """
    nh, rank, rope, page, n, w = (spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size,
                                  spec.max_tree_size, spec.mask_words)
    of = f"of spec {spec.name!r}"
    qn = rt.device_array(q_nope, "q_nope", dtype="bf16", ndim=4)
    b, nq, h, r = qn.shape
    if h != nh:
        raise ArgumentError(f"q_nope: H = {h} (dimension 2) must equal num_heads = {nh} {of}")
    if r != rank:
        raise ArgumentError(f"q_nope: R = {r} (dimension 3) must equal kv_lora_rank = {rank} {of}")
    if not 1 <= nq <= n:
        raise ArgumentError(f"q_nope: Nq = {nq} (dimension 1) must be in [1, max_tree_size = {n}] {of}")
    qp = rt.device_array(q_pe, "q_pe", dtype="bf16", ndim=4)
    if qp.shape[3] != rope:
        raise ArgumentError(f"q_pe: P = {qp.shape[3]} (dimension 3) must equal qk_rope_head_dim = {rope} {of}")
    if qp.shape != (b, nq, h, rope):
        raise ArgumentError(f"q_pe: shape {qp.shape}, expected {(b, nq, h, rope)} (B, Nq, H of q_nope)")
    kv = rt.device_array(kv_cache, "kv_cache", dtype="bf16", ndim=3)
    num_pages, ps, row = kv.shape
    if ps != page:
        raise ArgumentError(f"kv_cache: page_size = {ps} (dimension 1) must equal page_size = {page} {of}")
    if row != rank + rope:
        raise ArgumentError(f"kv_cache: row width {row} (dimension 2) must equal kv_lora_rank + qk_rope_head_dim "
                            f"= {rank + rope} {of}")
    bt = rt.device_array(block_table, "block_table", dtype="int32", ndim=2)
    if bt.shape[0] != b:
        raise ArgumentError(f"block_table: {bt.shape[0]} rows (dimension 0), expected batch size {b} of q_nope")
    max_pages = bt.shape[1]
    pl = rt.device_array(prefix_lens, "prefix_lens", dtype="int32", shape=(b,))
    ql = rt.device_array(q_lens, "q_lens", dtype="int32", shape=(b,))
    tm = rt.device_array(tree_mask, "tree_mask", dtype="uint32", ndim=3)
    if tm.shape[2] != w:
        raise ArgumentError(f"tree_mask: W = {tm.shape[2]} (dimension 2) must equal mask_words = "
                            f"ceil(max_tree_size / 32) = {w} {of}")
    if tm.shape != (b, nq, w):
        raise ArgumentError(f"tree_mask: shape {tm.shape}, expected {(b, nq, w)} (B, Nq of q_nope)")
    scale = rt.float_arg(softmax_scale, "softmax_scale")
    scale_log2 = scale * _LOG2E
    if not abs(scale_log2) < float(np.finfo(np.float32).max):
        raise ArgumentError(f"softmax_scale: {scale} is out of float32 range")
    inputs = {"q_nope": qn, "q_pe": qp, "kv_cache": kv, "block_table": bt, "prefix_lens": pl, "q_lens": ql,
              "tree_mask": tm}
    _same_device(inputs)
    _aligned(kv, "kv_cache", 16, reader)
    _aligned(qn, "q_nope", q_align, reader)
    _aligned(qp, "q_pe", q_align, reader)
    if row_indices32:
        if num_pages * page > _INT32_MAX or max_pages > _INT32_MAX:
            raise ArgumentError(f"kv_cache/block_table: num_pages x page_size = {num_pages * page} cache rows and "
                                f"max_pages {max_pages} must be < 2**31 (32-bit row indices)")
    elif num_pages > _INT32_MAX or max_pages > _INT32_MAX:
        raise ArgumentError(f"kv_cache/block_table: num_pages {num_pages} and max_pages {max_pages} "
                            f"must be < 2**31")
    return inputs, scale_log2


def _given_outputs(out, lse, out_shape: tuple, lse_shape: tuple):
    """The caller's out (bf16) and lse (float32) buffers as DevArrays, None where not given."""
    oa = rt.device_array(out, "out", dtype="bf16", shape=out_shape) if out is not None else None
    la = rt.device_array(lse, "lse", dtype="float32", shape=lse_shape) if lse is not None else None
    return oa, la


def _check_outputs(inputs: dict, outputs: dict, *, allowed: dict | None = None, reader: str = "kernel") -> None:
    """The caller's output buffers (name -> DevArray or None: not given): on the device of the first
    input, out 4-byte aligned, no memory shared with the inputs or each other (`allowed`: see _no_overlap)."""
    given = {k: v for k, v in outputs.items() if v is not None}
    if not given:
        return
    first = next(iter(inputs))
    _same_device({first: inputs[first], **given})
    if "out" in given:
        _aligned(given["out"], "out", 4, reader)
    _no_overlap(given, inputs, allowed)


def _new_outputs(like: rt.DevArray, oa, la, out_shape: tuple, lse_shape: tuple):
    """(out, lse): the given buffers, or new ones of the caller's kind on like's device."""
    if oa is None:
        oa = rt.device_array(rt.allocate(like, out_shape, "bf16"), "out", dtype="bf16", shape=out_shape)
    if la is None:
        la = rt.device_array(rt.allocate(like, lse_shape, "float32"), "lse", dtype="float32", shape=lse_shape)
    return oa, la


def _validate(tail: bool, inputs: dict, page_size: int) -> None:
    """validate=True: the device-side lengths and block table on the host (a sync), before launch."""
    pl, ql, bt = inputs["prefix_lens"], inputs["q_lens"], inputs["block_table"]
    nq, num_pages = inputs["q_nope"].shape[1], inputs["kv_cache"].shape[0]
    prefix, qlens, table = _host(pl).astype(np.int64), _host(ql).astype(np.int64), _host(bt).astype(np.int64)
    max_pages = table.shape[1]
    for b in range(len(qlens)):
        q, L = int(qlens[b]), int(prefix[b])
        if not 1 <= q <= nq:
            raise ArgumentError(f"q_lens: request {b} has q_len {q}, must be in [1, Nq = {nq}]")
        if L < 0:
            raise ArgumentError(f"prefix_lens: request {b} has prefix_len {L}, must be >= 0")
        if L + q > max_pages * page_size:
            raise ArgumentError(f"prefix_lens: request {b} has prefix_len {L} + q_len {q} = {L + q} tokens, "
                                f"more than block_table holds (max_pages {max_pages} x page_size {page_size} "
                                f"= {max_pages * page_size})")
        first, last = (L if tail else 0) // page_size, (L + q - 1) // page_size
        used = table[b, first:last + 1]
        bad = np.flatnonzero((used < 0) | (used >= num_pages))
        if bad.size:
            k = first + int(bad[0])
            raise ArgumentError(f"block_table: request {b} entry [{b}, {k}] = {int(table[b, k])} is not a page "
                                f"in [0, num_pages = {num_pages})")


# ----------------------------------------------------------------------------- launchers

IMPLS = ("auto", "wgmma", "mma", "simple")
TENSOR_CORE_IMPLS = ("wgmma", "mma")   # in the order "auto" prefers them
MMA_COMBINE = "tree_verify_mma_combine"   # the split-KV combine of both tensor-core families


def _loaded(kset, name: str) -> bool:
    """Whether kernel `name` is loaded in kset (KernelSet.kernels). A kernel set without a `kernels`
    list (a test stand-in) has the CUDA-core kernels only; looked up statically, so that a stand-in's
    __getattr__ is not asked."""
    if inspect.getattr_static(kset, "kernels", None) is None:
        return False
    return name in kset.kernels


def _pick_impl(kset, name: str, impl, workspace, num_splits) -> str:
    """Which implementation `impl` sends launcher `name` to: "wgmma", "mma" or "simple" (module docstring)."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ArgumentError(f"impl: {impl!r}, expected one of {', '.join(map(repr, IMPLS))}")
    if impl == "simple":
        for arg, value in (("workspace", workspace), ("num_splits", num_splits)):
            if value is not None:
                raise ArgumentError(f"{arg}: only the tensor-core kernels take it, but impl='simple' "
                                    f"(the CUDA-core kernel) was asked")
        return "simple"
    for kind in TENSOR_CORE_IMPLS if impl == "auto" else (impl,):
        missing = [k for k in (f"{name}_{kind}", MMA_COMBINE) if not _loaded(kset, k)]
        if not missing:
            return kind
        if impl != "auto":
            raise ArgumentError(f"impl: {impl!r} needs {' and '.join(missing)}, not loaded in this kernel set of "
                                f"spec {kset.spec.name!r} (load them, or pass impl='auto' or 'simple')")
    return "simple"


def _attention(kset, name, tail, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
               softmax_scale, out, lse, validate) -> AttentionOutput:
    """The CUDA-core kernel `name`."""
    spec = kset.spec
    inputs, scale_log2 = _check_inputs(spec, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                       softmax_scale, q_align=4)
    qn = inputs["q_nope"]
    b, nq, h, r = qn.shape
    num_pages, max_pages = inputs["kv_cache"].shape[0], inputs["block_table"].shape[1]
    groups = kset.constants(name)["HEAD_GROUPS"]
    if groups * nq * b > _INT32_MAX:
        raise ArgumentError(f"q_nope: batch size {b} too large for one launch")
    # the caller's buffers are checked before anything is allocated or copied
    oa, la = _given_outputs(out, lse, (b, nq, h, r), (b, nq, h))
    _check_outputs(inputs, {"out": oa, "lse": la})
    if validate and b:
        _validate(tail, inputs, spec.page_size)
    oa, la = _new_outputs(qn, oa, la, (b, nq, h, r), (b, nq, h))
    if b:
        kset.launch(name, grid=(groups * nq * b,),
                    args=[*inputs.values(), rt.f32(scale_log2), rt.i32(nq), rt.i32(max_pages), rt.i32(num_pages),
                          oa, la], like=qn)
    return AttentionOutput(oa.obj, la.obj)


def _dispatch(kset, name, tail, args, out, lse, validate, impl, workspace, num_splits) -> AttentionOutput:
    kind = _pick_impl(kset, name, impl, workspace, num_splits)
    if kind == "simple":
        return _attention(kset, name, tail, *args, out, lse, validate)
    # not at import time: the tensor-core modules import this one
    from . import tree_verify_mma, tree_verify_wgmma
    module = tree_verify_wgmma if kind == "wgmma" else tree_verify_mma
    launch = module.tree_verify_tail if tail else module.tree_verify
    return launch(kset, *args, out, lse, validate=validate, workspace=workspace, num_splits=num_splits)


def tree_verify(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                out=None, lse=None, *, validate=False, impl="auto", workspace=None,
                num_splits=None) -> AttentionOutput:
    """Tree attention over the prefix and the tree (DESIGN.md tree_verify), on the current stream.

    q_nope [B,Nq,H,R] bf16, q_pe [B,Nq,H,P] bf16, kv_cache [num_pages,page_size,R+P] bf16,
    block_table [B,max_pages] int32, prefix_lens [B] int32, q_lens [B] int32,
    tree_mask [B,Nq,W] uint32, softmax_scale finite. Returns AttentionOutput(out [B,Nq,H,R] bf16,
    lse [B,Nq,H] float32); rows i >= q_len are not written. validate=True checks the device-side
    lengths and block table on the host first (a sync); see the module docstring.

    impl: "auto" (tree_verify_wgmma, else tree_verify_mma, whichever the kernel set has loaded
    first, else the CUDA-core kernel), "wgmma" / "mma" (that tensor-core kernel; ArgumentError
    if the kernel set lacks it) or "simple" (the CUDA-core kernel). The tensor-core kernels need
    q_nope and q_pe 16-byte aligned (the CUDA-core one: 4) and take workspace / num_splits (see
    tree_verify_mma.tree_verify); they are refused with impl="simple" and unused when "auto"
    picks the CUDA-core kernel.
    """
    return _dispatch(kset, "tree_verify", False,
                     (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale),
                     out, lse, validate, impl, workspace, num_splits)


def tree_verify_tail(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                     out=None, lse=None, *, validate=False, impl="auto", workspace=None,
                     num_splits=None) -> AttentionOutput:
    """tree_verify over the tree tail alone (keys prefix_len + j with mask bit j set), for
    merging with an external prefix kernel through merge_states. Same arguments as tree_verify
    (impl "wgmma" / "mma" picks tree_verify_tail_wgmma / tree_verify_tail_mma)."""
    return _dispatch(kset, "tree_verify_tail", True,
                     (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale),
                     out, lse, validate, impl, workspace, num_splits)


def merge_states(kset, o_a, lse_a, o_b, lse_b, out=None, lse=None) -> AttentionOutput:
    """Merge two attention states (DESIGN.md merge_states), natural-log LSE, on the current stream.

    o_a, o_b [..., R] bf16; lse_a, lse_b [...] float32 (o's shape without R). A side whose lse is
    not finite (-inf, +inf, NaN) is empty; two empty sides give o = 0, lse = -inf. out may be o_a
    or o_b and lse may be lse_a or lse_b (in place). Returns AttentionOutput(out, lse).
    """
    rank = kset.spec.kv_lora_rank
    oa = rt.device_array(o_a, "o_a", dtype="bf16")
    if len(oa.shape) < 1 or oa.shape[-1] != rank:
        raise ArgumentError(f"o_a: shape {oa.shape} must end in kv_lora_rank = {rank} of spec {kset.spec.name!r}")
    lead = oa.shape[:-1]
    la = rt.device_array(lse_a, "lse_a", dtype="float32", shape=lead)
    ob = rt.device_array(o_b, "o_b", dtype="bf16", shape=oa.shape)
    lb = rt.device_array(lse_b, "lse_b", dtype="float32", shape=lead)
    inputs = {"o_a": oa, "lse_a": la, "o_b": ob, "lse_b": lb}
    _same_device(inputs)
    for k, v in inputs.items():
        _aligned(v, k, 4)
    oo, lo = _given_outputs(out, lse, oa.shape, lead)
    _check_outputs(inputs, {"out": oo, "lse": lo}, allowed={"out": ("o_a", "o_b"), "lse": ("lse_a", "lse_b")})
    rows = math.prod(lead)
    blocks = -(-rows // MERGE_WARPS)
    if blocks > _INT32_MAX:
        raise ArgumentError(f"o_a: {rows} rows are too many for one launch")
    oo, lo = _new_outputs(oa, oo, lo, oa.shape, lead)
    if rows:
        kset.launch("merge_states", grid=(blocks,), args=[oa, la, ob, lb, oo, lo, np.int64(rows)], like=oa)
    return AttentionOutput(oo.obj, lo.obj)


KERNELS = [
    KernelDef(name="tree_verify", template="tree_verify.cu.j2", entry="ddtree_tree_verify",
              plan=verify_plan, launch=tree_verify, context={"tail": False}),
    KernelDef(name="tree_verify_tail", template="tree_verify.cu.j2", entry="ddtree_tree_verify_tail",
              plan=tail_plan, launch=tree_verify_tail, context={"tail": True}),
    KernelDef(name="merge_states", template="merge_states.cu.j2", entry="ddtree_merge_states",
              plan=merge_plan, launch=merge_states),
]

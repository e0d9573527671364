"""Argument checks shared by the attention launchers (CUDA-core, mma.sync and wgmma tree_verify,
tree_verify_tail, merge_states): shapes against the spec, the cache's dtype and kv_scale against the
spec's kv_dtype, devices, alignment and overlap.

Pointer checks (alignment, overlap) are recorded in a PointerChecks as they run, so that a cached
call (runtime.run_call) repeats exactly them, with the same messages, on every later call.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import arrays as ar
from ..errors import ArgumentError

INT32_MAX = 2**31 - 1
LOG2E = 1.4426950408889634
# the attention launchers' array arguments, in the order of the call's array list
ATTENTION_ARRAYS = ("q_nope", "q_pe", "kv_cache", "block_table", "prefix_lens", "q_lens", "tree_mask", "out", "lse")
INDEX = {name: i for i, name in enumerate(ATTENTION_ARRAYS)}


class PointerChecks:
    """Alignment and overlap checks: run now, and recorded for runtime.Prepared to repeat per call."""

    def __init__(self, index: dict):
        self.index = index      # argument name -> its position in the call's array list
        self.aligned: list = []
        self.disjoint: list = []

    def align(self, a: ar.DevArray, name: str, alignment: int, reader: str = "kernel", access: str = "reads") -> None:
        """`reader`: who reads it, for the message ("kernel", "tensor-core kernel"); `access`: "reads" or "writes"."""
        message = (f"{name}: data pointer {{ptr:#x}} is not {alignment}-byte aligned "
                   f"(the {reader} {access} it in {alignment}-byte units)")
        self.aligned.append((self.index[name], alignment, message))
        if a.ptr % alignment:
            raise ArgumentError(message.format(ptr=a.ptr))

    def no_overlap(self, outputs: dict, inputs: dict, allowed: dict | None = None) -> None:
        """Outputs must not share memory with inputs or each other; `allowed` maps an output name to
        the input names it may alias exactly (same pointer, same shape: an in-place operation)."""
        allowed = allowed or {}
        for oname, o in outputs.items():
            for iname, a in inputs.items():
                exact_ok = iname in allowed.get(oname, ()) and o.shape == a.shape
                message = f"{oname}: overlaps {iname} in memory" + (
                    f" (only {' or '.join(allowed[oname])} may be passed as {oname} exactly)"
                    if oname in allowed else " (outputs must not share memory with inputs)")
                self._disjoint(o, oname, a, iname, exact_ok, message)
        names = list(outputs)
        for x in range(len(names)):
            for y in range(x + 1, len(names)):
                self._disjoint(outputs[names[y]], names[y], outputs[names[x]], names[x], False,
                               f"{names[y]}: overlaps {names[x]} in memory")

    def _disjoint(self, a, aname, b, bname, exact_ok, message) -> None:
        entry = (self.index[aname], a.nbytes, self.index[bname], b.nbytes, exact_ok, message)
        self.disjoint.append(entry)
        pa, pb, na, nb = a.ptr, b.ptr, a.nbytes, b.nbytes
        if na and nb and pa < pb + nb and pb < pa + na and not (exact_ok and pa == pb):
            raise ArgumentError(message)


def check_attention_inputs(spec, ptrs: PointerChecks, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                           tree_mask, softmax_scale, kv_scale=None, *, q_align: int, reader: str = "kernel",
                           row_indices32: bool = False) -> tuple[dict, float, float]:
    """Shapes, dtypes, contiguity, devices, alignment and the spec's H / R / P / page_size / W / kv_dtype
    (host only).

    q_align: the alignment of q_nope and q_pe in bytes (kv_cache: always 16). row_indices32: the
    kernel indexes cache rows (page x page_size + offset) in 32 bits, so num_pages x page_size
    must be < 2**31 (else only num_pages and max_pages, passed as int, must be). kv_scale: required
    for an fp8 spec, refused for a bf16 one (kv_scale_arg).
    Returns (the inputs by name, in the kernels' argument order, as DevArrays; the kernels' scale_log2 =
    softmax_scale x kv_scale x log2(e); their v_scale = kv_scale, 1 for a bf16 cache).
    """
    nh, rank, rope, page, n, w = (spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size,
                                  spec.max_tree_size, spec.mask_words)
    of = f"of spec {spec.name!r}"
    qn = ar.device_array(q_nope, "q_nope", dtype="bf16", ndim=4)
    b, nq, h, r = qn.shape
    if h != nh:
        raise ArgumentError(f"q_nope: H = {h} (dimension 2) must equal num_heads = {nh} {of}")
    if r != rank:
        raise ArgumentError(f"q_nope: R = {r} (dimension 3) must equal kv_lora_rank = {rank} {of}")
    if not 1 <= nq <= n:
        raise ArgumentError(f"q_nope: Nq = {nq} (dimension 1) must be in [1, max_tree_size = {n}] {of}")
    qp = ar.device_array(q_pe, "q_pe", dtype="bf16", ndim=4)
    if qp.shape[3] != rope:
        raise ArgumentError(f"q_pe: P = {qp.shape[3]} (dimension 3) must equal qk_rope_head_dim = {rope} {of}")
    if qp.shape != (b, nq, h, rope):
        raise ArgumentError(f"q_pe: shape {qp.shape}, expected {(b, nq, h, rope)} (B, Nq, H of q_nope)")
    kv = ar.kv_array(kv_cache, "kv_cache", spec, ndim=3)
    num_pages, ps, row = kv.shape
    if ps != page:
        raise ArgumentError(f"kv_cache: page_size = {ps} (dimension 1) must equal page_size = {page} {of}")
    if row != rank + rope:
        raise ArgumentError(f"kv_cache: row width {row} (dimension 2) must equal kv_lora_rank + qk_rope_head_dim "
                            f"= {rank + rope} {of}")
    bt = ar.device_array(block_table, "block_table", dtype="int32", ndim=2)
    if bt.shape[0] != b:
        raise ArgumentError(f"block_table: {bt.shape[0]} rows (dimension 0), expected batch size {b} of q_nope")
    max_pages = bt.shape[1]
    pl = ar.device_array(prefix_lens, "prefix_lens", dtype="int32", shape=(b,))
    ql = ar.device_array(q_lens, "q_lens", dtype="int32", shape=(b,))
    tm = ar.device_array(tree_mask, "tree_mask", dtype="uint32", ndim=3)
    if tm.shape[2] != w:
        raise ArgumentError(f"tree_mask: W = {tm.shape[2]} (dimension 2) must equal mask_words = "
                            f"ceil(max_tree_size / 32) = {w} {of}")
    if tm.shape != (b, nq, w):
        raise ArgumentError(f"tree_mask: shape {tm.shape}, expected {(b, nq, w)} (B, Nq of q_nope)")
    v_scale = kv_scale_arg(spec, kv_scale)
    scale_log2 = softmax_scale_log2(softmax_scale, v_scale)
    inputs = {"q_nope": qn, "q_pe": qp, "kv_cache": kv, "block_table": bt, "prefix_lens": pl, "q_lens": ql,
              "tree_mask": tm}
    ar.same_device(inputs)
    ptrs.align(kv, "kv_cache", 16, reader)
    ptrs.align(qn, "q_nope", q_align, reader)
    ptrs.align(qp, "q_pe", q_align, reader)
    if row_indices32:
        if num_pages * page > INT32_MAX or max_pages > INT32_MAX:
            raise ArgumentError(f"kv_cache/block_table: num_pages x page_size = {num_pages * page} cache rows and "
                                f"max_pages {max_pages} must be < 2**31 (32-bit row indices)")
    elif num_pages > INT32_MAX or max_pages > INT32_MAX:
        raise ArgumentError(f"kv_cache/block_table: num_pages {num_pages} and max_pages {max_pages} "
                            f"must be < 2**31")
    return inputs, scale_log2, v_scale


class AttentionChecked(NamedTuple):
    """What check_attention_call found: the pointer checks (to add the caller's other buffers to), the inputs by name
    as DevArrays, the kernels' scale_log2 and v_scale, and the caller's out / lse (None: not given)."""
    ptrs: PointerChecks
    inputs: dict
    scale_log2: float
    v_scale: float
    out: object
    lse: object


def check_attention_call(spec, index: dict, arrays, softmax_scale, kv_scale=None, *, q_align: int,
                         reader: str = "kernel", row_indices32: bool = False) -> AttentionChecked:
    """The checks every tree_verify / tree_verify_tail launch takes, in one pass before its launch plan: the inputs
    (check_attention_inputs) and the caller's out / lse buffers (given_outputs); `index`: the call's array positions
    by name (the pointer checks'). The launch plan adds its own buffers and checks them all together
    (check_outputs) before anything is allocated."""
    ptrs = PointerChecks(index)
    inputs, scale_log2, v_scale = check_attention_inputs(spec, ptrs, *arrays[:7], softmax_scale, kv_scale,
                                                         q_align=q_align, reader=reader, row_indices32=row_indices32)
    b, nq, h, r = inputs["q_nope"].shape
    out, lse = given_outputs(arrays[7], arrays[8], (b, nq, h, r), (b, nq, h))
    return AttentionChecked(ptrs, inputs, scale_log2, v_scale, out, lse)


F32_TINY, F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def kv_scale_arg(spec, kv_scale) -> float:
    """The dequantization scale of the spec's cache: kv_scale for kv_dtype "fp8_e4m3" (required: a real
    number, finite, > 0 and a normal float32), 1.0 for "bf16" (where kv_scale must not be given)."""
    of = f"spec {spec.name!r}"
    if not spec.kv_fp8:
        if kv_scale is not None:
            raise ArgumentError(f"kv_scale: given ({kv_scale!r}), but {of} has kv_dtype {spec.kv_dtype!r}: its cache "
                                f"holds the values themselves (kv_scale is for kv_dtype 'fp8_e4m3' only)")
        return 1.0
    if kv_scale is None:
        raise ArgumentError(f"kv_scale: required for kv_dtype {spec.kv_dtype!r} of {of} (the cache holds e4m3 "
                            f"bytes; the value of an element is e4m3 x kv_scale)")
    scale = ar.float_arg(kv_scale, "kv_scale")
    if not scale > 0:
        raise ArgumentError(f"kv_scale: {scale} must be > 0")
    if not F32_TINY <= scale <= F32_MAX:
        raise ArgumentError(f"kv_scale: {scale} is out of the normal float32 range [{F32_TINY:.3g}, {F32_MAX:.3g}] "
                            f"(the kernels apply it in fp32)")
    return scale


def softmax_scale_log2(softmax_scale, kv_scale: float = 1.0) -> float:
    """softmax_scale x kv_scale x log2(e), the factor the kernels apply to q . k (they use exp2; an fp8
    cache's keys are e4m3 x kv_scale, so its scale is folded in here)."""
    scale = ar.float_arg(softmax_scale, "softmax_scale")
    scale_log2 = scale * kv_scale * LOG2E
    if not abs(scale_log2) < F32_MAX:
        extra = f" x kv_scale {kv_scale}" if kv_scale != 1.0 else ""
        raise ArgumentError(f"softmax_scale: {scale}{extra} is out of float32 range")
    return scale_log2


def given_outputs(out, lse, out_shape: tuple, lse_shape: tuple):
    """The caller's out (bf16) and lse (float32) buffers as DevArrays, None where not given."""
    oa = ar.device_array(out, "out", dtype="bf16", shape=out_shape) if out is not None else None
    la = ar.device_array(lse, "lse", dtype="float32", shape=lse_shape) if lse is not None else None
    return oa, la


def check_outputs(ptrs: PointerChecks, inputs: dict, outputs: dict, *, allowed: dict | None = None,
                  reader: str = "kernel") -> None:
    """The caller's output buffers (name -> DevArray or None: not given): on the device of the first
    input, out 4-byte aligned, no memory shared with the inputs or each other (`allowed`: see no_overlap)."""
    given = {k: v for k, v in outputs.items() if v is not None}
    if not given:
        return
    first = next(iter(inputs))
    ar.same_device({first: inputs[first], **given})
    if "out" in given:
        ptrs.align(given["out"], "out", 4, reader)
    ptrs.no_overlap(given, inputs, allowed)


def host_copy(a: ar.DevArray) -> np.ndarray:
    """A synchronizing host copy (validate=True only)."""
    if a.kind == "torch":
        return a.obj.detach().cpu().numpy()
    import cupy
    with cupy.cuda.Device(a.device):
        return cupy.asnumpy(cupy.asarray(a.obj))


def validate_attention_values(tail: bool, inputs: dict, page_size: int) -> None:
    """validate=True: the device-side lengths and block table on the host (a sync), before launch."""
    pl, ql, bt = inputs["prefix_lens"], inputs["q_lens"], inputs["block_table"]
    nq, num_pages = inputs["q_nope"].shape[1], inputs["kv_cache"].shape[0]
    prefix, qlens, table = (host_copy(pl).astype(np.int64), host_copy(ql).astype(np.int64),
                            host_copy(bt).astype(np.int64))
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

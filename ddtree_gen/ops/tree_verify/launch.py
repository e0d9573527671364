"""Launchers of tree_verify, tree_verify_tail (every implementation) and merge_states.

A call is one record (route.VerifyCall: the arrays, scalars and choices it was given). `verify` enters the
runtime once (runtime.run_call, its launch plan cached per call signature); on a new signature `prepare` reads the
shapes and the device, asks the one route (ops/tree_verify/route.route: fp8 path, then backend, then build) what the
call runs, checks the arguments once (checks.check_attention_call, with the backend's alignment rules), then builds
the CUDA-core or the tensor-core launch plan (tensor_core.prepare_attention); which.which_kernel
/ which.schedule report the same route. Backends: "wgmma" (the Hopper warpgroup tensor-core kernels), "mma" (the
mma.sync ones), "simple" (the CUDA-core kernels: one block per (request, query row, group of heads), keys streamed
through shared memory with an online softmax). On a GPU other than H100 / H200 (or with DDTREE_GEN_ARCH=sm_80) the
wgmma kernels do not run (they are built for sm_90a only), and the mma.sync ones only where the device allows their
shared memory (A100, B200: yes; L4, L40S, RTX cards: no): see archs.py and KernelSet.unavailable. An fp8 spec has no
mma.sync kernels (plans: KernelDef.kv_dtypes): "auto" is wgmma where it runs, else the CUDA-core kernel, and
impl="mma" is an ArgumentError.
An fp8 spec's launches take kv_scale (the value of a cache element is e4m3 x kv_scale): folded into the scores'
factor and applied to the output, in fp32 (launch/checks.py kv_scale_arg); a bf16 spec refuses kv_scale.
The tensor-core families' own launchers (kset.tree_verify_wgmma, ...: family_launcher) take the same route with
their impl.

Values that live on the device (prefix_lens, q_lens, block_table) are never read on the host by
default, so a launch can be captured in a CUDA graph; the kernels are safe for any values instead
(docs/contract.md, docs/decisions.md). validate=True copies them to the host first (a sync) and
raises ArgumentError for values out of range. Shapes, dtypes, contiguity, devices, the spec's
H / R / P / page_size / W, alignment and overlap of outputs with inputs are always checked, on the
host, once per call signature (launch/checks.py, runtime.run_call). merge_states allows out to be
o_a or o_b, and lse to be lse_a or lse_b (in-place merge); any other overlap is refused.
"""
from __future__ import annotations

import math

import numpy as np

from ...launch import arrays as ar
from ...errors import ArgumentError
from ... import reference
from . import simple as _plans
from ...build.declaration import Bundles, Declaration, TorchOp
from .. import by_name
from .simple import MERGE_WARPS
from ...launch.runtime import Prepared, Step, run_call
from ...types import AttentionOutput
from .tensor_core import INDEX_TC, TENSOR_CORE_CHECKS, prepare_attention
from .route import (FP8_PATHS, IMPLS, KV_WORKSPACE_LIMIT, VerifyCall, auto_impl, dequant_kernels, fp8_default, route,
                    why_not)
from ...launch.checks import (INDEX, INT32_MAX, PointerChecks, check_attention_call, check_outputs, given_outputs,
                              validate_attention_values)

__all__ = ["FP8_PATHS", "IMPLS", "KV_WORKSPACE_LIMIT", "VerifyCall", "auto_impl", "dequant_kernels", "fp8_default",
           "merge_states", "prepare", "tree_verify", "tree_verify_tail", "verify", "why_not"]


def prepare(kset, call: VerifyCall) -> Prepared:
    """The checks and launch plan of one call signature: what the kernel set offers on the arrays' device (asked
    once), the call's route, the arguments' checks (one pass, checks.check_attention_call: the inputs and the caller's
    out / lse), then the CUDA-core kernel's plan (_prepare_simple) or the tensor-core one's
    (tensor_core.prepare_attention), which add their own buffers' checks."""
    q = _shape(call.arrays[0], "q_nope")
    table = _shape(call.arrays[3], "block_table")
    known = q is not None and len(q[0]) == 4 and table is not None and len(table[0]) == 2
    b, nq = (q[0][0], q[0][1]) if known else (0, 0)
    offer = kset.offer(q[1] if known else None)
    r = route(offer, call, b, nq, table[0][1] if known else 0)
    if r.impl == "simple":
        return _prepare_simple(offer, call, check_attention_call(offer.spec, INDEX, call.arrays, call.softmax_scale,
                                                                 call.kv_scale, q_align=4))
    if r.build not in offer.spec_builds:   # the mma.sync kernels and an fp8 spec
        raise ArgumentError(by_name(r.build).why_not_built(offer.spec))
    return prepare_attention(offer, r.build, call.tail, call.arrays,
                             check_attention_call(offer.spec, INDEX_TC, call.arrays, call.softmax_scale,
                                                  call.kv_scale, **TENSOR_CORE_CHECKS),
                             call.validate, call.num_splits)


def _shape(x, name: str) -> tuple | None:
    """The (shape, device) of a usable CUDA array, None if it is not one (the checks then say what is wrong)."""
    try:
        v = ar.view(x, name)[0]
        return v.shape, v.device
    except ArgumentError:
        return None


def verify(kset, call: VerifyCall) -> AttentionOutput:
    """Run `call`: the runtime entered once, its launch plan cached per call signature (runtime.run_call)."""
    return run_call(kset, lambda: prepare(kset, call), call.arrays, call.key(), cache=not call.validate)


def _prepare_simple(offer, call: VerifyCall, checked) -> Prepared:
    """The CUDA-core kernel of `call.name`: the launch plan of one call signature, after its checks (`checked`:
    checks.check_attention_call's)."""
    spec, name = offer.spec, call.name
    ptrs, inputs, scale_log2, v_scale, oa, la = checked
    qn = inputs["q_nope"]
    b, nq, h, r = qn.shape
    num_pages, max_pages = inputs["kv_cache"].shape[0], inputs["block_table"].shape[1]
    if name not in offer.consts:   # not loaded in the kernel set
        raise ArgumentError(offer.unavailable(name))
    groups = offer.constants(name)["HEAD_GROUPS"]
    if groups * nq * b > INT32_MAX:
        raise ArgumentError(f"q_nope: batch size {b} too large for one launch")
    # the caller's buffers are checked before anything is allocated or copied
    check_outputs(ptrs, inputs, {"out": oa, "lse": la})
    if call.validate and b:
        validate_attention_values(call.tail, inputs, spec.page_size)
    steps = (Step(name, (groups * nq * b,), (0, 1, 2, 3, 4, 5, 6, np.float32(scale_log2), np.float32(v_scale),
                                              np.int32(nq), np.int32(max_pages), np.int32(num_pages), 7, 8)),) if b else ()
    return Prepared(device=qn.device, kind=qn.kind, steps=steps,
                    new=((7, (b, nq, h, r), "bf16"), (8, (b, nq, h), "float32")),
                    aligned=tuple(ptrs.aligned), disjoint=tuple(ptrs.disjoint),
                    returns=(AttentionOutput, (7, 8)))


def tree_verify(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                out=None, lse=None, *, validate=False, impl="auto", workspace=None,
                num_splits=None, kv_scale=None, fp8_path=None, kv_workspace=None, build=None) -> AttentionOutput:
    """Tree attention over the prefix and the tree (docs/contract.md tree_verify), on the current stream.

    q_nope [B,Nq,H,R] bf16, q_pe [B,Nq,H,P] bf16, kv_cache [num_pages,page_size,R+P] bf16 (an fp8
    spec: e4m3 bytes, uint8 / torch.float8_e4m3fn, with kv_scale: finite, > 0),
    block_table [B,max_pages] int32, prefix_lens [B] int32, q_lens [B] int32,
    tree_mask [B,Nq,W] uint32, softmax_scale finite. Returns AttentionOutput(out [B,Nq,H,R] bf16,
    lse [B,Nq,H] float32); rows i >= q_len are not written. validate=True checks the device-side
    lengths and block table on the host first (a sync); see the module docstring.

    impl: "auto" (tree_verify_wgmma, else tree_verify_mma, whichever the kernel set has loaded
    first, else the CUDA-core kernel), "wgmma" / "mma" (that tensor-core kernel; ArgumentError
    if the kernel set lacks it) or "simple" (the CUDA-core kernel). The tensor-core kernels need
    q_nope and q_pe 16-byte aligned (the CUDA-core one: 4) and take workspace / num_splits (workspace: float32,
    at least ks.tree_verify_schedule(B, Nq, max_pages).workspace elements; num_splits: key chunks per request, or
    parts of the batch on the parts grid; None: from the shapes); they are refused with impl="simple" and unused
    when "auto" picks the CUDA-core kernel. build: a build of the tensor-core kernel by name ("default", "parts",
    "dequant", "dequant_parts" of tree_verify_wgmma: for tests and benchmarks; None: the kernel's rule picks).

    fp8_path (an fp8 spec only): "fused": the wgmma kernel converts the e4m3 tiles on chip (impl picks it as for a
    bf16 spec); "dequant": kv_dequant first converts the e4m3 pages the call reads (keys < prefix_len + q_len) into a
    bf16 workspace, and tree_verify_wgmma's dequantize build (the bf16-cache seesaw) reads it: the same bits as
    "fused" (but where the parts rule takes its parts-grid build: contract section 4b), Hopper only (impl "auto" or
    "wgmma"); None (the default): "dequant" where fp8_default allows it (impl "auto" / "wgmma", its kernels loaded and
    running on the device, the workspace it would allocate at most KV_WORKSPACE_LIMIT = 512 MiB or kv_workspace
    given), else "fused"; decided once per call signature. Its kv_workspace (fp8_path "dequant", or None where that
    takes the dequantize path; an ArgumentError where it takes the fused kernel): bf16 (uint16 on CuPy,
    torch.bfloat16), contiguous, 16-byte aligned, at least ops.kv_dequant.plan.workspace_elems(spec, B, max_pages)
    elements (B * max_pages * (page_size * (R + P) * 2 + 4) bytes: the pages, then their block table); allocated per
    call when not given.
    """
    return verify(kset, VerifyCall("tree_verify", (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                                                   tree_mask, out, lse, workspace, kv_workspace),
                                   softmax_scale, kv_scale, validate, impl, num_splits, fp8_path, build))


def tree_verify_tail(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                     out=None, lse=None, *, validate=False, impl="auto", workspace=None,
                     num_splits=None, kv_scale=None) -> AttentionOutput:
    """tree_verify over the tree tail alone (keys prefix_len + j with mask bit j set), for
    merging with an external prefix kernel through merge_states. Same arguments as tree_verify but fp8_path,
    kv_workspace and build (impl "wgmma" / "mma" picks tree_verify_tail_wgmma / tree_verify_tail_mma): it has no
    dequantize path, an fp8 spec's tail always runs the fused kernel (fp8_default says so)."""
    return verify(kset, VerifyCall("tree_verify_tail", (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens,
                                                        tree_mask, out, lse, workspace, None),
                                   softmax_scale, kv_scale, validate, impl, num_splits))


def family_launcher(name: str, impl: str, doc: str):
    """The launcher of one tensor-core kernel (tree_verify_wgmma, tree_verify_tail_mma, ...): `name` (tree_verify or
    tree_verify_tail) with impl=`impl`, an fp8 spec's cache read by the fused kernel unless `build` names a dequantize
    build; the same route and arguments as `name`'s (and build= for tree_verify's kernels)."""
    def launch(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
               out=None, lse=None, *, validate=False, workspace=None, num_splits=None, kv_scale=None,
               build=None) -> AttentionOutput:
        # (an fp8 spec's path: the route's, by the build named)
        return verify(kset, VerifyCall(name, (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                              out, lse, workspace, None),
                                       softmax_scale, kv_scale, validate, impl, num_splits, None, build, True))
    launch.__doc__ = doc
    return launch


_MERGE_INDEX = {name: i for i, name in enumerate(("o_a", "lse_a", "o_b", "lse_b", "out", "lse"))}


def merge_states(kset, o_a, lse_a, o_b, lse_b, out=None, lse=None) -> AttentionOutput:
    """Merge two attention states (docs/contract.md merge_states), natural-log LSE, on the current stream.

    o_a, o_b [..., R] bf16; lse_a, lse_b [...] float32 (o's shape without R). A side whose lse is
    not finite (-inf, +inf, NaN) is empty; two empty sides give o = 0, lse = -inf. out may be o_a
    or o_b and lse may be lse_a or lse_b (in place). Returns AttentionOutput(out, lse).
    """
    arrays = (o_a, lse_a, o_b, lse_b, out, lse)
    return run_call(kset, lambda: _prepare_merge(kset, arrays), arrays, ())


def _prepare_merge(kset, arrays) -> Prepared:
    rank = kset.spec.kv_lora_rank
    oa = ar.device_array(arrays[0], "o_a", dtype="bf16")
    if len(oa.shape) < 1 or oa.shape[-1] != rank:
        raise ArgumentError(f"o_a: shape {oa.shape} must end in kv_lora_rank = {rank} of spec {kset.spec.name!r}")
    lead = oa.shape[:-1]
    la = ar.device_array(arrays[1], "lse_a", dtype="float32", shape=lead)
    ob = ar.device_array(arrays[2], "o_b", dtype="bf16", shape=oa.shape)
    lb = ar.device_array(arrays[3], "lse_b", dtype="float32", shape=lead)
    inputs = {"o_a": oa, "lse_a": la, "o_b": ob, "lse_b": lb}
    ar.same_device(inputs)
    ptrs = PointerChecks(_MERGE_INDEX)
    for k, v in inputs.items():
        ptrs.align(v, k, 4)
    oo, lo = given_outputs(arrays[4], arrays[5], oa.shape, lead)
    check_outputs(ptrs, inputs, {"out": oo, "lse": lo}, allowed={"out": ("o_a", "o_b"), "lse": ("lse_a", "lse_b")})
    rows = math.prod(lead)
    blocks = -(-rows // MERGE_WARPS)
    if blocks > INT32_MAX:
        raise ArgumentError(f"o_a: {rows} rows are too many for one launch")
    steps = (Step("merge_states", (blocks,), (0, 1, 2, 3, 4, 5, np.int64(rows))),) if rows else ()
    return Prepared(device=oa.device, kind=oa.kind, steps=steps, new=((4, oa.shape, "bf16"), (5, lead, "float32")),
                    aligned=tuple(ptrs.aligned), disjoint=tuple(ptrs.disjoint),
                    returns=(AttentionOutput, (4, 5)))


# ------------------------------------------------------------------ the torch ops and the declarations

def torch_tree_verify(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                      impl="auto", kv_scale=None, fp8_path=None):
    """torch.ops.ddtree.tree_verify's implementation: the op's arguments (after spec) as kset.tree_verify takes them."""
    return kset.tree_verify(q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                            impl=impl, kv_scale=kv_scale, fp8_path=fp8_path)


def torch_tree_verify_tail(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                           impl="auto", kv_scale=None):
    """torch.ops.ddtree.tree_verify_tail's implementation (as torch_tree_verify, without fp8_path)."""
    return kset.tree_verify_tail(q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                                 impl=impl, kv_scale=kv_scale)


def attention_torch_fake(spec, q_nope, *args):
    """The fake (meta) implementation of tree_verify's and tree_verify_tail's ops: out like q_nope, lse [B, Nq, H]."""
    import torch
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:3], dtype=torch.float32)


def merge_torch_fake(spec, o_a, lse_a, o_b, lse_b):
    """merge_states' op's fake (meta) implementation."""
    return o_a.new_empty(o_a.shape), lse_a.new_empty(lse_a.shape)


# the torch ops' attention arguments (tree_verify, tree_verify_tail: the same schema)
ATTENTION_ARGS = ("Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor prefix_lens, "
                  "Tensor q_lens, Tensor tree_mask, float softmax_scale, str impl='auto', float? kv_scale=None")

DECLARATIONS = [
    Declaration(_plans.KERNELS[0], launcher=tree_verify, reference=reference.tree_verify, output=AttentionOutput,
                # tree_verify's own last argument: an fp8 spec's path (None / "fused" / "dequant": fp8_default)
                torch_ops=(TorchOp(f"tree_verify(str spec, {ATTENTION_ARGS}, str? fp8_path=None) -> (Tensor, Tensor)",
                                   fake=attention_torch_fake, impl=torch_tree_verify),),
                sanitize=_plans.sanitizer_cases,
                bundles=Bundles(_plans.bundle_inputs, _plans.BUNDLE_CASES, run=_plans.bundle_run)),
    Declaration(_plans.KERNELS[1], launcher=tree_verify_tail, reference=reference.tree_verify_tail,
                output=AttentionOutput,
                torch_ops=(TorchOp(f"tree_verify_tail(str spec, {ATTENTION_ARGS}) -> (Tensor, Tensor)",
                                   fake=attention_torch_fake, impl=torch_tree_verify_tail),),
                sanitize=_plans.sanitizer_cases,
                bundles=Bundles(_plans.bundle_inputs, _plans.BUNDLE_CASES, run=_plans.tail_bundle_run)),
    Declaration(_plans.KERNELS[2], launcher=merge_states, reference=reference.merge_states, output=AttentionOutput,
                torch_ops=(TorchOp("merge_states(str spec, Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b) "
                                   "-> (Tensor, Tensor)", fake=merge_torch_fake),),
                sanitize=_plans.merge_sanitizer_cases,
                bundles=Bundles(_plans.merge_bundle_inputs, _plans.MERGE_BUNDLE_CASES)),
]

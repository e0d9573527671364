"""Launchers of tree_verify, tree_verify_tail (every implementation) and merge_states.

kset.tree_verify(..., impl="auto"|"wgmma"|"mma"|"simple") and kset.tree_verify_tail pick the
implementation:
  * "wgmma": the Hopper warpgroup tensor-core kernels (kernels/tree_verify_wgmma.py), the fastest;
  * "mma": the mma.sync tensor-core kernels (kernels/tree_verify_mma.py); both take workspace= and
    num_splits= (split-KV, combined by tree_verify_mma_combine; their shared launch path:
    kernels/tensor_core.py);
  * "simple": the CUDA-core kernels launched here: one block per (request, query row, group of
    heads), keys streamed through shared memory with an online softmax;
  * "auto" (the default): the first of wgmma, mma whose kernels (with the combine kernel) the
    kernel set has loaded and that run on the arrays' device, else the CUDA-core one; decided here
    only (_pick_impl, _first_that_runs; auto_impl and why_not tell the benches what a call runs). The
    kernel of each tensor-core impl is the one whose build serves (launcher, impl) (plans/:
    KernelDef.serves), never a name put together here. On a GPU
    other than H100 / H200 (or with DDTREE_GEN_ARCH=sm_80) the wgmma kernels do not run (they are
    built for sm_90a only), and the mma.sync ones only where the device allows their shared memory
    (A100, B200: yes; L4, L40S, RTX cards: no): see archs.py and KernelSet.unavailable.
An fp8 spec (kv_dtype "fp8_e4m3": the cache holds e4m3 bytes) has no mma.sync kernels (plans: KernelDef
.kv_dtypes): "auto" is wgmma where it runs, else the CUDA-core kernel, and impl="mma" is an ArgumentError.
Its launches take kv_scale (the value of a cache element is e4m3 x kv_scale): folded into the scores'
factor and applied to the output, in fp32 (kernels/checks.py kv_scale_arg); a bf16 spec refuses kv_scale.
Its tree_verify reads the e4m3 cache by one of two paths of the same bits: "fused" (the kernel impl picks converts
the tiles on chip) or "dequant" (kv_dequant into a bf16 workspace, then tree_verify_wgmma_dequant: measured faster;
at B >= 8 with H <= 8 its parts-grid build, bits of its own: contract section 4b);
fp8_path=None (the default) takes "dequant" where fp8_default allows it (impl "auto" / "wgmma", its kernels loaded
and running on the device, a workspace of at most KV_WORKSPACE_LIMIT bytes), per call signature; tree_verify_tail
is always fused.

Values that live on the device (prefix_lens, q_lens, block_table) are never read on the host by
default, so a launch can be captured in a CUDA graph; the kernels are safe for any values instead
(docs/contract.md, docs/decisions.md). validate=True copies them to the host first (a sync) and
raises ArgumentError for values out of range. Shapes, dtypes, contiguity, devices, the spec's
H / R / P / page_size / W, alignment and overlap of outputs with inputs are always checked, on the
host, once per call signature (kernels/checks.py, runtime.run_call). merge_states allows out to be
o_a or o_b, and lse to be lse_a or lse_b (in-place merge); any other overlap is refused.
"""
from __future__ import annotations

import math

import numpy as np

from .. import arrays as ar
from ..errors import ArgumentError
from ..plans import all_kernels, by_name
from .. import reference
from ..plans import tree_verify as _plans
from ..plans.declaration import Bundles, Declaration, TorchOp
from ..plans.tree_verify import MERGE_WARPS
from ..plans.split_kv import COMBINE
from ..runtime import Prepared, Step, run_call
from ..types import AttentionOutput
from .tensor_core import KV_DEQUANT, KVW, WS, attention, attention_dequant, available, prepare_attention
from ..plans.kv_dequant import workspace_elems
from ..plans.tree_verify_wgmma import DEQUANT
from .checks import (INDEX, INT32_MAX, PointerChecks, check_attention_inputs, check_outputs, given_outputs,
                     validate_attention_values)

IMPLS = ("auto", "wgmma", "mma", "simple")
TENSOR_CORE_IMPLS = ("wgmma", "mma")   # in the order "auto" prefers them
# (launcher, impl) -> the tensor-core kernel that serves it: its KernelDef's `serves` (plans/)
_SERVED_BY = {k.serves: k.name for k in all_kernels() if k.serves}


def _kernel(name: str, kind: str) -> str:
    """The kernel that launcher `name` (tree_verify, tree_verify_tail) runs for impl=`kind` ("wgmma", "mma")."""
    return _SERVED_BY[(name, kind)]


def _loaded(kset, name: str) -> bool:
    """Whether kernel `name` is loaded in kset (KernelSet.kernels: it has a build there)."""
    return name in kset.kernels


def _built_for(kset, kernel: str) -> bool:
    """Whether the spec of kset gets kernel `kernel` at all (its kv_dtype: KernelDef.kv_dtypes)."""
    return by_name(kernel).builds_for(kset.spec)


def _pick_impl(kset, name: str, impl, workspace, num_splits) -> tuple:
    """The implementations `impl` may send launcher `name` to, in order of preference: ("simple",),
    one tensor-core kind ("wgmma" / "mma": impl asks for it), or for "auto" the loaded tensor-core
    kinds the spec is built with, followed by "simple" (the first that runs on the call's device is
    used: _prepare_auto)."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ArgumentError(f"impl: {impl!r}, expected one of {', '.join(map(repr, IMPLS))}")
    if impl == "simple":
        for arg, value in (("workspace", workspace), ("num_splits", num_splits)):
            if value is not None:
                raise ArgumentError(f"{arg}: only the tensor-core kernels take it, but impl='simple' "
                                    f"(the CUDA-core kernel) was asked")
        return ("simple",)
    if impl == "auto":
        return (*(kind for kind in TENSOR_CORE_IMPLS
                  if _built_for(kset, _kernel(name, kind))
                  and all(_loaded(kset, k) for k in (_kernel(name, kind), COMBINE))),
                "simple")
    if not _built_for(kset, _kernel(name, impl)):
        spec = kset.spec
        others = [k for k in IMPLS if k in ("auto", "simple") or _built_for(kset, _kernel(name, k))]
        raise ArgumentError(f"impl: {impl!r}: {by_name(_kernel(name, impl)).why_not_built(spec)}; "
                            f"pass impl={' or '.join(map(repr, others))}")
    # a kernel the set was asked for but holds no build of for its targets (wgmma when sm_80 is forced)
    # has its launcher: the launch says why it cannot run on the arrays' device
    missing = [k for k in (_kernel(name, impl), COMBINE)
               if not _loaded(kset, k) and k not in kset.requested]
    if missing:
        raise ArgumentError(f"impl: {impl!r} needs {' and '.join(missing)}, not loaded in this kernel set of "
                            f"spec {kset.spec.name!r} (load them, or pass impl='auto' or 'simple')")
    return (impl,)


def _device_of(q_nope) -> int | None:
    """The device of q_nope, None if it is not a usable CUDA array (the checks then say what is wrong)."""
    try:
        return ar.view(q_nope, "q_nope")[0].device
    except ArgumentError:
        return None


def _first_that_runs(kset, name, kinds, device) -> str:
    """The first of `kinds` (_pick_impl's candidates) whose kernel `name`_kind and the combine kernel run on
    `device` (None: not known, the checks will say why); "simple" is always last and always runs."""
    for kind in kinds:
        if kind == "simple" or device is None or (available(kset, _kernel(name, kind), device)
                                                  and available(kset, COMBINE, device)):
            return kind
    raise AssertionError(f"no implementation in {kinds}")


def auto_impl(kset, device: int, name: str = "tree_verify") -> str:
    """The implementation ("wgmma", "mma" or "simple") that launcher `name` (tree_verify or tree_verify_tail)
    with impl="auto" runs on `device`: the one rule of the dispatcher, for the benches to report."""
    return _first_that_runs(kset, name, _pick_impl(kset, name, "auto", None, None), device)


def why_not(kset, impl: str, device: int, name: str = "tree_verify") -> str | None:
    """Why launcher `name` with `impl` cannot run on `device` in kset: the ArgumentError's message a launch
    would raise (not built for the spec, not loaded, no build for the device); None if it can ("auto" and
    "simple" always can)."""
    try:
        kinds = _pick_impl(kset, name, impl, None, None)
    except ArgumentError as e:
        return str(e)
    if len(kinds) > 1 or kinds == ("simple",):
        return None
    return kset.unavailable(_kernel(name, kinds[0]), device) or kset.unavailable(COMBINE, device)


def _prepare_auto(kset, name, tail, kinds, arrays, softmax_scale, kv_scale, validate, num_splits) -> Prepared:
    """impl="auto" with a tensor-core kind loaded: the first of `kinds` whose kernels (and the combine
    kernel) run on the device of the arrays; "simple" last. Per call signature, so per device."""
    kind = _first_that_runs(kset, name, kinds, _device_of(arrays[0]))
    if kind == "simple":
        return _prepare_simple(kset, name, tail, arrays[:9], softmax_scale, kv_scale, validate)
    return prepare_attention(kset, _kernel(name, kind), tail, arrays, softmax_scale, validate, num_splits, kv_scale)


def _prepare_simple(kset, name, tail, arrays, softmax_scale, kv_scale, validate) -> Prepared:
    """The CUDA-core kernel `name`: checks and launch plan of one call signature."""
    spec = kset.spec
    ptrs = PointerChecks(INDEX)
    inputs, scale_log2, v_scale = check_attention_inputs(spec, ptrs, *arrays[:7], softmax_scale, kv_scale, q_align=4)
    qn = inputs["q_nope"]
    b, nq, h, r = qn.shape
    num_pages, max_pages = inputs["kv_cache"].shape[0], inputs["block_table"].shape[1]
    groups = kset.constants(name, qn.device)["HEAD_GROUPS"]
    if groups * nq * b > INT32_MAX:
        raise ArgumentError(f"q_nope: batch size {b} too large for one launch")
    # the caller's buffers are checked before anything is allocated or copied
    oa, la = given_outputs(arrays[7], arrays[8], (b, nq, h, r), (b, nq, h))
    check_outputs(ptrs, inputs, {"out": oa, "lse": la})
    if validate and b:
        validate_attention_values(tail, inputs, spec.page_size)
    steps = (Step(name, (groups * nq * b,), (0, 1, 2, 3, 4, 5, 6, np.float32(scale_log2), np.float32(v_scale),
                                              np.int32(nq), np.int32(max_pages), np.int32(num_pages), 7, 8)),) if b else ()
    return Prepared(device=qn.device, kind=qn.kind, steps=steps,
                    new=((7, (b, nq, h, r), "bf16"), (8, (b, nq, h), "float32")),
                    aligned=tuple(ptrs.aligned), disjoint=tuple(ptrs.disjoint),
                    returns=(AttentionOutput, (7, 8)))


FP8_PATHS = ("fused", "dequant")
# fp8_path=None (the default) takes the dequantize path only where the bf16 workspace it would allocate for the call,
# plans.kv_dequant.workspace_elems(spec, B, max_pages) x 2 bytes (B x max_pages pages of page_size x (R + P) bf16,
# 73,732 bytes a page for the shipped specs), is at most this many bytes: 512 MiB is B x max_pages = 7,281 such
# pages (B = 8 at 58K keys, B = 64 at 7K), a transient allocation per call that an engine can afford; past it the
# fused kernel reads the e4m3 cache with no workspace. A caller's kv_workspace always fits (it is already there).
KV_WORKSPACE_LIMIT = 512 * 2**20
DEQUANT_KERNELS = (KV_DEQUANT, DEQUANT, COMBINE)   # the dequantize path's kernels (the combine: split-KV)


def _shape_of(x, name: str) -> tuple | None:
    """The shape of a usable CUDA array, None if it is not one (the checks then say what is wrong)."""
    try:
        return ar.view(x, name)[0].shape
    except ArgumentError:
        return None


def fp8_default(kset, impl, device, b: int, max_pages: int, kv_workspace: bool = False,
                name: str = "tree_verify") -> tuple[str | None, str]:
    """The path an fp8 spec's `name` with fp8_path=None (the default) takes, and why: (path, reason), path "dequant"
    (kv_dequant into a bf16 workspace, then tree_verify_wgmma_dequant: the fused kernel's bits but on the parts grid, measured faster on
    every shape, docs/perf.md) or "fused" (the kernel impl picks reads the e4m3 cache itself). The first rule that
    fails gives "fused" and its reason:
      1. the launcher is tree_verify (tree_verify_tail has no dequantize path);
      2. impl is "auto" or "wgmma" (the dequantize path runs on the wgmma kernels);
      3. kv_dequant, tree_verify_wgmma_dequant and the combine kernel are loaded in kset;
      4. they run on `device` (Hopper; None: the arrays' device is not known, the call's checks will say why);
      5. `kv_workspace` (the caller gave one: it always fits), or the workspace the call would allocate,
         plans.kv_dequant.workspace_elems(spec, B, max_pages) bf16, is at most KV_WORKSPACE_LIMIT bytes.
    Otherwise "dequant". A bf16 spec: (None, reason): it has no fp8 path. The launcher decides once per call
    signature (shapes, device), so benches and engines may ask here what a call runs."""
    spec = kset.spec
    if not spec.kv_fp8:
        return None, f"spec {spec.name!r} has kv_dtype {spec.kv_dtype!r}: no fp8 path"
    if name != "tree_verify":
        return "fused", f"{name} has no dequantize path"
    if not isinstance(impl, str) or impl not in ("auto", "wgmma"):
        return "fused", f"impl={impl!r}: the dequantize path runs on the wgmma kernels (impl 'auto' or 'wgmma')"
    missing = [k for k in DEQUANT_KERNELS if not _loaded(kset, k)]
    if missing:
        return "fused", f"{' and '.join(missing)} not loaded in this kernel set"
    if device is None:
        return "fused", "the arrays' device is not known"
    for k in DEQUANT_KERNELS:
        why = kset.unavailable(k, device)
        if why:
            return "fused", why
    if kv_workspace:
        return "dequant", "the caller's kv_workspace"
    need = 2 * workspace_elems(spec, b, max_pages)
    mib = f"{need / 2**20:.1f} MiB (B = {b} x max_pages = {max_pages} bf16 pages)"
    if need > KV_WORKSPACE_LIMIT:
        return "fused", f"the workspace would be {mib}, over KV_WORKSPACE_LIMIT = {KV_WORKSPACE_LIMIT // 2**20} MiB"
    return "dequant", f"the workspace is {mib}, within KV_WORKSPACE_LIMIT = {KV_WORKSPACE_LIMIT // 2**20} MiB"


def _fp8_choice(kset, impl, fp8_path, kv_workspace) -> str | None:
    """What tree_verify's fp8_path asks, before anything is launched: "fused" (the fused kernel: an fp8 spec's
    fp8_path="fused"), "dequant" (fp8_path="dequant": impl "auto" or "wgmma", its kernels loaded), "auto" (an fp8
    spec's fp8_path=None: fp8_default decides per call signature) or None (a bf16 spec: no fp8 path). ArgumentError
    naming the argument otherwise."""
    spec = kset.spec
    if fp8_path is not None:
        if not isinstance(fp8_path, str) or fp8_path not in FP8_PATHS:
            raise ArgumentError(f"fp8_path: {fp8_path!r}, expected None (the default: fp8_default's choice), "
                                f"{' or '.join(map(repr, FP8_PATHS))}")
        if not spec.kv_fp8:
            raise ArgumentError(f"fp8_path: given ({fp8_path!r}), but spec {spec.name!r} has kv_dtype "
                                f"{spec.kv_dtype!r}: its cache is read as it is (fp8_path is for kv_dtype 'fp8_e4m3')")
    elif spec.kv_fp8:
        return "auto"
    if fp8_path != "dequant":
        if kv_workspace is not None:
            raise ArgumentError(f"kv_workspace: only the dequantize path (fp8_path='dequant') takes it, but fp8_path is "
                                f"{fp8_path!r}" + ("" if fp8_path else f" and spec {spec.name!r} has kv_dtype "
                                                                      f"{spec.kv_dtype!r}"))
        return "fused" if fp8_path else None
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ArgumentError(f"impl: {impl!r}, expected one of {', '.join(map(repr, IMPLS))}")
    if impl not in ("auto", "wgmma"):
        raise ArgumentError(f"fp8_path: 'dequant' runs on the wgmma kernels ({KV_DEQUANT}, {DEQUANT}), but impl="
                            f"{impl!r} was asked (pass impl='auto' or 'wgmma', or fp8_path=None)")
    missing = [k for k in (KV_DEQUANT, DEQUANT) if k not in kset.kernels and k not in kset.requested]
    if missing:
        raise ArgumentError(f"fp8_path: 'dequant' needs {' and '.join(missing)}, not loaded in this kernel set of spec "
                            f"{spec.name!r} (load them, or pass fp8_path=None)")
    return "dequant"


def _prepare_fp8_default(kset, impl, arrays, softmax_scale, kv_scale, validate, num_splits) -> Prepared:
    """An fp8 spec's tree_verify with fp8_path=None: the path fp8_default picks for this call signature, then that
    path's checks and plan (the dequantize path's, or what impl picks for the fused one: _pick_impl)."""
    table = _shape_of(arrays[3], "block_table")
    known = table is not None and len(table) == 2   # else the checks say what is wrong with block_table
    given = arrays[KVW] is not None
    path, why = fp8_default(kset, impl, _device_of(arrays[0]) if known else None, *(table if known else (0, 0)),
                            given)
    if path == "dequant":
        return prepare_attention(kset, DEQUANT, False, arrays, softmax_scale, validate, num_splits, kv_scale)
    if given:
        raise ArgumentError(f"kv_workspace: only the dequantize path takes it, but fp8_path=None takes the fused "
                            f"kernel here: {why} (pass fp8_path='dequant', or no kv_workspace)")
    kinds = _pick_impl(kset, "tree_verify", impl, arrays[WS], num_splits)
    if len(kinds) > 1:
        return _prepare_auto(kset, "tree_verify", False, kinds, arrays[:KVW], softmax_scale, kv_scale, validate,
                             num_splits)
    if kinds[0] == "simple":
        return _prepare_simple(kset, "tree_verify", False, arrays[:9], softmax_scale, kv_scale, validate)
    return prepare_attention(kset, _kernel("tree_verify", kinds[0]), False, arrays[:KVW], softmax_scale, validate,
                             num_splits, kv_scale)


def _dispatch(kset, name, tail, args, out, lse, validate, impl, workspace, num_splits, kv_scale) -> AttentionOutput:
    # the candidates depend on nothing else: cached beside the prepared calls
    pick = ("impl", name, impl, workspace is None, num_splits is None) if isinstance(impl, str) else None
    kinds = kset.prepared_calls.get(pick) if pick else None
    if kinds is None:
        kinds = _pick_impl(kset, name, impl, workspace, num_splits)
        kset.prepared_calls[pick] = kinds
    scale = args[7]
    if len(kinds) > 1:   # auto: which one runs depends on the device (part of the call's signature)
        arrays = (*args[:7], out, lse, workspace)

        def prepare_auto():
            return _prepare_auto(kset, name, tail, kinds, arrays, scale, kv_scale, validate, num_splits)
        return run_call(kset, prepare_auto, arrays, (name, kinds, type(scale), scale, type(num_splits), num_splits,
                                                     type(kv_scale), kv_scale), cache=not validate)
    kind = kinds[0]
    if kind != "simple":   # the tensor-core kernel's own launch (kernels/tree_verify_mma.py, _wgmma.py)
        return attention(kset, _kernel(name, kind), tail, *args, out, lse, validate, workspace, num_splits, kv_scale)
    arrays = (*args[:7], out, lse)

    def prepare():
        return _prepare_simple(kset, name, tail, arrays, scale, kv_scale, validate)
    return run_call(kset, prepare, arrays, (name, type(scale), scale, type(kv_scale), kv_scale), cache=not validate)


def tree_verify(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                out=None, lse=None, *, validate=False, impl="auto", workspace=None,
                num_splits=None, kv_scale=None, fp8_path=None, kv_workspace=None) -> AttentionOutput:
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
    q_nope and q_pe 16-byte aligned (the CUDA-core one: 4) and take workspace / num_splits (see
    tree_verify_mma.tree_verify); they are refused with impl="simple" and unused when "auto"
    picks the CUDA-core kernel.

    fp8_path (an fp8 spec only): "fused": the wgmma kernel converts the e4m3 tiles on chip (impl picks it as for a
    bf16 spec); "dequant": kv_dequant first converts the e4m3 pages the call reads (keys < prefix_len + q_len) into a
    bf16 workspace, and the bf16-cache seesaw (tree_verify_wgmma_dequant) reads it: the same bits as "fused" (but where
    the parts rule takes tree_verify_wgmma_dequant_parts: B >= 8, H <= 8, >= 2048 keys, no num_splits), Hopper
    only (impl "auto" or "wgmma"); None (the default): "dequant" where fp8_default allows it (impl "auto" / "wgmma",
    its kernels loaded and running on the device, the workspace it would allocate at most KV_WORKSPACE_LIMIT = 512
    MiB or kv_workspace given), else "fused"; decided once per call signature. Its kv_workspace (fp8_path "dequant",
    or None where that takes the dequantize path; an ArgumentError where it takes the fused kernel): bf16 (uint16
    on CuPy, torch.bfloat16), contiguous, 16-byte aligned, at least plans.kv_dequant.workspace_elems(spec, B,
    max_pages) elements (B * max_pages * (page_size * (R + P) * 2 + 4) bytes: the pages, then their block table);
    allocated per call when not given.
    """
    path = _fp8_choice(kset, impl, fp8_path, kv_workspace) if fp8_path is not None or kv_workspace is not None \
        or kset.spec.kv_fp8 else None
    if path == "dequant":
        return attention_dequant(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                 softmax_scale, out, lse, validate, workspace, num_splits, kv_scale, kv_workspace)
    if path == "auto":   # the path depends on the call's shapes and device: decided per call signature
        arrays = (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, out, lse, workspace,
                  kv_workspace)

        def prepare_fp8_default():
            return _prepare_fp8_default(kset, impl, arrays, softmax_scale, kv_scale, validate, num_splits)
        return run_call(kset, prepare_fp8_default, arrays,
                        (impl, type(softmax_scale), softmax_scale, type(num_splits), num_splits, type(kv_scale),
                         kv_scale), cache=not validate)
    return _dispatch(kset, "tree_verify", False,
                     (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale),
                     out, lse, validate, impl, workspace, num_splits, kv_scale)


def tree_verify_tail(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
                     out=None, lse=None, *, validate=False, impl="auto", workspace=None,
                     num_splits=None, kv_scale=None) -> AttentionOutput:
    """tree_verify over the tree tail alone (keys prefix_len + j with mask bit j set), for
    merging with an external prefix kernel through merge_states. Same arguments as tree_verify but fp8_path and
    kv_workspace (impl "wgmma" / "mma" picks tree_verify_tail_wgmma / tree_verify_tail_mma): it has no dequantize
    path, an fp8 spec's tail always runs the fused kernel (fp8_default says so)."""
    return _dispatch(kset, "tree_verify_tail", True,
                     (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale),
                     out, lse, validate, impl, workspace, num_splits, kv_scale)


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

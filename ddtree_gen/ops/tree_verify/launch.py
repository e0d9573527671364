"""Launchers of tree_verify, tree_verify_tail (every implementation) and merge_states, and the one route of every
tree_verify call.

A call is one record (VerifyCall: the arrays, scalars and choices it was given). `verify` enters the runtime once
(runtime.run_call, its launch plan cached per call signature); on a new signature `prepare` reads the shapes and the
device, asks `route` what the call runs, then builds the CUDA-core or the tensor-core launch plan
(tensor_core.prepare_attention). `route` is the only place a call's kernel is decided, from shapes and the device
(never device values: CUDA-graph friendly), and which.which_kernel / which.schedule report it:
  1. an fp8 spec's path (tree_verify only): "fused" (the kernel impl picks converts the e4m3 tiles on chip) or
     "dequant" (kv_dequant into a bf16 workspace, then tree_verify_wgmma's dequantize build: the same bits, measured
     faster; its parts-grid build has bits of its own: contract section 4b); fp8_path=None takes "dequant" where
     fp8_default allows it (impl "auto" / "wgmma", its builds loaded and running on the device, a workspace of at
     most KV_WORKSPACE_LIMIT bytes); tree_verify_tail is always fused;
  2. the implementation: "wgmma" (the Hopper warpgroup tensor-core kernels), "mma" (the mma.sync ones), "simple"
     (the CUDA-core kernels: one block per (request, query row, group of heads), keys streamed through shared memory
     with an online softmax), or "auto" (the default): the first of wgmma, mma whose kernels (with the combine kernel)
     the kernel set has loaded and that run on the arrays' device, else the CUDA-core one. The kernel of each
     tensor-core impl is the one that declares it serves (launcher, impl) (plans/: KernelDef.serves). On a GPU
     other than H100 / H200 (or with DDTREE_GEN_ARCH=sm_80) the wgmma kernels do not run (they are built for sm_90a
     only), and the mma.sync ones only where the device allows their shared memory (A100, B200: yes; L4, L40S, RTX
     cards: no): see archs.py and KernelSet.unavailable. An fp8 spec has no mma.sync kernels (plans: KernelDef
     .kv_dtypes): "auto" is wgmma where it runs, else the CUDA-core kernel, and impl="mma" is an ArgumentError;
  3. the build of the tensor-core kernel: the one `build=` names, else the kernel's rule (KernelDef.pick:
     tree_verify_wgmma's parts grid at B >= PARTS_MIN_B, its dequantize builds on that path), else its default.
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
from typing import NamedTuple

import numpy as np

from ...launch import arrays as ar
from ...errors import ArgumentError
from .. import DEFAULT_BUILD, all_kernels, by_name
from ... import reference
from . import simple as _plans
from ...build.declaration import Bundles, Declaration, TorchOp
from .simple import MERGE_WARPS
from .split import COMBINE
from ..kv_dequant.plan import workspace_elems
from .wgmma import DEQUANT, DEQUANT_BUILDS
from ...launch.runtime import Prepared, Step, run_call, sm_count
from ...types import AttentionOutput
from .tensor_core import KV_DEQUANT, KVW, WS, prepare_attention
from ...launch.checks import (INDEX, INT32_MAX, PointerChecks, check_attention_inputs, check_outputs, given_outputs,
                              validate_attention_values)

IMPLS = ("auto", "wgmma", "mma", "simple")
TENSOR_CORE_IMPLS = ("wgmma", "mma")   # in the order "auto" prefers them
# (launcher, impl) -> the tensor-core kernel that serves it: its KernelDef's `serves` (plans/)
_SERVED_BY = {k.serves: k.name for k in all_kernels() if k.serves}
# tensor-core kernel -> (the names of its builds, the default first; its rule that picks one: KernelDef.pick or None)
_BUILDS_OF = {k.name: ((DEFAULT_BUILD, *(b.name for b in k.builds)), k.pick) for k in all_kernels() if k.serves}
FP8_PATHS = ("fused", "dequant")
# fp8_path=None (the default) takes the dequantize path only where the bf16 workspace it would allocate for the call,
# ops.kv_dequant.plan.workspace_elems(spec, B, max_pages) x 2 bytes (B x max_pages pages of page_size x (R + P) bf16,
# 73,732 bytes a page for the shipped specs), is at most this many bytes: 512 MiB is B x max_pages = 7,281 such
# pages (B = 8 at 58K keys, B = 64 at 7K), a transient allocation per call that an engine can afford; past it the
# fused kernel reads the e4m3 cache with no workspace. A caller's kv_workspace always fits (it is already there).
KV_WORKSPACE_LIMIT = 512 * 2**20
DEQUANT_KERNELS = (KV_DEQUANT, DEQUANT, COMBINE)   # the dequantize path's builds (the combine: split-KV)


class VerifyCall(NamedTuple):
    """One call of tree_verify or tree_verify_tail (or of a tensor-core family's launcher): everything it was given,
    the one record the route (`route`) and the launch plan (`prepare`) read."""
    name: str              # "tree_verify" or "tree_verify_tail"
    arrays: tuple          # q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, out, lse, workspace,
                           # kv_workspace (checks.ATTENTION_ARRAYS, then tensor_core.WS, KVW)
    softmax_scale: object
    kv_scale: object = None
    validate: bool = False
    impl: object = "auto"
    num_splits: object = None
    fp8_path: object = None
    build: object = None   # a build of the tensor-core kernel by name (plans/kernel_def.Build), None: its `pick`
    direct: bool = False   # a tensor-core family's own launcher (kset.tree_verify_wgmma): the combine kernel is needed
                           # only where the call splits (tensor_core.prepare_attention says so)

    @property
    def tail(self) -> bool:
        return self.name == "tree_verify_tail"

    def key(self) -> tuple:
        """The non-array arguments the launch plan depends on (runtime.run_call's key; types: 1 is not 1.0)."""
        return (self.name, self.impl, self.fp8_path, self.build, type(self.softmax_scale), self.softmax_scale,
                type(self.num_splits), self.num_splits, type(self.kv_scale), self.kv_scale)


class Route(NamedTuple):
    """What a call runs: the implementation, the attention kernel, the build of it launched (a kernel set's key) and
    an fp8 spec's path."""
    impl: str              # "wgmma", "mma" or "simple"
    kernel: str            # the attention kernel, e.g. tree_verify_wgmma
    build: str             # its build launched, e.g. tree_verify_wgmma/parts
    fp8_path: str | None   # an fp8 spec's tree_verify: "fused" or "dequant"; None for a bf16 spec or the tail
    reason: str            # why that fp8 path (fp8_default's reason), else ""


def _kernel(name: str, kind: str) -> str:
    """The kernel that launcher `name` (tree_verify, tree_verify_tail) runs for impl=`kind` ("wgmma", "mma")."""
    return _SERVED_BY[(name, kind)]


def _runs(offer, build: str) -> bool:
    """Whether `build` runs on the offer's device (device None: not known; the call's checks will say why)."""
    return offer.device is None or offer.runs(build)


def _pick_impl(offer, name: str, impl, workspace, num_splits, direct: bool = False) -> tuple:
    """The implementations `impl` may send launcher `name` to, in order of preference: ("simple",),
    one tensor-core kind ("wgmma" / "mma": impl asks for it), or for "auto" the loaded tensor-core
    kinds the spec is built with, followed by "simple" (the first that runs on the call's device is
    used: _first_that_runs)."""
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
                  if _kernel(name, kind) in offer.spec_builds and _kernel(name, kind) in offer.builds
                  and COMBINE in offer.builds),
                "simple")
    kernel = _kernel(name, impl)
    if kernel not in offer.spec_builds:
        spec = offer.spec
        if direct:   # a family's own launcher: the caller named the kernel, not impl
            raise ArgumentError(by_name(kernel).why_not_built(spec))
        others = [k for k in IMPLS if k in ("auto", "simple") or _kernel(name, k) in offer.spec_builds]
        raise ArgumentError(f"impl: {impl!r}: {by_name(kernel).why_not_built(spec)}; "
                            f"pass impl={' or '.join(map(repr, others))}")
    # a kernel the set was asked for but holds no build of for its targets (wgmma when sm_80 is forced)
    # has its launcher: the launch says why it cannot run on the arrays' device
    # (a family's own launcher, `direct`: its build is checked by the route, _build, and the combine kernel where the
    # call splits, in tensor_core.prepare_attention)
    missing = [] if direct else [k for k in (kernel, COMBINE) if k not in offer.builds and k not in offer.requested]
    if missing:
        raise ArgumentError(f"impl: {impl!r} needs {' and '.join(missing)}, not loaded in this kernel set of "
                            f"spec {offer.spec.name!r} (load them, or pass impl='auto' or 'simple')")
    return (impl,)


def _first_that_runs(offer, name, kinds) -> str:
    """The first of `kinds` (_pick_impl's candidates) whose kernel and the combine kernel run on the offer's device
    (None: not known, the checks will say why); "simple" is always last and always runs."""
    for kind in kinds:
        if kind == "simple" or (_runs(offer, _kernel(name, kind)) and _runs(offer, COMBINE)):
            return kind
    raise AssertionError(f"no implementation in {kinds}")


def auto_impl(kset, device: int, name: str = "tree_verify") -> str:
    """The implementation ("wgmma", "mma" or "simple") that launcher `name` (tree_verify or tree_verify_tail)
    with impl="auto" runs on `device`: the one rule of the dispatcher, for the benches to report."""
    offer = kset.offer(device)
    return _first_that_runs(offer, name, _pick_impl(offer, name, "auto", None, None))


def why_not(kset, impl: str, device: int, name: str = "tree_verify") -> str | None:
    """Why launcher `name` with `impl` cannot run on `device` in kset: the ArgumentError's message a launch
    would raise (not built for the spec, not loaded, no build for the device); None if it can ("auto" and
    "simple" always can)."""
    offer = kset.offer(device)
    try:
        kinds = _pick_impl(offer, name, impl, None, None)
    except ArgumentError as e:
        return str(e)
    if len(kinds) > 1 or kinds == ("simple",):
        return None
    return offer.unavailable(_kernel(name, kinds[0])) or offer.unavailable(COMBINE)


def fp8_default(kset, impl, device, b: int, max_pages: int, kv_workspace: bool = False,
                name: str = "tree_verify") -> tuple[str | None, str]:
    """The path an fp8 spec's `name` with fp8_path=None (the default) takes, and why: (path, reason), path "dequant"
    (kv_dequant into a bf16 workspace, then tree_verify_wgmma's dequantize build: the fused kernel's bits, measured
    faster on every shape, docs/perf.md) or "fused" (the kernel impl picks reads the e4m3 cache itself). The first rule
    that fails gives "fused" and its reason:
      1. the launcher is tree_verify (tree_verify_tail has no dequantize path);
      2. impl is "auto" or "wgmma" (the dequantize path runs on the wgmma kernels);
      3. kv_dequant, tree_verify_wgmma's dequantize build and the combine kernel are loaded in kset;
      4. they run on `device` (Hopper; None: the arrays' device is not known, the call's checks will say why);
      5. `kv_workspace` (the caller gave one: it always fits), or the workspace the call would allocate,
         ops.kv_dequant.plan.workspace_elems(spec, B, max_pages) bf16, is at most KV_WORKSPACE_LIMIT bytes.
    Otherwise "dequant". A bf16 spec: (None, reason): it has no fp8 path. The launcher decides once per call
    signature (shapes, device), so benches and engines may ask here what a call runs."""
    return _fp8_default(kset.offer(device), impl, b, max_pages, kv_workspace, name)


def _fp8_default(offer, impl, b: int, max_pages: int, kv_workspace: bool, name: str) -> tuple[str | None, str]:
    spec = offer.spec
    if not spec.kv_fp8:
        return None, f"spec {spec.name!r} has kv_dtype {spec.kv_dtype!r}: no fp8 path"
    if name != "tree_verify":
        return "fused", f"{name} has no dequantize path"
    if not isinstance(impl, str) or impl not in ("auto", "wgmma"):
        return "fused", f"impl={impl!r}: the dequantize path runs on the wgmma kernels (impl 'auto' or 'wgmma')"
    missing = [k for k in DEQUANT_KERNELS if k not in offer.builds]
    if missing:
        return "fused", f"{' and '.join(missing)} not loaded in this kernel set"
    if offer.device is None:
        return "fused", "the arrays' device is not known"
    for k in DEQUANT_KERNELS:
        why = offer.unavailable(k)
        if why:
            return "fused", why
    if kv_workspace:
        return "dequant", "the caller's kv_workspace"
    need = 2 * workspace_elems(spec, b, max_pages)
    mib = f"{need / 2**20:.1f} MiB (B = {b} x max_pages = {max_pages} bf16 pages)"
    if need > KV_WORKSPACE_LIMIT:
        return "fused", f"the workspace would be {mib}, over KV_WORKSPACE_LIMIT = {KV_WORKSPACE_LIMIT // 2**20} MiB"
    return "dequant", f"the workspace is {mib}, within KV_WORKSPACE_LIMIT = {KV_WORKSPACE_LIMIT // 2**20} MiB"


def _fp8_choice(offer, impl, fp8_path, kv_workspace) -> str | None:
    """What tree_verify's fp8_path asks, before any shape is read: "fused" (an fp8 spec's fp8_path="fused"), "dequant"
    (fp8_path="dequant": impl "auto" or "wgmma", its kernels loaded), "auto" (an fp8 spec's fp8_path=None:
    fp8_default decides per call signature) or None (a bf16 spec: no fp8 path). ArgumentError naming the argument
    otherwise."""
    spec = offer.spec
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
    missing = [k for k in (KV_DEQUANT, DEQUANT) if k not in offer.builds and k not in offer.requested]
    if missing:
        raise ArgumentError(f"fp8_path: 'dequant' needs {' and '.join(missing)}, not loaded in this kernel set of spec "
                            f"{spec.name!r} (load them, or pass fp8_path=None)")
    return "dequant"


def _build(offer, kernel: str, call: VerifyCall, path, b: int, nq: int, max_pages: int) -> str:
    """The build of tensor-core kernel `kernel` the call runs (a kernel set's key): the one it names (`build=`), else
    the kernel's rule (KernelDef.pick: tree_verify_wgmma's parts grid, dequantize path), else its default."""
    names, pick = _BUILDS_OF[kernel]
    spec = offer.spec
    if call.build is not None:
        if call.build not in names:
            raise ArgumentError(f"build: {call.build!r}, {kernel} ships {', '.join(map(repr, names))}")
        key = kernel if call.build == DEFAULT_BUILD else f"{kernel}/{call.build}"
        if key not in offer.spec_builds:
            raise ArgumentError(f"build: {by_name(key).why_not_built(spec)}")
        if (call.build in DEQUANT_BUILDS) != (path == "dequant"):
            raise ArgumentError(f"build: {call.build!r} " + ("is the dequantize path's: pass fp8_path='dequant'"
                                                              if path != "dequant" else
                                                              "reads the spec's cache, not the dequantize path's "
                                                              "workspace (fp8_path='dequant')"))
        if key not in offer.builds and key not in offer.requested:
            raise ArgumentError(f"build: {key} is not loaded in this kernel set of spec {spec.name!r}")
        return key
    if pick is None:
        return kernel
    runnable = frozenset(n for n in names[1:] if offer.runs(f"{kernel}/{n}"))   # (runs: loaded, and on the device)
    build = pick(spec, fp8_path=path, b=b, nq=nq, max_keys=max_pages * spec.page_size,
                 sms=sm_count(offer.device) if b and offer.device is not None else 0, num_splits=call.num_splits,
                 runnable=runnable, workspace=_workspace_elems(call.arrays[WS]))
    return kernel if build == DEFAULT_BUILD else f"{kernel}/{build}"


def _workspace_elems(workspace) -> int | None:
    """The float32 elements of a caller's workspace (None: not given, the launcher allocates it; 0: not float32, the
    checks will say so): what the parts rule needs to know of it."""
    if workspace is None:
        return None
    wa, _ = ar.view(workspace, "workspace")
    return math.prod(wa.shape) if wa.dtype == "float32" else 0


def _shape(x, name: str) -> tuple | None:
    """The (shape, device) of a usable CUDA array, None if it is not one (the checks then say what is wrong)."""
    try:
        v = ar.view(x, name)[0]
        return v.shape, v.device
    except ArgumentError:
        return None


def route(kset, call: VerifyCall, b: int, nq: int, max_pages: int, device) -> Route:
    """What `call` runs for B requests of Nq rows over a block table of max_pages columns on `device` (None: not
    known; the call's checks will say why): the one decision of every tree_verify call, from shapes and the device
    only (a CUDA graph's replays take it), made once per call signature; which.schedule reports it."""
    return _route(kset.offer(device), call, b, nq, max_pages)


def _route(offer, call: VerifyCall, b: int, nq: int, max_pages: int) -> Route:
    """route() on what the kernel set offers on the call's device (runtime.DeviceOffer: the set asked once):
    1. fp8: an fp8 spec's tree_verify takes the path fp8_path asks, or fp8_default's (fp8_path=None);
    2. impl: the dequantize path runs wgmma; else impl's candidates (_pick_impl), the first that runs on the device;
    3. build: the tensor-core kernel's build (_build: `build=`, else its pick rule)."""
    path, reason = None, ""
    kv_workspace = call.arrays[KVW] if len(call.arrays) > KVW else None
    if not call.tail and (call.fp8_path is not None or kv_workspace is not None or offer.spec.kv_fp8):
        path = _fp8_choice(offer, call.impl, call.fp8_path, kv_workspace)
        if path == "auto":
            path, reason = _fp8_default(offer, call.impl, b, max_pages, kv_workspace is not None, call.name)
            if path != "dequant" and kv_workspace is not None:
                raise ArgumentError(f"kv_workspace: only the dequantize path takes it, but fp8_path=None takes the "
                                    f"fused kernel here: {reason} (pass fp8_path='dequant', or no kv_workspace)")
        elif path:
            reason = f"fp8_path={call.fp8_path!r}"
    if path == "dequant":
        kind = "wgmma"
    else:
        kinds = _pick_impl(offer, call.name, call.impl, call.arrays[WS], call.num_splits, call.direct)
        # one kind asked: that one (its launch says why, where it cannot run on the device); "auto": the first that runs
        kind = kinds[0] if len(kinds) == 1 else _first_that_runs(offer, call.name, kinds)
    if kind == "simple":
        if call.build is not None:
            raise ArgumentError(f"build: {call.build!r}: only the tensor-core kernels ship builds, but the call runs "
                                f"the CUDA-core kernel (impl='simple' or 'auto' without one that runs)")
        return Route("simple", call.name, call.name, path, reason)
    kernel = _kernel(call.name, kind)
    return Route(kind, kernel, _build(offer, kernel, call, path, b, nq, max_pages), path, reason)


def prepare(kset, call: VerifyCall) -> Prepared:
    """The checks and launch plan of one call signature: what the kernel set offers on the arrays' device (asked
    once), the call's route, then the CUDA-core kernel's plan (_prepare_simple) or the tensor-core one's
    (tensor_core.prepare_attention)."""
    q = _shape(call.arrays[0], "q_nope")
    table = _shape(call.arrays[3], "block_table")
    known = q is not None and len(q[0]) == 4 and table is not None and len(table[0]) == 2
    b, nq = (q[0][0], q[0][1]) if known else (0, 0)
    offer = kset.offer(q[1] if known else None)
    r = _route(offer, call, b, nq, table[0][1] if known else 0)
    if r.impl == "simple":
        return _prepare_simple(offer, call)
    return prepare_attention(offer, r.build, r.impl, call.tail, call.arrays, call.softmax_scale, call.validate,
                             call.num_splits, call.kv_scale)


def verify(kset, call: VerifyCall) -> AttentionOutput:
    """Run `call`: the runtime entered once, its launch plan cached per call signature (runtime.run_call)."""
    return run_call(kset, lambda: prepare(kset, call), call.arrays, call.key(), cache=not call.validate)


def _prepare_simple(offer, call: VerifyCall) -> Prepared:
    """The CUDA-core kernel of `call.name`: checks and launch plan of one call signature."""
    spec, name, arrays = offer.spec, call.name, call.arrays
    ptrs = PointerChecks(INDEX)
    inputs, scale_log2, v_scale = check_attention_inputs(spec, ptrs, *arrays[:7], call.softmax_scale, call.kv_scale,
                                                         q_align=4)
    qn = inputs["q_nope"]
    b, nq, h, r = qn.shape
    num_pages, max_pages = inputs["kv_cache"].shape[0], inputs["block_table"].shape[1]
    if name not in offer.consts:   # not loaded in the kernel set
        raise ArgumentError(offer.unavailable(name))
    groups = offer.constants(name)["HEAD_GROUPS"]
    if groups * nq * b > INT32_MAX:
        raise ArgumentError(f"q_nope: batch size {b} too large for one launch")
    # the caller's buffers are checked before anything is allocated or copied
    oa, la = given_outputs(arrays[7], arrays[8], (b, nq, h, r), (b, nq, h))
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
    tail = name == "tree_verify_tail"

    def launch(kset, q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, softmax_scale,
               out=None, lse=None, *, validate=False, workspace=None, num_splits=None, kv_scale=None,
               build=None) -> AttentionOutput:
        path = (None if tail or not kset.spec.kv_fp8 else
                "dequant" if impl == "wgmma" and build in DEQUANT_BUILDS else "fused")
        return verify(kset, VerifyCall(name, (q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask,
                                              out, lse, workspace, None),
                                       softmax_scale, kv_scale, validate, impl, num_splits, path, build, True))
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

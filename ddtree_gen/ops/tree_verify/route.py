"""The one route of every tree_verify / tree_verify_tail call: `route(offer, call, B, Nq, max_pages)`, over what the
kernel set offers on the call's device (runtime.DeviceOffer), from shapes and the device only (never device values:
CUDA-graph friendly), once per call signature. In order:
  1. an fp8 spec's path (tree_verify only): "fused" (the kernel the backend runs converts the e4m3 tiles on chip) or
     "dequant" (kv_dequant into a bf16 workspace, then the wgmma build that reads it: the same bits, measured faster;
     its parts-grid build has bits of its own: contract section 4b); fp8_path=None takes "dequant" where the rule of
     fp8_default allows it; tree_verify_tail is always fused; a family's own launcher (kset.tree_verify_wgmma) is fused
     unless the build it names reads the workspace;
  2. the backend (impl): "wgmma", "mma", "simple", or for "auto" the first of wgmma, mma whose kernel (and the combine
     kernel) the set has loaded for the spec and that runs on the device, else "simple" (the CUDA-core kernel). The
     kernel of each backend is the one that declares it serves (launcher, impl) (ops/: KernelDef.serves);
  3. the build of that kernel: the one `build=` names, else by the builds' typed records (KernelDef.record): the build
     that reads the dequantize path's workspace or the spec's cache, on the parts grid (record.parts) where the parts
     rule says so (ops/tree_verify/wgmma.py: B >= PARTS_MIN_B, PARTS_MIN_KEYS or parts_pay, a workspace that fits),
     else on its default grid.
which.which_kernel / which.schedule (ks.tree_verify_schedule) and auto_impl / why_not / fp8_default are views of it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ...launch import arrays as ar
from ...errors import ArgumentError
from .. import all_kernels, builds_of, by_name
from ..kv_dequant.plan import workspace_elems
from . import split as _split
from .split import COMBINE, parts_workspace_elems
from .wgmma import PARTS_MIN_B, PARTS_MIN_KEYS, parts_for, parts_pay
from ...launch.runtime import sm_count
from ...launch.checks import ATTENTION_ARRAYS

WS = len(ATTENTION_ARRAYS)      # the workspace's index in the call's array list
KVW = WS + 1                    # fp8_path "dequant": the bf16 kv_workspace's


class VerifyCall(NamedTuple):
    """One call of tree_verify or tree_verify_tail (or of a tensor-core family's launcher): everything it was given,
    the one record the route (route.route) and the launch plan (tree_verify.prepare) read."""
    name: str              # "tree_verify" or "tree_verify_tail"
    arrays: tuple          # q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree_mask, out, lse, workspace,
                           # kv_workspace (checks.ATTENTION_ARRAYS, then WS, KVW)
    softmax_scale: object
    kv_scale: object = None
    validate: bool = False
    impl: object = "auto"
    num_splits: object = None
    fp8_path: object = None
    build: object = None   # a build of the tensor-core kernel by name (build/kernel_def.Build), None: the route's
    direct: bool = False   # a tensor-core family's own launcher (kset.tree_verify_wgmma): the combine kernel is needed
                           # only where the call splits (tensor_core.prepare_attention says so)

    @property
    def tail(self) -> bool:
        return self.name == "tree_verify_tail"

    @property
    def kv_workspace(self):
        return self.arrays[KVW] if len(self.arrays) > KVW else None

    def key(self) -> tuple:
        """The non-array arguments the launch plan depends on (runtime.run_call's key; types: 1 is not 1.0), and
        split.PDL_COMBINE (how the plan launches its combine: a script or test may turn it on and off)."""
        return (self.name, self.impl, self.fp8_path, self.build, type(self.softmax_scale), self.softmax_scale,
                type(self.num_splits), self.num_splits, type(self.kv_scale), self.kv_scale, _split.PDL_COMBINE)


class Route(NamedTuple):
    """What a call runs: the implementation, the attention kernel, the build of it launched (a kernel set's key) with
    its typed record (KernelDef.record; None for the CUDA-core kernel) and an fp8 spec's path."""
    impl: str              # "wgmma", "mma" or "simple"
    kernel: str            # the attention kernel, e.g. tree_verify_wgmma
    build: str             # its build launched (a kernel set's key), e.g. tree_verify_wgmma/parts
    fp8_path: str | None   # an fp8 spec's tree_verify: "fused" or "dequant"; None for a bf16 spec or the tail
    reason: str            # why that fp8 path (fp8_default's reason), else ""
    record: object = None  # the build's typed record (ops/tree_verify/wgmma.WgmmaBuild, ...)


IMPLS = ("auto", "wgmma", "mma", "simple")
TENSOR_CORE_IMPLS = ("wgmma", "mma")   # in the order "auto" prefers them
FP8_PATHS = ("fused", "dequant")
KV_DEQUANT = "kv_dequant"              # the dequantize path's pre-pass (ops/kv_dequant/plan.py)
# fp8_path=None (the default) takes the dequantize path only where the bf16 workspace it would allocate for the call,
# ops.kv_dequant.plan.workspace_elems(spec, B, max_pages) x 2 bytes (B x max_pages pages of page_size x (R + P) bf16,
# 73,732 bytes a page for the shipped specs), is at most this many bytes: 512 MiB is B x max_pages = 7,281 such
# pages (B = 8 at 58K keys, B = 64 at 7K), a transient allocation per call that an engine can afford; past it the
# fused kernel reads the e4m3 cache with no workspace. A caller's kv_workspace always fits (it is already there).
KV_WORKSPACE_LIMIT = 512 * 2**20
# (launcher, impl) -> the tensor-core kernel that serves it: its KernelDef's `serves` (ops/)
_SERVED_BY = {k.serves: k.name for k in all_kernels() if k.serves}
# tensor-core kernel -> its builds (KernelDefs, the default first)
_BUILDS = {k.name: tuple(builds_of(k.name)) for k in all_kernels() if k.serves}


def dequant_build(offer) -> str:
    """The wgmma kernel's build of the dequantize path for the offer's spec (on the chunks grid): its key. Also where
    the spec does not get it (a page size the seesaw cannot take): its record as its policy makes it then says which
    build it is, and the route says why the spec has none (offer.spec_builds)."""
    builds = _BUILDS[_SERVED_BY[("tree_verify", "wgmma")]]
    for record in (lambda d: _declared(offer, d), lambda d: d.build_record(offer.spec)):   # the spec's, else any
        for d in builds:
            r = record(d)
            if getattr(r, "reads_workspace", False) and not r.parts:
                return d.name
    raise AssertionError("tree_verify_wgmma declares no build of the dequantize path")


def dequant_kernels(kset) -> tuple:
    """The kernels the dequantize path of kset's spec loads: kv_dequant, the build reading its workspace, the combine
    kernel."""
    return (KV_DEQUANT, dequant_build(kset.offer(None)), COMBINE)


def _declared(offer, kdef):
    """The typed record of build `kdef` as declared for the spec (its policy's: what the route chooses by; a variant
    set's knobs are the launch's, DeviceOffer.record); None where the spec does not get it."""
    return offer.declared.get(kdef.name)


def _reads_workspace(offer, kdef) -> bool:
    """Whether build `kdef` is the dequantize path's (its record reads kv_dequant's workspace)."""
    return bool(getattr(_declared(offer, kdef), "reads_workspace", False))


def _runs(offer, build: str) -> bool:
    """Whether `build` runs on the offer's device (device None: not known; the call's checks will say why)."""
    return offer.device is None or offer.runs(build)


def _impls(offer, name: str, impl, workspace, num_splits, direct: bool = False) -> tuple:
    """The backends `impl` may send launcher `name` to, in order of preference (argument checks included):
    ("simple",), one tensor-core kind ("wgmma" / "mma": impl asks for it), or for "auto" the loaded tensor-core kinds
    the spec is built with, followed by "simple"."""
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
                  if _SERVED_BY[(name, kind)] in offer.spec_builds and _SERVED_BY[(name, kind)] in offer.builds
                  and COMBINE in offer.builds),
                "simple")
    kernel = _SERVED_BY[(name, impl)]
    if kernel not in offer.spec_builds:
        spec = offer.spec
        if direct:   # a family's own launcher: the caller named the kernel, not impl
            raise ArgumentError(by_name(kernel).why_not_built(spec))
        others = [k for k in IMPLS if k in ("auto", "simple") or _SERVED_BY[(name, k)] in offer.spec_builds]
        raise ArgumentError(f"impl: {impl!r}: {by_name(kernel).why_not_built(spec)}; "
                            f"pass impl={' or '.join(map(repr, others))}")
    # a kernel the set was asked for but holds no build of for its targets (wgmma when sm_80 is forced) has its
    # launcher: the launch says why it cannot run on the arrays' device (a family's own launcher, `direct`: its build
    # is checked below, and the combine kernel where the call splits, in tensor_core.prepare_attention)
    missing = [] if direct else [k for k in (kernel, COMBINE) if k not in offer.builds and k not in offer.requested]
    if missing:
        raise ArgumentError(f"impl: {impl!r} needs {' and '.join(missing)}, not loaded in this kernel set of "
                            f"spec {offer.spec.name!r} (load them, or pass impl='auto' or 'simple')")
    return (impl,)


def _fp8_asked(offer, call: VerifyCall) -> str | None:
    """What tree_verify's fp8_path asks, before any shape is read: "fused", "dequant", "auto" (an fp8 spec's
    fp8_path=None: the rule of _fp8_rule decides per call signature) or None (a bf16 spec or the tail: no fp8 path).
    ArgumentError naming the argument otherwise."""
    spec, fp8_path, kv_workspace = offer.spec, call.fp8_path, call.kv_workspace
    if call.tail or (fp8_path is None and kv_workspace is None and not spec.kv_fp8):
        return None
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
    impl = call.impl
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ArgumentError(f"impl: {impl!r}, expected one of {', '.join(map(repr, IMPLS))}")
    dequant = dequant_build(offer)
    if impl not in ("auto", "wgmma"):
        raise ArgumentError(f"fp8_path: 'dequant' runs on the wgmma kernels ({KV_DEQUANT}, {dequant}), but impl="
                            f"{impl!r} was asked (pass impl='auto' or 'wgmma', or fp8_path=None)")
    if dequant not in offer.spec_builds:
        raise ArgumentError(f"fp8_path: 'dequant': {by_name(dequant).why_not_built(spec)} (pass fp8_path=None or "
                            f"'fused')")
    missing = [k for k in (KV_DEQUANT, dequant) if k not in offer.builds and k not in offer.requested]
    if missing:
        raise ArgumentError(f"fp8_path: 'dequant' needs {' and '.join(missing)}, not loaded in this kernel set of spec "
                            f"{spec.name!r} (load them, or pass fp8_path=None)")
    return "dequant"


def _fp8_rule(offer, impl, b: int, max_pages: int, kv_workspace: bool, name: str) -> tuple[str | None, str]:
    """fp8_path=None's path and why (fp8_default's rule list): the first rule that fails gives "fused"."""
    spec = offer.spec
    if not spec.kv_fp8:
        return None, f"spec {spec.name!r} has kv_dtype {spec.kv_dtype!r}: no fp8 path"
    if name != "tree_verify":
        return "fused", f"{name} has no dequantize path"
    if not isinstance(impl, str) or impl not in ("auto", "wgmma"):
        return "fused", f"impl={impl!r}: the dequantize path runs on the wgmma kernels (impl 'auto' or 'wgmma')"
    kernels = (KV_DEQUANT, dequant_build(offer), COMBINE)
    unbuilt = [k for k in kernels if k not in offer.spec_builds]
    if unbuilt:
        return "fused", "; ".join(by_name(k).why_not_built(spec) for k in unbuilt)
    missing = [k for k in kernels if k not in offer.builds]
    if missing:
        return "fused", f"{' and '.join(missing)} not loaded in this kernel set"
    if offer.device is None:
        return "fused", "the arrays' device is not known"
    for k in kernels:
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


def _workspace_elems(workspace) -> int | None:
    """The float32 elements of a caller's workspace (None: not given, the launcher allocates it; 0: not float32, the
    checks will say so): what the parts rule needs to know of it."""
    if workspace is None:
        return None
    wa, _ = ar.view(workspace, "workspace")
    return math.prod(wa.shape) if wa.dtype == "float32" else 0


def route(offer, call: VerifyCall, b: int, nq: int, max_pages: int) -> Route:
    """What `call` runs for B requests of Nq rows over a block table of max_pages columns, on what the kernel set
    offers on the call's device (runtime.DeviceOffer; its device None: not known, the call's checks will say why):
    the fp8 path, then the backend, then the build (the module docstring)."""
    spec = offer.spec
    # 1. the fp8 path
    path, reason = _fp8_asked(offer, call), ""
    if path == "auto" and call.direct:   # a family's own launcher: fused unless its build reads the workspace
        named = [d for d in _BUILDS[_SERVED_BY[(call.name, call.impl)]] if d.build == call.build]
        path = "dequant" if named and _reads_workspace(offer, named[0]) else "fused"
    elif path == "auto":
        path, reason = _fp8_rule(offer, call.impl, b, max_pages, call.kv_workspace is not None, call.name)
        if path != "dequant" and call.kv_workspace is not None:
            raise ArgumentError(f"kv_workspace: only the dequantize path takes it, but fp8_path=None takes the "
                                f"fused kernel here: {reason} (pass fp8_path='dequant', or no kv_workspace)")
    elif path:
        reason = f"fp8_path={call.fp8_path!r}"
    # 2. the backend: the dequantize path's is wgmma; else impl's candidates, the first that runs on the device (one
    # kind asked: that one, its launch says why where it cannot run)
    if path == "dequant":
        kind = "wgmma"
    else:
        kinds = _impls(offer, call.name, call.impl, call.arrays[WS], call.num_splits, call.direct)
        kind = next(k for k in kinds if len(kinds) == 1 or k == "simple"
                    or (_runs(offer, _SERVED_BY[(call.name, k)]) and _runs(offer, COMBINE)))
    if kind == "simple":
        if call.build is not None:
            raise ArgumentError(f"build: {call.build!r}: only the tensor-core kernels ship builds, but the call runs "
                                f"the CUDA-core kernel (impl='simple' or 'auto' without one that runs)")
        return Route("simple", call.name, call.name, path, reason)
    # 3. the build: by name (build=), else by the records of the builds the spec gets
    kernel = _SERVED_BY[(call.name, kind)]
    defs = _BUILDS[kernel]
    dequant = path == "dequant"
    if call.build is not None:
        named = [d for d in defs if d.build == call.build]
        if not named:
            raise ArgumentError(f"build: {call.build!r}, {kernel} ships {', '.join(repr(d.build) for d in defs)}")
        kdef = named[0]
        if kdef.name not in offer.spec_builds:
            raise ArgumentError(f"build: {kdef.why_not_built(spec)}")
        if _reads_workspace(offer, kdef) != dequant:
            raise ArgumentError(f"build: {call.build!r} " + ("is the dequantize path's: pass fp8_path='dequant'"
                                                              if not dequant else
                                                              "reads the spec's cache, not the dequantize path's "
                                                              "workspace (fp8_path='dequant')"))
        if kdef.name not in offer.builds and kdef.name not in offer.requested:
            raise ArgumentError(f"build: {kdef.name} is not loaded in this kernel set of spec {spec.name!r}")
        return Route(kind, kernel, kdef.name, path, reason, offer.record(kdef.name))
    # the builds of this path (the spec's cache, or the dequantize path's workspace): its default grid, the first
    # declared (the kernel's own default first), and its parts-grid build where one runs and the parts rule says so
    ours = [(d, _declared(offer, d)) for d in defs
            if d.name in offer.spec_builds and _reads_workspace(offer, d) == dequant]
    if not ours:   # the kernel is not built for the spec: the launch plan says why
        return Route(kind, kernel, kernel, path, reason, None)
    base = next((d, r) for d, r in ours if not r.parts)
    parts = [(d, r) for d, r in ours if r.parts and offer.runs(d.name)]   # (runs: loaded, and on the device)
    sms = sm_count(offer.device) if b and offer.device is not None else 0
    max_keys = max_pages * spec.page_size
    if (parts and call.num_splits is None and b >= PARTS_MIN_B
            and (max_keys >= PARTS_MIN_KEYS or parts_pay(spec, b, nq, max_keys, sms))):
        # a caller's workspace sized for the chunks grid need not hold the parts' partials: then the chunks grid
        have = _workspace_elems(call.arrays[WS])
        count = parts_for(spec, b, nq, max_keys, sms, parts[0][1].seg_cost)
        if have is None or have >= parts_workspace_elems(spec, b, nq, count):
            base = parts[0]
    return Route(kind, kernel, base[0].name, path, reason, offer.record(base[0].name))


# ------------------------------------------------------------------------- views of the route

def auto_impl(kset, device: int, name: str = "tree_verify") -> str:
    """The backend ("wgmma", "mma" or "simple") that launcher `name` (tree_verify or tree_verify_tail) with
    impl="auto" runs on `device`: the route's step 2, for the benches to report."""
    offer = kset.offer(device)
    kinds = _impls(offer, name, "auto", None, None)
    return next(k for k in kinds if k == "simple" or (_runs(offer, _SERVED_BY[(name, k)]) and _runs(offer, COMBINE)))


def why_not(kset, impl: str, device: int, name: str = "tree_verify") -> str | None:
    """Why launcher `name` with `impl` cannot run on `device` in kset: the ArgumentError's message a launch
    would raise (not built for the spec, not loaded, no build for the device); None if it can ("auto" and
    "simple" always can)."""
    offer = kset.offer(device)
    try:
        kinds = _impls(offer, name, impl, None, None)
    except ArgumentError as e:
        return str(e)
    if len(kinds) > 1 or kinds == ("simple",):
        return None
    return offer.unavailable(_SERVED_BY[(name, kinds[0])]) or offer.unavailable(COMBINE)


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
    Otherwise "dequant". A bf16 spec: (None, reason): it has no fp8 path. The route's step 1 for fp8_path=None."""
    return _fp8_rule(kset.offer(device), impl, b, max_pages, kv_workspace, name)

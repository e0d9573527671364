"""KernelSet: a spec's compiled kernels with their launchers as methods, and load().

The top of the import graph: it joins the build layer (artifacts), the runtime and the launchers (ops/<op>/launch.py: each
imported by name, the method of its kernel: Launchers). One KernelSet serves every GPU of the process and every
thread: modules are loaded per device on first use, and launches go to the current stream of the inputs' device.
StandInKernelSet is the same interface without a GPU (what the launchers ask of a kernel set: launch.protocol.KernelSetLike),
for CPU tests and host-side profiling.
"""
from __future__ import annotations

import functools
import threading

from . import archs
from .build import artifacts
from .launch import runtime
from .errors import ArgumentError
from .ops import KernelDef, all_builds, by_name
from .launch.runtime import Binary, DeviceModules, DeviceOffer
from .ops.draft_topk import launch as _draft_topk
from .ops.kv_commit import launch as _kv_commit
from .ops.kv_dequant import launch as _kv_dequant
from .ops.tree_verify import tensor_core as _tensor_core
from .ops.tree_accept import launch as _tree_accept
from .ops.tree_build import launch as _tree_build
from .ops.tree_verify import launch as _tree_verify
from .ops.tree_verify import mma_launch as _tree_verify_mma
from .ops.tree_verify import wgmma_launch as _tree_verify_wgmma
from .spec import Spec, find_spec

__all__ = ["KernelSet", "StandInKernelSet", "load", "variant_set"]


class Launchers:
    """Each declared kernel's launcher, launch(kset, ...), as the method of the kernel's name: the launcher function
    itself (a function as a class attribute is a method), so "go to definition" reaches its def through the import,
    and help(kset.tree_verify) shows its signature and docstring. One line per declaration of ddtree_gen.registry
    (tests/test_declarations.py: a declaration with no method here, or a method with no declaration, fails), in
    build order. KernelSet and StandInKernelSet have them all."""

    tree_build = _tree_build.launch
    tree_verify = _tree_verify.tree_verify
    tree_verify_tail = _tree_verify.tree_verify_tail
    merge_states = _tree_verify.merge_states
    tree_verify_mma = _tree_verify_mma.tree_verify
    tree_verify_tail_mma = _tree_verify_mma.tree_verify_tail
    tree_verify_mma_combine = _tensor_core.combine
    tree_verify_wgmma = _tree_verify_wgmma.tree_verify
    tree_verify_tail_wgmma = _tree_verify_wgmma.tree_verify_tail
    tree_accept = _tree_accept.launch
    kv_commit = _kv_commit.launch
    draft_topk = _draft_topk.launch
    kv_dequant = _kv_dequant.launch


class KernelSet(Launchers):
    """The compiled kernels of one spec. Each kernel's launcher is a method: kset.tree_build(...) (one per
    declared kernel, with the launcher's signature and docstring: help(kset.tree_verify)); the launch of a
    kernel this set was not loaded with raises ArgumentError (no build of it for the device). A kernel may ship
    several builds (build/kernel_def.Build: tree_verify_wgmma's "parts", "dequant", ...): the set holds each, under
    its key ("<kernel>/<build>"; the default build under the kernel's name), and the launcher picks one per call."""

    def __init__(self, spec, built: dict, kdefs: list[KernelDef] | None = None, arch: str | None = None):
        """`built`: build key -> {target: artifacts.Built} (or one Built); `kdefs`: the builds' KernelDefs (default:
        every registered one); `arch`: the forced target (archs.forced), None to pick per device.

        Every kernel named in `built` gets its launcher, also one with no build here (a wgmma kernel
        when sm_80 is forced, an mma.sync one for an fp8 spec): its launch raises ArgumentError saying why."""
        self.spec = spec
        self.forced_arch = arch
        self._defs = {}
        self._plans = {}        # (name, target) -> Plan
        self._constants = {}    # (name, target) -> template constants
        self._first = {}        # name -> its first target here (plan / constants without a device)
        modules = {}
        for kdef in kdefs if kdefs is not None else all_builds():
            if kdef.name not in built:
                continue
            builds = built[kdef.name]
            builds = builds if isinstance(builds, dict) else {builds.arch: builds}
            builds = {a: builds[a] for a in archs.ordered(builds) if arch is None or a == arch}
            self._defs[kdef.name] = kdef
            if not builds:
                continue
            per_arch = {}
            for a, b in builds.items():
                plan = b.variant.plan()     # the build's own (a script's variant: its config)
                # launch geometry is evaluated once here: sympy has no place on the launch path
                per_arch[a] = Binary(b.binary, kdef.entry, plan.value(plan.threads), plan.value(plan.dynamic_smem),
                                     plan.value(plan.static_smem))
                self._plans[(kdef.name, a)] = plan
                self._constants[(kdef.name, a)] = plan.template_constants()
            self._first[kdef.name] = next(iter(builds))
            modules[kdef.name] = per_arch
        self._modules = DeviceModules(modules, forced=arch)
        self._spec_builds = _spec_builds(spec)
        self._declared = _declared_records(spec)
        # a build the spec does not get (an mma.sync one for an fp8 spec): why, once (no build on any device)
        self._not_built = {n: k.why_not_built(spec) for n, k in self._defs.items() if n not in self._spec_builds}
        self.prepared_calls: dict = {}   # call signature -> runtime.Prepared (see runtime.run_call)

    def tree_verify_schedule(self, b: int, nq: int, max_pages: int, **kw):
        """What tree_verify (name="tree_verify_tail": the tail) runs for B requests of Nq rows over a block table of
        max_pages columns: the kernel, grid, pieces, blocks, combine and workspace (ops.tree_verify.which.schedule;
        keywords device, impl, num_splits, fp8_path, kv_workspace as the call's)."""
        from .ops.tree_verify.which import schedule
        return schedule(self, b, nq, max_pages, **kw)

    @property
    def kernels(self) -> list[str]:
        """The kernels with a build in this set (on a given device: kernels_on(device))."""
        return list(dict.fromkeys(self._defs[b].kernel for b in self._modules.names))

    @property
    def builds(self) -> list[str]:
        """The builds in this set, by key: each kernel's default under its name, its further builds as
        "<kernel>/<build>" (what plan, constants, unavailable and launch take)."""
        return self._modules.names

    @property
    def requested(self) -> tuple:
        """The builds this set was loaded with: those of `builds`, and those it holds no binary of for its
        targets (a wgmma kernel when sm_80 is forced, an mma.sync one for an fp8 spec: unavailable() says why)."""
        return tuple(self._defs)

    @property
    def archs(self) -> tuple:
        """The targets this set holds builds of, in preference order."""
        return archs.ordered({a for name in self.kernels for a in self._modules.archs(name)})

    def arch_for(self, name: str, device: int) -> str | None:
        """The target of the build of `name` that runs on `device` (None: none does; unavailable() says why)."""
        return self._modules.arch_for(name, device) if name in self._first else None

    def unavailable(self, name: str, device: int) -> str | None:
        """None if kernel `name` runs on `device`, else why not: an ArgumentError's message naming the
        kernel, the device and its compute capability (a build for another target only, more shared
        memory than the device allows, a target forced by $DDTREE_GEN_ARCH / load(arch=))."""
        if name in self._first:
            return self._modules.unavailable(name, device)
        kdef = self._defs.get(name)
        if kdef is None:
            return f"{name}: not loaded in this kernel set of spec {self.spec.name!r}"
        if name in self._not_built:   # the mma.sync kernels for an fp8 spec: no build on any device
            return self._not_built[name]
        info = runtime.device_info(device)
        return (f"{name}: not available on {info.describe(device)}: "
                f"{archs.why_not(info.cc, kdef.archs_for(self.spec), self.forced_arch)}")

    def require(self, name: str, device: int) -> str:
        """The target `name` runs as on `device`; ArgumentError (unavailable()'s message) if it cannot run there."""
        why = self.unavailable(name, device)
        if why:
            raise ArgumentError(why)
        return self._modules.arch_for(name, device)

    def kernels_on(self, device: int) -> list[str]:
        """The kernels of this set that run on `device` (their default build does)."""
        return [k for k in self.kernels if self.unavailable(k, device) is None]

    def offer(self, device: int | None) -> DeviceOffer:
        """What this set offers on `device` (None: not known), as data (runtime.DeviceOffer): the one question
        tree_verify's route asks of it."""
        return _offer(self, device, self._spec_builds, {n: self.constants(n, device) for n in self.builds},
                      {n: self.plan(n, device).build for n in self.builds}, self._declared)

    def plan(self, name, device: int | None = None):
        """The resource plan of `name`'s build for `device` (None: its first target here)."""
        return self._plans[(name, self._target(name, device))]

    def constants(self, name, device: int | None = None) -> dict:
        """The kernel's template constants (THREADS, BN, ...) of its build for `device` (None: its first
        target here), evaluated once at load."""
        return self._constants[(name, self._target(name, device))]

    def _target(self, name, device):
        if device is None:
            return self._first[name]
        return self._modules.arch_for(name, device) or self._first[name]

    def launch(self, name: str, *, grid: tuple, args: list, device: int, kind: str, fmt: str, pdl: bool = False) -> None:
        """Launch kernel `name` on `device`'s current stream (torch's for kind "torch", else CuPy's); pdl: as a
        programmatic dependent of the launch before it (launch/pdl.py)."""
        self._modules.launch(name, grid, args, device, kind, fmt, pdl)

    launch.direct = True   # runtime.run_call may launch this set's calls through its modules directly

    def __repr__(self):
        forced = f", arch={self.forced_arch!r}" if self.forced_arch else ""
        return f"KernelSet({self.spec.name!r}, kernels={self.kernels}{forced})"


class StandInKernelSet(Launchers):
    """A kernel set without a GPU (launch.protocol.KernelSetLike): the spec's plans and constants (of each kernel's
    sm_90a build, as KernelSet.plan without a device), every kernel of `kernels` (default: every kernel the
    spec gets) running there as its first target, and a launch that records what it was given in
    `launches` (name, grid, args; and "pdl" for a programmatic dependent launch) instead of launching. The
    launchers' checks and their per-signature cache (prepared_calls) run as on a GPU; with torch or CuPy absent, the
    arrays may be any objects with __cuda_array_interface__ (tests/conftest.FakeCudaArray)."""

    def __init__(self, spec, kernels=None):
        """`kernels`: the builds it holds, by key (a kernel's name: its default build; "<kernel>/<build>": another),
        so that a test can leave one out; default: every build the spec gets."""
        self.spec = spec
        self.forced_arch = None
        names = {k.name for k in all_builds()}
        self.builds = [k.name for k in all_builds() if k.archs_for(spec)] if kernels is None else list(kernels)
        unknown = [k for k in self.builds if k not in names]
        if unknown:
            raise ArgumentError(f"kernels: unknown kernel {unknown[0]!r}")
        self._spec_builds = _spec_builds(spec)
        self._declared = _declared_records(spec)
        self.prepared_calls: dict = {}
        self.launches: list = []

    def offer(self, device: int | None) -> DeviceOffer:
        return _offer(self, device, self._spec_builds, {n: _stand_in_constants(n, self.spec) for n in self.builds},
                      {n: by_name(n).plan_for(self.spec).build for n in self.builds}, self._declared)

    @property
    def kernels(self) -> list[str]:
        return list(dict.fromkeys(by_name(b).kernel for b in self.builds))

    @property
    def requested(self) -> tuple:
        return tuple(self.builds)

    def unavailable(self, name: str, device: int) -> str | None:
        why = by_name(name).why_not_built(self.spec) if name in {k.name for k in all_builds()} else None
        if why is None and name not in self.builds:
            return f"{name}: not loaded in this kernel set of spec {self.spec.name!r}"
        return why

    def require(self, name: str, device: int) -> str:
        why = self.unavailable(name, device)
        if why:
            raise ArgumentError(why)
        return by_name(name).archs_for(self.spec)[0]

    def arch_for(self, name: str, device: int) -> str | None:
        return None if self.unavailable(name, device) else by_name(name).archs_for(self.spec)[0]

    def plan(self, name, device: int | None = None):
        return by_name(name).plan_for(self.spec)     # the sm_90a build's

    def constants(self, name, device: int | None = None) -> dict:
        return _stand_in_constants(name, self.spec)

    def launch(self, name: str, *, grid: tuple, args: list, device: int, kind: str, fmt: str, pdl: bool = False) -> None:
        self.launches.append((name, grid, args, "pdl") if pdl else (name, grid, args))

    def __repr__(self):
        return f"StandInKernelSet({self.spec.name!r}, kernels={self.kernels})"


def _spec_builds(spec) -> frozenset:
    """Every build `spec` gets (plans: KernelDef.builds_for), by key."""
    return frozenset(k.name for k in all_builds() if k.builds_for(spec))


@functools.lru_cache(maxsize=None)
def _declared_records(spec) -> dict:
    """Every build the spec gets -> its typed record as declared (its policy's: KernelDef.build_record)."""
    return {k.name: k.build_record(spec) for k in all_builds() if k.builds_for(spec)}


def _offer(kset, device, spec_builds: frozenset, consts: dict, records: dict, declared: dict) -> DeviceOffer:
    """kset's DeviceOffer on `device`: for each build it was loaded with, its target there or why it has none."""
    targets, why = {}, {}
    for name in kset.requested:
        reason = kset.unavailable(name, device) if device is not None else "the arrays' device is not known"
        if reason is None:
            targets[name] = kset.arch_for(name, device)
        else:
            why[name] = reason
    return DeviceOffer(kset.spec, device, frozenset(kset.builds), frozenset(kset.requested), spec_builds, targets,
                       why, consts, records, declared)


@functools.lru_cache(maxsize=None)
def _stand_in_constants(name: str, spec) -> dict:
    """A stand-in's template constants of build `name` (its sm_90a plan's), computed once per process."""
    return by_name(name).plan_for(spec).template_constants()


_LOADED: dict = {}
_LOCK = threading.Lock()


def _say(line: str) -> None:
    """What load() compiles, on stderr (a cold cache costs tens of seconds of NVRTC; a warm one says nothing).
    DDTREE_GEN_QUIET=1 silences it."""
    import os
    import sys
    if os.environ.get("DDTREE_GEN_QUIET", "") in ("", "0"):
        print(line, file=sys.stderr, flush=True)


def load(spec, *, kernels=None, arch: str | None = None) -> KernelSet:
    """The compiled kernel set of a spec (a name from specs/, a path, or a Spec), building it if needed.
    Loading touches no GPU: modules are loaded on each device at its first launch, each kernel as the
    build of its targets that runs there (archs.py). `arch` ("sm_90a" / "sm_80"; default
    $DDTREE_GEN_ARCH, else none) forces one target on every device: only that one is built and loaded.
    What is not in the binary cache is compiled on one thread per CPU, and said on stderr (one line first,
    naming the variants, then one per variant compiled; DDTREE_GEN_QUIET=1: silent)."""
    spec = spec if isinstance(spec, Spec) else find_spec(spec)
    forced = archs.forced(arch)
    if forced is not None and forced not in spec.archs:
        raise ArgumentError(f"arch: {forced} is forced, but spec {spec.name!r} is not built for it "
                            f"(its targets: {', '.join(spec.archs)})")
    key = (spec, tuple(kernels) if kernels else None, forced)
    with _LOCK:
        if key not in _LOADED:
            built = artifacts.ensure_built(spec, kernels=kernels, arch=forced, say=_say)
            _LOADED[key] = KernelSet(spec, built, arch=forced)
        return _LOADED[key]


def variant_set(variants, *, also=(), arch: str | None = None) -> KernelSet:
    """A KernelSet of some variants of one spec (build/variant.py; for the tuner, the comparison and ablation
    scripts), compiled through the cache, with the default builds of the kernels `also` (e.g. the split-KV
    combine) beside them; `arch`: the forced target (archs.forced). `.variants` (kernel name -> Variant) and
    `.reports` (kernel name -> (plan, ptxas report)) of the variants.

    v = variant(by_name("tree_verify_wgmma"), spec, schedule="lockstep", tma=False)
    vs = variant_set([v], also=[COMBINE]); vs.tree_verify_wgmma(...)
    """
    variants = list(variants)
    spec = variants[0].spec
    if any(v.spec != spec for v in variants):
        raise ArgumentError(f"variant_set: variants of more than one spec ({', '.join(sorted({v.spec.name for v in variants}))})")
    built = {v.kernel.name: artifacts.compile_variant(v) for v in variants}   # (by build key)
    forced = archs.forced(arch)
    vs = KernelSet(spec, {**artifacts.ensure_built(spec, kernels=list(also), arch=forced), **built} if also else built,
                   arch=forced)
    vs.variants = {v.kernel.name: v for v in variants}
    vs.reports = {v.kernel.name: (v.plan(), built[v.kernel.name].report) for v in variants}
    return vs

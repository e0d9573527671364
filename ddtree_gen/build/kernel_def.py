"""KernelDef: one kernel's build data (template, entry point, resource plan, targets, config policy, the builds it
ships). No launcher. A build of it for a spec, a target and a config is a Variant (build/variant.py).

A kernel ships its default build and, where one build cannot serve every call as fast, further named builds (`Build`:
a policy over the same knobs, e.g. tree_verify_wgmma's "parts": the balanced parts grid). A build's config is a typed
record (`record`, e.g. ops/tree_verify/wgmma.WgmmaBuild) that the plan, the route and the launch plan read. Each
build is a KernelDef of its own for the layers that build and load (`build_defs`: the kernel's name, then
"<kernel>/<build>"); a kernel set holds them all, and tree_verify's route (ops/tree_verify/route.py) chooses one per call
by their records (docs/adding-a-kernel.md "A kernel with several builds")."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ..archs import ARCHS, PRIMARY
from ..errors import BuildError, SpecError
from .resources import Plan
from ..spec import KV_DTYPES, Spec

DEFAULT_BUILD = "default"


@dataclass(frozen=True)
class Build:
    """One further build a kernel ships beside its default: a named policy over the kernel's knobs."""
    name: str                                  # "parts": the kernel set's key is "<kernel>/<name>"
    policy: Callable[[Spec, str], dict]        # (spec, arch) -> its config
    kv_dtypes: tuple = KV_DTYPES               # the specs it is built for
    context: dict = field(default_factory=dict)  # template variables of its own (KV_FP8: False for a bf16 workspace)
    why: str = ""                              # what it is for (ddtree-gen list, the docs)


@dataclass(frozen=True)
class KernelDef:
    name: str                                  # "tree_build"; also its default variant's generated file's stem
    template: str                              # file under templates/
    entry: str                                 # extern "C" symbol
    # resource plan for a spec: plan(spec), or plan(spec, config=...) for a kernel with knobs (policy)
    plan: Callable[..., Plan]
    context: dict = field(default_factory=dict)  # extra template variables (e.g. tail=True)
    # the targets it can be built for (archs.py): every one by default; ("sm_90a",) for a kernel that
    # needs a Hopper-only instruction (wgmma)
    archs: tuple = ARCHS
    # the KV-cache element types (spec kv_dtype) it is built for: every one by default; ("bf16",) for a
    # kernel that reads bf16 caches only (the mma.sync tree_verify kernels): not built for an fp8 spec
    kv_dtypes: tuple = KV_DTYPES
    # the kernel's knobs: policy(spec, arch) -> its default config (a dict; build/variant.default_config), and
    # spell(config) -> the parts of a variant's procedural name (build/variant.Variant.name); None: no knobs
    policy: Callable[[Spec, str], dict] | None = None
    spell: Callable[[dict], tuple] | None = None
    # the typed record of a build (record(config) -> it, checked; e.g. ops/tree_verify/wgmma.WgmmaBuild): what the
    # route and the launch plan read of a build (build_record); None: the config dict itself
    record: Callable[[dict], object] | None = None
    # a tensor-core kernel's split-KV rule as values: split_rule(spec, arch) -> (table, model) for
    # split_kv.choose_splits (its tuned counts by shape class, its model); None: it does not split
    split_rule: Callable[[Spec, str], tuple] | None = None
    # its parameter list, declared once: signature(record) -> the signature's text (the template's `params`), e.g.
    # ops/tree_verify/params.signature; None: the template writes its signature itself
    signature: Callable[[object], str] | None = None
    # the further builds it ships (Build, ...; the default build is this KernelDef's own policy); the route picks one
    # for a call by their records (ops/tree_verify/route.py)
    builds: tuple = ()
    # the build data of one of a kernel's further builds: the kernel's name ("" for the default build itself) and its
    # build's name (build_defs sets both)
    of: str = ""
    build: str = DEFAULT_BUILD

    @property
    def kernel(self) -> str:
        """The kernel this is a build of (its own name for the default build)."""
        return self.of or self.name

    def build_defs(self) -> tuple:
        """This kernel's builds as KernelDefs, the default first: each further build the kernel's template and plan
        with its own policy, kv_dtypes and template context, named "<kernel>/<build>" (a kernel set's key for it)."""
        return (self, *(replace(self, name=f"{self.name}/{b.name}", policy=b.policy, kv_dtypes=b.kv_dtypes,
                                context={**self.context, **b.context}, builds=(), of=self.name,
                                build=b.name) for b in self.builds))
    # (public launcher, impl): the impl= of a public launcher this kernel serves, e.g. ("tree_verify", "mma")
    # (ops/tree_verify/launch.py sends impl="mma" to the kernel that declares it); None: none
    serves: tuple | None = None

    def build_record(self, spec: Spec, arch: str = PRIMARY):
        """The typed record of this build for `spec` and `arch` (record of the policy's config)."""
        config = self.policy(spec, arch) if self.policy is not None else {}
        return self.record(config) if self.record is not None else config

    def plan_for(self, spec: Spec, arch: str = PRIMARY, config: dict | None = None) -> Plan:
        """The resource plan of this kernel's build for `arch`, with `config` (a kernel with a policy: default,
        the policy's config for spec and arch)."""
        if self.policy is not None:
            return self.plan(spec, config=self.policy(spec, arch) if config is None else config)
        if config:
            raise BuildError(f"kernel {self.name} has no knobs (config {config})")
        return self.plan(spec)

    def builds_for(self, spec: Spec) -> bool:
        """Whether `spec` gets this kernel at all: its kv_dtype is one the kernel reads, and the kernel's
        resource plan serves the spec's shape on each of its targets (unfit)."""
        return spec.kv_dtype in self.kv_dtypes and self.unfit(spec) is None

    def unfit(self, spec: Spec) -> str | None:
        """None if this kernel's plan serves `spec` on every target the spec asks of it, else why not: the
        plan's refusal, naming the field or the limit (a kv_lora_rank the mma.sync and wgmma kernels cannot
        split over their warps, more registers than the CUDA-core kernel holds, shared memory past sm_90's).
        A spec the loader accepts gets every kernel that can be built for it; list, build and load say
        which ones it does not get, and why (docs/decisions.md "Specs the build cannot fully serve")."""
        cache = self.__dict__.get("_unfit_cache")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_unfit_cache", cache)   # frozen: a cache beside the fields
        if spec not in cache:
            why = None
            for arch in (a for a in ARCHS if a in self.archs and a in spec.archs):
                try:
                    self.plan_for(spec, arch).check_fits()
                except (SpecError, BuildError) as e:
                    why = str(e)
                    for name in (self.name, self.kernel):   # a build's plan names the kernel it builds
                        prefix = f"spec {spec.name!r}, kernel {name}: "
                        why = why[len(prefix):] if why.startswith(prefix) else why
                    break
            cache[spec] = why
        return cache[spec]

    def archs_for(self, spec: Spec) -> tuple:
        """The targets this kernel is built for in `spec`: its own that the spec asks for, in preference order;
        none when the kernel is not built for the spec's kv_dtype (builds_for). Every enumeration of a spec's
        kernels (artifacts, kernel sets, list, the tests) goes through here."""
        if not self.builds_for(spec):
            return ()
        return tuple(a for a in ARCHS if a in self.archs and a in spec.archs)

    def why_not_built(self, spec: Spec) -> str | None:
        """None if `spec` gets this kernel, else why not: a message naming the kernel, the spec and the reason
        (the ArgumentError of a launch, the BuildError of a build)."""
        if spec.kv_dtype not in self.kv_dtypes:
            return (f"{self.name}: not built for kv_dtype {spec.kv_dtype!r} of spec {spec.name!r} (it reads "
                    f"{', '.join(self.kv_dtypes)} caches only)")
        if self.unfit(spec):
            return f"{self.name}: not built for spec {spec.name!r}: {self.unfit(spec)}"
        if not self.archs_for(spec):
            return (f"{self.name}: not built for spec {spec.name!r}: its targets ({', '.join(self.archs)}) are "
                    f"not the spec's ({', '.join(spec.archs)})")
        return None

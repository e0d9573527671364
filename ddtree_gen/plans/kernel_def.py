"""KernelDef: one kernel variant's build data (template, entry point, resource plan, targets). No launcher."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..archs import ARCHS, PRIMARY
from ..resources import Plan
from ..spec import KV_DTYPES, Spec


@dataclass(frozen=True)
class KernelDef:
    name: str                                  # "tree_build"; also the generated file's stem
    template: str                              # file under templates/
    entry: str                                 # extern "C" symbol
    plan: Callable[[Spec], Plan]               # resource plan for a spec (plan(spec, arch=...) if arch_plan)
    context: dict = field(default_factory=dict)  # extra template variables (e.g. tail=True)
    # the targets it can be built for (archs.py): every one by default; ("sm_90a",) for a kernel that
    # needs a Hopper-only instruction (wgmma)
    archs: tuple = ARCHS
    # plan takes arch= : its configuration (tile sizes, shared memory) differs per target
    arch_plan: bool = False
    # the KV-cache element types (spec kv_dtype) it is built for: every one by default; ("bf16",) for a
    # kernel that reads bf16 caches only (the mma.sync tree_verify kernels): not built for an fp8 spec
    kv_dtypes: tuple = KV_DTYPES

    def plan_for(self, spec: Spec, arch: str = PRIMARY) -> Plan:
        """The resource plan of this kernel's build for `arch`."""
        return self.plan(spec, arch=arch) if self.arch_plan else self.plan(spec)

    def builds_for(self, spec: Spec) -> bool:
        """Whether `spec` gets this kernel at all: its kv_dtype is one the kernel reads."""
        return spec.kv_dtype in self.kv_dtypes

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
        if not self.builds_for(spec):
            return (f"{self.name}: not built for kv_dtype {spec.kv_dtype!r} of spec {spec.name!r} (it reads "
                    f"{', '.join(self.kv_dtypes)} caches only)")
        if not self.archs_for(spec):
            return (f"{self.name}: not built for spec {spec.name!r}: its targets ({', '.join(self.archs)}) are "
                    f"not the spec's ({', '.join(spec.archs)})")
        return None

"""KernelDef: one kernel variant's build data (template, entry point, resource plan, targets). No launcher."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..archs import ARCHS, PRIMARY
from ..resources import Plan
from ..spec import Spec


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

    def plan_for(self, spec: Spec, arch: str = PRIMARY) -> Plan:
        """The resource plan of this kernel's build for `arch`."""
        return self.plan(spec, arch=arch) if self.arch_plan else self.plan(spec)

    def archs_for(self, spec: Spec) -> tuple:
        """The targets this kernel is built for in `spec`: its own that the spec asks for, in preference order."""
        return tuple(a for a in ARCHS if a in self.archs and a in spec.archs)

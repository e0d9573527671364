"""KernelDef: one kernel variant's build data (template, entry point, resource plan). No launcher."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..resources import Plan
from ..spec import Spec


@dataclass(frozen=True)
class KernelDef:
    name: str                                  # "tree_build"; also the generated file's stem
    template: str                              # file under templates/
    entry: str                                 # extern "C" symbol
    plan: Callable[[Spec], Plan]               # resource plan for a spec
    context: dict = field(default_factory=dict)  # extra template variables (e.g. tail=True)

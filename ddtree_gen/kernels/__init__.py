"""The kernel registry: one module per kernel family, each defining KernelDef objects.

A KernelDef ties together a template (templates/<file>), its entry point, its resource plan
(a function of the spec, see resources.py) and its launcher (called through a KernelSet).
"""
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
    launch: Callable                           # launch(kset, *args, **kwargs)
    context: dict = field(default_factory=dict)  # extra template variables (e.g. tail=True)


def all_kernels() -> list[KernelDef]:
    """Every kernel built for every spec, in build order."""
    from . import tree_accept, tree_build, tree_verify, tree_verify_mma, tree_verify_wgmma
    return [*tree_build.KERNELS, *tree_verify.KERNELS, *tree_verify_mma.KERNELS, *tree_verify_wgmma.KERNELS,
            *tree_accept.KERNELS]


def by_name(name: str) -> KernelDef:
    for k in all_kernels():
        if k.name == name:
            return k
    raise KeyError(name)

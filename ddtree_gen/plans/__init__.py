"""The kernels' build data: one module per kernel family, each with the KernelDefs of its kernels (KERNELS).

Each family module defines the resource plans (sympy formulas of the spec, see resources.py), the KernelDefs
of its kernels, and the inputs of their sanitizer cases and bundles (`sanitizer_cases`, `bundle_inputs`). A
family is listed in FAMILIES, in build order (docs/adding-a-kernel.md). The kernels' declarations (declaration.py:
launcher, reference, torch ops, ...) are made next to their launchers, in ddtree_gen/kernels/, and collected by ddtree_gen.registry. The build layer
(render, compile, artifacts) and the runtime read this package; nothing here imports a launcher
(ddtree_gen.kernels) or the runtime.
"""
from __future__ import annotations

from . import draft_topk, kv_commit, kv_dequant, split_kv, tree_accept, tree_build, tree_verify, tree_verify_mma
from . import tree_verify_wgmma
from .declaration import FACETS, Bundles, Declaration, TorchOp
from .kernel_def import DEFAULT_BUILD, Build, KernelDef

# the families in build order (the order of `build`, `list` and the sanitizer's runs): a new family is added here
FAMILIES = (tree_build, tree_verify, tree_verify_mma, split_kv, tree_verify_wgmma, tree_accept, kv_commit, draft_topk,
            kv_dequant)


_ALL = tuple(k for m in FAMILIES for k in m.KERNELS)
_BUILDS = tuple(b for k in _ALL for b in k.build_defs())
_BY_NAME = {k.name: k for k in _BUILDS}
assert len({k.name for k in _ALL}) == len(_ALL), "two KernelDefs of one kernel name"
assert len(_BY_NAME) == len(_BUILDS), "two builds of one name"


def all_kernels() -> list[KernelDef]:
    """Every declared kernel (its default build's KernelDef), in build order."""
    return list(_ALL)


def all_builds() -> list[KernelDef]:
    """Every build of every kernel, in build order (each kernel's default first, then its further builds): what
    `ddtree-gen build` compiles and a kernel set holds."""
    return list(_BUILDS)


def builds_of(kernel: str) -> list[KernelDef]:
    """The builds of declared kernel `kernel` (KeyError: no such kernel), its default first."""
    kdef = _BY_NAME[kernel]
    if kdef.of:
        raise KeyError(f"{kernel}: a build, not a kernel (its kernel: {kdef.of})")
    return list(kdef.build_defs())


def by_name(name: str) -> KernelDef:
    """A build by its name: a kernel's (its default build) or "<kernel>/<build>"."""
    return _BY_NAME[name]


__all__ = ["DEFAULT_BUILD", "FACETS", "Build", "Bundles", "Declaration", "KernelDef", "TorchOp", "all_builds",
           "all_kernels", "builds_of", "by_name"]

"""The kernel registry: plain build data, one module per kernel family.

Each family module defines the resource plans (sympy formulas of the spec, see resources.py) and
the KernelDefs of its kernels. The build layer (render, compile, artifacts) and the runtime read
this registry; nothing here imports a launcher (ddtree_gen.kernels) or the runtime.
"""
from __future__ import annotations

from . import draft_topk, kv_commit, tree_accept, tree_build, tree_verify, tree_verify_mma, tree_verify_wgmma
from .kernel_def import KernelDef

_ALL = (*tree_build.KERNELS, *tree_verify.KERNELS, *tree_verify_mma.KERNELS, *tree_verify_wgmma.KERNELS,
        *tree_accept.KERNELS, *kv_commit.KERNELS, *draft_topk.KERNELS)
_BY_NAME = {k.name: k for k in _ALL}


def all_kernels() -> list[KernelDef]:
    """Every kernel built for every spec, in build order."""
    return list(_ALL)


def by_name(name: str) -> KernelDef:
    return _BY_NAME[name]


__all__ = ["KernelDef", "all_kernels", "by_name"]

"""The operations, one folder each (ops/<op>/), listed here once, in build order.

An operation's folder holds its build data (plan.py; tree_verify: simple.py, mma.py, split.py, wgmma.py: the
KernelDefs of its kernels, their resource plans, builds, sanitizer cases and bundle inputs) beside its launchers
(launch.py; tree_verify: launch.py, tensor_core.py, which.py and the families' mma_launch.py / wgmma_launch.py)
with the kernels' declarations. This module imports the build data only (the build wing, ddtree_gen/build/, and
the runtime read it); ddtree_gen.registry collects the launchers' declarations. A new operation is a folder and a
line in FAMILIES below (docs/adding-a-kernel.md).
"""
from __future__ import annotations

from ..build.declaration import FACETS, Bundles, Declaration, TorchOp
from ..build.kernel_def import DEFAULT_BUILD, Build, KernelDef

from .draft_topk import plan as _draft_topk
from .kv_commit import plan as _kv_commit
from .kv_dequant import plan as _kv_dequant
from .tree_accept import plan as _tree_accept
from .tree_build import plan as _tree_build
from .tree_verify import mma as _tree_verify_mma, simple as _tree_verify, split as _split_kv, wgmma as _tree_verify_wgmma

# the modules with KernelDefs (KERNELS), in build order (the order of `build`, `list` and the sanitizer's runs)
FAMILIES = (_tree_build, _tree_verify, _tree_verify_mma, _split_kv, _tree_verify_wgmma, _tree_accept, _kv_commit,
            _draft_topk, _kv_dequant)

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


__all__ = ["FAMILIES", "DEFAULT_BUILD", "FACETS", "Build", "Bundles", "Declaration", "KernelDef", "TorchOp", "all_builds",
           "all_kernels", "builds_of", "by_name"]

"""The kernel declarations, collected: one Declaration per kernel, made next to its launcher (ops/<op>/launch.py).

A declaration holds the kernel's facets as objects (build/declaration.py): its launcher, numpy reference, output
record, torch ops, sanitizer cases and bundle inputs. This module, above the launchers, gathers the DECLARATIONS of
every launcher module (LAUNCHERS, below) in build order (ops.all_kernels()); torch_ops, sanitize, bundles,
`ddtree-gen list` and the tests iterate it, and tests/test_declarations.py holds kernel_set.Launchers (the KernelSet
methods) to it.
"""
from __future__ import annotations

import inspect

from .ops import FACETS, Declaration, all_kernels, by_name
from .ops.draft_topk import launch as _draft_topk
from .ops.kv_commit import launch as _kv_commit
from .ops.kv_dequant import launch as _kv_dequant
from .ops.tree_accept import launch as _tree_accept
from .ops.tree_build import launch as _tree_build
from .ops.tree_verify import launch as _tree_verify, mma_launch as _tree_verify_mma, tensor_core as _tensor_core
from .ops.tree_verify import wgmma_launch as _tree_verify_wgmma

# the modules with DECLARATIONS (launchers next to them); their order does not matter: declarations() sorts by build
# order (ops.FAMILIES)
LAUNCHERS = (_tree_build, _tree_verify, _tree_verify_mma, _tensor_core, _tree_verify_wgmma, _tree_accept, _kv_commit,
             _draft_topk, _kv_dequant)

__all__ = ["FACETS", "Declaration", "declaration", "declarations", "launcher", "reference", "output",
           "torch_ops", "sanitizer_cases", "bundle_cases", "problems"]

_ORDER = {k.name: i for i, k in enumerate(all_kernels())}
_COLLECTED = tuple(d for m in LAUNCHERS for d in m.DECLARATIONS)
_DECLS = tuple(sorted(_COLLECTED, key=lambda d: _ORDER.get(d.name, len(_ORDER))))
_BY_NAME: dict = {}
for _d in _DECLS:
    _BY_NAME.setdefault(_d.name, _d)
del _d


def declarations() -> list[Declaration]:
    """Every kernel's declaration, in build order."""
    return list(_DECLS)


def declaration(name: str) -> Declaration:
    return _BY_NAME[name]


def launcher(name: str):
    """Kernel `name`'s launcher, launch(kset, ...): the KernelSet method of that name."""
    return declaration(name).launcher


def reference(name: str):
    """The numpy reference of kernel `name` (None: the declaration says why it has none)."""
    return declaration(name).reference


def output(name: str):
    """The record kernel `name`'s launcher returns (None: it returns nothing, or the declaration says why)."""
    return declaration(name).output


def torch_ops() -> list:
    """(declaration, TorchOp) of every torch op, in build order."""
    return [(d, op) for d in declarations() for op in d.torch_ops]


def sanitizer_cases() -> dict:
    """Kernel name -> its sanitizer cases, cases(spec, rng) -> (case name, inputs), ... (kernels with cases only)."""
    return {d.name: d.sanitize for d in declarations() if d.sanitize}


def bundle_cases() -> dict:
    """Kernel name -> its Bundles (inputs, case names, run) for the kernels with bundles in refs/."""
    return {d.name: d.bundles for d in declarations() if d.bundles}


def _first_parameter(fn) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params[0] if params else None


def problems() -> list[str]:
    """What is wrong with the declarations: a facet neither declared nor explained or not the object it stands for
    (Declaration.problems), a kernel of ops/ with no declaration or with two, a declaration of a build that is not
    ops/' KernelDef of its name, a launcher or torch op implementation that does not take the kernel set first, a
    torch op's name twice."""
    decls = declarations()
    out = [p for d in decls for p in d.problems()]
    names = [d.name for d in decls]
    out += [f"{k.name}: a kernel of ops/ with no declaration beside its launcher" for k in all_kernels() if k.name not in names]
    out += [f"{n}: declared {names.count(n)} times" for n in sorted({n for n in names if names.count(n) > 1})]
    for d in decls:
        if d.name not in _ORDER or d.build is not by_name(d.name):
            out.append(f"{d.name}: its build is not ops/' KernelDef of that name (ops.by_name)")
        if callable(d.launcher) and _first_parameter(d.launcher) != "kset":
            out.append(f"{d.name}: launcher {d.launcher.__qualname__} does not take the kernel set first (kset)")
        for op in d.torch_ops:
            if callable(op.impl) and _first_parameter(op.impl) != "kset":
                out.append(f"{d.name}: torch op {op.name}'s impl {op.impl.__qualname__} does not take the kernel "
                           f"set first (kset)")
    ops = [op.name for _, op in torch_ops()]
    out += [f"torch op {n!r} declared twice" for n in sorted({n for n in ops if ops.count(n) > 1})]
    return out

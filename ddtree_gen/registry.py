"""The kernel declarations, collected: one Declaration per kernel, made next to its launcher (kernels/<family>.py).

A declaration holds the kernel's facets as objects (plans/declaration.py): its launcher, numpy reference, output
record, torch ops, sanitizer cases and bundle inputs. This module, above the launchers, gathers every kernels/
module's DECLARATIONS (kernels.declarations()) in build order (plans.all_kernels()); torch_ops, sanitize, bundles,
`ddtree-gen list` and the tests iterate it, and tests/test_declarations.py holds kernel_set.Launchers (the KernelSet
methods) to it.
"""
from __future__ import annotations

import inspect

from . import kernels
from .plans import FACETS, Declaration, all_kernels, by_name

__all__ = ["FACETS", "Declaration", "declaration", "declarations", "launcher", "reference", "output",
           "torch_ops", "sanitizer_cases", "bundle_cases", "problems"]

_ORDER = {k.name: i for i, k in enumerate(all_kernels())}
_COLLECTED = tuple(kernels.declarations())
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
    (Declaration.problems), a kernel of plans/ with no declaration or with two, a declaration of a build that is not
    plans/' KernelDef of its name, a launcher or torch op implementation that does not take the kernel set first, a
    torch op's name twice."""
    decls = declarations()
    out = [p for d in decls for p in d.problems()]
    names = [d.name for d in decls]
    out += [f"{k.name}: a kernel of plans/ with no declaration in kernels/" for k in all_kernels() if k.name not in names]
    out += [f"{n}: declared {names.count(n)} times" for n in sorted({n for n in names if names.count(n) > 1})]
    for d in decls:
        if d.name not in _ORDER or d.build is not by_name(d.name):
            out.append(f"{d.name}: its build is not plans/' KernelDef of that name (plans.by_name)")
        if callable(d.launcher) and _first_parameter(d.launcher) != "kset":
            out.append(f"{d.name}: launcher {d.launcher.__qualname__} does not take the kernel set first (kset)")
        for op in d.torch_ops:
            if callable(op.impl) and _first_parameter(op.impl) != "kset":
                out.append(f"{d.name}: torch op {op.name}'s impl {op.impl.__qualname__} does not take the kernel "
                           f"set first (kset)")
    ops = [op.name for _, op in torch_ops()]
    out += [f"torch op {n!r} declared twice" for n in sorted({n for n in ops if ops.count(n) > 1})]
    return out

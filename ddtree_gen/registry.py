"""The kernel declarations (plans/: one Declaration per kernel) with their strings resolved.

The declarations name a kernel's launcher, numpy reference, output record, torch ops, sanitizer cases and
bundle inputs as "module:attribute" strings, so that plans/ imports nothing above it; this module, above the
launchers, turns them into the objects. kernel_set (the KernelSet methods), torch_ops, sanitize, bundles,
`ddtree-gen list` and the tests iterate it. A string names a module of ddtree_gen, relative to the package.
"""
from __future__ import annotations

import functools
import importlib

from .plans import FACETS, Declaration, declaration, declarations

__all__ = ["FACETS", "Declaration", "declaration", "declarations", "resolve", "launcher", "reference", "output",
           "torch_ops", "sanitizer_cases", "bundle_cases", "problems"]


@functools.lru_cache(maxsize=None)
def resolve(ref: str):
    """The object a declaration's "module:attribute" string names (module relative to ddtree_gen)."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{ref!r}: expected 'module:attribute'")
    return getattr(importlib.import_module(f"ddtree_gen.{module}"), attr)


def launcher(name: str):
    """Kernel `name`'s launcher, launch(kset, ...): the KernelSet method of that name."""
    return resolve(declaration(name).launcher)


def reference(name: str):
    """The numpy reference of kernel `name` (None: the declaration says why it has none)."""
    ref = declaration(name).reference
    return resolve(ref) if ref else None


def output(name: str):
    """The record kernel `name`'s launcher returns (None: it returns nothing, or the declaration says why)."""
    ref = declaration(name).output
    return resolve(ref) if ref else None


def torch_ops() -> list:
    """(declaration, TorchOp) of every torch op, in build order."""
    return [(d, op) for d in declarations() for op in d.torch_ops]


def sanitizer_cases() -> dict:
    """Kernel name -> its sanitizer cases, cases(spec, rng) -> (case name, inputs), ... (kernels with cases only)."""
    return {d.name: resolve(d.sanitize) for d in declarations() if d.sanitize}


def bundle_cases() -> dict:
    """Kernel name -> its Bundles (inputs, case names, run) for the kernels with bundles in refs/."""
    return {d.name: d.bundles for d in declarations() if d.bundles}


def problems() -> list[str]:
    """What is wrong with the declarations: a facet neither declared nor explained, a string that does not
    resolve, a torch op's name twice, a launcher that does not take the kernel set first."""
    out = [p for d in declarations() for p in d.problems()]
    refs = []
    for d in declarations():
        refs += [(d.name, f, getattr(d, f)) for f in ("launcher", "reference", "output", "sanitize") if getattr(d, f)]
        refs += [(d.name, "torch_ops", r) for op in d.torch_ops for r in (op.fake, op.impl) if r]
        refs += [(d.name, "bundles", r) for r in ((d.bundles.inputs, d.bundles.run) if d.bundles else ()) if r]
    for name, facet, ref in refs:
        if ref.startswith("torch_ops:"):
            continue   # torch is optional: torch_ops resolves its own when it registers the ops (tests/test_torch_ops_cpu)
        try:
            resolve(ref)
        except (ImportError, AttributeError, ValueError) as e:
            out.append(f"{name}: {facet} {ref!r} does not resolve ({type(e).__name__}: {e})")
    ops = [op.name for _, op in torch_ops()]
    out += [f"torch op {n!r} declared twice" for n in sorted({n for n in ops if ops.count(n) > 1})]
    return out

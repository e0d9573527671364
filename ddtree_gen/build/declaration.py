"""Declaration: one record per kernel, holding every facet of it (docs/adding-a-kernel.md).

A kernel's build data is its KernelDef (ops/: template, entry, resource plan). Its declaration sits next to
its launcher, in its operation's launch module, ddtree_gen/ops/<op>/launch.py (`DECLARATIONS = [Declaration(...)]`), and holds the
facets themselves, as objects: the launcher, the numpy reference and its output record, the torch ops (their
fakes and implementations, in the same module), the sanitizer's cases and the bundles' inputs (in the kernel's
plan module, ops/<op>/plan.py). A reader follows them as imports; ddtree_gen/registry.py collects the
declarations. The records are defined here, below the launchers, so that the launch modules can build them; nothing here
imports a facet.

A facet a kernel does not have is named in `missing` with the reason (a test holds it: every facet of
every registered kernel is declared, or its absence is explained).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from .kernel_def import KernelDef

# what a kernel declares, besides its build: a value, or a reason in Declaration.missing
FACETS = ("launcher", "reference", "output", "torch_ops", "sanitize", "bundles")

# sanitizer cases: cases(spec, rng) -> (case name, keyword arguments of the launcher), ...
SanitizerCases = Callable[[Any, Any], Iterator[tuple]]


@dataclass(frozen=True)
class TorchOp:
    """One torch custom op (torch.ops.ddtree.<name>) of a kernel (ddtree_gen/torch_ops.py registers it)."""
    schema: str                          # torch.library schema; its first argument is `str spec`
    fake: Callable[..., Any]             # fake(spec: Spec, *args) -> the outputs as new empty tensors (torch
                                         # imported inside it: torch is optional)
    impl: Callable[..., Any] | None = None   # impl(kset, *args) -> tuple, the op's arguments after spec; None: the
                                         # launcher called with them positionally, its record returned as a tuple

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


@dataclass(frozen=True)
class Bundles:
    """The kernel's KDTR bundles in refs/<spec>/<kernel>-<case>.kdtr (ddtree_gen/bundles.py)."""
    inputs: Callable[[Any, Any, str], Mapping]   # inputs(spec, rng, case) -> {name: numpy array or scalar}
    cases: tuple                                 # the case names
    run: Callable[[Any, Mapping], Mapping] | None = None   # run(spec, inputs) -> {name: array}; None: the reference
                                 # called with the inputs by name (a parameter not among them: the spec field of that
                                 # name), its record's fields as outputs (float64 stored as float32)


_CALLABLE = ("launcher", "reference", "sanitize")


@dataclass(frozen=True)
class Declaration:
    build: KernelDef                                  # template, entry, resource plan, targets (ops/)
    launcher: Callable[..., Any] | None = None        # launch(kset, ...), the KernelSet method `name`
    reference: Callable[..., Any] | None = None       # the numpy reference (ddtree_gen.reference)
    output: type | None = None                        # the record the launcher returns
    torch_ops: tuple[TorchOp, ...] = ()
    sanitize: SanitizerCases | None = None            # cases(spec, rng) -> (case name, inputs), ...
    bundles: Bundles | None = None
    missing: dict = field(default_factory=dict)       # facet -> why this kernel has none

    @property
    def name(self) -> str:
        return self.build.name

    @property
    def serves(self) -> tuple | None:
        """(public launcher, impl) this kernel serves: its build's (KernelDef.serves)."""
        return self.build.serves

    def has(self, facet: str) -> bool:
        return bool(getattr(self, facet))

    def problems(self) -> list[str]:
        """Facets neither declared nor explained, explanations of facets that are declared, and facets that are not
        the objects they stand for (a "module:attribute" string, of the declarations before issue 40, among them)."""
        out = []
        for facet in FACETS:
            if not self.has(facet) and not self.missing.get(facet):
                out.append(f"{self.name}: no {facet}, and no reason in missing[{facet!r}]")
            if self.has(facet) and facet in self.missing:
                out.append(f"{self.name}: {facet} is declared and also explained as missing")
        out += [f"{self.name}: missing[{f!r}]: not a facet (facets: {', '.join(FACETS)})"
                for f in self.missing if f not in FACETS]
        values = [(f, getattr(self, f)) for f in _CALLABLE]
        values += [("torch_ops", r) for op in self.torch_ops for r in (op.fake, op.impl)]
        values += [("bundles", r) for r in ((self.bundles.inputs, self.bundles.run) if self.bundles else ())]
        for facet, value in values:
            if value is None:
                continue
            if isinstance(value, str):
                out.append(f"{self.name}: {facet} {value!r} is a string, not the object itself (a declaration "
                           f"holds its facets: docs/adding-a-kernel.md)")
            elif not callable(value):
                out.append(f"{self.name}: {facet} {value!r} is not callable")
        if self.output is not None and not isinstance(self.output, type):
            out.append(f"{self.name}: output {self.output!r} is not a type (the launcher's record)")
        if not isinstance(self.build, KernelDef):
            out.append(f"{self.name}: build {self.build!r} is not a KernelDef")
        return out

"""Declaration: one record per kernel, naming every facet of it (docs/adding-a-kernel.md).

A kernel's build data is its KernelDef (template, entry, resource plan). Everything else about it lives
above the plans in the import graph (the launcher in kernels/, the numpy reference, the torch op, the
sanitizer's and the bundles' cases), so the declaration names those by strings, "module:attribute"
(a module of ddtree_gen, relative to the package: "kernels.draft_topk:launch"). They are resolved in
ddtree_gen/registry.py, above the launchers; nothing here imports them.

A facet a kernel does not have is named in `missing` with the reason (a test holds it: every facet of
every registered kernel is declared, or its absence is explained).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .kernel_def import KernelDef

# what a kernel declares, besides its build: a value, or a reason in Declaration.missing
FACETS = ("launcher", "reference", "output", "torch_ops", "sanitize", "bundles")


@dataclass(frozen=True)
class TorchOp:
    """One torch custom op (torch.ops.ddtree.<name>) of a kernel (ddtree_gen/torch_ops.py registers it)."""
    schema: str                 # torch.library schema; its first argument is `str spec`
    fake: str                   # "module:function": fake(spec: Spec, *args) -> the outputs as new empty tensors
    impl: str | None = None     # "module:function": impl(kset, *args) -> tuple; None: the launcher called with the
                                # op's arguments (after spec) positionally, its record returned as a tuple

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


@dataclass(frozen=True)
class Bundles:
    """The kernel's KDTR bundles in refs/<spec>/<kernel>-<case>.kdtr (ddtree_gen/bundles.py)."""
    inputs: str                 # "module:function": inputs(spec, rng, case) -> {name: numpy array or scalar}
    cases: tuple                # the case names
    run: str | None = None      # "module:function": run(spec, inputs) -> {name: array}; None: the reference called
                                # with the inputs by name (a parameter not among them: the spec field of that
                                # name), its record's fields as outputs (float64 stored as float32)


@dataclass(frozen=True)
class Declaration:
    build: KernelDef                           # template, entry, resource plan, targets
    launcher: str | None = None                # "module:function": launch(kset, ...), the KernelSet method `name`
    reference: str | None = None               # "module:function": the numpy reference (ddtree_gen.reference)
    output: str | None = None                  # "module:Record": the record the launcher returns
    torch_ops: tuple = ()                      # TorchOp, ...
    sanitize: str | None = None                # "module:function": cases(spec, rng) -> (case name, inputs), ...
    bundles: Bundles | None = None
    # (public launcher, impl): the impl= of a public launcher this kernel serves, e.g. ("tree_verify", "mma")
    serves: tuple | None = None
    missing: dict = field(default_factory=dict)   # facet -> why this kernel has none

    @property
    def name(self) -> str:
        return self.build.name

    def has(self, facet: str) -> bool:
        return bool(getattr(self, facet))

    def problems(self) -> list[str]:
        """Facets neither declared nor explained, and explanations of facets that are declared."""
        out = []
        for facet in FACETS:
            if not self.has(facet) and not self.missing.get(facet):
                out.append(f"{self.name}: no {facet}, and no reason in missing[{facet!r}]")
            if self.has(facet) and facet in self.missing:
                out.append(f"{self.name}: {facet} is declared and also explained as missing")
        out += [f"{self.name}: missing[{f!r}]: not a facet (facets: {', '.join(FACETS)})"
                for f in self.missing if f not in FACETS]
        return out

"""The kernel declarations (ops/<op>/launch.py: one Declaration per kernel, collected by ddtree_gen.registry), on the CPU.

Every registered kernel declares each facet (launcher, reference, output record, torch ops, sanitizer cases,
bundles) as the object itself or says in `missing` why it has none; the KernelSet methods are the launchers
with their signatures; the CPU stand-in and KernelSet answer what a launcher asks (kernels.KernelSetLike).
"""
from __future__ import annotations

import inspect

import pytest

from ddtree_gen import kernel_set, registry
from ddtree_gen.launch.protocol import KernelSetLike
from ddtree_gen.ops import FACETS, Bundles, Declaration, all_kernels, by_name


@pytest.mark.parametrize("decl", registry.declarations(), ids=lambda d: d.name)
def test_every_facet_is_declared_or_explained(decl):
    assert decl.problems() == []


def test_the_declarations_are_the_registry():
    assert [d.name for d in registry.declarations()] == [k.name for k in all_kernels()]
    assert all(d.build is by_name(d.name) for d in registry.declarations())
    assert registry.problems() == []


def test_a_missing_facet_without_a_reason_is_a_problem():
    full = registry.declaration("draft_topk")
    for facet in FACETS:
        cut = Declaration(**{**full.__dict__, facet: () if facet == "torch_ops" else None})
        assert cut.problems() == [f"draft_topk: no {facet}, and no reason in missing[{facet!r}]"]
        why = Declaration(**{**cut.__dict__, "missing": {facet: "a reason"}})
        assert why.problems() == []
    both = Declaration(**{**full.__dict__, "missing": {"launcher": "a reason"}})
    assert "launcher is declared and also explained as missing" in both.problems()[0]
    odd = Declaration(**{**full.__dict__, "missing": {"benchmark": "x"}})
    assert "not a facet" in odd.problems()[0]


def test_a_facet_that_is_not_its_object_is_named(monkeypatch):
    """A facet given as a "module:attribute" string (the declarations before issue 40) or as anything else that is
    not the object is named, as is a launcher or op implementation that does not take the kernel set first."""
    bad = Declaration(**{**registry.declaration("draft_topk").__dict__, "reference": "reference:no_such_function",
                         "bundles": Bundles("plans.no_such_module:inputs", ("x",)), "output": "DraftTopkOutput",
                         "launcher": lambda spec, logits: None})
    decls = [bad if d.name == "draft_topk" else d for d in registry.declarations()]
    monkeypatch.setattr(registry, "declarations", lambda: decls)
    problems = registry.problems()
    assert any("reference 'reference:no_such_function' is a string, not the object" in p for p in problems), problems
    assert any("bundles 'plans.no_such_module:inputs' is a string, not the object" in p for p in problems), problems
    assert any("output 'DraftTopkOutput' is not a type" in p for p in problems), problems
    assert any("draft_topk: launcher" in p and "does not take the kernel set first" in p for p in problems), problems


def test_every_kernel_of_plans_is_declared_once(monkeypatch):
    decls = registry.declarations()
    monkeypatch.setattr(registry, "declarations", lambda: [d for d in decls if d.name != "kv_commit"] + decls[:1])
    problems = registry.problems()
    assert "kv_commit: a kernel of ops/ with no declaration beside its launcher" in problems, problems
    assert "tree_build: declared 2 times" in problems, problems


@pytest.mark.parametrize("decl", registry.declarations(), ids=lambda d: d.name)
def test_kernel_set_methods_are_the_launchers(decl):
    """Each declared kernel's method, on KernelSet and on the CPU stand-in, is its declared launcher itself (a class
    attribute of kernel_set.Launchers: "go to definition" reaches the launcher's def), so help(ks.tree_verify)
    shows the launcher's signature and docstring (not *args, **kwargs)."""
    launch = registry.launcher(decl.name)
    assert vars(kernel_set.Launchers)[decl.name] is launch
    for cls in (kernel_set.KernelSet, kernel_set.StandInKernelSet):   # neither shadows it
        assert getattr(cls, decl.name) is launch, cls
    params = list(inspect.signature(launch).parameters)
    assert params[0] == "kset" and "args" not in params and "kwargs" not in params


def test_every_method_of_launchers_is_declared():
    """kernel_set.Launchers names the registry's kernels, no more (the registry is the source of which kernels
    exist), in build order."""
    methods = [n for n, v in vars(kernel_set.Launchers).items() if not n.startswith("__")]
    assert methods == [d.name for d in registry.declarations()]


def test_no_launcher_is_attached_at_run_time():
    """The methods are in the class body, where a reader (and an editor's "go to definition") finds them: kernel_set
    sets no attribute at import (no setattr, no assignment to a class's attribute outside its body)."""
    import ast
    from pathlib import Path
    tree = ast.parse(Path(kernel_set.__file__).read_text())
    calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setattr"]
    assigned = [n.lineno for n in tree.body if isinstance(n, (ast.Assign, ast.AugAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)]
    assert not calls and not assigned, (calls, assigned)


def test_bound_method_signature_drops_the_kernel_set(spec):
    ks = kernel_set.StandInKernelSet(spec)
    sig = inspect.signature(ks.tree_verify)
    assert list(sig.parameters)[:3] == ["q_nope", "q_pe", "kv_cache"] and sig.parameters["impl"].default == "auto"
    assert "kernel set" not in str(sig)
    assert inspect.signature(ks.draft_topk).parameters["temperature"].default == 1.0


def test_kernel_sets_follow_the_protocol(spec):
    stand_in = kernel_set.StandInKernelSet(spec)
    assert isinstance(stand_in, KernelSetLike)
    ks = kernel_set.KernelSet(spec, {})
    assert isinstance(ks, KernelSetLike)
    for name in (p for p in dir(KernelSetLike) if not p.startswith("_")):   # the methods and properties
        assert hasattr(ks, name) and hasattr(stand_in, name), name


def test_stand_in_runs_what_the_spec_gets(spec):
    ks = kernel_set.StandInKernelSet(spec)
    assert ks.kernels == [k.name for k in all_kernels() if k.archs_for(spec)]
    for k in all_kernels():
        if k.archs_for(spec):
            assert ks.unavailable(k.name, 0) is None and ks.require(k.name, 0) == k.archs_for(spec)[0]
        else:   # an fp8 spec's mma.sync kernels: the build's reason
            assert ks.unavailable(k.name, 0) == k.why_not_built(spec)
    few = kernel_set.StandInKernelSet(spec, ["tree_build"])
    assert "not loaded in this kernel set" in few.unavailable("kv_commit", 0)
    assert few.plan("tree_build").kernel == "tree_build"
    assert few.constants("tree_build") == by_name("tree_build").plan_for(spec).template_constants()


def test_stand_in_records_launches(spec, fake_device):
    import numpy as np

    from conftest import FakeCudaArray
    from ddtree_gen.reference import DraftTopkOutput
    ks = kernel_set.StandInKernelSet(spec)
    b, dp, v, k = 2, 1, 1000, 4
    out = DraftTopkOutput(FakeCudaArray((b, dp, k), np.int32, ptr=2 << 30),
                          FakeCudaArray((b, dp, k), np.float32, ptr=3 << 30))
    got = ks.draft_topk(FakeCudaArray((b, dp, v), np.float32, ptr=1 << 30), k, out=out)
    assert got == out and [(name, grid) for name, grid, _ in ks.launches] == [("draft_topk", (b * dp,))]


def test_impl_served_by_the_tensor_core_kernels():
    served = {d.serves: d.name for d in registry.declarations() if d.serves}
    assert served == {("tree_verify", "simple"): "tree_verify", ("tree_verify_tail", "simple"): "tree_verify_tail",
                      ("tree_verify", "mma"): "tree_verify_mma", ("tree_verify_tail", "mma"): "tree_verify_tail_mma",
                      ("tree_verify", "wgmma"): "tree_verify_wgmma",
                      ("tree_verify_tail", "wgmma"): "tree_verify_tail_wgmma"}


def test_every_kernel_with_bundles_has_them_in_refs(spec):
    from ddtree_gen import bundles
    for name, b in registry.bundle_cases().items():
        for case in b.cases:
            assert bundles.bundle_path(spec, name, case).is_file(), (name, case)
    assert "kv_commit" in registry.bundle_cases()

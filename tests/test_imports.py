"""The import graph of ddtree_gen: no cycle, and layers that import downwards only.

Every `import` and `from ... import` statement counts, at module level or inside a function
(a function-level import is still an edge: it only hides a ring until the call).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ddtree_gen

PACKAGE = Path(ddtree_gen.__file__).resolve().parent

# Lower layers first. A module may import its own layer or a lower one, never a higher one.
LAYERS = [
    ["errors", "paths", "types", "fileio", "bf16", "fp8", "trees", "archs", "spec", "needs"],   # leaves (archs: build targets)
    ["resources", "kdtr", "inputs", "reference"],                        # resource model, bundle format, inputs, numpy
    ["plans"],                                                           # the kernel registry (build data)
    ["render", "compile"],
    ["artifacts", "arrays"],                                             # build products; caller arrays
    ["runtime", "callplan"],                                             # modules per device, launches; one call compiled
    ["kernels"],                                                         # launchers
    ["registry"],                                                        # the declarations' strings resolved
    ["kernel_set"],                                                      # launchers bound to a spec's binaries
    ["torch_ops", "model", "bench", "sanitize", "hf",                   # users of kernel sets (bench/: a package; hf: transformers)
     "bundles"],                                                         # and of the declarations (bundles: refs/)
    ["cli", "__main__", "__init__"],
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["ddtree_gen", *parts])


def _modules() -> dict:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(importer: str, is_package: bool, node) -> list[str]:
    """The ddtree_gen modules an import statement loads (explicitly, not the implicit parents)."""
    mods = _modules()
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "ddtree_gen"]
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "ddtree_gen":
        return []
    out = []
    for a in node.names:   # `from pkg import sub` loads the submodule pkg.sub, else pkg itself
        sub = f"{target}.{a.name}"
        out.append(sub if sub in mods else target)
    return out


def import_graph() -> dict:
    graph = {}
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_resolve(name, path.name == "__init__.py", node))
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict) -> list | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _layer(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    if key not in RANK:
        pytest.fail(f"{module}: not in any layer of tests/test_imports.py; place it")
    return RANK[key]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_downwards():
    wrong = [f"{a} imports {b}" for a, bs in sorted(import_graph().items()) for b in sorted(bs)
             if _layer(b) > _layer(a)]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


# bench/: what the benchmarks share (below them); every other module of bench/ is one `ddtree-gen bench NAME`
BENCH_SHARED = {"ddtree_gen.bench", "ddtree_gen.bench.timing", "ddtree_gen.bench.peers", "ddtree_gen.bench.specs",
                "ddtree_gen.bench.shapes"}


def test_benches_do_not_import_each_other():
    graph = import_graph()
    benches = [m for m in graph if m.startswith("ddtree_gen.bench.") and m not in BENCH_SHARED]
    assert benches, "no benchmark modules found in ddtree_gen/bench/"
    wrong = [f"{a} imports {b}" for a in sorted(benches) for b in sorted(graph[a])
             if b.startswith("ddtree_gen.bench") and b not in BENCH_SHARED]
    wrong += [f"{a} (shared) imports {b}" for a in sorted(BENCH_SHARED & set(graph)) for b in sorted(graph[a])
              if b.startswith("ddtree_gen.bench") and b not in BENCH_SHARED]
    assert not wrong, "benchmarks import each other:\n" + "\n".join(wrong)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_function_level_imports_count():
    src = "def f():\n    from . import runtime\n"
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom))
    assert _resolve("ddtree_gen.artifacts", False, node) == ["ddtree_gen.runtime"]


def test_declared_strings_name_modules_below_the_registry():
    """A declaration's "module:attribute" strings are imports the AST cannot see: the modules they name
    must lie in a layer the registry may import (below it), or be a user of the registry resolving its own."""
    from ddtree_gen import registry
    users = {"torch_ops", "sanitize", "bundles"}   # resolve strings that name themselves
    wrong = []
    for d in registry.declarations():
        refs = [d.launcher, d.reference, d.output, d.sanitize, *(r for op in d.torch_ops for r in (op.fake, op.impl)),
                *((d.bundles.inputs, d.bundles.run) if d.bundles else ())]
        for ref in filter(None, refs):
            top = ref.split(":")[0].split(".")[0]
            if top not in users and _layer(f"ddtree_gen.{top}") >= _layer("ddtree_gen.registry"):
                wrong.append(f"{d.name}: {ref}")
    assert not wrong, "declared strings naming modules at or above the registry:\n" + "\n".join(wrong)

"""The import graph of ddtree_gen: no cycle, and layers that import downwards only.

Every `import` and `from ... import` statement counts, at module level or inside a function
(a function-level import is still an edge: it only hides a ring until the call). An import the statements do not
show (importlib.import_module, __import__, pkgutil discovery) is allowed only where this test models it (DYNAMIC:
the package's lazy attributes), as edges of the graph; and no
module names another by a "module:attribute" string (the declarations hold their facets as objects: issue 40).
"""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import ddtree_gen

PACKAGE = Path(ddtree_gen.__file__).resolve().parent

# Lower layers first. A module may import its own layer or a lower one, never a higher one. A module is placed by the
# longest entry that is its dotted name (below ddtree_gen) or a package above it; an operation's modules (ops/<op>/)
# by OPS_LAUNCH: the launch side, else the build data.
LAYERS = [
    ["errors", "paths", "types", "fileio", "bf16", "fp8", "trees", "archs", "spec", "needs"],   # leaves (archs: build targets)
    ["build.resources", "kdtr", "inputs", "reference"],                  # resource model, bundle format, inputs, numpy
    ["build", "build.kernel_def", "build.declaration", "build.variant"],  # the build data's records
    ["ops", "ops:plan"],                                                 # the operations' build data and case inputs
    ["build.render", "build.compile"],
    ["build.artifacts", "launch", "launch.arrays"],                      # build products; caller arrays
    ["launch.runtime", "launch.callplan", "launch.hostcode"],            # modules per device, launches; one call's plan;
                                                                         # Python source made at run time and compiled
    ["launch.checks", "launch.protocol", "ops:launch"],                  # launchers and the kernels' declarations
    ["registry"],                                                        # the declarations collected
    ["kernel_set"],                                                      # launchers bound to a spec's binaries
    ["torch_ops", "torch_api", "model", "bench", "sanitize", "hf",      # users of kernel sets (bench/: a package; hf: transformers)
     "bundles"],                                                         # and of the declarations (bundles: refs/)
    ["cli", "__main__", "__init__"],
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# the launch side of an operation's folder (its other modules are its build data)
OPS_LAUNCH = {"launch", "tensor_core", "which", "mma_launch", "wgmma_launch", "route", "call"}


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


def _submodules(package: str) -> set:
    return {m for m in _modules() if m.startswith(f"{package}.") and "." not in m[len(package) + 1:]}


def _lazy_attributes() -> set:
    """ddtree_gen/__init__.py's _LAZY: the submodules its __getattr__ imports on first use."""
    return {f"ddtree_gen.{m}" for m in ddtree_gen._LAZY.values()}


# The modules that import by a computed name, and the modules they import that way (the edges the statements do not
# show): a family is found by being in plans/ or kernels/ (their __init__'s discovery: docs/adding-a-kernel.md).
DYNAMIC = {"ddtree_gen": _lazy_attributes}


def dynamic_imports(tree) -> list:
    """The imports of a module the statements do not show: (line, what, module name or None where it is computed).
    importlib.import_module(...) / import_module(...) / __import__(...) / importlib.__import__(...) calls, and any
    use of pkgutil (module discovery)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("import_module", "__import__"):
                arg = node.args[0] if node.args else None
                const = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
                found.append((node.lineno, name, const))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pkgutil" for a in node.names):
            found.append((node.lineno, "pkgutil", None))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pkgutil":
            found.append((node.lineno, "pkgutil", None))
    return found


def import_graph() -> dict:
    graph = {}
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_resolve(name, path.name == "__init__.py", node))
        for _, _, const in dynamic_imports(tree):   # a constant name of ddtree_gen is an edge like a statement
            if const and const.split(".")[0] == "ddtree_gen":
                edges.add(const)
        if name in DYNAMIC:
            edges.update(DYNAMIC[name]())
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
    parts = module.split(".")[1:]
    if len(parts) == 3 and parts[0] == "ops":   # ddtree_gen.ops.<op>.<module>
        return RANK["ops:launch" if parts[2] in OPS_LAUNCH else "ops:plan"]
    if len(parts) == 2 and parts[0] == "ops":   # an operation's package
        return RANK["ops:plan"]
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in RANK:
            return RANK[key]
    if not parts:
        return RANK["__init__"]
    pytest.fail(f"{module}: not in any layer of tests/test_imports.py; place it")


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_downwards():
    wrong = [f"{a} imports {b}" for a, bs in sorted(import_graph().items()) for b in sorted(bs)
             if _layer(b) > _layer(a)]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


# bench/: what the benchmarks share (below them); every other module of bench/ is one `ddtree-gen bench NAME`, or a
# user of them that no benchmark imports (BENCH_USERS: the CPU harness over bench launch's call table; the scripts'
# output comparisons)
BENCH_SHARED = {"ddtree_gen.bench", "ddtree_gen.bench.timing", "ddtree_gen.bench.peers", "ddtree_gen.bench.specs",
                "ddtree_gen.bench.shapes"}
BENCH_USERS = {"ddtree_gen.bench.stand_in", "ddtree_gen.bench.compare"}


def test_no_benchmark_imports_a_bench_user():
    graph = import_graph()
    wrong = [f"{a} imports {b}" for a in sorted(graph) for b in sorted(graph[a]) if b in BENCH_USERS]
    assert not wrong, "modules importing a user of the benchmarks:\n" + "\n".join(wrong)


def test_benches_do_not_import_each_other():
    graph = import_graph()
    benches = [m for m in graph if m.startswith("ddtree_gen.bench.") and m not in BENCH_SHARED | BENCH_USERS]
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
    src = "def f():\n    from ..launch import runtime\n"
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom))
    assert _resolve("ddtree_gen.build.artifacts", False, node) == ["ddtree_gen.launch.runtime"]


def test_dynamic_imports_are_modeled():
    """An import by a computed name is an edge the AST cannot see: it is allowed only in a module DYNAMIC models (its
    edges then count in the tests above); an import of a constant name outside ddtree_gen (an optional dependency)
    is no edge. And each modeled module still imports that way (the model does not go stale)."""
    unseen, modeled = [], set()
    for name, path in sorted(_modules().items()):
        for line, what, const in dynamic_imports(ast.parse(path.read_text(), str(path))):
            if const is not None:   # a constant name: an edge (import_graph) or an outside module
                continue
            if name in DYNAMIC:
                modeled.add(name)
            else:
                unseen.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}(...) of a computed name")
    assert not unseen, ("imports by a computed name that tests/test_imports.py does not model (DYNAMIC):\n"
                        + "\n".join(unseen))
    assert modeled == set(DYNAMIC), f"DYNAMIC models modules that no longer import that way: {set(DYNAMIC) - modeled}"


def test_the_dynamic_import_finder_finds_them():
    src = ("import importlib, pkgutil\nfrom importlib import import_module\n"
           "def f(n):\n    importlib.import_module(n)\n    import_module('ddtree_gen.spec')\n    __import__(n)\n"
           "    importlib.import_module('torch')\n")
    assert sorted(dynamic_imports(ast.parse(src))) == [(1, "pkgutil", None), (4, "import_module", None),
                                                   (5, "import_module", "ddtree_gen.spec"), (6, "__import__", None),
                                                   (7, "import_module", "torch")]
    assert DYNAMIC["ddtree_gen"]() >= {"ddtree_gen.reference", "ddtree_gen.hf"}
    assert "ddtree_gen.reference" in import_graph()["ddtree_gen"]


def test_the_operations_are_listed_not_discovered():
    """The operations are listed once, in build order (ops.FAMILIES; registry.LAUNCHERS their launchers): no module
    discovers modules (pkgutil), and every module of ops/ with KernelDefs or declarations is in those lists."""
    from ddtree_gen import ops, registry

    assert not [n for n, p in _modules().items() if "pkgutil" in p.read_text()]
    listed = {m.__name__ for m in ops.FAMILIES} | {m.__name__ for m in registry.LAUNCHERS}
    import importlib
    having = {n for n in _modules() if n.startswith("ddtree_gen.ops.")
              and any(hasattr(importlib.import_module(n), a) for a in ("KERNELS", "DECLARATIONS"))}
    assert having == listed, f"unlisted: {sorted(having - listed)}; listed without KERNELS/DECLARATIONS: {sorted(listed - having)}"


# "module:attribute" (module relative to ddtree_gen, or absolute): how the declarations named facets before issue 40
_REF = re.compile(r"^(?:ddtree_gen\.)?([A-Za-z_][\w.]*):([A-Za-z_]\w*)$")


def _string_reference(value) -> bool:
    m = _REF.match(value) if isinstance(value, str) else None
    return bool(m) and f"ddtree_gen.{m.group(1)}" in _modules()


def test_no_module_attribute_strings():
    """No string of the package names a module of ddtree_gen and an attribute ("ops.tree_build.launch:launch"): an
    import the AST cannot see. The declarations hold their facets as objects, every field of them (their torch
    ops' and bundles' too) checked here, and no string constant of any module reads like one."""
    from dataclasses import fields, is_dataclass

    from ddtree_gen import registry

    def strings(value, where):
        if isinstance(value, str):
            yield where, value
        elif is_dataclass(value) and not isinstance(value, type):
            for f in fields(value):
                if f.name != "build":
                    yield from strings(getattr(value, f.name), f"{where}.{f.name}")
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                yield from strings(v, f"{where}[{i}]")
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from strings(v, f"{where}[{k!r}]")

    wrong = [f"{where}: {v!r}" for d in registry.declarations() for where, v in strings(d, d.name)
             if _string_reference(v)]
    for name, path in sorted(_modules().items()):
        wrong += [f"{path.relative_to(PACKAGE.parent)}:{n.lineno}: {n.value!r}"
                  for n in ast.walk(ast.parse(path.read_text(), str(path)))
                  if isinstance(n, ast.Constant) and _string_reference(n.value)]
    assert not wrong, "\"module:attribute\" strings (declare the object itself):\n" + "\n".join(wrong)
    assert _string_reference("ops.tree_build.launch:launch") and _string_reference("reference:tree_build")
    assert not _string_reference("none: it moves the caches in place") and not _string_reference("ddtree::tree_build")


def _compiles_source(tree) -> list:
    """The lines of a module that compile Python source made at run time: a call of the builtins exec, eval or
    compile (re.compile, a method, is another thing), or a function made from a code object (types.FunctionType)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("exec", "eval", "compile", "FunctionType"):
                found.append(node.lineno)
            elif isinstance(f, ast.Attribute) and f.attr == "FunctionType":
                found.append(node.lineno)
    return found


def test_source_is_compiled_in_one_module():
    """Host code made from strings (a cached call, a guarded entry's test, a torch op's direct entry, a call cut
    after a stage) is compiled in ddtree_gen/launch/hostcode.py only: one place to read what runs that no file shows."""
    where = {name: _compiles_source(ast.parse(path.read_text(), str(path))) for name, path in _modules().items()}
    wrong = [f"{_modules()[n].relative_to(PACKAGE.parent)}:{line}" for n, lines in sorted(where.items())
             for line in lines if n != "ddtree_gen.launch.hostcode"]
    assert not wrong, "source compiled outside ddtree_gen/launch/hostcode.py:\n" + "\n".join(wrong)
    assert where["ddtree_gen.launch.hostcode"], "hostcode compiles nothing: the rule above is stale"
    src = "import re, types\nre.compile('x')\nexec('1')\nf = types.FunctionType(g.__code__, {})\nx.eval()\n"
    assert _compiles_source(ast.parse(src)) == [3, 4]


def test_every_import_of_the_package_resolves():
    """Every `from ddtree_gen... import name` and `import ddtree_gen...` in the package, tests/, scripts/ and examples/,
    function-level ones included (a GPU test's body does not run on a CPU machine, so a stale name there would wait
    for the GPU matrix): its module imports and has the name (or the name is a submodule). A module that needs an
    optional package that is not installed (torch, transformers) is passed over."""
    repo = PACKAGE.parent
    files = [p for d in ("ddtree_gen", "tests", "scripts", "examples") for p in sorted((repo / d).rglob("*.py"))]
    wrong = []

    def load(name):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("ddtree_gen"):
                return None   # an optional package
            raise

    def getattr_optional(module, attr) -> bool:
        """Whether module has attr; True also where getting it imports an optional package that is not installed
        (the package's lazy attributes: ddtree_gen.hf needs torch)."""
        try:
            return hasattr(module, attr)
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("ddtree_gen"):
                return True
            raise

    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        name = _module_name(path) if path.is_relative_to(PACKAGE) else None
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:   # relative: from the importing module's package
                    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    parts = parts[:len(parts) - (node.level - 1)]
                    target = ".".join(parts + ([node.module] if node.module else []))
                if target.split(".")[0] != "ddtree_gen":
                    continue
                targets = [(target, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names if a.name.split(".")[0] == "ddtree_gen"]
            for target, attr in targets:
                where = f"{path.relative_to(repo)}:{node.lineno}"
                try:
                    module = load(target)
                    if module is None or attr is None or getattr_optional(module, attr):
                        continue
                    if load(f"{target}.{attr}") is None:
                        continue
                except ModuleNotFoundError:
                    wrong.append(f"{where}: {target}{'.' + attr if attr else ''} does not exist")
                except Exception as e:   # noqa: BLE001 - any failure to import is the finding
                    wrong.append(f"{where}: {target}: {type(e).__name__}: {e}")
    assert not wrong, "imports that do not resolve:\n" + "\n".join(wrong)

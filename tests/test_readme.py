"""README.md runs as written: every Python block that needs no GPU is executed here (CPU, in CI; one that imports
an optional package where it is installed, else skipped naming the extra); every other block (on a GPU, with the
caller's arrays) at least compiles and calls only what exists: kernel-set launchers, torch ops and references of
those names. What a block needs is read from what it imports (block_needs); .ci/run runs the README's commands."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need, optional_packages

import ddtree_gen
from ddtree_gen import reference
from ddtree_gen.ops import all_kernels

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "docs" / "engine.md", REPO / "docs" / "usage.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
GPU_MODULES = {"cupy", "flash_mla"}   # a block that imports one of these runs on a GPU


def _blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in FENCE.finditer(text)]


def _undefined(code: str) -> set:
    """Names a block reads that nothing in it defines (an import, an assignment, a def, a loop or lambda
    variable) and that are no builtins: what would be a NameError when it is pasted."""
    import builtins
    tree = ast.parse(code)
    defined, used = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return used - defined


def _imported(tree: ast.AST) -> set[str]:
    """The dotted names of the modules a piece of code imports (`from a.b import c`: a.b and a.b.c, one of which
    is a module), anywhere in it."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _package_module(dotted: str) -> Path | None:
    """The source file of a module of this package (ddtree_gen.hf: ddtree_gen/hf.py), else None."""
    base = REPO.joinpath(*dotted.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def block_needs(code: str) -> tuple[bool, set[str]]:
    """What a doc block needs, from what it imports: (a GPU?, the optional packages, e.g. {"torch"}). A GPU where it
    imports CuPy or FlashMLA, loads a kernel set (ddtree_gen.load) or names a CUDA device (torch's "cuda");
    optional packages (pyproject's extras: torch, transformers) where it imports one, or a module of this package
    that imports one (ddtree_gen.hf: torch and transformers)."""
    tree = ast.parse(code)
    modules = _imported(tree)
    optional = set(optional_packages())
    packages = {m.split(".")[0] for m in modules} & optional
    for source in filter(None, (_package_module(m) for m in modules if m.split(".")[0] == "ddtree_gen")):
        packages |= {i.split(".")[0] for i in _imported(ast.parse(source.read_text()))} & optional
    loads = any(isinstance(n, ast.Call) and ast.unparse(n.func) in ("ddtree_gen.load", "load") for n in ast.walk(tree))
    cuda = any(isinstance(n, ast.Attribute) and n.attr == "cuda" or
               isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.split(":")[0] == "cuda"
               for n in ast.walk(tree))
    return bool({m.split(".")[0] for m in modules} & GPU_MODULES) or loads or cuda, packages


def _gpu(code: str) -> bool:
    """Whether a block needs a GPU, or is a fragment (it reads names it does not define: the caller's kernel set
    `ks`, CuPy arrays) that runs only where the doc says, so only its calls are checked."""
    return block_needs(code)[0] or bool(_undefined(code))


def test_block_needs_reads_the_imports():
    """What a block needs comes from its imports and calls, not from words in it."""
    assert block_needs("import numpy as np\nprint(np.zeros(1))  # no torch, no cupy here") == (False, set())
    assert block_needs("from ddtree_gen import hf\nprint(hf)") == (False, {"torch", "transformers"})
    assert block_needs("import torch\nprint(torch.zeros(1))") == (False, {"torch"})
    assert block_needs("import torch\nx = torch.zeros(1, device='cuda:0')") == (True, {"torch"})
    assert block_needs("import torch\nx = torch.zeros(1).cuda()") == (True, {"torch"})
    assert block_needs("import cupy as cp\nprint(cp.zeros(1))") == (True, set())
    assert block_needs("import ddtree_gen\nks = ddtree_gen.load('kimi-k2.6-tp8')") == (True, set())
    assert block_needs("from ddtree_gen.ops import by_name\nprint(by_name('tree_build'))") == (False, set())


def _cases(gpu: bool) -> list:
    return [pytest.param(path, line, code, id=f"{path.name}:{line}") for path in DOCS
            for line, code in _blocks(path) if _gpu(code) == gpu]


def _torch_op_names() -> set:
    """The torch ops of the kernels' declarations (read without importing torch)."""
    from ddtree_gen.registry import declarations
    return {op.name for d in declarations() for op in d.torch_ops}


def test_readme_has_blocks_that_run_without_a_gpu():
    assert [c for c in _cases(gpu=False) if c.values[0].name == "README.md"], "README lost its GPU-free block"


@pytest.mark.parametrize("path,line,code", _cases(gpu=False))
def test_gpu_free_block_runs_as_written(path, line, code, tmp_path):
    """In a fresh interpreter, as a user pastes it (only `import ddtree_gen` before the attributes it uses); a block
    that needs an optional package (the Hugging Face one: torch and transformers) where it is installed."""
    need(*sorted(block_needs(code)[1]))
    env = dict(os.environ, PYTHONPATH=str(REPO), DDTREE_GEN_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, f"{path.name}:{line}:\n{r.stderr}"
    assert r.stdout.strip(), "the block printed nothing"   # every such block shows its result


@pytest.mark.parametrize("path,line,code", _cases(gpu=True))
def test_gpu_block_calls_what_exists(path, line, code):
    tree = ast.parse(code, f"{path.name}:{line}")
    kernels = {k.name for k in all_kernels()}
    ops = _torch_op_names()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner, name = node.func.value, node.func.attr
        if isinstance(owner, ast.Name) and owner.id in ("ks", "ks8"):
            from ddtree_gen.kernel_set import KernelSet   # a kernel's launcher, or a method of the set (tree_verify_schedule)
            assert name in kernels or callable(getattr(KernelSet, name, None)), \
                f"{path.name}:{line + node.lineno - 1}: ks.{name} is no kernel nor a KernelSet method"
        elif isinstance(owner, ast.Name) and owner.id == "ops":
            assert name in ops, f"{path.name}:{line + node.lineno - 1}: ops.{name} is no torch op"
        elif isinstance(owner, ast.Attribute) and ast.unparse(owner) == "ddtree_gen.reference":
            assert hasattr(reference, name), f"{path.name}:{line + node.lineno - 1}: reference.{name}"
        elif isinstance(owner, ast.Name) and owner.id == "ddtree_gen":
            assert hasattr(ddtree_gen, name), f"{path.name}:{line + node.lineno - 1}: ddtree_gen.{name}"


CONTINUES = "# after the GPU block above"   # a block that starts so runs after the last GPU block before it


def _runnable(path: Path) -> list[tuple[int, str]]:
    """(line, code) of each block of `path` as it runs: a continuation block joined to the GPU block it continues."""
    out, last_gpu = [], None
    for line, code in _blocks(path):
        if code.startswith(CONTINUES) and last_gpu is not None:
            code = last_gpu + "\n" + code
        if block_needs(code)[0]:
            last_gpu = code
        out.append((line, code))
    return out


@pytest.mark.parametrize("line,code", _runnable(REPO / "README.md"), ids=lambda x: str(x)[:12])
def test_every_readme_block_defines_what_it_uses(line, code):
    """Every README block, GPU ones included, runs as pasted (a continuation after the block it names): no
    name it reads is left for the reader to supply (the GPU block's `topk_ids` was a NameError)."""
    assert not _undefined(code), f"README.md:{line}: undefined {sorted(_undefined(code))}"


def test_undefined_names_are_found():
    assert _undefined("import numpy as np\nx = np.zeros(3)\nprint(x, y)\nf = lambda a: a + z") == {"y", "z"}
    assert _undefined("for i in range(3):\n    print(i)\n[j for j in range(2)]") == set()


@pytest.mark.gpu
@pytest.mark.parametrize("line,code", [(ln, c) for ln, c in _runnable(REPO / "README.md") if block_needs(c)[0]],
                         ids=lambda x: str(x)[:12])
def test_gpu_block_runs_on_a_gpu(line, code, tmp_path):
    """On a GPU: each README block that needs one runs as pasted, in a fresh interpreter (a torch block: where
    torch is installed)."""
    need(*sorted(block_needs(code)[1]))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert r.returncode == 0, f"README.md:{line}:\n{r.stderr}"


def test_ci_runs_the_readme_commands():
    """.ci/run runs the README's two commands as written (each line verbatim, in order, comment included), before
    it installs any extra or runs any other test: CI is green only where the README's promise holds."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"^## Two commands on a fresh machine\n\n```bash\n(.*?)^```", readme, re.S | re.M)
    assert block, "README.md lost its section 'Two commands on a fresh machine'"
    commands = [ln for ln in block.group(1).splitlines() if ln.strip()]
    assert len(commands) == 2 and "pytest" in commands[1], commands
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    missing = [c for c in commands if c not in ci]
    assert not missing, f".ci/run does not run the README's {missing}"
    at = [ci.index(c) for c in commands]
    others = [i for i, ln in enumerate(ci) if not ln.lstrip().startswith("#") and ln not in commands
              and re.search(r"pip install|pytest", ln)]
    assert at == sorted(at) and max(at) < min(others), (at, [ci[i] for i in others])

"""README.md runs as written: every Python block that needs no GPU is executed here (CPU, in CI); every
other block (on a GPU, with the caller's arrays) at least compiles and calls only what exists: kernel-set
launchers, torch ops and references of those names."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ddtree_gen
from ddtree_gen import reference
from ddtree_gen.plans import all_kernels

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "docs" / "engine.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
GPU_ONLY = re.compile(r"\b(cupy|torch)\b|\bddtree_gen\.load\(|\bks\.", re.M)   # cupy, torch or a kernel set


def _blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in FENCE.finditer(text)]


def _cases(gpu: bool) -> list:
    return [pytest.param(path, line, code, id=f"{path.name}:{line}") for path in DOCS
            for line, code in _blocks(path) if bool(GPU_ONLY.search(code)) == gpu]


def _torch_op_names() -> set:
    """The torch ops of the kernels' declarations (read without importing torch)."""
    from ddtree_gen.plans import declarations
    return {op.name for d in declarations() for op in d.torch_ops}


def test_readme_has_blocks_that_run_without_a_gpu():
    assert [c for c in _cases(gpu=False) if c.values[0].name == "README.md"], "README lost its GPU-free block"


@pytest.mark.parametrize("path,line,code", _cases(gpu=False))
def test_gpu_free_block_runs_as_written(path, line, code, tmp_path):
    """In a fresh interpreter, as a user pastes it (only `import ddtree_gen` before the attributes it uses)."""
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
            assert name in kernels, f"{path.name}:{line + node.lineno - 1}: ks.{name} is no kernel"
        elif isinstance(owner, ast.Name) and owner.id == "ops":
            assert name in ops, f"{path.name}:{line + node.lineno - 1}: ops.{name} is no torch op"
        elif isinstance(owner, ast.Attribute) and ast.unparse(owner) == "ddtree_gen.reference":
            assert hasattr(reference, name), f"{path.name}:{line + node.lineno - 1}: reference.{name}"
        elif isinstance(owner, ast.Name) and owner.id == "ddtree_gen":
            assert hasattr(ddtree_gen, name), f"{path.name}:{line + node.lineno - 1}: ddtree_gen.{name}"

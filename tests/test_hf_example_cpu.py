"""examples/hf_ddtree.py on the CPU (its float32 reference mode: numpy references for draft_topk, tree_build,
tree_verify, tree_accept and kv_commit): transformers' greedy tokens exactly, and its control fails."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need

need("torch", "transformers")


@pytest.mark.parametrize("flip", [False, True], ids=["plain", "flip-mask-bit"])
def test_example_hf_ddtree_on_the_cpu(flip):
    """examples/hf_ddtree.py in its reference mode: generate()'s tokens exactly (exit 0); one mask bit flipped each
    step (the control): exit 1."""
    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(repo / "examples" / "hf_ddtree.py"), "--device", "cpu", "--new-tokens", "16",
                        *(["--flip-mask-bit"] if flip else [])], capture_output=True, text=True, timeout=300,
                       cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == (1 if flip else 0), r.stdout[-2000:] + r.stderr[-2000:]
    assert ("FAIL" if flip else "OK: identical to transformers' greedy generate()") in r.stdout
    assert "tokens per step" in r.stdout and "step  1:" in r.stdout

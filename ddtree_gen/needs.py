"""What a GPU-only command needs (a CUDA GPU, torch), checked before it starts.

`require("bench tree_verify", gpu=True, torch=True)` returns when all is there and otherwise raises
DdtreeError with one line naming the command, what it needs and what is missing, which the command
line prints as its error (exit 2) instead of a traceback from deep inside CuPy or an import.
"""
from __future__ import annotations

import importlib.util

from .errors import DdtreeError

TORCH_HINT = "pip install 'ddtree-gen[torch]', or torch itself"


def gpu_problem() -> str | None:
    """None where CuPy sees a usable CUDA GPU, else why not (one line)."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # no CuPy, no driver, a driver too old, no device
        first = (str(e).strip().splitlines() or [""])[0]
        return f"no usable CUDA GPU here ({type(e).__name__}: {first})"
    return None if count > 0 else "no CUDA GPU here (CUDA sees 0 devices)"


def torch_problem() -> str | None:
    """None where torch can be imported, else why not (one line)."""
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"torch is not installed ({TORCH_HINT})"


def require(what: str, *, gpu: bool = True, torch: bool = False) -> None:
    """DdtreeError, one line, unless everything `what` needs is here."""
    needed = [n for n, want in (("a CUDA GPU", gpu), ("torch", torch)) if want]
    problems = [p for p, want in ((gpu_problem, gpu), (torch_problem, torch)) if want for p in [p()] if p]
    if problems:
        raise DdtreeError(f"{what} needs {' and '.join(needed)}: {'; '.join(problems)}")


def script_requires(script_file: str, *, gpu: bool = True, torch: bool = False) -> None:
    """require() for a script of scripts/ (pass its __file__): what is missing ends it with one line, exit 1."""
    name = "scripts/" + script_file.replace("\\", "/").rsplit("/", 1)[-1]
    try:
        require(name, gpu=gpu, torch=torch)
    except DdtreeError as e:
        raise SystemExit(f"error: {e}") from None


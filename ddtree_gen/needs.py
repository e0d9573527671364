"""What a GPU-only command needs (a CUDA GPU, torch), checked before it starts.

`require("bench tree_verify", gpu=True, torch=True)` returns when all is there and otherwise raises
DdtreeError with one line naming the command, what it needs and what is missing, which the command
line prints as its error instead of a traceback from deep inside CuPy or an import.

One exit status for "this machine lacks what the command needs" (no GPU, no NVIDIA driver, a driver too
old, no torch): EXIT_MISSING = 2, for `ddtree-gen`, the examples and every script of scripts/ alike
(1 stays "ran and failed"; docs/decisions.md "One exit status for a missing GPU").
"""
from __future__ import annotations

import importlib.util

from .errors import DdtreeError

TORCH_HINT = "pip install 'ddtree-gen[torch]', or torch itself"
EXIT_MISSING = 2   # the exit status of every command refused for what the machine lacks


def _driver_loads() -> bool:
    """Whether the NVIDIA driver's library (libcuda) can be loaded at all."""
    import ctypes
    import sys
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def gpu_problem() -> str | None:
    """None where CuPy sees a usable CUDA GPU, else what is missing (one line): the NVIDIA driver, a
    GPU, or a new enough driver."""
    if not _driver_loads():
        return "no NVIDIA driver here (libcuda cannot be loaded), so no CUDA GPU"
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # no CuPy, a driver too old, no device
        first = (str(e).strip().splitlines() or [""])[0]
        if "cudaErrorNoDevice" in first or "no CUDA-capable device" in first:
            return "no CUDA GPU here (the NVIDIA driver is installed but sees no device)"
        return f"no usable CUDA GPU here ({type(e).__name__}: {first})"
    return None if count > 0 else "no CUDA GPU here (the NVIDIA driver sees 0 devices)"


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
    """require() for a script of scripts/ (pass its __file__): what is missing ends it with one line on
    stderr, exit EXIT_MISSING."""
    name = "scripts/" + script_file.replace("\\", "/").rsplit("/", 1)[-1]
    try:
        require(name, gpu=gpu, torch=torch)
    except DdtreeError as e:
        import sys
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_MISSING) from None

def script_without_options(script_file: str, doc: str, *, gpu: bool = True, torch: bool = False) -> None:
    """The start of a script of scripts/ that takes no options: --help (its docstring) works anywhere; then
    script_requires (what is missing ends it with one line, exit EXIT_MISSING)."""
    import argparse
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    script_requires(script_file, gpu=gpu, torch=torch)



# FlashMLA: a peer of the benchmarks and of the pairing test, never a dependency
FLASHMLA_ENV = "DDTREE_GEN_FLASHMLA"
FLASHMLA_HINT = ("FlashMLA is github.com/deepseek-ai/FlashMLA (a Hopper GPU, torch with CUDA and the CUDA toolkit "
                 "to build it): git clone https://github.com/deepseek-ai/FlashMLA && cd FlashMLA && "
                 "git submodule update --init --recursive && python setup.py install; or set "
                 f"{FLASHMLA_ENV} (or PYTHONPATH) to a folder that holds its built flash_mla package")


def import_flash_mla():
    """The flash_mla module: importable as it is, or from the folder ${FLASHMLA_ENV} names (put first on sys.path).
    ImportError, its message saying how to get FlashMLA, where neither finds it."""
    import os
    import sys
    try:
        import flash_mla
        return flash_mla
    except ImportError as first:
        folder = os.environ.get(FLASHMLA_ENV, "")
        if folder and folder not in sys.path:
            sys.path.insert(0, folder)
            try:
                import flash_mla
                return flash_mla
            except ImportError as e:
                first = e
        where = f" (not in {FLASHMLA_ENV}={folder} either)" if folder else ""
        raise ImportError(f"flash_mla is not importable ({first}){where}. {FLASHMLA_HINT}") from None

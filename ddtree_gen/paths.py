"""Where the project's folders are. DDTREE_GEN_ROOT and DDTREE_GEN_CACHE override them.

Two layouts, one set of folder names (specs/, templates/, generated/, refs/):
- a checkout (the repository, an editable install): the folders at the top of the repository, beside
  the package;
- an installed wheel: the copies that the wheel build puts inside the package, ddtree_gen/_data/
  (setup.py maps templates/, specs/ and generated/ there; refs/ stays in the repository). They are the
  shipped record: `ddtree-gen build` compiles into the binary cache there and writes no file of the
  package (`installed()`).
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
DATA = PACKAGE / "_data"   # an installed wheel's specs/, templates/, generated/ (setup.py, build_py)


def installed() -> bool:
    """Whether the folders are an installed wheel's shipped data (no DDTREE_GEN_ROOT, no checkout)."""
    return not os.environ.get("DDTREE_GEN_ROOT") and DATA.is_dir()


def project_root() -> Path:
    env = os.environ.get("DDTREE_GEN_ROOT")
    if env:
        return Path(env)
    return DATA if DATA.is_dir() else PACKAGE.parent


def specs_dir() -> Path:
    return project_root() / "specs"


def templates_dir() -> Path:
    return project_root() / "templates"


def generated_dir() -> Path:
    return project_root() / "generated"


def refs_dir() -> Path:
    return project_root() / "refs"


def cache_dir() -> Path:
    """Compiled binaries live outside git, keyed by the hash of what produced them."""
    env = os.environ.get("DDTREE_GEN_CACHE")
    if env:
        return _folder(Path(env), "DDTREE_GEN_CACHE")
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg or os.path.join(os.path.expanduser("~"), ".cache")
    return _folder(Path(base) / "ddtree-gen", "XDG_CACHE_HOME" if xdg else "the binary cache")


def _folder(path: Path, what: str) -> Path:
    """`path`, unless it or a folder above it exists and is not a folder: then a DdtreeError naming `what`
    (a raw FileExistsError from deep inside a build before issue 37)."""
    from .errors import DdtreeError
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "it" if p == path else f"{p}, a folder above it,"
                raise DdtreeError(f"{what}={path}: {where} is a file, not a folder; point {what} at a folder "
                                  f"(created if missing) for the compiled binaries")
            break
    return path

"""Where the project's folders are. DDTREE_GEN_ROOT and DDTREE_GEN_CACHE override them."""
from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    env = os.environ.get("DDTREE_GEN_ROOT")
    return Path(env) if env else Path(__file__).resolve().parent.parent


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
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddtree-gen"

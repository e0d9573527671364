"""Spec files (specs/*.toml): strict loading and validation, and finding them (find_spec, all_specs).

A spec is refused at load time, with a message naming the file and the field, when a field
is unknown, missing, of the wrong type, or asks for something the templates cannot serve.
"""
from __future__ import annotations

import hashlib
import os
import re
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from . import archs as _archs
from . import paths
from .errors import SpecError

# The templates keep a tree-mask row in at most this many 32-bit words (registers / shared
# memory are sized for it), so max_tree_size is limited to MAX_MASK_WORDS * 32.
MAX_MASK_WORDS = 4
MAX_TREE_SIZE = MAX_MASK_WORDS * 32
MAX_HEADS = 1024
MAX_RANK = 1024
MAX_PAGE_SIZE = 4096
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")  # used with fullmatch


@dataclass(frozen=True)
class Spec:
    name: str
    num_heads: int         # H: query heads on one GPU
    kv_lora_rank: int      # R: latent rank of the compressed KV
    qk_rope_head_dim: int  # P: rope part of q/k
    page_size: int         # tokens per KV-cache page
    max_tree_size: int     # N: verify tokens per request, root included
    max_depth: int         # D: draft horizon
    archs: tuple = _archs.DEFAULT  # build targets (optional field; archs.py), in preference order
    kv_dtype: str = "bf16"         # KV-cache element type (optional field): "bf16" or "fp8_e4m3"

    @property
    def kv_fp8(self) -> bool:
        """Whether the KV cache holds e4m3 bytes (dequantized value = byte * kv_scale)."""
        return self.kv_dtype == "fp8_e4m3"

    @property
    def kv_itemsize(self) -> int:
        """Bytes per KV-cache element."""
        return 1 if self.kv_fp8 else 2

    @property
    def mask_words(self) -> int:
        """W = ceil(N / 32): 32-bit words per tree-mask row."""
        return -(-self.max_tree_size // 32)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["archs"] = list(self.archs)
        return out

    def digest(self) -> str:
        """Hash of the spec's values (not of the file's bytes: comments don't matter)."""
        text = ";".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(text.encode()).hexdigest()


# field -> (type, check(value, fields) -> problem or None)
def _fields():
    return {
        "name": (str, lambda v, f: None if NAME_RE.fullmatch(v) else
                 "must be 1-64 characters of a-z, 0-9, '.', '_', '-' starting with a letter or digit"),
        "num_heads": (int, lambda v, f: None if 1 <= v <= MAX_HEADS else f"must be in [1, {MAX_HEADS}]"),
        "kv_lora_rank": (int, lambda v, f: None if 16 <= v <= MAX_RANK and v % 16 == 0 else
                         f"must be a multiple of 16 in [16, {MAX_RANK}] (tiles of 16 bf16 = 32 bytes)"),
        "qk_rope_head_dim": (int, lambda v, f: None if 16 <= v <= 256 and v % 16 == 0 else
                             "must be a multiple of 16 in [16, 256]"),
        "page_size": (int, lambda v, f: None if 1 <= v <= MAX_PAGE_SIZE else f"must be in [1, {MAX_PAGE_SIZE}]"),
        "max_tree_size": (int, lambda v, f: None if 2 <= v <= MAX_TREE_SIZE else
                          f"must be in [2, {MAX_TREE_SIZE}] (the templates support tree masks of "
                          f"at most {MAX_MASK_WORDS} words of 32 bits)"),
        "max_depth": (int, lambda v, f: (None if 1 <= v <= f.get("max_tree_size", MAX_TREE_SIZE) - 1
                                         else "must be in [1, max_tree_size - 1]")),
    }


def _check_archs(v, f):
    if not v:
        return "must name at least one target"
    bad = [a for a in v if not isinstance(a, str) or a not in _archs.ARCHS]
    if bad:
        return f"names an unknown target {bad[0]!r} (known: {', '.join(_archs.ARCHS)})"
    if len(set(v)) != len(v):
        return "names a target twice"
    return None


KV_DTYPES = ("bf16", "fp8_e4m3")


def _check_kv_dtype(v, f):
    return None if v in KV_DTYPES else f"must be one of {', '.join(map(repr, KV_DTYPES))}"


# optional field -> (types, what the type must be, check, normalise)
OPTIONAL = {"archs": ((list, tuple), "a list of strings", _check_archs, _archs.ordered),
            "kv_dtype": ((str,), "str", _check_kv_dtype, str)}


def parse_spec(data: dict, source: str) -> Spec:
    """Validate a parsed TOML table; `source` names the file in every message."""
    fields = _fields()
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec must be a TOML table of fields")
    unknown = sorted(set(data) - set(fields) - set(OPTIONAL), key=repr)
    if unknown:
        raise SpecError(f"{source}: unknown field {unknown[0]!r} (known fields: {', '.join([*fields, *OPTIONAL])})")
    missing = [k for k in fields if k not in data]
    if missing:
        raise SpecError(f"{source}: missing field {missing[0]!r}")
    for key, (typ, check) in fields.items():
        value = data[key]
        # bool is an int in Python; a spec saying `num_heads = true` is a mistake
        if not isinstance(value, typ) or isinstance(value, bool):
            raise SpecError(f"{source}: field {key!r} must be {typ.__name__}, got "
                            f"{type(value).__name__} {value!r}")
    for key, (typ, check) in fields.items():
        problem = check(data[key], data)
        if problem:
            raise SpecError(f"{source}: field {key!r} = {data[key]!r} {problem}")
    optional = {}
    for key, (typ, what, check, normalise) in OPTIONAL.items():
        if key not in data:
            continue
        value = data[key]
        if not isinstance(value, typ):
            raise SpecError(f"{source}: field {key!r} must be {what}, got {type(value).__name__} {value!r}")
        problem = check(value, data)
        if problem:
            shown = list(value) if isinstance(value, (list, tuple)) else value
            raise SpecError(f"{source}: field {key!r} = {shown!r} {problem}")
        optional[key] = normalise(value)
    return Spec(**{k: data[k] for k in fields}, **optional)


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec file ({e.strerror or e})") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:
        raise SpecError(f"{path}: not a spec (TOML nested too deeply)") from None
    spec = parse_spec(data, str(path))
    if spec.name != path.stem:
        raise SpecError(f"{path}: field 'name' = {spec.name!r} must match the file name {path.stem!r}")
    return spec


def spec_paths(specs_dir: Path) -> list[Path]:
    return sorted(specs_dir.glob("*.toml"))


def find_spec(name) -> Spec:
    """A spec by name (specs/<name>.toml) or by path to a .toml file."""
    p = Path(str(name))
    if p.suffix == ".toml" or os.sep in str(name):
        return load_spec(p)
    path = paths.specs_dir() / f"{name}.toml"
    if not path.exists():
        known = ", ".join(q.stem for q in spec_paths(paths.specs_dir())) or "none"
        raise SpecError(f"unknown spec {name!r}: no file {path} (known specs: {known})")
    return load_spec(path)


def all_specs() -> list[Spec]:
    """Every shipped spec (specs/*.toml), by file name."""
    return [load_spec(p) for p in spec_paths(paths.specs_dir())]

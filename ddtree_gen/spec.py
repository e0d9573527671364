"""Spec files (specs/*.toml): strict loading and validation, and finding them (find_spec, all_specs).

A spec is refused at load time, with a message naming the file and the field, when a field
is unknown, missing, of the wrong type, or asks for something the templates cannot serve.
"""
from __future__ import annotations

import hashlib
import os
import re
import tomllib
from dataclasses import dataclass, make_dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any, Callable

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


KV_DTYPES = ("bf16", "fp8_e4m3")
REQUIRED = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()   # Field.default of a required field


@dataclass(frozen=True)
class Field:
    """One spec field's declaration: what the loader checks, and what the build reads of it. Everything that
    enumerates spec fields reads FIELDS (the loader here; render.context: `alias` is a template variable;
    resources.symbols_of: `alias` of an int field is a sympy symbol; the fuzzer, tests/test_fuzz.py)."""
    name: str
    types: tuple                  # the value's accepted Python (TOML) types (bool is never an int)
    what: str                     # that type, as a message names it
    check: Callable               # check(value, data) -> problem or None; `data`: the whole parsed table
    default: Any = REQUIRED       # REQUIRED: a required field
    alias: str | None = None      # template variable (and, for an int field, sympy symbol) of the value
    normalise: Callable = lambda v: v   # the stored value of an optional field
    # at its default, an optional field is left out of as_dict() and digest(), so that declaring one does not
    # change the shipped manifests (spec_values, spec_sha256); archs and kv_dtype predate that rule and stay
    recorded: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def symbolic(self) -> bool:
        """Whether the resource model has a sympy symbol for this field (resources.SYMBOLS)."""
        return self.alias is not None and int in self.types


def _check_name(v, f):
    return None if NAME_RE.fullmatch(v) else \
        "must be 1-64 characters of a-z, 0-9, '.', '_', '-' starting with a letter or digit"


def _check_archs(v, f):
    if not v:
        return "must name at least one target"
    bad = [a for a in v if not isinstance(a, str) or a not in _archs.ARCHS]
    if bad:
        return f"names an unknown target {bad[0]!r} (known: {', '.join(_archs.ARCHS)})"
    if len(set(v)) != len(v):
        return "names a target twice"
    return None


def _check_kv_dtype(v, f):
    return None if v in KV_DTYPES else f"must be one of {', '.join(map(repr, KV_DTYPES))}"


def _int(name, alias, check):
    return Field(name, (int,), "int", check, alias=alias)


# In declaration order: the required fields, then the optional ones (the loader's messages list them so).
FIELDS = (
    Field("name", (str,), "str", _check_name),
    _int("num_heads", "H", lambda v, f: None if 1 <= v <= MAX_HEADS else f"must be in [1, {MAX_HEADS}]"),
    _int("kv_lora_rank", "R", lambda v, f: None if 16 <= v <= MAX_RANK and v % 16 == 0 else
         f"must be a multiple of 16 in [16, {MAX_RANK}] (tiles of 16 bf16 = 32 bytes)"),
    _int("qk_rope_head_dim", "P", lambda v, f: None if 16 <= v <= 256 and v % 16 == 0 else
         "must be a multiple of 16 in [16, 256]"),
    _int("page_size", "PAGE", lambda v, f: None if 1 <= v <= MAX_PAGE_SIZE else f"must be in [1, {MAX_PAGE_SIZE}]"),
    _int("max_tree_size", "N", lambda v, f: None if 2 <= v <= MAX_TREE_SIZE else
         f"must be in [2, {MAX_TREE_SIZE}] (the templates support tree masks of at most {MAX_MASK_WORDS} words "
         f"of 32 bits)"),
    _int("max_depth", "D", lambda v, f: (None if 1 <= v <= f.get("max_tree_size", MAX_TREE_SIZE) - 1
                                         else "must be in [1, max_tree_size - 1]")),
    Field("archs", (list, tuple), "a list of strings", _check_archs, default=_archs.DEFAULT,
          normalise=_archs.ordered, recorded=True),
    Field("kv_dtype", (str,), "str", _check_kv_dtype, default="bf16", normalise=str, recorded=True),
)
FIELD = {f.name: f for f in FIELDS}
# template variables derived from the fields (render.context): alias -> Spec property
DERIVED = {"W": "mask_words", "KV_FP8": "kv_fp8"}


def _spec_fields():
    """The dataclass fields of Spec, one per declared field (with its default where it is optional)."""
    return [(f.name, f.types[0] if len(f.types) == 1 else tuple, dc_field() if f.required else dc_field(default=f.default))
            for f in FIELDS]


class _Values:
    """Spec's behaviour beside its fields (FIELDS makes the fields: Spec = make_dataclass(...) below)."""

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

    def _recorded(self) -> dict:
        """The values as_dict / digest hold: every field but an optional one left at its default (unless it is
        one of the fields recorded always)."""
        return {f.name: getattr(self, f.name) for f in FIELDS
                if f.required or f.recorded or getattr(self, f.name) != f.default}

    def as_dict(self) -> dict:
        out = self._recorded()
        out.update({k: list(v) for k, v in out.items() if isinstance(v, tuple)})
        return out

    def digest(self) -> str:
        """Hash of the spec's values (not of the file's bytes: comments don't matter)."""
        text = ";".join(f"{k}={v}" for k, v in sorted(self._recorded().items()))
        return hashlib.sha256(text.encode()).hexdigest()

    def template_values(self) -> dict:
        """The spec's template variables (render.context): each field's alias, then DERIVED."""
        out = {f.alias: getattr(self, f.name) for f in FIELDS if f.alias}
        out.update({alias: getattr(self, prop) for alias, prop in DERIVED.items()})
        return out


def _spec_class() -> type:
    """The Spec dataclass of FIELDS: one attribute per field, in declaration order, an optional one with its
    default."""
    cls = make_dataclass("Spec", _spec_fields(), bases=(_Values,), frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = ("A validated spec: one attribute per declared field (spec.FIELDS: name, num_heads H, kv_lora_rank "
                   "R, qk_rope_head_dim P, page_size PAGE, max_tree_size N, max_depth D, archs, kv_dtype).")
    return cls


Spec = _spec_class()


def parse_spec(data: dict, source: str) -> Spec:
    """Validate a parsed TOML table; `source` names the file in every message."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec must be a TOML table of fields")
    unknown = sorted(set(data) - set(FIELD), key=repr)
    if unknown:
        raise SpecError(f"{source}: unknown field {unknown[0]!r} (known fields: {', '.join(FIELD)})")
    required = [f for f in FIELDS if f.required]
    missing = [f.name for f in required if f.name not in data]
    if missing:
        raise SpecError(f"{source}: missing field {missing[0]!r}")

    def check_type(f, value):
        # bool is an int in Python; a spec saying `num_heads = true` is a mistake
        if not isinstance(value, f.types) or isinstance(value, bool):
            raise SpecError(f"{source}: field {f.name!r} must be {f.what}, got {type(value).__name__} {value!r}")

    def check_value(f, value):
        problem = f.check(value, data)
        if problem:
            shown = list(value) if isinstance(value, (list, tuple)) else value
            raise SpecError(f"{source}: field {f.name!r} = {shown!r} {problem}")

    for f in required:          # every required field's type, then every one's value: then the optional ones
        check_type(f, data[f.name])
    for f in required:
        check_value(f, data[f.name])
    values = {f.name: data[f.name] for f in required}
    for f in FIELDS:
        if f.required or f.name not in data:
            continue
        check_type(f, data[f.name])
        check_value(f, data[f.name])
        values[f.name] = f.normalise(data[f.name])
    return Spec(**values)


def make_spec(name: str, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, *, page_size: int = 64,
              max_tree_size: int = 65, max_depth: int = 15, kv_dtype: str = "bf16", archs=None) -> Spec:
    """A spec built in code (no file): the same fields and the same checks as a specs/<name>.toml (SpecError naming
    the field). `ddtree_gen.load(make_spec(...))` renders, builds and caches its kernels like a shipped spec's;
    the torch ops (torch_ops) find specs by file name, so a spec made here is used through `ddtree_gen.load`.

        spec = make_spec("my-model-tp8", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)
    """
    data = {"name": name, "num_heads": num_heads, "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim,
            "page_size": page_size, "max_tree_size": max_tree_size, "max_depth": max_depth, "kv_dtype": kv_dtype}
    if archs is not None:
        data["archs"] = list(archs)
    return parse_spec(data, f"make_spec({name!r})")


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

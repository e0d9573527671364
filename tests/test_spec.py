"""The strict spec loader (ddtree_gen/spec.py): shipped specs, and every refusal.

Every refusal is a SpecError whose message names the file and (where there is one) the field.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_gen import paths
from ddtree_gen.errors import SpecError
from ddtree_gen.spec import MAX_TREE_SIZE, Spec, load_spec, parse_spec

REPO = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------ shipped specs

SHIPPED = {   # name -> (H, kv_dtype)
    "kimi-k2.6-tp8": (8, "bf16"),
    "deepseek-v3-tp8": (16, "bf16"),
    "kimi-k2.6": (64, "bf16"),
    "deepseek-v3": (128, "bf16"),
    "kimi-k2.6-tp8-fp8": (8, "fp8_e4m3"),
    "deepseek-v3-fp8": (128, "fp8_e4m3"),
}


@pytest.mark.parametrize("name,heads_dtype", sorted(SHIPPED.items()), ids=sorted(SHIPPED))
def test_shipped_spec_values(name, heads_dtype):
    heads, kv_dtype = heads_dtype
    spec = load_spec(paths.specs_dir() / f"{name}.toml")
    assert spec == Spec(name=name, num_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64,
                        page_size=64, max_tree_size=65, max_depth=15, kv_dtype=kv_dtype)
    assert spec.kv_fp8 == (kv_dtype == "fp8_e4m3") and spec.kv_itemsize == (1 if spec.kv_fp8 else 2)
    assert spec.mask_words == 3  # ceil(65 / 32)
    assert isinstance(spec.num_heads, int) and not isinstance(spec.num_heads, bool)


def test_shipped_specs_are_exactly_these():
    assert sorted(p.stem for p in paths.specs_dir().glob("*.toml")) == sorted(SHIPPED)


def test_digest_ignores_comments_and_order(tmp_path):
    a = tmp_path / "a" / "x.toml"
    b = tmp_path / "b" / "x.toml"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_text(_toml(dict(VALID, name="x")))
    b.write_text("# a comment\n" + "\n".join(reversed(_toml(dict(VALID, name="x")).splitlines())) + "\n")
    assert load_spec(a).digest() == load_spec(b).digest()
    b.write_text(_toml(dict(VALID, name="x", num_heads=16)))
    assert load_spec(a).digest() != load_spec(b).digest()


# ----------------------------------------------------------------------------- refusals

VALID = dict(name="t", num_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, page_size=64,
             max_tree_size=65, max_depth=15)
FIELDS = list(VALID)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _toml(fields: dict) -> str:
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in fields.items())


def _write(tmp_path: Path, fields: dict, stem: str | None = None) -> Path:
    stem = stem or str(fields.get("name", "t"))
    path = tmp_path / f"{stem}.toml"
    path.write_text(_toml(fields))
    return path


def _refused(path: Path, *needles: str) -> str:
    with pytest.raises(SpecError) as ei:
        load_spec(path)
    msg = str(ei.value)
    assert str(path) in msg, f"message does not name the file: {msg}"
    for n in needles:
        assert n in msg, f"message does not mention {n!r}: {msg}"
    return msg


def _with(**changes) -> dict:
    d = dict(VALID)
    d.update(changes)
    return d


def _without(field) -> dict:
    return {k: v for k, v in VALID.items() if k != field}


def test_valid_base_loads(tmp_path):
    assert load_spec(_write(tmp_path, VALID)) == Spec(**VALID)


def test_unknown_field(tmp_path):
    msg = _refused(_write(tmp_path, _with(num_layers=61)), "'num_layers'", "unknown field")
    assert "num_heads" in msg  # lists the known ones


def test_unknown_table(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(_toml(VALID) + "[extra]\nx = 1\n")
    _refused(path, "'extra'")


@pytest.mark.parametrize("field", FIELDS)
def test_missing_field(tmp_path, field):
    _refused(_write(tmp_path, _without(field), stem="t"), f"'{field}'", "missing")


WRONG_TYPES = [
    ("num_heads", "8", "str"),            # string for int
    ("kv_lora_rank", 512.0, "float"),     # float for int
    ("page_size", 64.5, "float"),
    ("num_heads", True, "bool"),          # bool true for int
    ("max_depth", False, "bool"),
    ("name", 7, "int"),                   # int for name
    ("qk_rope_head_dim", [64], "list"),
    ("max_tree_size", {"n": 65}, "dict"),
]


@pytest.mark.parametrize("field,value,typ", WRONG_TYPES, ids=[f"{f}-{t}" for f, _, t in WRONG_TYPES])
def test_wrong_type(tmp_path, field, value, typ):
    _refused(_write(tmp_path, _with(**{field: value}), stem="t"), f"'{field}'", typ)


IMPOSSIBLE = [
    ("num_heads", 0), ("num_heads", -8), ("num_heads", 10**30),
    ("kv_lora_rank", 0), ("kv_lora_rank", 500), ("kv_lora_rank", -512), ("kv_lora_rank", 8),
    ("qk_rope_head_dim", 0), ("qk_rope_head_dim", 63), ("qk_rope_head_dim", -64),
    ("page_size", 0), ("page_size", -64),
    ("max_tree_size", 1), ("max_tree_size", 0), ("max_tree_size", MAX_TREE_SIZE + 1),
    ("max_tree_size", 129), ("max_tree_size", 1000),
    ("max_depth", 0), ("max_depth", -1), ("max_depth", 65), ("max_depth", 66),
]


@pytest.mark.parametrize("field,value", IMPOSSIBLE, ids=[f"{f}={v}" for f, v in IMPOSSIBLE])
def test_impossible_value(tmp_path, field, value):
    _refused(_write(tmp_path, _with(**{field: value}), stem="t"), f"'{field}'", "must be")


def test_mask_width_limit_is_128():
    # the templates keep a tree-mask row in 4 words of 32 bits
    assert MAX_TREE_SIZE == 128


@pytest.mark.parametrize("n,d", [(2, 1), (128, 127), (128, 15), (33, 32)])
def test_edge_values_accepted(tmp_path, n, d):
    spec = load_spec(_write(tmp_path, _with(max_tree_size=n, max_depth=d)))
    assert (spec.max_tree_size, spec.max_depth) == (n, d)
    assert spec.mask_words == -(-n // 32)


@pytest.mark.parametrize("d", [65, 64])
def test_max_depth_relative_to_tree_size(tmp_path, d):
    # max_depth must be < max_tree_size (a chain of D nodes plus the root)
    _refused(_write(tmp_path, _with(max_tree_size=65 if d == 65 else 64, max_depth=d), stem="t"),
             "'max_depth'")


BAD_NAMES = ["Kimi", "kimi k2", "kimi/k2", "-kimi", ".kimi", "_kimi", "", "kimi\u00e9", "x" * 65,
             "kimi\t", "ki\x00mi", "../kimi"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:20] for n in BAD_NAMES])
def test_bad_name_characters_parse(name):
    with pytest.raises(SpecError) as ei:
        parse_spec(_with(name=name), "specs/x.toml")
    assert "specs/x.toml" in str(ei.value) and "'name'" in str(ei.value)


def test_name_with_trailing_newline_is_refused():
    with pytest.raises(SpecError):
        parse_spec(_with(name="kimi\n"), "specs/kimi.toml")


@pytest.mark.parametrize("name", ["Kimi", "kimi k2", "-kimi", "x" * 65, "kimi\n"],
                         ids=["upper", "space", "dash", "long", "newline"])
def test_bad_name_in_file(tmp_path, name):
    # the file stem is a legal name; the field is not
    _refused(_write(tmp_path, _with(name=name), stem="t"), "'name'")


def test_name_must_match_file_name(tmp_path):
    path = _write(tmp_path, _with(name="other"), stem="t")
    _refused(path, "'name'", "'other'", "'t'")


@pytest.mark.parametrize("text", [
    "name = \n",                          # missing value
    "name = \"t\"\nname = \"t\"\n",       # duplicate key
    "num_heads = 8 8\n",
    "[unterminated\n",
    "name = \"t\n",                       # unterminated string
    "num_heads = 0x\n",
], ids=["no-value", "duplicate", "two-values", "table", "string", "hex"])
def test_invalid_toml(tmp_path, text):
    path = tmp_path / "t.toml"
    path.write_text(text)
    _refused(path, "not valid TOML")


def test_non_utf8(tmp_path):
    path = tmp_path / "t.toml"
    path.write_bytes(_toml(VALID).encode() + b"# \xff\xfe caf\xe9\n")
    _refused(path, "UTF-8")


def test_missing_file(tmp_path):
    _refused(tmp_path / "nope.toml", "cannot read")


def test_directory_instead_of_file(tmp_path):
    path = tmp_path / "t.toml"
    path.mkdir()
    _refused(path, "cannot read")


def test_parse_spec_not_a_table():
    for data in (None, [], "name = 't'", 3):
        with pytest.raises(SpecError) as ei:
            parse_spec(data, "src.toml")
        assert "src.toml" in str(ei.value)


def test_spec_error_is_value_error():
    # callers that catch ValueError keep working
    assert issubclass(SpecError, ValueError)


# ----------------------------------------------------------------------------- the CLI

def _cli(*args, root: Path | None = None, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if root is not None:
        env["DDTREE_GEN_ROOT"] = str(root)
    if cache is not None:
        env["DDTREE_GEN_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "ddtree_gen", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


def test_cli_unknown_spec_name(tmp_path):
    r = _cli("build", "no-such-model", cache=tmp_path / "cache")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no-such-model" in r.stderr
    for name in SHIPPED:
        assert name in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_cli_invalid_spec_file_exits_2(tmp_path):
    bad = _write(tmp_path, _with(num_heads=0), stem="t")
    r = _cli("build", str(bad), cache=tmp_path / "cache")
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(bad) in r.stderr and "'num_heads'" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ fields declared once

def test_fields_are_declared_once():
    """Spec's attributes, the loader's fields, the template variables and the sympy symbols all come from
    spec.FIELDS."""
    import dataclasses

    from ddtree_gen.build import render, resources
    from ddtree_gen import spec as S
    from ddtree_gen.ops import by_name
    from ddtree_gen.build.variant import variant
    assert [f.name for f in dataclasses.fields(Spec)] == [f.name for f in S.FIELDS]
    spec = load_spec(paths.specs_dir() / "kimi-k2.6-tp8.toml")
    ctx = render.context(variant(by_name("tree_build"), spec))
    for f in S.FIELDS:
        if f.alias:
            assert ctx[f.alias] == getattr(spec, f.name)
    assert {str(s) for s in resources.symbols_of(spec)} == {f.alias for f in S.FIELDS if f.symbolic}
    assert resources.symbols_of(spec)[resources.R] == spec.kv_lora_rank


def test_an_optional_field_at_its_default_changes_no_manifest(monkeypatch):
    """A new optional field (here declared for the test only) left at its default leaves as_dict() and digest()
    -- the manifests' spec_values and spec_sha256 -- as they were; set, it is in both and in the templates."""
    import json

    from ddtree_gen import spec as S
    extra = S.Field("extra_knob", (int,), "int", lambda v, f: None if v >= 0 else "must be >= 0", default=0,
                    alias="EXTRA")
    fields = (*S.FIELDS, extra)
    monkeypatch.setattr(S, "FIELDS", fields)
    monkeypatch.setattr(S, "FIELD", {f.name: f for f in fields})
    monkeypatch.setattr(S, "Spec", S._spec_class())
    manifest = json.loads((paths.generated_dir() / "kimi-k2.6-tp8" / "manifest.json").read_text())
    spec = load_spec(paths.specs_dir() / "kimi-k2.6-tp8.toml")
    assert spec.extra_knob == 0
    assert spec.as_dict() == manifest["spec_values"] and spec.digest() == manifest["spec_sha256"]
    knob = S.parse_spec(dict(spec.as_dict(), extra_knob=3), "t.toml")
    assert knob.as_dict()["extra_knob"] == 3 and knob.digest() != spec.digest()
    assert knob.template_values()["EXTRA"] == 3
    with pytest.raises(SpecError, match="field 'extra_knob' = -1 must be >= 0"):
        S.parse_spec(dict(spec.as_dict(), extra_knob=-1), "t.toml")


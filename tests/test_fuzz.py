"""Fuzzing the two readers of untrusted files: the spec loader and the KDTR bundle reader.

Whatever the input, a reader raises its own error type (SpecError / KdtrError) or returns a
valid object; never KeyError, TypeError, OverflowError, RecursionError, MemoryError, ... and
never a huge allocation driven by a size field. Kept under ~40 s in total.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from ddtree_gen.errors import KdtrError, SpecError
from ddtree_gen.spec import FIELDS as SPEC_FIELDS
from ddtree_gen.spec import Spec, load_spec, parse_spec

FUZZ = settings(max_examples=150, deadline=None, derandomize=False, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# the declared fields (ddtree_gen/spec.py FIELDS): the required ones, the optional ones and their defaults
FIELDS = tuple(f.name for f in SPEC_FIELDS if f.required)
OPTIONAL = tuple(f.name for f in SPEC_FIELDS if not f.required)
NUMERIC = tuple(f.name for f in SPEC_FIELDS if f.required and f.types == (int,))
VALID = dict(name="t", num_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, page_size=64,
             max_tree_size=65, max_depth=15)
# what as_dict() holds of the optional fields of a spec that leaves them out
DEFAULTS = {k: v for k, v in Spec(**VALID).as_dict().items() if k in OPTIONAL}


# ================================================================== spec loader

@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzzspec") / "t.toml"


def _load_bytes(path, data: bytes):
    path.write_bytes(data)
    try:
        spec = load_spec(path)
    except SpecError as e:
        assert str(path) in str(e), f"SpecError does not name the file: {e}"
        return None
    assert isinstance(spec, Spec)
    return spec


@FUZZ
@given(st.binary(max_size=400))
@example(b"")
@example(b"\xff\xfe\x00")
@example(b"name = \"t\"\x00")
def test_spec_random_bytes(spec_file, data):
    _load_bytes(spec_file, data)


# TOML-ish text: lines of `key = value` with keys from the spec's fields (and a few others),
# values from a small TOML value grammar, sprinkled with junk.
_keys = st.sampled_from(FIELDS + OPTIONAL + ("num_layers", "Name", "name.x", '"name"', "[t]", ""))
_scalars = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70).map(str),
    st.sampled_from(["0", "1", "16", "64", "65", "128", "129", "-0", "+64", "0x40", "0o100", "0b1",
                     "1_000", "1e3", "64.0", "inf", "nan", "-inf", "true", "false", "1979-05-27",
                     "07:32:00", "1979-05-27T07:32:00Z", '"t"', "'t'", '""', '"\\u00e9"', '"a\\nb"',
                     '"""t"""', "'''t'''", '"\\x"', "[]", "{}", "[1, 2]", '{a = 1}']),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12).map(json.dumps),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
    st.dictionaries(st.sampled_from(["a", "b", "name"]), inner, max_size=2).map(
        lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}")), max_leaves=6)
_junk = st.text(alphabet="=[]{}\"'#\\\n \t.,-+_0123456789abcxyz\u00e9\x00\x7f", max_size=8)
_line = st.one_of(st.tuples(_keys, _values).map(lambda kv: f"{kv[0]} = {kv[1]}"), _junk,
                  st.sampled_from(["[table]", "[[array]]", "# comment", ""]))


@FUZZ
@given(st.lists(_line, max_size=12), st.booleans())
def test_spec_random_toml_text(spec_file, lines, start_valid):
    text = "\n".join(lines) + "\n"
    if start_valid:  # mostly-valid spec with random extra / replaced lines
        text = "".join(f"{k} = {json.dumps(v)}\n" for k, v in VALID.items()) + text
    _load_bytes(spec_file, text.encode("utf-8", "surrogatepass"))


@FUZZ
@given(st.dictionaries(st.sampled_from(NUMERIC), st.sampled_from([0, 1, 2, 15, 16, 63, 64, 65, 127, 128, 129,
                                                                   512, 1024, -1]), min_size=len(NUMERIC)))
def test_spec_values_in_file(spec_file, values):
    """Numeric fields only: a spec is either refused or loaded with exactly those values."""
    values = dict(values, name="t")
    spec_file.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    spec = _load_bytes(spec_file, spec_file.read_bytes())
    if spec is not None:
        assert spec.as_dict() == dict(values, **DEFAULTS)   # the optional fields: their defaults
        assert 2 <= spec.max_tree_size <= 128 and 1 <= spec.max_depth < spec.max_tree_size
        assert spec.kv_lora_rank % 16 == 0 and spec.qk_rope_head_dim % 16 == 0


_any_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**200, max_value=2**200),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=70), st.binary(max_size=8),
              st.sampled_from([0, 1, 16, 64, 65, 128, 512, "t", "kimi-k2.6", "x" * 64, "x" * 65]),
              st.just(float("nan")), st.complex_numbers(max_magnitude=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=5)


@FUZZ
@given(st.dictionaries(st.one_of(st.sampled_from(FIELDS + OPTIONAL), st.text(max_size=10)), _any_value,
                       max_size=len(FIELDS + OPTIONAL)),
       st.booleans())
def test_parse_spec_random_dicts(data, fill):
    if fill:  # keep most fields valid so that the later checks are reached too
        data = dict(VALID, **data)
    try:
        spec = parse_spec(data, "fuzz.toml")
    except SpecError as e:
        assert "fuzz.toml" in str(e)
        return
    assert isinstance(spec, Spec)
    for k in FIELDS:
        assert type(getattr(spec, k)) is type(VALID[k])


@FUZZ
@given(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
                 st.binary(max_size=5), st.floats()))
def test_parse_spec_not_a_dict(data):
    with pytest.raises(SpecError):
        parse_spec(data, "fuzz.toml")


def test_parse_spec_mixed_key_types():
    with pytest.raises(SpecError):
        parse_spec({1: 2, "a": 3}, "fuzz.toml")


@pytest.mark.parametrize("text", ["a = " + "[" * 5000, "a = " + "{b = " * 2000 + "1" + "}" * 2000],
                         ids=["arrays", "tables"])
def test_spec_deeply_nested_toml(spec_file, text):
    spec_file.write_text(text)
    escaped = None
    try:
        load_spec(spec_file)
    except SpecError:
        return
    except RecursionError as e:  # reported outside the handler: its 1000-frame traceback is slow to format
        escaped = type(e).__name__
    pytest.fail(f"load_spec let {escaped} escape instead of raising SpecError", pytrace=False)


# ================================================================== KDTR reader

try:
    from ddtree_gen import kdtr
except ModuleNotFoundError as _e:  # the KDTR module lands separately; its tests wait for it
    if _e.name != "ddtree_gen.kdtr":
        raise
    kdtr = None
KDTR_MISSING = "ddtree_gen.kdtr (ddtree_gen/kdtr.py, the KDTR reader) is not there yet"
needs_kdtr = pytest.mark.skipif(kdtr is None, reason=KDTR_MISSING)
DTYPES = kdtr.DTYPES if kdtr else ("int32", "uint32", "int64", "uint16", "uint8", "float32", "float64")

_FIXED = struct.Struct("<4sHHI")


def _valid_bundle() -> bytes:
    rng = np.random.default_rng(0)
    return kdtr.dumps(spec="kimi-k2.6-tp8", kernel="tree_build", case="fuzz", seed=7, arrays={
        "topk_ids": rng.integers(0, 1000, (2, 3, 4), dtype=np.int32),
        "topk_logprobs": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "mask": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "bits": np.arange(5, dtype=np.uint16),
        "scalar": np.float64(1.5),
        "empty": np.zeros((0, 7), np.int64),
        "u8": np.arange(3, dtype=np.uint8),
    })


VALID_BUNDLE = _valid_bundle() if kdtr else bytes(64)


def _loads(data: bytes):
    """kdtr.loads, asserting it fails only with KdtrError, quickly, without large allocations."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        return kdtr.loads(data, name="fuzz.kdtr")
    except KdtrError as e:
        assert "fuzz.kdtr" in str(e), f"KdtrError does not name the file: {e}"
        return None
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < 2.0, f"{elapsed:.2f} s for {len(data)} bytes"
        assert peak < 8 * len(data) + (4 << 20), f"{peak} bytes allocated for a {len(data)}-byte input"


def _with_checksum(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def _bundle_from_header(header, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    """A bundle with this header (a dict, JSON-encoded) and data, and a correct checksum."""
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    h += b" " * (-(_FIXED.size + len(h)) % 8)
    return _with_checksum(_FIXED.pack(b"KDTR", 1, 0, len(h)) + h + data)


@needs_kdtr
def test_kdtr_valid_bundle_round_trips():
    b = _loads(VALID_BUNDLE)
    assert b is not None and b.case == "fuzz" and b.seed == 7
    assert b.arrays["topk_ids"].shape == (2, 3, 4) and b.arrays["empty"].shape == (0, 7)
    assert b.arrays["scalar"].shape == () and b.arrays["scalar"] == 1.5


@needs_kdtr
@FUZZ
@given(st.binary(max_size=600))
@example(b"")
@example(b"KDTR")
@example(b"KDTR\x01\x00\x00\x00\xff\xff\xff\xff" + bytes(32))
@example(b"KDTR\x01\x00\x00\x00\x00\x00\x00\x00" + bytes(32))
def test_kdtr_random_bytes(data):
    _loads(data)


@needs_kdtr
@FUZZ
@given(st.binary(max_size=600))
def test_kdtr_random_bytes_after_magic(data):
    _loads(b"KDTR\x01\x00\x00\x00" + data)


@needs_kdtr
@FUZZ
@given(st.integers(min_value=0, max_value=len(VALID_BUNDLE) - 1))
def test_kdtr_truncations(n):
    assert _loads(VALID_BUNDLE[:n]) is None


@needs_kdtr
@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID_BUNDLE) - 1), st.integers(0, 7)), min_size=1, max_size=4))
def test_kdtr_bit_flips(flips):
    data = bytearray(VALID_BUNDLE)
    for pos, bit in flips:
        data[pos] ^= 1 << bit
    assume(bytes(data) != VALID_BUNDLE)
    assert _loads(bytes(data)) is None  # the checksum catches whatever the structure checks miss


@needs_kdtr
@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID_BUNDLE) - 33), st.integers(0, 7)), min_size=1, max_size=3))
def test_kdtr_bit_flips_with_fixed_checksum(flips):
    """A flip with a recomputed checksum: the structure checks alone must hold."""
    data = bytearray(VALID_BUNDLE[:-32])
    for pos, bit in flips:
        data[pos] ^= 1 << bit
    b = _loads(_with_checksum(bytes(data)))
    if b is not None:  # a flip in array data (or in a harmless header byte) still decodes
        assert isinstance(b, kdtr.Bundle)
        assert all(a.nbytes <= len(VALID_BUNDLE) for a in b.arrays.values())


@needs_kdtr
@FUZZ
@given(st.integers(1, 64), st.binary(min_size=1, max_size=64))
def test_kdtr_trailing_or_inserted_bytes(pos, extra):
    body = VALID_BUNDLE[:-32]
    assert _loads(_with_checksum(body + extra)) is None
    p = min(pos, len(body))
    assert _loads(_with_checksum(body[:p] + extra + body[p:])) is None


_huge = st.one_of(st.integers(min_value=2**31, max_value=2**70), st.integers(max_value=-1, min_value=-2**70),
                  st.sampled_from([2**63 - 1, 2**63, 2**64, 2**64 - 1, -2**63, 10**40, 10**300]))
_dim = st.one_of(_huge, st.integers(0, 8))
_shape = st.lists(_dim, min_size=0, max_size=40)


@needs_kdtr
@FUZZ
@given(_shape, st.one_of(_dim, st.none()), st.one_of(_dim, st.none()), st.sampled_from(DTYPES))
@example([2**62, 2**62], None, None, "float64")
@example([2**40] * 32, None, None, "uint8")
@example([-1], None, None, "int32")
@example([0, 2**63], None, 0, "int32")
@example([3, 10**300], None, None, "int32")
@example([2**31, 2**31], 0, 2**64, "uint8")
def test_kdtr_huge_and_negative_shapes(shape, offset, nbytes, dtype):
    itemsize = np.dtype(dtype).itemsize
    if nbytes is None:  # a consistent nbytes, to get past that check to the size checks
        nbytes = math.prod(shape) * itemsize if shape else itemsize
    entry = {"name": "a", "dtype": dtype, "shape": shape, "offset": 0 if offset is None else offset,
             "nbytes": nbytes}
    header = {"spec": "s", "kernel": "k", "case": "c", "seed": 0, "arrays": [entry]}
    data = _loads(_bundle_from_header(header, bytes(16)))
    if data is not None:  # only a tiny array can fit in 16 bytes
        assert data.arrays["a"].nbytes <= 16


@needs_kdtr
@FUZZ
@given(st.dictionaries(st.sampled_from(["spec", "kernel", "case", "seed", "arrays", "extra"]), _any_value,
                       max_size=6),
       st.lists(st.dictionaries(st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "x"]),
                                _any_value, max_size=6), max_size=3))
def test_kdtr_random_headers(header, entries):
    header = {k: v for k, v in header.items() if not isinstance(v, (bytes, complex)) and not _has_unjsonable(v)}
    entries = [{k: v for k, v in e.items() if not _has_unjsonable(v)} for e in entries]
    if "arrays" not in header:
        header["arrays"] = entries
    try:
        raw = json.dumps(header, allow_nan=True).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        return
    _loads(_bundle_from_header(None, bytes(64), raw_header=raw))


def _has_unjsonable(v) -> bool:
    if isinstance(v, (bytes, complex)):
        return True
    if isinstance(v, (list, tuple)):
        return any(_has_unjsonable(x) for x in v)
    if isinstance(v, dict):
        return any(_has_unjsonable(x) for x in v.values())
    return False


@pytest.mark.parametrize("raw", [
    b"[" * 100000,                              # deep nesting
    b'{"spec": "s"' + b', "spec": "t"' * 3 + b"}",
    b'{"spec":"s","kernel":"k","case":"c","seed":' + b"9" * 5000 + b',"arrays":[]}',  # int too long
    b'{"spec":"s","kernel":"k","case":"c","seed":NaN,"arrays":[]}',
    b'{"spec":"s","kernel":"k","case":"c","seed":1e400,"arrays":[]}',
    b'{"spec":"s","kernel":"k","case":"c","seed":0,"arrays":[{"name":"a","dtype":"int32","shape":[1e999],'
    b'"offset":0,"nbytes":4}]}',
    b'{"spec":"\xed\xa0\x80","kernel":"k","case":"c","seed":0,"arrays":[]}',  # surrogate in UTF-8
    b'\xff\xfe{}',
    b"null", b"[]", b'"x"', b"",
], ids=["deep", "dup-keys", "long-int", "nan", "inf", "float-dim", "surrogate", "bom", "null", "list",
        "string", "empty"])
@needs_kdtr
def test_kdtr_hostile_headers(raw):
    _loads(_bundle_from_header(None, b"", raw_header=raw))


@needs_kdtr
def test_kdtr_header_length_beyond_file():
    for hl in (2**32 - 1, 2**31, 10**6, 9):
        data = _FIXED.pack(b"KDTR", 1, 0, hl) + bytes(40)
        with pytest.raises(KdtrError, match="truncated"):
            kdtr.loads(data, name="fuzz.kdtr")


@needs_kdtr
def test_kdtr_read_missing_file(tmp_path):
    with pytest.raises(KdtrError) as ei:
        kdtr.read(tmp_path / "nope.kdtr")
    assert "nope.kdtr" in str(ei.value)


@needs_kdtr
@FUZZ
@given(st.dictionaries(
    st.from_regex(r"[A-Za-z0-9_.\-]{1,12}", fullmatch=True),
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=4)),
    max_size=5), st.integers(-2**63, 2**63))
def test_kdtr_round_trip(spec_arrays, seed):
    rng = np.random.default_rng(abs(seed) % 2**32)
    arrays = {}
    for name, (dtype, shape) in spec_arrays.items():
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
        arrays[name] = raw.view(dtype).reshape(shape)
    data = kdtr.dumps(spec="s", kernel="k", case="c", seed=seed, arrays=arrays)
    b = _loads(data)
    assert b is not None and b.seed == seed
    assert set(b.arrays) == set(arrays)
    for name, a in arrays.items():
        assert b.arrays[name].dtype == a.dtype and b.arrays[name].shape == a.shape
        assert b.arrays[name].tobytes() == a.tobytes()

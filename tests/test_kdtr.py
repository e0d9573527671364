"""Tests of the KDTR reference-bundle container (ddtree_gen.kdtr)."""
import hashlib
import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_gen import kdtr
from ddtree_gen.errors import KdtrError

META = dict(spec="kimi-k2.6-tp8", kernel="tree_build", case="b2-n65", seed=1234)


def _small_bundle():
    return kdtr.dumps(**META, arrays={
        "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
        "lp": np.array([-0.5, -np.inf, np.nan], np.float32),
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 4), np.uint16),
    })


def _assemble(header, data=b"", *, magic=b"KDTR", version=1, flags=0, header_len=None):
    """A file with an arbitrary header (dict or bytes), and a correct checksum."""
    if isinstance(header, dict):
        header = json.dumps(header).encode()
    body = struct.pack("<4sHHI", magic, version, flags,
                       len(header) if header_len is None else header_len) + header + data
    return body + hashlib.sha256(body).digest()


def _header(**arrays_and_fields):
    h = dict(META, arrays=[])
    h.update(arrays_and_fields)
    return h


def _entry(name="a", dtype="int32", shape=(2,), offset=0, nbytes=8):
    return {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset,
            "nbytes": nbytes}


# ------------------------------------------------------------------------ round trip

ALL_DTYPES = ["int32", "uint32", "int64", "uint16", "uint8", "float32", "float64"]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 5)],
                         ids=["0d", "empty", "empty-3d", "1d", "3d"])
def test_round_trip(tmp_path, dtype, shape):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                       dtype=np.uint8)
    a = raw.view(dtype).reshape(shape)  # every bit pattern, NaNs included
    path = tmp_path / "x.kdtr"
    kdtr.write(path, **META, arrays={"a": a, "b": np.arange(3, dtype=np.int64)})
    got = kdtr.read(path)
    assert (got.spec, got.kernel, got.case, got.seed) == tuple(META.values())
    assert got.arrays["a"].dtype == np.dtype(dtype) and got.arrays["a"].shape == shape
    assert got.arrays["a"].tobytes() == a.tobytes()
    assert got.arrays["a"].flags.writeable
    assert got == kdtr.loads(path.read_bytes())
    assert os.listdir(tmp_path) == ["x.kdtr"]


def test_layout_and_alignment():
    data = _small_bundle()
    magic, version, flags, header_len = struct.unpack_from("<4sHHI", data)
    assert (magic, version, flags) == (b"KDTR", 1, 0)
    assert (12 + header_len) % 8 == 0
    header = json.loads(data[12:12 + header_len])
    assert set(header) == {"spec", "kernel", "case", "seed", "arrays"}
    for e in header["arrays"]:
        assert e["offset"] % 8 == 0
    assert data[-32:] == hashlib.sha256(data[:-32]).digest()
    assert data == _small_bundle()  # deterministic


def test_non_native_and_non_contiguous_inputs():
    a = np.arange(12, dtype=">i4").reshape(3, 4)
    b = np.arange(12, dtype=np.float64).reshape(3, 4).T
    got = kdtr.loads(kdtr.dumps(**META, arrays={"a": a, "b": b}))
    np.testing.assert_array_equal(got.arrays["a"], a)
    np.testing.assert_array_equal(got.arrays["b"], b)
    assert got.arrays["a"].dtype == np.int32


def test_bundle_equality():
    a = kdtr.loads(_small_bundle())
    b = kdtr.loads(_small_bundle())
    assert a == b  # NaN arrays compare by bits
    b.arrays["ids"][0, 0] = 99
    assert a != b
    c = kdtr.loads(_small_bundle())
    c.seed = 1
    assert a != c
    assert a != "not a bundle"


def test_atomic_write_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "b.kdtr"
    kdtr.write(str(path), **META, arrays={"x": np.zeros(3, np.uint8)})
    kdtr.write(path, **META, arrays={"x": np.ones(5, np.uint8)})
    assert os.listdir(tmp_path) == ["b.kdtr"]
    assert kdtr.read(path).arrays["x"].tolist() == [1] * 5
    with pytest.raises(KdtrError):
        kdtr.write(path, **META, arrays={"x": np.zeros(2, bool)})
    assert os.listdir(tmp_path) == ["b.kdtr"]
    assert kdtr.read(path).arrays["x"].tolist() == [1] * 5


@pytest.mark.parametrize("arrays", [
    {"a": np.zeros(2, bool)}, {"a": np.zeros(2, np.float16)}, {"a": np.zeros(2, np.int8)},
    {"a": np.zeros(2, np.complex64)}, {"a": np.array([None], object)},
    {"": np.zeros(2, np.int32)}, {"a b": np.zeros(2, np.int32)},
    {"x" * 129: np.zeros(2, np.int32)}, {3: np.zeros(2, np.int32)}, {"a/b": np.zeros(1)},
    {"a": [[1, 2], [3]]},
], ids=["bool", "float16", "int8", "complex", "object", "empty-name", "space-in-name",
        "long-name", "int-name", "slash-in-name", "ragged"])
def test_writer_refuses_unsupported_arrays(arrays):
    with pytest.raises(KdtrError):
        kdtr.dumps(**META, arrays=arrays)


@pytest.mark.parametrize("field, value", [
    ("spec", None), ("kernel", 3), ("case", b"x"), ("seed", True), ("seed", 1.5),
    ("arrays", [np.zeros(2)]), ("spec", "\ud800"),
], ids=["spec-none", "kernel-int", "case-bytes", "seed-bool", "seed-float", "arrays-list",
        "spec-surrogate"])
def test_writer_refuses_bad_metadata(field, value):
    with pytest.raises(KdtrError, match=field):
        kwargs = dict(META, arrays={})
        kwargs[field] = value
        kdtr.dumps(**kwargs)


def test_read_missing_file_names_it(tmp_path):
    with pytest.raises(KdtrError, match="nope.kdtr"):
        kdtr.read(tmp_path / "nope.kdtr")
    with pytest.raises(KdtrError):
        kdtr.read(tmp_path)


@pytest.mark.parametrize("data", ["KDTR", 10**12, None], ids=["str", "int", "none"])
def test_loads_refuses_non_bytes(data):
    with pytest.raises(KdtrError, match="expected bytes"):
        kdtr.loads(data)


def test_written_file_mode_follows_umask(tmp_path):
    path = tmp_path / "m.kdtr"
    kdtr.write(path, **META, arrays={})
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


# ------------------------------------------------------------------------- refusals

def test_every_truncation_is_refused():
    data = _small_bundle()
    for n in range(len(data)):
        with pytest.raises(KdtrError, match="truncated") as info:
            kdtr.loads(data[:n], name="cut.kdtr")
        assert "cut.kdtr" in str(info.value)
    with pytest.raises(KdtrError, match=rf"{len(data)} bytes, file has {len(data) - 8}"):
        kdtr.loads(data[:-8])


def test_trailing_bytes_are_refused():
    with pytest.raises(KdtrError, match="trailing"):
        kdtr.loads(_small_bundle() + b"\0" * 8)


def test_every_single_bit_flip_is_refused():
    data = bytearray(_small_bundle())
    for bit in range(len(data) * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(KdtrError):
            kdtr.loads(bytes(data))
        data[bit // 8] ^= 1 << (bit % 8)
    kdtr.loads(bytes(data))


MALFORMED = [  # (id, bundle bytes, expected message part)
    ("wrong-magic", _assemble(_header(), magic=b"KDTX"), "magic"),
    ("version-2", _assemble(_header(), version=2), "version 2"),
    ("version-0", _assemble(_header(), version=0), "version 0"),
    ("flags", _assemble(_header(), flags=1), "flags"),
    ("not-json", _assemble(b"{not json"), "bad header JSON"),
    ("not-utf8", _assemble(b"\xff\xfe{}"), "bad header JSON"),
    ("json-nan", _assemble(b'{"seed": NaN}'), "bad header JSON"),
    ("json-deep", _assemble(b"[" * 100000 + b"]" * 100000), "bad header JSON"),
    ("json-huge-int", _assemble(b'{"seed": 1' + b"0" * 5000 + b"}"), "bad header JSON"),
    ("json-list", _assemble(b"[]"), "object"),
    ("json-string", _assemble(b'"text"'), "object"),
    ("missing-case",
     _assemble({k: v for k, v in _header().items() if k != "case"}), "missing field 'case'"),
    ("missing-arrays",
     _assemble({k: v for k, v in _header().items() if k != "arrays"}), "missing field 'arrays'"),
    ("extra-field", _assemble(_header(extra=1)), "unexpected header field"),
    ("seed-str", _assemble(_header(seed="1")), "seed"),
    ("seed-bool", _assemble(_header(seed=True)), "seed"),
    ("spec-none", _assemble(_header(spec=None)), "spec"),
    ("arrays-dict", _assemble(_header(arrays={})), "arrays"),
    ("entry-not-object", _assemble(_header(arrays=[1])), r"arrays\[0\]"),
    ("entry-missing-dtype", _assemble(_header(arrays=[{"name": "a"}])), "missing field 'dtype'"),
    ("entry-extra-field",
     _assemble(_header(arrays=[dict(_entry(), more=1)]), b"\0" * 8), "unexpected field"),
    ("name-space", _assemble(_header(arrays=[_entry(name="a b")]), b"\0" * 8), "invalid name"),
    ("name-none", _assemble(_header(arrays=[_entry(name=None)]), b"\0" * 8), "invalid name"),
    ("dtype-float16",
     _assemble(_header(arrays=[_entry(dtype="float16", nbytes=4)]), b"\0" * 8), "dtype"),
    ("dtype-bool", _assemble(_header(arrays=[_entry(dtype="bool")]), b"\0" * 8), "unknown dtype"),
    ("dtype-list",
     _assemble(_header(arrays=[_entry(dtype=["int32"])]), b"\0" * 8), "unknown dtype"),
    ("shape-negative",
     _assemble(_header(arrays=[_entry(shape=(-2,), nbytes=8)]), b"\0" * 8), "shape"),
    ("shape-float", _assemble(_header(arrays=[_entry(shape=(2.0,))]), b"\0" * 8), "shape"),
    ("shape-str", _assemble(_header(arrays=[dict(_entry(), shape="2")]), b"\0" * 8), "shape"),
    ("shape-40d",
     _assemble(_header(arrays=[_entry(shape=(1,) * 40, nbytes=4)]), b"\0" * 8), "shape"),
    ("shape-huge",
     _assemble(_header(arrays=[_entry(shape=(2**40, 2**40), nbytes=8)]), b"\0" * 8),
     "needs more bytes"),
    ("shape-dim-2**63",
     _assemble(_header(arrays=[_entry(shape=(2**63, 0), nbytes=0)]), b""), "shape"),
    ("nbytes-mismatch",
     _assemble(_header(arrays=[_entry(nbytes=12)]), b"\0" * 16), "does not match"),
    ("nbytes-negative", _assemble(_header(arrays=[_entry(nbytes=-8)]), b"\0" * 8), "nbytes"),
    ("offset-unaligned", _assemble(_header(arrays=[_entry(offset=4)]), b"\0" * 16), "offset"),
    ("offset-negative", _assemble(_header(arrays=[_entry(offset=-8)]), b"\0" * 8), "offset"),
    ("array-beyond-file", _assemble(_header(arrays=[_entry(offset=8)]), b"\0" * 8), "truncated"),
    ("empty-array-far-offset",
     _assemble(_header(arrays=[_entry(shape=(0,), nbytes=0, offset=10**4000)]), b""),
     "truncated"),
    ("duplicate-names", _assemble(_header(arrays=[_entry(), _entry()]), b"\0" * 8), "duplicate"),
    ("overlap",
     _assemble(_header(arrays=[_entry(), _entry(name="b", shape=(4,), nbytes=16)]),
               b"\0" * 16), "overlap"),
    ("header-len-huge", _assemble(_header(), header_len=2**32 - 1), "truncated"),
    ("header-len-short", _assemble(_header(), header_len=3), "bad header JSON"),
    ("checksum", _small_bundle()[:-1] + bytes([_small_bundle()[-1] ^ 1]), "checksum"),
    ("empty-file", b"", "truncated"),
    ("magic-only", b"KDTR", "truncated"),
]


@pytest.mark.parametrize("blob, match", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_bundles_are_refused(blob, match):
    with pytest.raises(KdtrError, match=match) as info:
        kdtr.loads(blob, name="bad.kdtr")
    assert str(info.value).startswith("bad.kdtr: ")
    assert len(str(info.value)) < 600


def test_valid_hand_assembled_bundle_loads():
    blob = _assemble(_header(arrays=[_entry(), _entry(name="z", shape=(0, 3), offset=8,
                                                       nbytes=0)]),
                     np.array([5, -6], np.int32).tobytes())
    b = kdtr.loads(blob)
    assert b.arrays["a"].tolist() == [5, -6] and b.arrays["z"].shape == (0, 3)


# ---------------------------------------------------------------------------- fuzz

VALID = _small_bundle()
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _loads_or_kdtr_error(blob):
    try:
        return kdtr.loads(blob)
    except KdtrError:
        return None


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(blob):
    _loads_or_kdtr_error(blob)
    _loads_or_kdtr_error(b"KDTR\x01\x00\x00\x00" + blob)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(VALID)), st.binary(max_size=40))
def test_fuzz_mutations_of_a_valid_bundle(edits, cut, tail):
    data = bytearray(VALID)
    for pos, byte in edits:
        data[pos] = byte
    blob = bytes(data[:cut]) + tail
    result = _loads_or_kdtr_error(blob)
    if result is not None:
        assert blob == VALID or result == kdtr.loads(VALID)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                       children, max_size=4),
    max_leaves=12)
_ENTRY = st.fixed_dictionaries({
    "name": st.sampled_from(["a", "b", "", "a b"]) | _JSON,
    "dtype": st.sampled_from(ALL_DTYPES + ["bool", "float16"]) | _JSON,
    "shape": st.lists(st.integers(-2, 2**40), max_size=4) | _JSON,
    "offset": st.integers(-8, 64) | st.sampled_from([2**64, 10**30]) | _JSON,
    "nbytes": st.integers(-8, 64) | st.sampled_from([2**64, 10**30]) | _JSON,
})


@FUZZ
@given(st.fixed_dictionaries({
    "spec": st.text(max_size=5) | _JSON, "kernel": st.text(max_size=5),
    "case": st.text(max_size=5), "seed": st.integers() | _JSON,
    "arrays": st.lists(_ENTRY, max_size=4) | _JSON,
}), st.binary(max_size=80))
def test_fuzz_headers_with_valid_checksum(header, data):
    """Structured headers re-checksummed, so validation past the checksum is exercised."""
    blob = _assemble(json.dumps(header).encode(), data)
    result = _loads_or_kdtr_error(blob)
    if result is not None:
        for e in header["arrays"]:
            assert result.arrays[e["name"]].nbytes == e["nbytes"]

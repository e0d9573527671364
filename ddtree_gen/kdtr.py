"""KDTR: the container of reference bundles (inputs and expected outputs of one kernel case).

Layout (all integers little-endian):
  offset 0   magic b"KDTR"
  offset 4   uint16 version (1)
  offset 6   uint16 flags (0)
  offset 8   uint32 header length H
  offset 12  H bytes of UTF-8 JSON: {"spec": str, "kernel": str, "case": str, "seed": int,
             "arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}
             (the writer pads it with spaces so that the data starts 8-byte aligned)
  12 + H     data: each array's raw bytes, little-endian, C order, at its offset (relative
             to the data start, a multiple of 8); the data section ends at the largest
             offset + nbytes rounded up to 8, zero padded
  end - 32   SHA-256 of every preceding byte

Allowed dtypes: int32, uint32, int64, uint16 (bf16 bits), uint8, float32, float64.
Array names: 1-128 characters of [A-Za-z0-9_.-], unique. Arrays may be 0-d or empty; at
most 32 dimensions; arrays of nonzero size must not overlap.
Every problem with a file raises KdtrError naming the file; sizes are validated before
anything is allocated from them. Unknown header fields are refused (the version covers
format changes).
"""
import dataclasses
import hashlib
import json
import os
import re
import struct

import numpy as np

from .errors import KdtrError
from .fileio import atomic_write

__all__ = ["Bundle", "write", "read", "dumps", "loads", "MAGIC", "VERSION", "DTYPES"]

MAGIC = b"KDTR"
VERSION = 1
DTYPES = ("int32", "uint32", "int64", "uint16", "uint8", "float32", "float64")
_FIXED = struct.Struct("<4sHHI")
_DIGEST = 32
_MAX_NDIM = 32
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}\Z")
_FIELDS = ("spec", "kernel", "case", "seed", "arrays")
_ENTRY_FIELDS = ("name", "dtype", "shape", "offset", "nbytes")


@dataclasses.dataclass(eq=False)
class Bundle:
    """A decoded bundle. Equality compares metadata and arrays (names, dtypes, shapes, bytes)."""
    spec: str
    kernel: str
    case: str
    seed: int
    arrays: dict

    def __eq__(self, other):
        if not isinstance(other, Bundle):
            return NotImplemented
        if (self.spec, self.kernel, self.case, self.seed) != (
                other.spec, other.kernel, other.case, other.seed):
            return False
        if self.arrays.keys() != other.arrays.keys():
            return False
        for key, a in self.arrays.items():
            b = other.arrays[key]
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
        return True

    __hash__ = None


def _align8(n):
    return (n + 7) // 8 * 8


def _num(n):
    """A byte count for a message (JSON integers can be too long for str())."""
    return str(n) if n < 2**64 else "more than 2**64"


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------ write

def dumps(*, spec, kernel, case, seed, arrays):
    """Encode a bundle to bytes (see the module docstring); KdtrError on bad input."""
    for field, value in (("spec", spec), ("kernel", kernel), ("case", case)):
        if not isinstance(value, str):
            raise KdtrError(f"{field}: expected a str, got {type(value).__name__}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise KdtrError(f"{field}: not encodable as UTF-8") from None
    if isinstance(seed, np.integer):
        seed = int(seed)
    if not _is_int(seed):
        raise KdtrError(f"seed: expected an int, got {type(seed).__name__}")
    if not isinstance(arrays, dict):
        raise KdtrError(f"arrays: expected a dict, got {type(arrays).__name__}")
    entries, blobs, offset = [], [], 0
    for name, value in arrays.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise KdtrError(f"array name {name!r}: expected 1-128 characters of [A-Za-z0-9_.-]")
        try:
            a = np.asarray(value)
        except (ValueError, TypeError) as exc:
            raise KdtrError(f"array {name!r}: not an array: {exc}") from None
        if a.dtype.name not in DTYPES:
            raise KdtrError(f"array {name!r}: unsupported dtype {a.dtype} (allowed: "
                            f"{', '.join(DTYPES)})")
        if a.ndim > _MAX_NDIM:
            raise KdtrError(f"array {name!r}: more than {_MAX_NDIM} dimensions")
        raw = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
        entries.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape),
                        "offset": offset, "nbytes": len(raw)})
        blobs.append(raw + bytes(_align8(len(raw)) - len(raw)))
        offset += len(blobs[-1])
    try:
        header = json.dumps({"spec": spec, "kernel": kernel, "case": case, "seed": seed,
                             "arrays": entries}, ensure_ascii=False, allow_nan=False,
                            separators=(",", ":")).encode("utf-8")
    except ValueError as exc:  # a seed too long for str()
        raise KdtrError(f"cannot encode the header: {exc}") from None
    header += b" " * (_align8(_FIXED.size + len(header)) - _FIXED.size - len(header))
    if len(header) > 0xFFFFFFFF:
        raise KdtrError("header too large")
    body = _FIXED.pack(MAGIC, VERSION, 0, len(header)) + header + b"".join(blobs)
    return body + hashlib.sha256(body).digest()


def write(path, *, spec, kernel, case, seed, arrays):
    """Write a bundle atomically (hidden temporary file in the same directory, fsync,
    os.replace); the temporary file is removed on failure."""
    data = dumps(spec=spec, kernel=kernel, case=case, seed=seed, arrays=arrays)
    atomic_write(path, data)


# ------------------------------------------------------------------------------- read

def read(path):
    """Read and validate a bundle file; KdtrError (naming the file) on any problem."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise KdtrError(f"{os.fspath(path)}: cannot read: {exc}") from exc
    return loads(data, name=os.fspath(path))


def _reject_constant(token):
    raise ValueError(f"non-finite number {token}")


def _exact_fields(obj: dict, fields, missing: str, unexpected: str) -> None:
    """KdtrError unless obj has exactly `fields`: the first missing one, or the unexpected ones, named after the
    messages' starts `missing`, `unexpected`."""
    for field in fields:
        if field not in obj:
            raise KdtrError(f"{missing} {field!r}")
    extra = sorted(set(obj) - set(fields))
    if extra:
        raise KdtrError(f"{unexpected} {extra}"[:500])


def _entry(name, i, e, data_start, size):
    """Validate one array entry against a file of `size` bytes; return its fields."""
    data_len = size - data_start - _DIGEST
    where = f"{name}: header arrays[{i}]"
    if not isinstance(e, dict):
        raise KdtrError(f"{where}: expected an object")
    _exact_fields(e, _ENTRY_FIELDS, f"{where}: missing field", f"{where}: unexpected field(s)")
    arr_name, dtype, shape, offset, nbytes = (e[f] for f in _ENTRY_FIELDS)
    if not isinstance(arr_name, str) or not _NAME.match(arr_name):
        raise KdtrError(f"{where}: invalid name {arr_name!r}"[:300])
    where = f"{name}: array {arr_name!r}"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise KdtrError(f"{where}: unknown dtype {dtype!r}"[:300])
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM \
            or not all(_is_int(s) and 0 <= s < 2**63 for s in shape):
        raise KdtrError(f"{where}: shape must be a list of at most {_MAX_NDIM} "
                        f"integers in [0, 2**63)")
    if not _is_int(offset) or offset < 0 or offset % 8:
        raise KdtrError(f"{where}: offset must be a non-negative multiple of 8")
    if not _is_int(nbytes) or nbytes < 0:
        raise KdtrError(f"{where}: nbytes must be a non-negative integer")
    expected = 0 if 0 in shape else np.dtype(dtype).itemsize
    for s in shape:
        expected *= s
        if expected > data_len:  # more than the file could hold: stop multiplying
            raise KdtrError(f"{where}: shape {shape} needs more bytes than the "
                            f"{data_len} the file has for data (truncated or corrupt)"[:500])
    if expected != nbytes:
        raise KdtrError(f"{where}: nbytes {nbytes} does not match shape {shape} x "
                        f"{np.dtype(dtype).itemsize}-byte {dtype}"[:500])
    if offset + nbytes > data_len:
        raise KdtrError(f"{where}: truncated: its data needs a file of at least "
                        f"{_num(data_start + offset + nbytes + _DIGEST)} bytes, file has {size}")
    return arr_name, dtype, tuple(shape), offset, nbytes


def loads(data, name="<bytes>"):
    """Decode and validate bundle bytes; `name` labels error messages."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise KdtrError(f"{name}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    size = len(data)
    if size < _FIXED.size + _DIGEST:
        raise KdtrError(f"{name}: truncated: {size} bytes, a bundle has at least "
                        f"{_FIXED.size + _DIGEST}")
    magic, version, flags, header_len = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise KdtrError(f"{name}: wrong magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise KdtrError(f"{name}: unsupported version {version} (this reader: {VERSION})")
    if flags != 0:
        raise KdtrError(f"{name}: unsupported flags 0x{flags:04x}")
    data_start = _FIXED.size + header_len
    if data_start + _DIGEST > size:
        raise KdtrError(f"{name}: truncated: header alone needs {data_start + _DIGEST} bytes "
                        f"(with checksum), file has {size}")
    try:
        header = json.loads(data[_FIXED.size:data_start].decode("utf-8"),
                            parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise KdtrError(f"{name}: bad header JSON: {exc}"[:500]) from None
    if not isinstance(header, dict):
        raise KdtrError(f"{name}: header JSON must be an object")
    _exact_fields(header, _FIELDS, f"{name}: header is missing field", f"{name}: unexpected header field(s)")
    for field in ("spec", "kernel", "case"):
        if not isinstance(header[field], str):
            raise KdtrError(f"{name}: header field {field!r} must be a string")
    if not _is_int(header["seed"]):
        raise KdtrError(f"{name}: header field 'seed' must be an integer")
    if not isinstance(header["arrays"], list):
        raise KdtrError(f"{name}: header field 'arrays' must be a list")

    entries = [_entry(name, i, e, data_start, size) for i, e in enumerate(header["arrays"])]
    if len({e[0] for e in entries}) != len(entries):
        raise KdtrError(f"{name}: duplicate array names")
    data_len = _align8(max((e[3] + e[4] for e in entries), default=0))
    expected = data_start + data_len + _DIGEST
    if expected > size:
        raise KdtrError(f"{name}: truncated: expected {expected} bytes, file has {size}")
    if expected < size:
        raise KdtrError(f"{name}: {size - expected} trailing bytes: expected {expected} "
                        f"bytes, file has {size}")
    spans = sorted((e[3], e[3] + e[4], e[0]) for e in entries if e[4])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise KdtrError(f"{name}: arrays {first!r} and {second!r} overlap")
    if hashlib.sha256(memoryview(data)[:size - _DIGEST]).digest() != data[size - _DIGEST:]:
        raise KdtrError(f"{name}: checksum mismatch (file corrupted)")

    arrays = {}
    for arr_name, dtype, shape, offset, nbytes in entries:
        dt = np.dtype(dtype).newbyteorder("<")
        raw = np.frombuffer(data, dtype=dt, count=nbytes // dt.itemsize,
                            offset=data_start + offset)
        arrays[arr_name] = raw.astype(dt.newbyteorder("="), copy=True).reshape(shape)
    return Bundle(spec=header["spec"], kernel=header["kernel"], case=header["case"],
                  seed=header["seed"], arrays=arrays)

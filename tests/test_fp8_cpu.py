"""The fp8 (e4m3) KV cache without a GPU (spec kv_dtype = "fp8_e4m3").

* the spec field and the kernel registry per kv_dtype (no mma.sync kernels for an fp8 spec: artifacts,
  kernel sets, `list`, `build --check`);
* dequantization: every byte through ddtree_gen.fp8 and the reference against ml_dtypes and against the
  e4m3 format written out bit by bit; the device conversion (common.cuh.j2 fp8x4_to_bf16x4) emulated in
  numpy bit for bit over every byte in every position, NaN and subnormals included;
* kv_scale (required for fp8, refused for bf16, finite, > 0, a normal float32) and the cache's dtype in
  the launchers and the reference, impl="mma" refused for fp8, impl="auto" per device;
* the fp8 specs' refs bundles and the sanitizer's fp8 cases (they pass the launchers' checks).
"""
from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import FakeCudaArray, FakeKernelSet, LaunchReached
from ddtree_gen.build import artifacts
from ddtree_gen import bf16, bundles, cli, fp8, kdtr, paths, reference, registry, sanitize
from ddtree_gen.launch.arrays import KV_CACHE_DTYPES, _TORCH_DTYPES
from ddtree_gen.errors import ArgumentError, BuildError, SpecError
from ddtree_gen.ops.kv_commit import launch as kv_commit_mod
from ddtree_gen.ops.tree_accept import launch as tree_accept_mod
from ddtree_gen.ops.tree_verify import launch as tv
from ddtree_gen.ops.tree_verify import mma_launch as mma_launchers
from ddtree_gen.ops import all_builds, all_kernels, by_name
from ddtree_gen.build.variant import variant
from ddtree_gen.spec import KV_DTYPES, all_specs, find_spec, load_spec, parse_spec
from ddtree_gen.types import TreeAcceptOutput
from ddtree_gen.ops.tree_verify.wgmma import DEQUANT, DEQUANT_PARTS, PARTS_KERNEL
from test_archs import DEVICES, fake_devices, fake_set  # noqa: F401  (fake_devices: a fixture)
from test_tree_verify_cpu import Arrays, MmaKernelSet, verify_args

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is a test dependency (pip install -e '.[test]')")

FP8 = find_spec("kimi-k2.6-tp8-fp8")
BF16 = find_spec("kimi-k2.6-tp8")          # the same spec with a bf16 cache
VALID = dict(name="t", num_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, page_size=64, max_tree_size=65,
             max_depth=15)
LAUNCHERS = [("tree_verify", tv.tree_verify), ("tree_verify_tail", tv.tree_verify_tail)]
ALL_BYTES = np.arange(256, dtype=np.uint8)


def e4m3_by_hand(byte: int) -> float:
    """The e4m3 (float8_e4m3fn) value of a byte from the format's definition: s.eeee.mmm, bias 7, subnormals
    at exponent 0, NaN at s.1111.111, no infinities."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return -math.nan if s else math.nan
    value = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -value if s else value


# ----------------------------------------------------------------------------- the spec field

def test_kv_dtype_field():
    s = parse_spec(VALID, "t.toml")
    assert s.kv_dtype == "bf16" and not s.kv_fp8 and s.kv_itemsize == 2      # optional, bf16 by default
    f = parse_spec(dict(VALID, kv_dtype="fp8_e4m3"), "t.toml")
    assert f.kv_dtype == "fp8_e4m3" and f.kv_fp8 and f.kv_itemsize == 1
    assert f.digest() != s.digest() and parse_spec(dict(VALID, kv_dtype="bf16"), "t.toml") == s
    assert parse_spec(f.as_dict(), "again") == f and f.as_dict()["kv_dtype"] == "fp8_e4m3"
    assert KV_DTYPES == ("bf16", "fp8_e4m3")


@pytest.mark.parametrize("bad,words", [
    ("fp8", "must be one of 'bf16', 'fp8_e4m3'"), ("e4m3", "must be one of"), ("FP8_E4M3", "must be one of"),
    ("fp8_e5m2", "must be one of"), ("", "must be one of"), ("bf16 ", "must be one of"),
    (8, "must be str"), (True, "must be str"), (["fp8_e4m3"], "must be str"), (1.0, "must be str"),
], ids=repr)
def test_kv_dtype_field_refusals(bad, words):
    with pytest.raises(SpecError) as e:
        parse_spec(dict(VALID, kv_dtype=bad), "specs/t.toml")
    msg = str(e.value)
    assert "specs/t.toml" in msg and "'kv_dtype'" in msg and words in msg, msg


def test_kv_dtype_in_a_spec_file(tmp_path):
    path = tmp_path / "x.toml"
    body = "\n".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in dict(VALID, name="x").items())
    path.write_text(body.replace("'", '"') + '\nkv_dtype = "fp8_e4m3"\n')
    assert load_spec(path).kv_fp8
    path.write_text(body.replace("'", '"') + '\nkv_dtype = "int8"\n')
    with pytest.raises(SpecError, match=r"x\.toml: field 'kv_dtype' = 'int8' must be one of"):
        load_spec(path)


# --------------------------------------------------------------------- the registry per kv_dtype

def test_registry_per_kv_dtype():
    """The mma.sync tree_verify kernels and the seesaw's parts-grid build read bf16 caches only; the dequantize path
    (kv_dequant, tree_verify_wgmma's dequant and dequant_parts builds) is an fp8 spec's only; every other build is
    built for both kv_dtypes."""
    fp8_only = ("kv_dequant", DEQUANT, DEQUANT_PARTS)
    bf16_only = ("tree_verify_mma", "tree_verify_tail_mma", PARTS_KERNEL)
    for k in all_builds():
        want = ("bf16",) if k.name in bf16_only else ("fp8_e4m3",) if k.name in fp8_only else KV_DTYPES
        assert k.kv_dtypes == want, k.name
        assert k.builds_for(BF16) == ("bf16" in want) and k.builds_for(FP8) == ("fp8_e4m3" in want), k.name
        assert bool(k.archs_for(FP8)) == k.builds_for(FP8), k.name
    pairs = {v.kernel.name for v in artifacts.variants(FP8, all_builds())}
    assert pairs == {k.name for k in all_builds()} - set(bf16_only)
    assert {v.kernel.name for v in artifacts.variants(BF16, all_builds())} == {k.name for k in all_builds()} - set(
        fp8_only)
    assert "tree_verify_mma_combine" in pairs and "merge_states" in pairs    # fp32 / bf16 outputs: built for fp8
    why = by_name("tree_verify_mma").why_not_built(FP8)
    assert why == ("tree_verify_mma: not built for kv_dtype 'fp8_e4m3' of spec 'kimi-k2.6-tp8-fp8' (it reads bf16 "
                   "caches only)")
    assert by_name("tree_verify_mma").why_not_built(BF16) is None
    with pytest.raises(BuildError, match="tree_verify_tail_mma: not built for kv_dtype 'fp8_e4m3'"):
        artifacts.compile_variant(variant(by_name("tree_verify_tail_mma"), FP8))    # refused before anything is compiled
    assert "tree_verify_mma" not in artifacts.expected_sources(FP8)
    assert set(artifacts.generated_state(FP8)["tree_verify_mma"]) == set()


def test_list_and_build_check_show_kv_dtype(capsys):
    cli.main(["list", FP8.name, BF16.name])
    out = capsys.readouterr().out
    assert f"{FP8.name}: H=8 R=512 P=64 page=64 N=65 D=15 kv_dtype=fp8_e4m3" in out
    assert f"{BF16.name}: H=8 R=512 P=64 page=64 N=65 D=15 kv_dtype=bf16" in out
    assert re.search(r"tree_verify_mma +- +not built: it reads bf16 caches, the spec's kv_dtype is fp8_e4m3", out)
    cli.main(["build", "--check", FP8.name])
    out = capsys.readouterr().out
    # the counts and the list come from the declarations (ddtree_gen/plans), so adding a kernel needs no edit here
    built = [k for k in all_kernels() if k.archs_for(FP8)]
    not_fp8 = [k.name for k in all_builds() if "fp8_e4m3" not in k.kv_dtypes]
    assert {"tree_verify_mma", "tree_verify_tail_mma", PARTS_KERNEL} <= set(not_fp8)
    assert (f"{FP8.name}: kv_dtype=fp8_e4m3 targets=sm_90a,sm_80, {len(built)} kernels, "
            f"{sum(len(k.archs_for(FP8)) for k in all_builds())} variants (not built for fp8_e4m3: "
            f"{', '.join(not_fp8)})") in out
    assert len([k for k in all_builds() if k.archs_for(FP8)]) + len(not_fp8) == len(all_builds())
    assert re.search(r"kv_dequant +- +not built: it reads fp8_e4m3 caches, the spec's kv_dtype is bf16", out) is None
    cli.main(["list", BF16.name])
    assert re.search(r"kv_dequant +- +not built: it reads fp8_e4m3 caches, the spec's kv_dtype is bf16",
                     capsys.readouterr().out)


def test_kernel_set_of_an_fp8_spec(fake_devices):
    """The mma.sync launchers of an fp8 kernel set say why they cannot run (no device asked); impl="auto" is
    wgmma on Hopper and the CUDA-core kernel elsewhere (A100, B200 included: no mma.sync for fp8) for the fused
    path (fp8_path="fused", and tree_verify_tail always); tree_verify's default (fp8_path=None) is the dequantize
    path on Hopper (kv_dequant first) and that same fused kernel elsewhere, as tv.fp8_default says."""
    from ddtree_gen.ops.kv_dequant.plan import workspace_elems
    ks = fake_set(FP8)
    assert "tree_verify_mma" not in ks.kernels and "tree_verify_mma_combine" in ks.kernels
    for device in DEVICES:
        assert ks.unavailable("tree_verify_mma", device) == by_name("tree_verify_mma").why_not_built(FP8)
    new = Arrays()
    with pytest.raises(ArgumentError, match="^tree_verify_mma: not built for kv_dtype 'fp8_e4m3'"):
        ks.tree_verify_mma(**verify_args(FP8, new), num_splits=1)
    for launcher in ("tree_verify", "tree_verify_tail"):
        fused = {"fp8_path": "fused"} if launcher == "tree_verify" else {}
        for device, want in ((0, "wgmma"), (1, None), (2, None), (3, None), (0, "wgmma")):
            new = Arrays()
            new.next = (device << 40) + (1 << 32)
            with pytest.raises(LaunchReached):
                getattr(ks, launcher)(**verify_args(FP8, new), num_splits=1, **fused)
            assert ks.launched[0] == (f"{launcher}_{want}" if want else launcher), device
    for device, want in ((0, "kv_dequant"), (1, "tree_verify"), (2, "tree_verify"), (3, "tree_verify")):
        new = Arrays()
        new.next = (device << 40) + (1 << 32)
        args = verify_args(FP8, new)
        b, max_pages = args["block_table"].__cuda_array_interface__["shape"]
        path, why = tv.fp8_default(ks, "auto", device, b, max_pages)
        assert path == ("dequant" if device == 0 else "fused"), (device, why)
        if device:
            assert why.startswith(f"{DEQUANT}: not available on device"), why
        # on the H200 the workspace is given (a new one would be allocated on a GPU this machine lacks)
        kvw = {"kv_workspace": new((workspace_elems(FP8, b, max_pages),), np.uint16)} if device == 0 else {}
        with pytest.raises(LaunchReached):
            ks.tree_verify(**args, num_splits=1, **kvw)
        assert ks.launched[0] == want, device
        with pytest.raises(ArgumentError, match=f"^impl: 'mma': {launcher}_mma: not built for kv_dtype 'fp8_e4m3'"):
            getattr(ks, launcher)(**verify_args(FP8, Arrays()), impl="mma")


# --------------------------------------------------------------------------- dequantization

def test_every_byte_decodes_as_the_format_says():
    by_hand = np.array([e4m3_by_hand(int(b)) for b in ALL_BYTES])
    got = fp8.to_float64(ALL_BYTES)
    assert got.dtype == np.float64
    assert np.array_equal(got, by_hand, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(by_hand))                      # -0.0 is byte 0x80
    assert np.array_equal(got, ALL_BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float64), equal_nan=True)
    assert np.flatnonzero(np.isnan(got)).tolist() == list(fp8.NAN_BYTES)
    assert np.nanmax(got) == fp8.MAX == 448.0 and got[1] == 2.0 ** -9               # the smallest subnormal
    assert np.array_equal(fp8.to_float64(ALL_BYTES.view(ml_dtypes.float8_e4m3fn)), got, equal_nan=True)
    assert np.array_equal(fp8.dequantize(ALL_BYTES, 0.375), got * 0.375, equal_nan=True)


def test_from_float_rounds_to_nearest_even():
    finite = np.setdiff1d(ALL_BYTES, fp8.NAN_BYTES)
    assert np.array_equal(fp8.from_float(fp8.to_float64(finite)), finite)             # every value round-trips
    assert fp8.from_float(np.float32(np.nan)) in fp8.NAN_BYTES
    # between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even mantissa, just above it up
    assert fp8.from_float(np.float32([1.0625, 1.0625 + 2 ** -10, 1.1875, 448.0, 460.0])).tolist() == \
        [0x38, 0x39, 0x3A, 0x7E, 0x7E]


def _one_key_case(row, kv_scale, q_value=0.25):
    """tree_verify's reference with one visible key (prefix 0, q_len 1, mask bit 0) whose entry is `row`."""
    r = row.size - 16
    kv = np.zeros((1, 1, row.size), row.dtype)
    kv[0, 0] = row
    q_nope = np.full((1, 1, 1, r), q_value)
    q_pe = np.zeros((1, 1, 1, 16))
    return dict(q_nope=q_nope, q_pe=q_pe, kv_cache=kv, block_table=np.zeros((1, 1), np.int32),
                prefix_lens=np.zeros(1, np.int32), q_lens=np.ones(1, np.int32), tree_mask=np.ones((1, 1, 1), np.uint32),
                softmax_scale=0.1, kv_scale=kv_scale)


def test_reference_dequantizes_every_finite_byte():
    """One visible key: out is its latent, e4m3 x kv_scale exactly, for each of the 254 finite bytes; lse is
    its score; the same as the reference on the float64 dequantized cache."""
    finite = np.setdiff1d(ALL_BYTES, fp8.NAN_BYTES)
    row = np.concatenate([finite, np.zeros(16, np.uint8)])          # latent: every finite byte; rope: zeros
    for kv_scale in (1.0, 0.0137, 1.75, np.float32(0.5)):
        case = _one_key_case(row, kv_scale)
        got = reference.tree_verify(**case)
        want = fp8.to_float64(finite) * float(kv_scale)
        assert np.array_equal(got.out[0, 0, 0], want)
        assert got.lse[0, 0, 0] == pytest.approx(0.1 * np.dot(np.full(finite.size, 0.25), want), rel=1e-13)
        same = reference.tree_verify(**dict(case, kv_cache=fp8.dequantize(case["kv_cache"], kv_scale), kv_scale=None))
        assert np.array_equal(same.out, got.out) and np.array_equal(same.lse, got.lse)


def test_reference_fp8_equals_reference_on_the_dequantized_cache():
    """Several keys, a tree mask, pages: the fp8 reference is the bf16/float reference on e4m3 x kv_scale."""
    rng = np.random.default_rng(5)
    h, r, p, page, n = 2, 32, 16, 4, 5
    kv = fp8.from_float(rng.standard_normal((6, page, r + p), dtype=np.float32))
    args = dict(q_nope=rng.standard_normal((2, n, h, r)), q_pe=rng.standard_normal((2, n, h, p)),
                block_table=np.array([[3, 1, 0], [5, 2, 4]], np.int32), prefix_lens=np.array([3, 6], np.int32),
                q_lens=np.array([5, 3], np.int32), tree_mask=rng.integers(0, 32, (2, n, 1)).astype(np.uint32),
                softmax_scale=0.3)
    for fn in (reference.tree_verify, reference.tree_verify_tail):
        got = fn(**args, kv_cache=kv, kv_scale=0.7)
        via_ml = fn(**args, kv_cache=kv.view(ml_dtypes.float8_e4m3fn), kv_scale=0.7)    # ml_dtypes arrays too
        want = fn(**args, kv_cache=kv.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 0.7)
        for x in (got, via_ml):
            assert np.array_equal(x.out, want.out, equal_nan=True) and np.array_equal(x.lse, want.lse, equal_nan=True)


# the device conversion, emulated: templates/common.cuh.j2 fp8x2_hi_to_bf16x2 / fp8x4_to_bf16x4

def _byte_perm(x, s):
    """__byte_perm(x, 0, s): result byte i = byte (s >> 4i) & 7 of the 8 bytes {0:x} (bytes 4..7 zero)."""
    out = np.zeros_like(x)
    for i in range(4):
        sel = (s >> (4 * i)) & 7
        byte = (x >> np.uint32(8 * sel)) & np.uint32(0xFF) if sel < 4 else np.zeros_like(x)
        out |= byte << np.uint32(8 * i)
    return out


def _bf16x2_fma(a, b, c):
    """fma.rn.bf16x2 per 16-bit half: a * b + c rounded once to bf16 (nearest, even), subnormals kept. Exact in
    float64 here (a has at most 8 significant bits, b is a power of two)."""
    out = np.zeros_like(a)
    for shift in (0, 16):
        h = lambda v: bf16.from_bits(((v >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16))  # noqa: E731
        exact = h(a).astype(np.float64) * h(b).astype(np.float64) + h(c).astype(np.float64)
        out |= bf16.to_bits(exact).astype(np.uint32) << np.uint32(shift)
    return out


def _vcmpeq2(a, b):
    out = np.zeros_like(a)
    for shift in (0, 16):
        m = np.uint32(0xFFFF) << np.uint32(shift)
        out |= np.where((a & m) == (b & m), m, np.uint32(0))
    return out


def fp8x2_hi_to_bf16x2_finite(t):
    r = (t & np.uint32(0x80008000)) | ((t >> np.uint32(4)) & np.uint32(0x07F007F0))
    return _bf16x2_fma(r, np.full_like(r, 0x7B807B80), np.full_like(r, 0x80008000))


def fp8x2_hi_to_bf16x2(t):
    nan = _vcmpeq2(t & np.uint32(0x7F007F00), np.full_like(t, 0x7F007F00)) & np.uint32(0x7FC07FC0)
    return fp8x2_hi_to_bf16x2_finite(t) | nan


def fp8x4_to_bf16x4(x, finite=False):
    """-> (.x, .y): bf16 of elements 0, 1 and of elements 2, 3 (element i in byte i of x); finite: the
    NaN-free path (fp8x4_to_bf16x4_finite)."""
    f = fp8x2_hi_to_bf16x2_finite if finite else fp8x2_hi_to_bf16x2
    return f(_byte_perm(x, 0x1404)), f(_byte_perm(x, 0x3424))


def fp8x4_nan_bits(x):
    return ((x & np.uint32(0x7F7F7F7F)) + np.uint32(0x01010101)) & np.uint32(0x80808080)


def test_device_conversion_formula_is_the_one_emulated():
    """The emulation below follows the template's code: its constants and selectors are there."""
    text = (paths.templates_dir() / "common.cuh.j2").read_text()
    for token in ("(t & 0x80008000u) | ((t >> 4) & 0x07f007f0u)", "fma.rn.bf16x2", '"r"(0x7b807b80u)',
                  '"r"(0x80008000u)', "__vcmpeq2(t & 0x7f007f00u, 0x7f007f00u) & 0x7fc07fc0u",
                  "fp8x2_hi_to_bf16x2_finite(t) |", "__byte_perm(x, 0u, 0x1404)", "__byte_perm(x, 0u, 0x3424)",
                  "((x & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u"):
        assert token in text, token


def test_device_conversion_is_exact_for_every_byte_in_every_position():
    """Every e4m3 byte, in each of the 4 positions of a word, converts to the bf16 of its exact value (bf16 holds
    every e4m3 value, subnormals included, exactly); the NaN bytes to a bf16 NaN of their sign."""
    want = bf16.to_bits(fp8.to_float64(ALL_BYTES))                  # exact: no rounding happens
    assert np.array_equal(bf16.from_bits(want).astype(np.float64), fp8.to_float64(ALL_BYTES), equal_nan=True)
    rng = np.random.default_rng(0)
    words = [ALL_BYTES.astype(np.uint32) << np.uint32(8 * k) for k in range(4)]          # one byte, others 0
    words.append(ALL_BYTES.astype(np.uint32) * np.uint32(0x01010101))                     # the same byte 4 times
    words.append(rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32))         # any mixture
    for x in words:
        elems = np.stack([(x >> np.uint32(8 * k)) & np.uint32(0xFF) for k in range(4)], axis=-1).astype(np.uint8)
        nan = np.isin(elems, fp8.NAN_BYTES)
        assert np.array_equal(fp8x4_nan_bits(x) != 0, nan.any(axis=-1))   # the fast path's test: a NaN byte
        for finite in (False, True):
            lo, hi = fp8x4_to_bf16x4(x, finite)
            got = np.stack([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], axis=-1).astype(np.uint16)
            assert np.array_equal(got[~nan], want[elems[~nan]])                                # bit for bit
            if finite:
                continue
            nan_bits = got[nan]
            assert ((nan_bits & 0x7F80) == 0x7F80).all() and ((nan_bits & 0x7F) != 0).all()  # NaN
            assert np.array_equal(nan_bits >> 15, elems[nan] >> 7)                             # the byte's sign
    lo, hi = fp8x4_to_bf16x4(np.array([0x81_01_80_00], np.uint32))     # +0, -0, +2^-9, -2^-9
    assert [int(lo[0]) & 0xFFFF, int(lo[0]) >> 16, int(hi[0]) & 0xFFFF, int(hi[0]) >> 16] == \
        [0x0000, 0x8000, int(bf16.to_bits(np.float64(2.0 ** -9))), int(bf16.to_bits(np.float64(-2.0 ** -9)))]


# ------------------------------------------------------------------------ kv_scale, cache dtype

class WgmmaKernelSet(MmaKernelSet):
    """A stand-in with the CUDA-core, wgmma and mma.sync names loaded (as if), for any spec."""

    def __init__(self, spec):
        super().__init__(spec, ("tree_verify", "tree_verify_tail", "merge_states", "tree_verify_wgmma",
                                "tree_verify_tail_wgmma", "tree_verify_mma", "tree_verify_tail_mma",
                                "tree_verify_mma_combine"))


IMPLS = ["simple", "wgmma", "auto"]


def _launch(launcher, spec, impl, **change):
    kset = WgmmaKernelSet(spec)
    args = dict(verify_args(spec, Arrays()), **change)
    with pytest.raises(LaunchReached):
        launcher(kset, **args, impl=impl, **({} if impl == "simple" else {"num_splits": 1}))
    return kset.launched


def _refused(launcher, spec, impl, **change):
    kset = WgmmaKernelSet(spec)
    args = {k: v for k, v in dict(verify_args(spec, Arrays()), **change).items() if v is not _DROP}
    with pytest.raises(ArgumentError) as e:
        launcher(kset, **args, impl=impl, **({} if impl == "simple" else {"num_splits": 1}))
    assert not hasattr(kset, "launched")
    return str(e.value)


_DROP = object()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
def test_kv_scale_required_for_fp8(fake_device, name, launcher, impl):
    msg = _refused(launcher, FP8, impl, kv_scale=_DROP)
    assert msg.startswith("kv_scale: required for kv_dtype 'fp8_e4m3' of spec 'kimi-k2.6-tp8-fp8'"), msg
    assert _refused(launcher, FP8, impl, kv_scale=None).startswith("kv_scale: required"), impl


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad,words", [
    (math.nan, "must be finite"), (math.inf, "must be finite"), (-math.inf, "must be finite"),
    (np.float32("nan"), "must be finite"), (0.0, "must be > 0"), (-0.5, "must be > 0"), (-0.0, "must be > 0"),
    (1e-50, "normal float32 range"), (1e-39, "normal float32 range"), (1e39, "normal float32 range"),
    (True, "expected a float"), ("0.5", "expected a float"), ([0.5], "expected a float"),
    (np.array([0.5]), "expected a float"),
], ids=repr)
def test_kv_scale_values(fake_device, impl, bad, words):
    for _, launcher in LAUNCHERS:
        msg = _refused(launcher, FP8, impl, kv_scale=bad)
        assert msg.startswith("kv_scale:") and words in msg, msg


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_scale_factors_reach_the_kernel(fake_device, impl):
    """scale_log2 = softmax_scale x kv_scale x log2(e) and v_scale = kv_scale, both float32, for any real
    number type; a bf16 spec launches v_scale 1."""
    for _, launcher in LAUNCHERS:
        for kv_scale in (0.5, np.float32(0.0123), np.float64(2.0), 3, np.int64(1), 1.2e-38):
            name, kw = _launch(launcher, FP8, impl, kv_scale=kv_scale)
            a = kw["args"]
            assert a[8] == np.float32(kv_scale) and a[8].dtype == np.float32, (name, kv_scale)
            assert a[7] == np.float32(192 ** -0.5 * float(kv_scale) * math.log2(math.e)), (name, kv_scale)
        name, kw = _launch(launcher, BF16, impl)
        assert kw["args"][8] == np.float32(1.0) and kw["args"][7] == np.float32(192 ** -0.5 * math.log2(math.e))


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_scale_refused_for_bf16(fake_device, impl):
    for _, launcher in LAUNCHERS:
        for value in (0.5, 1.0, math.nan):
            msg = _refused(launcher, BF16, impl, kv_scale=value)
            assert msg.startswith("kv_scale: given") and "kv_dtype 'bf16'" in msg and "'kimi-k2.6-tp8'" in msg, msg


def test_softmax_scale_times_kv_scale_must_fit_float32(fake_device):
    msg = _refused(tv.tree_verify, FP8, "simple", softmax_scale=1e30, kv_scale=1e20)
    assert msg.startswith("softmax_scale: 1e+30 x kv_scale 1e+20 is out of float32 range"), msg


@pytest.mark.parametrize("impl", IMPLS)
def test_cache_dtype_follows_kv_dtype(fake_device, impl):
    """An fp8 spec takes uint8 (e4m3 bytes), a bf16 spec uint16 (bf16 bits); the message names kv_cache, the
    dtype found and what the spec's kv_dtype needs."""
    shape = (10, 64, 576)
    for _, launcher in LAUNCHERS:
        msg = _refused(launcher, FP8, impl, kv_cache=FakeCudaArray(shape, np.uint16, ptr=1 << 36))
        assert msg == ("kv_cache: dtype bf16, expected e4m3 bytes (uint8 on CuPy, torch.float8_e4m3fn or torch.uint8 "
                       "on torch) for kv_dtype 'fp8_e4m3' of spec 'kimi-k2.6-tp8-fp8'"), msg
        for other in (np.int8, np.float16, np.float32):
            msg = _refused(launcher, FP8, impl, kv_cache=FakeCudaArray(shape, other, ptr=1 << 36))
            assert msg.startswith(f"kv_cache: dtype {np.dtype(other).name}, expected e4m3 bytes"), msg
        msg = _refused(launcher, BF16, impl, kv_cache=FakeCudaArray(shape, np.uint8, ptr=1 << 36))
        assert msg == ("kv_cache: dtype uint8, expected bf16 (uint16 bits on CuPy, torch.bfloat16 on torch) for "
                       "kv_dtype 'bf16' of spec 'kimi-k2.6-tp8'"), msg
    # torch's e4m3 dtype is an e4m3 cache (taken through the tensor's pointer, as bf16 is)
    assert _TORCH_DTYPES["torch.float8_e4m3fn"] == "fp8_e4m3" and _TORCH_DTYPES["torch.uint8"] == "uint8"
    assert set(KV_CACHE_DTYPES["fp8_e4m3"]) == {"uint8", "fp8_e4m3"} and KV_CACHE_DTYPES["bf16"] == ("bf16",)


@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
def test_mma_refused_for_fp8(fake_device, name, launcher):
    """impl="mma" on an fp8 spec: an ArgumentError naming impl, the kernel and the kv_dtype, even where a kernel
    set (a stand-in) lists the kernel; its direct launcher likewise; "auto" never picks it."""
    msg = _refused(launcher, FP8, "mma")
    assert msg == (f"impl: 'mma': {name}_mma: not built for kv_dtype 'fp8_e4m3' of spec 'kimi-k2.6-tp8-fp8' (it "
                   f"reads bf16 caches only); pass impl='auto' or 'wgmma' or 'simple'"), msg
    direct = mma_launchers.tree_verify_tail if name == "tree_verify_tail" else mma_launchers.tree_verify
    kset = WgmmaKernelSet(FP8)
    with pytest.raises(ArgumentError, match=f"^{name}_mma: not built for kv_dtype 'fp8_e4m3'"):
        direct(kset, **verify_args(FP8, Arrays()), num_splits=1)
    only_mma = MmaKernelSet(FP8, ("tree_verify", "tree_verify_tail", "tree_verify_mma", "tree_verify_tail_mma",
                                  "tree_verify_mma_combine"))
    with pytest.raises(LaunchReached):
        launcher(only_mma, **verify_args(FP8, Arrays()))
    assert only_mma.launched[0] == name                   # auto: the CUDA-core kernel, not mma.sync
    assert _launch(launcher, FP8, "auto")[0] == f"{name}_wgmma"
    assert _launch(launcher, BF16, "mma")[0] == f"{name}_mma"


def test_reference_kv_scale_rules():
    finite = np.setdiff1d(ALL_BYTES, fp8.NAN_BYTES)[:48]
    case = _one_key_case(finite, 0.5)
    with pytest.raises(ArgumentError, match=r"^kv_scale: required for an e4m3 kv_cache \(uint8"):
        reference.tree_verify(**dict(case, kv_scale=None))
    for bad, words in ((math.nan, "finite and > 0"), (0.0, "finite and > 0"), (-1.0, "finite and > 0"),
                       (math.inf, "finite and > 0"), (True, "expected a real number"), ("1", "expected a real")):
        with pytest.raises(ArgumentError, match=f"^kv_scale: .*{words}"):
            reference.tree_verify_tail(**dict(case, kv_scale=bad))
    as_float = fp8.dequantize(case["kv_cache"], 0.5)
    with pytest.raises(ArgumentError, match=r"^kv_scale: given \(0\.5\), but kv_cache holds float64"):
        reference.tree_verify(**dict(case, kv_cache=as_float))
    with pytest.raises(ArgumentError, match="kv_cache: expected a float dtype or uint16"):
        reference.tree_verify(**dict(case, kv_cache=case["kv_cache"].astype(np.int8), kv_scale=None))


# ------------------------------------------------------------------------ tree_accept, kv_commit

def _accept_args(spec, kv):
    n = spec.max_tree_size
    f = lambda shape: FakeCudaArray(shape, np.int32, ptr=_next())  # noqa: E731
    tree = SimpleNamespace(num_nodes=f((2,)), tokens=f((2, n)), first_child=f((2, n)), next_sibling=f((2, n)))
    return dict(tree=tree, target_tokens=f((2, n)), prefix_lens=f((2,)), kv_cache=kv, block_table=f((2, 4)),
                out=TreeAcceptOutput(f((2,)), f((2, spec.max_depth + 1)), f((2, spec.max_depth + 1)), f((2,))))


_PTR = [1 << 33]


def _next():
    """Distinct fake addresses, 4 GB apart, on device 0 (below 1 << 40, conftest.fake_device)."""
    _PTR[0] = _PTR[0] + (1 << 32) if _PTR[0] < (1 << 39) else 1 << 33
    return _PTR[0]


def test_tree_accept_moves_bytes_at_any_address(fake_device):
    """An e4m3 cache is moved in 16-byte chunks where 16-byte aligned, else byte by byte: any address is fine
    (a bf16 cache must be 2-byte aligned); the wrong element type is refused naming kv_dtype."""
    seen = {}

    class Recorder(FakeKernelSet):
        def launch(self, name, **kw):
            seen.update(kw)

    shape = (7, 64, 576)
    for ptr in (1 << 36, (1 << 36) + 1, (1 << 36) + 8):
        tree_accept_mod.launch(Recorder(FP8), **_accept_args(FP8, FakeCudaArray(shape, np.uint8, ptr=ptr)))
        assert seen["args"][6] == ptr and int(seen["args"][10]) == (ptr % 16 == 0)
    with pytest.raises(ArgumentError, match="^kv_cache: data pointer 0x[0-9a-f]+ is not 2-byte aligned"):
        tree_accept_mod.launch(Recorder(BF16), **_accept_args(BF16, FakeCudaArray(shape, np.uint16, ptr=(1 << 36) + 1)))
    with pytest.raises(ArgumentError, match="^kv_cache: dtype bf16, expected e4m3 bytes .* for kv_dtype 'fp8_e4m3'"):
        tree_accept_mod.launch(Recorder(FP8), **_accept_args(FP8, FakeCudaArray(shape, np.uint16, ptr=1 << 36)))


def test_kv_commit_layers_must_share_the_byte_type(fake_device):
    acc = SimpleNamespace(accept_lens=FakeCudaArray((2,), np.int32, ptr=_next()),
                          accepted_nodes=FakeCudaArray((2, FP8.max_depth + 1), np.int32, ptr=_next()))
    shape = (3, 64, 576)
    layers = [FakeCudaArray(shape, np.uint8, ptr=1 << 36), FakeCudaArray(shape, np.uint16, ptr=1 << 37)]
    with pytest.raises(ArgumentError, match=r"^kv_caches\[1\]: dtype bf16, expected e4m3 bytes"):
        kv_commit_mod.launch(FakeKernelSet(FP8), acc, FakeCudaArray((2,), np.int32, ptr=_next()), layers,
                             FakeCudaArray((2, 4), np.int32, ptr=_next()))


# ------------------------------------------------------------------------------- refs, sanitize

@pytest.mark.parametrize("name", [s.name for s in all_specs() if s.kv_fp8])
def test_fp8_refs_hold_bytes_and_scale(name):
    spec = find_spec(name)
    for kernel in ("tree_verify", "tree_verify_tail"):
        a = kdtr.read(bundles.bundle_path(spec, kernel, "prefix70")).arrays
        assert a["in.kv_cache"].dtype == np.uint8 and not np.isin(a["in.kv_cache"], fp8.NAN_BYTES).any()
        scale = a["in.kv_scale"]
        assert scale.dtype == np.float32 and scale.shape == () and 0.01 <= float(scale) <= 2.0
    a = kdtr.read(bundles.bundle_path(spec, "tree_accept", "walks")).arrays
    assert a["in.kv_cache"].dtype == a["out.kv_cache_after"].dtype == np.uint8


def test_sanitizer_cases_use_the_spec_cache(spec):
    """The sanitizer's attention and commit cases hold the spec's cache type (an fp8 spec: e4m3 bytes without
    NaN, with a kv_scale); test_builds.py runs every case through its launcher's checks."""
    for kernel in ("tree_verify", "tree_verify_tail", "tree_accept", "kv_commit"):
        for case, inputs in registry.sanitizer_cases()[kernel](spec, np.random.default_rng(0)):
            cache = inputs.get("kv_cache", inputs.get("kv_caches"))
            first = cache[0] if isinstance(cache, (list, tuple)) else cache
            assert first.dtype == (np.uint8 if spec.kv_fp8 else np.uint16), (kernel, case)
            assert not spec.kv_fp8 or not np.isin(first, fp8.NAN_BYTES).any(), (kernel, case)
            if kernel.startswith("tree_verify"):
                assert ("kv_scale" in inputs) == spec.kv_fp8, (kernel, case)


def test_sanitizer_runs_every_kernel_with_cases():
    """kv_commit has cases of its own; the combine kernel is launched by the tensor-core ones (its declaration
    says so; tests/test_declarations.py holds every kernel to a case list or a reason)."""
    assert "kv_commit" in registry.sanitizer_cases()
    assert "tensor-core" in registry.declaration("tree_verify_mma_combine").missing["sanitize"]


def test_bench_kv_dtype_specs():
    """bench kv-dtype: issue 22's seven configs; each H and kv_dtype from a shipped spec with exactly those values
    where there is one, else an unshipped variant that differs from the base only in name, H and kv_dtype."""
    import dataclasses

    from ddtree_gen.bench import kv_dtype as bench
    from ddtree_gen.bench.specs import spec_variant
    assert bench.KV_DTYPE_CONFIGS == [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (64, 16, 2048), (8, 64, 4096),
                                      (8, 128, 4096), (8, 64, 16384)]
    assert "kv-dtype" in cli.BENCHES
    shipped = {s.name for s in all_specs()}
    for h in sorted({h for _, h, _ in bench.KV_DTYPE_CONFIGS}):
        for kv_dtype in KV_DTYPES:
            s = spec_variant(BF16, h, kv_dtype)
            assert (s.num_heads, s.kv_dtype) == (h, kv_dtype)
            assert dataclasses.replace(s, name=BF16.name, num_heads=8, kv_dtype="bf16") == BF16
            want = {(8, "bf16"): BF16.name, (8, "fp8_e4m3"): FP8.name, (16, "bf16"): "deepseek-v3-tp8",
                    (64, "bf16"): "kimi-k2.6", (128, "bf16"): "deepseek-v3", (128, "fp8_e4m3"): "deepseek-v3-fp8"}
            assert s.name == want.get((h, kv_dtype), f"kimi-k2.6-tp8-h{h}-fp8"), (h, kv_dtype)
            assert (s.name in shipped) == ((h, kv_dtype) in want)

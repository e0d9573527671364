"""draft_topk without a GPU: the numpy reference (docs/contract.md section 5a) against an independent
per-row implementation and on its edge cases (ties, +-0, NaN, -inf and +inf rows, k = V, temperature),
its errors, and the launcher's checks and launch plan on stand-in arrays."""
from __future__ import annotations

import heapq
import math
from fractions import Fraction

import numpy as np
import pytest

from ddtree_gen import bf16, reference
from ddtree_gen.errors import ArgumentError
from ddtree_gen.reference import DraftTopkOutput


FLT_MAX = float(np.finfo(np.float32).max)


def _row_oracle(row, k, t):
    """One row the slow way: python floats, heapq on (-value, id), each gap to the maximum and its quotient by
    T as exact rationals (Fraction) rounded once, math.fsum for the normaliser; a finite logit's log-prob
    floored at -FLT_MAX (contract 5a)."""
    vals = [(-math.inf if math.isnan(v) else float(v)) for v in row]
    best = heapq.nsmallest(k, ((-v, i) for i, v in enumerate(vals)))
    ids = [i for _, i in best]
    m = max(vals)
    if m == -math.inf:
        return ids, [-math.inf] * k
    if m == math.inf:
        n = sum(v == math.inf for v in vals)
        return ids, [-math.log(n) if vals[i] == math.inf else -math.inf for i in ids]
    ft, fm = Fraction(t), Fraction(m)
    a = [-math.inf if v == -math.inf else float((Fraction(v) - fm) / ft) for v in vals]   # (x - M) / T, <= 0
    lse = math.log(math.fsum(math.exp(q) for q in a))                                  # >= log 1: one term is 1
    return ids, [a[i] if a[i] == -math.inf else max(a[i] - lse, -FLT_MAX) for i in ids]


def _check(logits, k, t=1.0):
    got = reference.draft_topk(logits, k, temperature=t)
    assert isinstance(got, DraftTopkOutput)
    x = bf16.from_bits(logits).astype(np.float64) if logits.dtype == np.uint16 else np.asarray(logits, np.float64)
    b, dp, v = x.shape
    assert got.topk_ids.shape == (b, dp, k) and got.topk_ids.dtype == np.int32
    assert got.topk_logprobs.shape == (b, dp, k) and got.topk_logprobs.dtype == np.float64
    for i in range(b):
        for d in range(dp):
            ids, lps = _row_oracle(x[i, d], k, t)
            assert got.topk_ids[i, d].tolist() == ids, (i, d)
            np.testing.assert_allclose(got.topk_logprobs[i, d], lps, rtol=1e-12, atol=1e-12)
            lp = got.topk_logprobs[i, d]
            assert np.all(lp[1:] <= lp[:-1]), lp                          # non-increasing (-inf <= -inf)
    return got


def test_random_rows_match_the_oracle():
    rng = np.random.default_rng(1)
    _check((rng.standard_normal((2, 3, 1000)) * 4).astype(np.float32), 64)
    _check(bf16.to_bits(rng.standard_normal((2, 2, 777)) * 3), 17)


def test_ties_lowest_id_first():
    rng = np.random.default_rng(2)
    x = rng.integers(-3, 3, size=(2, 2, 300)).astype(np.float32)   # six values: heavy ties
    got = _check(x, 40)
    first = x[0, 0]
    top = first.max()
    want = np.flatnonzero(first == top)[:40]
    assert got.topk_ids[0, 0, :len(want)].tolist() == want.tolist()
    _check(np.zeros((1, 1, 50), np.float32), 50)                     # one value: ids 0..49
    assert reference.draft_topk(np.zeros((1, 1, 50), np.float32), 5).topk_ids[0, 0].tolist() == [0, 1, 2, 3, 4]


def test_signed_zeros_are_equal():
    x = np.array([[[-0.0, 0.0, -0.0, 0.0, -1.0]]], np.float32)
    got = _check(x, 5)
    assert got.topk_ids[0, 0].tolist() == [0, 1, 2, 3, 4]


def test_nan_counts_as_minus_inf():
    x = np.array([[[1.0, np.nan, 2.0, -np.inf, np.nan, 0.5]]], np.float32)
    got = _check(x, 6)
    assert got.topk_ids[0, 0].tolist() == [2, 0, 5, 1, 3, 4]
    assert np.all(np.isneginf(got.topk_logprobs[0, 0, 3:]))
    # bf16 NaN bits (quiet and signalling, both signs) too
    bits = bf16.to_bits(np.array([[[1.0, 2.0, 3.0, 4.0]]]))
    bits[0, 0, 1] = 0x7fc0
    bits[0, 0, 3] = 0xff81
    got = _check(bits, 4)
    assert got.topk_ids[0, 0].tolist() == [2, 0, 1, 3]


def test_all_minus_inf_row():
    x = np.full((1, 2, 30), -np.inf, np.float32)
    x[0, 1, 7] = np.nan
    got = _check(x, 10)
    assert got.topk_ids[0, 0].tolist() == list(range(10)) and got.topk_ids[0, 1].tolist() == list(range(10))
    assert np.all(np.isneginf(got.topk_logprobs))


def test_plus_inf_shares_the_probability():
    x = np.array([[[0.0, np.inf, 3.0, np.inf, np.inf, -np.inf]]], np.float32)
    got = _check(x, 6)
    assert got.topk_ids[0, 0].tolist() == [1, 3, 4, 2, 0, 5]
    np.testing.assert_allclose(got.topk_logprobs[0, 0, :3], -math.log(3))
    assert np.all(np.isneginf(got.topk_logprobs[0, 0, 3:]))


def test_k_equals_v_and_one_token():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 1, 9)).astype(np.float32)
    got = _check(x, 9)
    np.testing.assert_allclose(np.exp(got.topk_logprobs).sum(-1), 1.0, rtol=1e-12)
    got = _check(x[:, :, :1].copy(), 1)
    assert np.all(got.topk_logprobs == 0.0) and np.all(got.topk_ids == 0)


@pytest.mark.parametrize("t", [0.05, 0.7, 1.0, 3.0, 1e-20, 1e30])
def test_temperature(t):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((1, 2, 200)) * 2).astype(np.float32)
    got = _check(x, 12, t)
    base = reference.draft_topk(x, 12)
    assert np.array_equal(got.topk_ids, base.topk_ids)             # the order does not depend on it
    if t == 1.0:
        np.testing.assert_array_equal(got.topk_logprobs, base.topk_logprobs)


# the smallest and the largest temperature the contract accepts (fl32(log2(e) / T) finite; fl32(1 / T) normal)
T_MIN, T_MAX = 4.25e-39, 2.0**126
EXTREME_T = [1.0, 1e-9, 1e-12, 1e-20, 1e-37, T_MIN, 1e30, T_MAX]


def _extreme_rows():
    """float32 rows over the whole range: the issue's maxima (1e10, 1e30, 3.0), both ends of float32, subnormals,
    near-ties one unit apart, two tied maxima, and a tiny row."""
    f = np.float32
    big = float(np.finfo(f).max)
    sub = float(np.finfo(f).smallest_subnormal)
    rows = [
        [1e10, 1e10 * (1 - 2**-23), 9e9, -1e10, 0.0, 3.0, -big, 1e9],
        [1e30, 1e30 * (1 - 2**-23), -1e30, 1e29, 0.0, -big, 5e29, 1.0],
        [3.0, 3.0 - 2**-22, 2.5, -3.0, 0.0, 1e-30, -1e30, 2.9],
        [big, -big, big / 2, 0.0, -big / 2, big * (1 - 2**-23), 1.0, -1.0],
        [-big, -big, -big * (1 - 2**-23), -1e38, -big, -big, -big, -big],
        [7.5, 7.5, -2.0, 7.5 - 2**-21, -big, big / 1e30, 1e-3, 7.0],
        [sub, 0.0, -sub, 2 * sub, -0.0, 3 * sub, -2 * sub, sub],
        [1e-38, 2e-38, -1e-38, 0.0, 1.5e-38, 2e-38, -3e-38, 1e-39],
    ]
    return np.array(rows, f).reshape(2, 4, 8)


@pytest.mark.parametrize("t", EXTREME_T)
def test_finite_logits_give_finite_logprobs(t):
    """Contract 5a: finite logits and any accepted temperature give finite log-probs (below the float32 range:
    -FLT_MAX), within 1e-12 relative of the exact-gap oracle; the issue's cases (max 1e10 / 1e30 at T = 1, max 3.0
    at T = 1e-9, T = 1e-20 and 1e-37) among them."""
    reference.temperature_arg(t)                                       # accepted
    x = _extreme_rows()
    got = _check(x, 8, t)
    lp = got.topk_logprobs
    assert np.all(np.isfinite(lp)) and np.all(lp >= -FLT_MAX) and np.all(lp <= 0.0)
    assert np.all(lp[..., 0] >= -math.log(8) - 1e-12)                # the maximum: at least -log(V)


@pytest.mark.parametrize("t", [1e-12, 1e-20, 1e-37, T_MIN])
def test_tied_maxima_at_tiny_temperatures(t):
    """Two tied maxima share the probability, -log 2 each, whatever the temperature; the next logit, one unit
    below, is a finite log-prob (x - M) / T - log 2, floored at -FLT_MAX (the old x / T - (max(x / T) + log S)
    gave 0.0 at T = 1e-20 and missed the gap by 3e-5 at T = 1e-12)."""
    below = np.nextafter(np.float32(3.0), np.float32(0.0))
    x = np.array([[[2.0, 3.0, -1.0, 3.0, below]]], np.float32)
    got = _check(x, 4, t)
    assert got.topk_ids[0, 0].tolist() == [1, 3, 4, 0]
    np.testing.assert_allclose(got.topk_logprobs[0, 0, :2], -math.log(2), rtol=1e-15)
    gap = (float(below) - 3.0) / t - math.log(2)
    assert got.topk_logprobs[0, 0, 2] == pytest.approx(max(gap, -FLT_MAX), rel=1e-15)


def test_gap_at_a_tiny_temperature_is_exact_enough():
    """The issue's T = 1e-12 loss: a maximum of 2.7 at T = 7e-13 (x / T = 3.9e12, whose float64 unit is 4.9e-4): the
    log-prob of the logit one float32 unit below is the gap / T minus log S to 1e-14 relative (the old
    x / T - max(x / T) was 4.2e-4 off here, 1.2e-9 relative: the rounding of x / T, not of the gap)."""
    top = np.float32(2.7)
    below = np.nextafter(top, np.float32(0.0))
    x = np.array([[[top, below, 0.0]]], np.float32)
    t = 7e-13
    got = reference.draft_topk(x, 3, t)
    d = float((Fraction(float(below)) - Fraction(float(top))) / Fraction(t))   # the exact gap / T: -340597.97015
    assert got.topk_logprobs[0, 0, 0] == -math.log1p(math.exp(d))           # -0.0: exp(d) underflows
    assert got.topk_logprobs[0, 0, 1] == pytest.approx(d, rel=1e-14)


def test_logprob_floor_is_the_most_negative_float32():
    """A finite logit whose log-prob is below the float32 range gets -FLT_MAX, a -inf / NaN logit -inf."""
    big = float(np.finfo(np.float32).max)
    x = np.array([[[big, -big, np.nan, -np.inf, 0.0]]], np.float32)
    got = reference.draft_topk(x, 5, 1.0)
    assert got.topk_ids[0, 0].tolist() == [0, 4, 1, 2, 3]
    assert got.topk_logprobs[0, 0].tolist() == [0.0, -FLT_MAX, -FLT_MAX, -math.inf, -math.inf]
    # at the largest temperature the same gap (2 FLT_MAX, above the float32 range itself) is a moderate log-prob
    got = reference.draft_topk(x, 5, T_MAX)
    lp = got.topk_logprobs[0, 0]
    assert lp[2] == pytest.approx(-2 * big / T_MAX + lp[0], rel=1e-12)   # (x - M) / T - log S, log S = -lp[0]
    assert -10 < lp[2] < -7 and np.isneginf(lp[3]) and np.isneginf(lp[4])


def test_bf16_forms_agree():
    ml = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    bits = bf16.to_bits(rng.standard_normal((1, 2, 100)))
    a = reference.draft_topk(bits, 7)
    b = reference.draft_topk(bits.view(ml.bfloat16), 7)
    c = reference.draft_topk(bf16.from_bits(bits), 7)
    for x, y in ((a, b), (a, c)):
        assert np.array_equal(x.topk_ids, y.topk_ids) and np.array_equal(x.topk_logprobs, y.topk_logprobs)


@pytest.mark.parametrize("bad,match", [
    (dict(k=0), "k: 0"), (dict(k=11), "k: 11"), (dict(k=2.0), "k: expected an integer"),
    (dict(k=True), "k: expected an integer"),
    (dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e-40), "temperature"), (dict(temperature=1e39), "temperature"),
    (dict(temperature="1"), "temperature"),
])
def test_errors_name_the_argument(bad, match):
    args = dict(logits=np.zeros((1, 1, 10), np.float32), k=3) | bad
    with pytest.raises(ArgumentError, match=match):
        reference.draft_topk(**args)


def test_logits_errors():
    with pytest.raises(ArgumentError, match="logits: expected 3 dimensions"):
        reference.draft_topk(np.zeros((2, 10), np.float32), 1)
    with pytest.raises(ArgumentError, match="logits: expected a float dtype"):
        reference.draft_topk(np.zeros((1, 1, 10), np.int32), 1)
    with pytest.raises(ArgumentError, match="logits: V = 0"):
        reference.draft_topk(np.zeros((1, 1, 0), np.float32), 1)


def test_temperature_bounds():
    assert reference.temperature_arg(1.0)[:2] == (1.0, 1.0)
    assert reference.temperature_arg(2**126)[1] == 2.0**-126          # the smallest normal reciprocal
    for bad in (2.0**127, 4.0e-39):                                   # 1/T subnormal; log2(e)/T overflows
        with pytest.raises(ArgumentError, match="temperature"):
            reference.temperature_arg(bad)
    reference.temperature_arg(4.5e-39)


# ----------------------------------------------------------------------------- the launcher (no GPU)

from conftest import FakeCudaArray, LaunchLog  # noqa: E402
from ddtree_gen.ops.draft_topk.launch import launch as draft_topk, workspace_elems  # noqa: E402
from ddtree_gen.ops.draft_topk.plan import CHUNK, chunks  # noqa: E402
from ddtree_gen.launch.runtime import IsAligned  # noqa: E402


# fake_alloc (a launcher's own allocations, as fake arrays): tests/conftest.py


def _logits(b, dp, v, dtype=np.uint16, **kw):
    return FakeCudaArray((b, dp, v), dtype, **kw)


@pytest.mark.parametrize("v,dtype", [(129280, np.uint16), (163840, np.uint16), (262144, np.float32), (16384, np.uint16),
                                     (8192, np.float32), (1001, np.uint16), (7, np.float32)])
def test_launch_plan(spec, fake_alloc, v, dtype):
    """Stage 0 over rows x chunks, stage 1 over rows when a row has several chunks (then a workspace of
    workspace_elems int32); the scalars: V, k, chunks, bf16, the vector flag, 1/T and log2(e)/T."""
    ks = LaunchLog(spec)
    b, dp, k = 3, min(spec.max_depth, 15), min(spec.max_tree_size - 1, 7)
    name = "bf16" if dtype == np.uint16 else "float32"
    out = draft_topk(ks, _logits(b, dp, v, dtype), k, temperature=0.5)
    assert isinstance(out, DraftTopkOutput)
    c = chunks(v, name)
    assert c == -(-v // CHUNK[name]) and c <= 32
    assert [n for n, _ in ks.seen] == ["draft_topk"] * (1 + (c > 1))
    assert ks.seen[0][1]["grid"] == (b * dp * c,)
    a = ks.seen[0][1]["args"]
    assert [int(x) for x in a[1:5]] == [v, k, c, int(dtype == np.uint16)]
    assert int(a[5]) == (1 if v % (8 if dtype == np.uint16 else 4) == 0 else 0)   # 0x10000 is 16-byte aligned
    assert float(a[6]) == 2.0 and float(a[7]) == pytest.approx(2 * 1.4426950408889634, rel=1e-7)
    assert int(a[-1]) == 0
    shapes = [s for s, _ in fake_alloc]
    assert shapes[:2] == [(b, dp, k), (b, dp, k)]
    need = workspace_elems(b, dp, v, k, name)
    if c > 1:
        assert ks.seen[1][1]["grid"] == (b * dp,) and int(ks.seen[1][1]["args"][-1]) == 1
        assert shapes[2] == (need,) and need == 2 * b * dp * c * (k + 1)
        assert a[9] - a[8] == b * dp * c * k * 8          # the (max, sum) pairs after the candidates
    else:
        assert len(shapes) == 2 and need == 0


def test_launch_with_every_output_allocates_nothing(spec, fake_alloc):
    ks = LaunchLog(spec)
    b, dp, v, k = 2, 3, 50000, 5
    out = DraftTopkOutput(FakeCudaArray((b, dp, k), np.int32, ptr=1 << 30),
                          FakeCudaArray((b, dp, k), np.float32, ptr=(1 << 30) + 4096))
    ws = FakeCudaArray((workspace_elems(b, dp, v, k),), np.int32, ptr=1 << 31)
    got = draft_topk(ks, _logits(b, dp, v), k, out=out, workspace=ws)
    assert fake_alloc == [] and got.topk_ids is out.topk_ids
    assert ks.seen[0][1]["args"][8] == 1 << 31
    draft_topk(ks, _logits(0, dp, v), k, out=DraftTopkOutput(FakeCudaArray((0, dp, k), np.int32),
                                                             FakeCudaArray((0, dp, k), np.float32)))
    assert len(ks.seen) == 2                                   # B = 0: nothing launched


def _expect(spec, match, *args, **kw):
    with pytest.raises(ArgumentError, match=match):
        draft_topk(LaunchLog(spec), *args, **kw)


def test_argument_errors_name_the_argument(spec, fake_alloc):
    d, n = spec.max_depth, spec.max_tree_size
    _expect(spec, r"logits: D' = %d \(dimension 1\) must be in \[1, max_depth" % (d + 1), _logits(1, d + 1, 100), 3)
    _expect(spec, r"logits: D' = 0", _logits(1, 0, 100), 3)
    _expect(spec, r"k: %d must be in \[1, %d\]" % (n, n - 1), _logits(1, 2, 1000), n)
    _expect(spec, r"k: 0 must be in", _logits(1, 2, 1000), 0)
    _expect(spec, r"k: 5 is larger than the vocabulary, V = 4", _logits(1, 2, 4), 5)
    _expect(spec, r"k: expected an int", _logits(1, 2, 100), 2.0)
    _expect(spec, r"logits: V = 262145", _logits(1, 2, 262145), 3)
    _expect(spec, r"logits: dtype float16, expected bf16", _logits(1, 2, 100, np.float16), 3)
    _expect(spec, r"logits: dtype int32", _logits(1, 2, 100, np.int32), 3)
    _expect(spec, r"logits: 2 dimensions", FakeCudaArray((2, 100), np.uint16), 3)
    _expect(spec, r"logits: not C-contiguous", _logits(1, 2, 100, strides=(800, 2, 4)), 3)
    _expect(spec, r"logits: required", None, 3)
    for t in (0.0, -1.0, float("inf"), float("nan"), 1e-40, "1"):
        _expect(spec, r"temperature", _logits(1, 2, 100), 3, temperature=t)
    _expect(spec, r"out.topk_ids: shape", _logits(1, 2, 100), 3,
            out=DraftTopkOutput(FakeCudaArray((1, 2, 4), np.int32), FakeCudaArray((1, 2, 3), np.float32)))
    _expect(spec, r"out.topk_logprobs: dtype", _logits(1, 2, 100), 3,
            out=DraftTopkOutput(FakeCudaArray((1, 2, 3), np.int32), FakeCudaArray((1, 2, 3), np.int32)))
    _expect(spec, r"out: has no field 'topk_ids'", _logits(1, 2, 100), 3, out=object())
    _expect(spec, r"workspace: 3 int32 elements", _logits(1, 2, 100000), 3, workspace=FakeCudaArray((3,), np.int32))
    _expect(spec, r"workspace: dtype float32", _logits(1, 2, 100000), 3, workspace=FakeCudaArray((10**6,), np.float32))
    # also where the call needs no workspace (one chunk a row: V = 100), and on the rows schedule's path (none used)
    _expect(spec, r"workspace: dtype float32", _logits(1, 2, 100), 3, workspace=FakeCudaArray((10**6,), np.float32))
    _expect(spec, r"workspace: dtype int64", _logits(1, 2, 100), 3, workspace=FakeCudaArray((4,), np.int64))
    _expect(spec, r"out.topk_ids: on device 1", _logits(1, 2, 100), 3,
            out=DraftTopkOutput(FakeCudaArray((1, 2, 3), np.int32, ptr=1 << 41), FakeCudaArray((1, 2, 3), np.float32)))


def test_overlapping_outputs_are_refused(spec, fake_alloc):
    logits = _logits(1, 2, 100, ptr=1 << 30)
    _expect(spec, r"out.topk_ids: overlaps logits", logits, 3,
            out=DraftTopkOutput(FakeCudaArray((1, 2, 3), np.int32, ptr=(1 << 30) + 64),
                                FakeCudaArray((1, 2, 3), np.float32, ptr=1 << 32)))
    _expect(spec, r"out.topk_logprobs: overlaps out.topk_ids", logits, 3,
            out=DraftTopkOutput(FakeCudaArray((1, 2, 3), np.int32, ptr=1 << 32),
                                FakeCudaArray((1, 2, 3), np.float32, ptr=(1 << 32) + 4)))


def test_misaligned_rows_use_scalar_loads(spec, fake_alloc):
    ks = LaunchLog(spec)
    draft_topk(ks, _logits(1, 2, 4096, ptr=0x10002), 3)     # V a multiple of 8, the pointer 2 bytes off
    assert int(ks.seen[0][1]["args"][5]) == 0   # the flag is computed per call from the pointer: 0 here
    ks2 = LaunchLog(spec)
    from ddtree_gen.ops.draft_topk import launch as mod
    prep = mod._prepare(ks2, (_logits(1, 2, 4096), None, None, None), 3, 1.0, False)
    assert prep.steps[0].args[5] == IsAligned(0, 16)


# 210 rows: stage 2; 195: not; V = 49152 (3 chunks a row): not, at any batch; 65536 (4 chunks): stage 2
@pytest.mark.parametrize("rows_b,v", [(64, 129280), (14, 163840), (13, 129280), (8, 129280), (1, 1000), (64, 49152),
                                      (64, 65536)])
def test_launch_plan_rows_schedule(spec, fake_alloc, monkeypatch, rows_b, v):
    """The "rows" build (template constants ROWS = 1, no static shared memory): stage 2 alone, one block per row and
    no workspace, where the rows are at least ROWS_PER_SM x SMs and a row ROWS_MIN_CHUNKS chunks; else the chunks schedule's two
    stages and workspace."""
    from ddtree_gen.ops.draft_topk import launch as mod
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.draft_topk.plan import MIN_BLOCKS
    from ddtree_gen.build.variant import variant
    plan = variant(by_name("draft_topk"), spec, schedule="rows").plan()
    consts = plan.template_constants()
    assert consts["ROWS"] == 1 and consts["STATIC_SMEM"] == 0
    assert consts["DYNAMIC_SMEM"] * consts["MIN_BLOCKS"] <= 227 * 1024   # MIN_BLOCKS blocks fit an H100 / H200 SM
    ks = LaunchLog(spec)
    monkeypatch.setattr(ks, "constants", lambda name, device=None: consts)
    monkeypatch.setattr(mod, "sm_count", lambda device: 132)
    dp, k = min(spec.max_depth, 15), min(spec.max_tree_size - 1, 64)
    draft_topk(ks, _logits(rows_b, dp, v), k)
    rows, c = rows_b * dp, chunks(v, "bf16")
    if rows >= mod.ROWS_PER_SM * 132 and c >= mod.ROWS_MIN_CHUNKS:
        assert len(ks.seen) == 1 and ks.seen[0][1]["grid"] == (rows,)
        assert int(ks.seen[0][1]["args"][-1]) == 2
        assert int(ks.seen[0][1]["args"][8]) == 0 and int(ks.seen[0][1]["args"][9]) == 0   # no workspace
        # a workspace the call does not use: still refused for its dtype, before anything is launched
        ks2 = LaunchLog(spec)
        monkeypatch.setattr(ks2, "constants", lambda name, device=None: consts)
        with pytest.raises(ArgumentError, match=r"workspace: dtype float32"):
            draft_topk(ks2, _logits(rows_b, dp, v), k, workspace=FakeCudaArray((10**6,), np.float32))
        assert ks2.seen == []
        draft_topk(ks2, _logits(rows_b, dp, v), k, workspace=FakeCudaArray((1,), np.int32))   # int32: unused, fine
        assert len(ks2.seen) == 1 and int(ks2.seen[0][1]["args"][8]) == 0
    else:
        assert ks.seen[0][1]["grid"] == (rows * c,) and int(ks.seen[0][1]["args"][-1]) == 0
        assert len(ks.seen) == 1 + (c > 1)
        if c > 1:
            assert ks.seen[1][1]["grid"] == (rows,) and int(ks.seen[1][1]["args"][-1]) == 1


def test_schedule_and_min_blocks_options(spec):
    """The build options: schedule "rows" (the default) or "chunks", min_blocks "auto" (4 where they fit) or 1-4;
    their variant names, their template constants and shared memory, and clear errors (also for the options
    removed in issue 40: schedule "stream", row_end)."""
    from ddtree_gen.errors import BuildError, SpecError
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.draft_topk.plan import MIN_BLOCKS, SCHEDULES, plan
    from ddtree_gen.build.variant import variant
    kdef = by_name("draft_topk")
    assert SCHEDULES == ("chunks", "rows")
    rows, ch = variant(kdef, spec), variant(kdef, spec, schedule="chunks")
    assert rows.stem == "draft_topk" and ch.stem == "draft_topk.chunks"
    assert variant(kdef, spec, min_blocks=2).stem == "draft_topk.mb2"
    assert variant(kdef, spec, schedule="chunks", min_blocks=2).stem == "draft_topk.chunks.mb2"
    cr, cc = rows.plan().template_constants(), ch.plan().template_constants()
    assert cr["ROWS"] == 1 and cc["ROWS"] == 0 and cr["MIN_BLOCKS"] == MIN_BLOCKS
    assert not {"STREAM", "ROW_END_BLOCK", "ECAP"} & set(cr)
    assert cr["BCAP"] == 16 * cr["KP"]   # the block's candidates: < 8 per entry above the k-th, k ties a warp
    assert cr["DYNAMIC_SMEM"] * MIN_BLOCKS <= 227 * 1024
    assert cc["STATIC_SMEM"] < cr["DYNAMIC_SMEM"] and cc["DYNAMIC_SMEM"] == 0
    with pytest.raises(SpecError, match="schedule 'stream', one of chunks, rows"):
        variant(kdef, spec, schedule="stream").plan()
    with pytest.raises(SpecError, match="schedule 'nope'"):
        variant(kdef, spec, schedule="nope").plan()
    with pytest.raises(BuildError, match="no knob 'row_end' \\(its knobs: schedule, min_blocks\\)"):
        variant(kdef, spec, row_end="warps")
    with pytest.raises(SpecError, match="no build option 'row_end', its options: schedule, min_blocks"):
        plan(spec, {"schedule": "rows", "row_end": "block", "min_blocks": "auto"})
    with pytest.raises(SpecError, match="min_blocks 5"):
        variant(kdef, spec, min_blocks=5).plan()

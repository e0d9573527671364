"""draft_topk without a GPU: the numpy reference (docs/contract.md section 5a) against an independent
per-row implementation and on its edge cases (ties, +-0, NaN, -inf and +inf rows, k = V, temperature),
its errors, and the launcher's checks and launch plan on stand-in arrays."""
from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

from ddtree_gen import bf16, reference
from ddtree_gen.errors import ArgumentError
from ddtree_gen.types import DraftTopkOutput


def _row_oracle(row, k, t):
    """One row the slow way: python floats, heapq on (-value, id), math.fsum for the normaliser."""
    vals = [(-math.inf if math.isnan(v) else float(v)) for v in row]
    best = heapq.nsmallest(k, ((-v, i) for i, v in enumerate(vals)))
    ids = [i for _, i in best]
    m = max(vals)
    if m == -math.inf:
        return ids, [-math.inf] * k
    if m == math.inf:
        n = sum(v == math.inf for v in vals)
        return ids, [-math.log(n) if vals[i] == math.inf else -math.inf for i in ids]
    lse = m / t + math.log(math.fsum(math.exp(v / t - m / t) for v in vals))
    return ids, [vals[i] / t - lse for i in ids]


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
    assert reference.temperature_arg(1.0) == (1.0, 1.0)
    assert reference.temperature_arg(2**126)[1] == 2.0**-126          # the smallest normal reciprocal
    with pytest.raises(ArgumentError):
        reference.temperature_arg(2.0**127)

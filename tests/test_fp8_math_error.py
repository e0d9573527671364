"""scripts/fp8_math_error.py (the FP8-products emulation, no GPU): its rounding helpers keep e4m3's error bounds, and
its modes order as the design in docs/perf/journal-fp8.md relies on (a small shape, a fixed seed)."""
import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fp8_math_error.py"


def _module():
    spec = importlib.util.spec_from_file_location("fp8_math_error", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_row_quantization_keeps_e4m3_bounds():
    m = _module()
    rng = np.random.default_rng(1)
    q = rng.standard_normal((16, 576)) * np.exp(rng.uniform(-3, 3, (16, 1)))
    whole = [slice(0, 576)]
    q1 = m.quantize_rows(q, whole)
    amax = np.abs(q).max(axis=1, keepdims=True)
    normal = np.abs(q) >= 2.0**-6 * amax / 448.0
    # e4m3 rounds to 3 mantissa bits: a relative error of at most 2^-4 where the value is normal, and the row's
    # largest magnitude is exact (it maps to 448)
    assert np.all(np.abs(q1 - q)[normal] <= 2.0**-4 * np.abs(q)[normal] * (1 + 1e-12))
    assert np.allclose(np.abs(q1).max(axis=1), amax[:, 0], rtol=1e-15, atol=0)
    # two terms (the residual rounded again, a scale of its own): the error shrinks by 2^-4 again at least (the
    # residual's small values are subnormal in its own scale, so not by 2^-4 everywhere)
    q2 = q1 + m.quantize_rows(q - q1, whole)
    rms = lambda x: np.sqrt(np.mean(x ** 2))   # noqa: E731
    assert np.abs(q2 - q).max() <= 2.0**-4 * np.abs(q1 - q).max()
    assert rms(q2 - q) < 2.0**-5 * rms(q1 - q)
    assert np.array_equal(m.quantize_rows(np.zeros((2, 576)), whole), np.zeros((2, 576)))


def test_modes_order_as_the_design_says():
    m = _module()
    res = {mode: (rms, worst, lse) for mode, rms, worst, lse in m.run(heads=1, length=512, seed=0)}
    assert set(res) == set(m.MODES)
    exact = res["bf16 P"][0]
    assert exact < 3e-3                                   # today's path: bf16 P alone
    assert res["S hi+lo"][0] < 4 * exact                  # two FP8 terms for S: near the exact path
    assert res["P e4m3 448"][0] < res["P e4m3"][0]        # P scaled up before its rounding: small P stay normal
    assert res["S e4m3 x1"][0] > 10 * exact               # one FP8 term for S: an order of magnitude more
    assert all(np.isfinite(v).all() for v in res.values())

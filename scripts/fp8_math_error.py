#!/usr/bin/env python
"""How far an FP8-products tree_verify would be from the exact answer: a numpy emulation, no GPU (issue 22's
moonshot; docs/perf/journal-fp8.md "FP8 products: the design for the next session").

One request's 65 queries x H heads against L prefix keys of an e4m3 cache (kv_scale mapping the cache's largest
magnitude to 448), every query seeing every key. The reference is float64 attention on the dequantized cache with the
bf16 queries (what the exact kernels compute, to their rounding). Each mode is the flash loop over 64-key tiles
(running maximum, rescaled accumulators) with some operands rounded as a kernel would round them:
  bf16 P        today's exact path: S exact, P rounded to bf16 before P.V (the bf16 kernels' only rounding here)
  P e4m3        S exact, P in [0, 1] rounded to e4m3 (P.V in FP8)
  P e4m3 448    the same with P scaled by 448 before the rounding (and back after: a power-of-two 256 would be free
                in the kernel, folded into the row sum): small P stay normal instead of subnormal / flushed
  S e4m3 x1     Q rounded to e4m3 with one scale per (query, head) row of 576 (amax / 448); P bf16
  S e4m3 x2     the same with two scales a row (512 latent dims, 64 rope dims); P bf16
  S x2 + P      S e4m3 x2 and P e4m3: both products in FP8
  S x2 + P448   S e4m3 x2 and P e4m3 448
  S hi+lo       Q as two e4m3 terms, q ~ hi + lo (lo: the residual q - hi, rounded with a scale of its own, per row):
                two FP8 products for S (K is exact e4m3), P bf16
  S hi+lo P448  S hi+lo and P e4m3 448
The row sum l is taken of the rounded P (the weights P.V uses). Per mode: the output's relative error per row
(||o - ref|| / ||ref||: the RMS and the worst over rows) and the worst lse error. The inputs: q ~ N(0, 1) with 4
latent channels x 8 (outliers), q_pe ~ 2 N(0, 1); the cache N(0, 1), with 8 keys per query row planted along its
query (a few large logits); softmax_scale 1 / sqrt(192).
When: before choosing the FP8 mode's numerical bar; the kernel's own error is measured against this.
Run: PYTHONPATH=. python scripts/fp8_math_error.py [--heads 8] [--lens 4096 16384] [--seed 0]
"""
from __future__ import annotations

import argparse

import numpy as np

R, P, NQ, TILE = 512, 64, 65, 64
MODES = ("bf16 P", "P e4m3", "P e4m3 448", "S e4m3 x1", "S e4m3 x2", "S x2 + P", "S x2 + P448", "S hi+lo",
         "S hi+lo P448")


def e4m3(x):
    """x rounded to e4m3 (nearest, ties to even; |x| <= 448 here), as float64."""
    from ddtree_gen import fp8
    return fp8.to_float64(fp8.from_float(np.clip(x, -fp8.MAX, fp8.MAX)))


def bf16(x):
    from ddtree_gen import bf16 as b
    return b.from_bits(b.to_bits(x)).astype(np.float64)


def quantize_rows(q, parts):
    """q [rows, D] rounded to e4m3 with one scale per row and part (parts: column slices): the values q stands for
    after the rounding (scale x e4m3(q / scale), scale = amax / 448)."""
    out = np.empty_like(q)
    for sl in parts:
        amax = np.abs(q[:, sl]).max(axis=1, keepdims=True)
        scale = np.where(amax > 0, amax / 448.0, 1.0)
        out[:, sl] = e4m3(q[:, sl] / scale) * scale
    return out


def flash(q, k, v, scale, round_p):
    """Attention of q [rows, D] over k [L, D], v [L, R] by 64-key tiles: o [rows, R], lse [rows] (natural log)."""
    rows, length = q.shape[0], k.shape[0]
    m = np.full(rows, -np.inf)
    l = np.zeros(rows)
    o = np.zeros((rows, v.shape[1]))
    for t0 in range(0, length, TILE):
        s = (q @ k[t0:t0 + TILE].T) * scale
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)
        p = round_p(np.exp(s - m_new[:, None]))
        l = l * alpha + p.sum(axis=1)
        o = o * alpha[:, None] + p @ v[t0:t0 + TILE]
        m = m_new
    return o / l[:, None], m + np.log(l)


def run(heads, length, seed):
    rng = np.random.default_rng(seed)
    rows = NQ * heads
    qn = rng.standard_normal((rows, R))
    qn[:, rng.choice(R, 4, replace=False)] *= 8.0
    q = bf16(np.concatenate([qn, 2.0 * rng.standard_normal((rows, P))], axis=1))
    x = rng.standard_normal((length, R + P))
    planted = rng.choice(length, (rows, 8))                        # a few keys along each query: large logits
    x[planted.ravel()] += 0.05 * np.repeat(q, 8, axis=0)
    kv_scale = np.abs(x).max() / 448.0
    k = e4m3(x / kv_scale) * kv_scale                              # the dequantized cache: exact in every mode
    v = k[:, :R]
    scale = 1.0 / np.sqrt(192.0)
    s = (q @ k.T) * scale                                          # the float64 reference
    mx = s.max(axis=1, keepdims=True)
    w = np.exp(s - mx)
    ref_o = (w @ v) / w.sum(axis=1, keepdims=True)
    ref_lse = mx[:, 0] + np.log(w.sum(axis=1))
    whole, split = [slice(0, R + P)], [slice(0, R), slice(R, R + P)]
    q1, q2 = quantize_rows(q, whole), quantize_rows(q, split)
    q_hilo = q1 + quantize_rows(q - q1, whole)
    p448 = lambda x: e4m3(x * 448.0) / 448.0   # noqa: E731
    qs = {"bf16 P": q, "P e4m3": q, "P e4m3 448": q, "S e4m3 x1": q1, "S e4m3 x2": q2, "S x2 + P": q2,
          "S x2 + P448": q2, "S hi+lo": q_hilo, "S hi+lo P448": q_hilo}
    rp = {"bf16 P": bf16, "P e4m3": e4m3, "P e4m3 448": p448, "S e4m3 x1": bf16, "S e4m3 x2": bf16,
          "S x2 + P": e4m3, "S x2 + P448": p448, "S hi+lo": bf16, "S hi+lo P448": p448}
    table = []
    for mode in MODES:
        o, lse = flash(qs[mode], k, v, scale, rp[mode])
        rel = np.linalg.norm(o - ref_o, axis=1) / np.linalg.norm(ref_o, axis=1)
        table.append((mode, np.sqrt(np.mean(rel ** 2)), rel.max(), np.abs(lse - ref_lse).max()))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=8, help="heads (query rows: 65 x heads)")
    ap.add_argument("--lens", type=int, nargs="*", default=[4096, 16384], help="prefix lengths L")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.heads < 1 or any(n < TILE for n in args.lens):
        ap.error(f"--heads must be >= 1 and every --lens >= {TILE}")
    print(f"FP8-products emulation: {NQ} queries x {args.heads} heads, seed {args.seed}; error against float64 on the "
          f"dequantized cache")
    print(f"{'L':>6}  {'mode':<12}  {'rel. err RMS':>12}  {'rel. err max':>12}  {'lse err max':>11}")
    for length in args.lens:
        for mode, rms, worst, lse in run(args.heads, length, args.seed):
            print(f"{length:>6}  {mode:<12}  {rms:>12.2e}  {worst:>12.2e}  {lse:>11.2e}")


if __name__ == "__main__":
    main()

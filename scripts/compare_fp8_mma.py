#!/usr/bin/env python
"""FP8 products (the fp8 seesaw's knob fp8_mma: S and P.V in e4m3 wgmma) against the exact paths, in one process: per
shape the bf16 default (tree_verify, impl auto), the fp8 default (fp8_path=None: the dequantize path), the fused fp8
kernel (exact bf16 math on converted tiles) and each fp8_mma mode (Q and P in 1 or 2 e4m3 terms); CUDA-graph medians,
speed against bf16, and the error of every fp8 build against the float64 reference on the dequantized cache (first
requests, a few heads): the worst (request, row, head) of ||out - ref|| / ||ref||, its RMS over rows, and the worst
|lse - ref|. --ablate adds builds with parts left out (timing only). The modes on the GPU tests' irregular batches (rows written,
untouched, within the modes' bars): tests/test_gpu_tree_verify.py::test_fp8_mma_builds.
When: on a GPU after a change to templates/tree_verify_seesaw.cu.j2's F8M path (docs/perf.md, "FP8 products, built").
Run: PYTHONPATH=. python scripts/compare_fp8_mma.py [--shapes B,H,L ...] [--modes q1p1 ...] [--vt-stages 2 3] [--ablate 0 4]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

# issue 22's table
SHAPES = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (64, 16, 2048), (8, 64, 4096), (8, 128, 4096), (8, 64, 16384)]
MODES = ("q1p1", "q2p1", "q2p2")


def errors(out, lse, ref, n, heads):
    """(worst, RMS) of ||out - ref|| / ||ref|| over the (request, row, head) of the first n requests, and the worst
    |lse - ref| (NaN anywhere: inf)."""
    from ddtree_gen import bf16
    o = bf16.from_bits(np.asarray(out)[:n][:, :, heads]).astype(np.float64)
    lo = np.asarray(lse)[:n][:, :, heads].astype(np.float64)
    if np.isnan(o).any() or np.isnan(lo).any():
        return float("inf"), float("inf"), float("inf")
    rel = np.linalg.norm(o - ref.out, axis=-1) / np.maximum(np.linalg.norm(ref.out, axis=-1), 1e-30)
    return float(rel.max()), float(np.sqrt((rel ** 2).mean())), float(np.abs(lo - ref.lse).max())


def shape_setup(base, b: int, h: int, L: int):
    """One shape's bf16 and fp8 specs (H variants of `base`) and inputs (Nq = 65, every request L keys), its FLOPs and
    the two default calls: (fp8 spec, fp8 inputs, flops, {"bf16 default": ..., "fp8 default": ...}) with each call
    (fn, inputs, kwargs). The fp8 kernel set holds the chunks-grid dequantize path (not its parts build)."""
    from ddtree_gen.bench.specs import spec_variant
    from ddtree_gen.bench.timing import verify_flops
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load
    bf, f8 = spec_variant(base, h, "bf16"), spec_variant(base, h, "fp8_e4m3")
    lens = np.full(b, L)
    xb, x8 = verify_inputs(bf, b, lens, 65), verify_inputs(f8, b, lens, 65)
    kb = load(bf, kernels=["tree_verify_wgmma", "tree_verify_wgmma_parts", "tree_verify_mma_combine"])
    k8 = load(f8, kernels=["tree_verify_wgmma", "tree_verify_mma_combine", "kv_dequant", "tree_verify_wgmma_dequant"])
    return f8, x8, verify_flops(bf, lens, 65), {"bf16 default": (kb.tree_verify, xb, {}),
                                                "fp8 default": (k8.tree_verify, x8, {})}


def time_and_check(calls: dict, x8: dict, config: str, flops: float, peak: float) -> list:
    """Time each call (name -> (fn, inputs, kwargs); the first is the baseline of the speed column) by CUDA-graph
    replay, and the error of each call on the fp8 inputs x8 (but ablations) against the float64 reference of the first
    requests (at most 2), heads 0 and H - 1; the table's rows."""
    import cupy
    from ddtree_gen import reference
    from ddtree_gen.bench.timing import graph_time_ms
    b, h = x8["q_nope"].shape[0], x8["q_nope"].shape[2]
    n = min(b, 2)
    heads = np.array(sorted({0, h - 1}))
    host = {k: (cupy.asnumpy(v) if hasattr(v, "device") else v) for k, v in x8.items()}
    sub = {**host, "q_nope": host["q_nope"][:n][:, :, heads], "q_pe": host["q_pe"][:n][:, :, heads],
           "block_table": host["block_table"][:n], "prefix_lens": host["prefix_lens"][:n],
           "q_lens": host["q_lens"][:n], "tree_mask": host["tree_mask"][:n]}
    ref = reference.tree_verify(**sub)
    times, rows, base = {}, [], next(iter(calls))
    for name, (fn, x, kw) in calls.items():
        res = fn(**x, **kw)
        times[name] = graph_time_ms(lambda fn=fn, x=x, kw=kw, res=res: fn(**x, **kw, out=res.out, lse=res.lse),
                                    per_graph=5, reps=10)
        err = (errors(cupy.asnumpy(res.out), cupy.asnumpy(res.lse), ref, n, heads)
               if x is x8 and "ablate" not in name else None)
        tf = flops / (times[name] * 1e-3) / 1e12
        rows.append([config, name, f"{times[name]:.4f}", f"{100 * tf / peak:.1f}%", f"{times[base] / times[name]:.2f}x",
                     *((f"{err[0]:.2e}", f"{err[1]:.2e}", f"{err[2]:.2e}") if err else ("-", "-", "-"))])
        print(rows[-1], flush=True)
    return rows


def variants(f8, modes, stages, ablates=(0,)):
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.plans import by_name
    from ddtree_gen.plans.split_kv import COMBINE
    from ddtree_gen.plans.variant import variant
    wg = by_name("tree_verify_wgmma")
    out = {}
    for m in modes:
        for vt in stages:
            for ab in ablates:
                name = f"fp8_mma {m}" + (f" vt{vt}" if len(stages) > 1 else "") + (f" ablate{ab}" if ab else "")
                out[name] = variant_set([variant(wg, f8, fp8_mma=m, rescale="lazy4", vt_stages=vt, ablate=ab)],
                                        also=[COMBINE])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", help="B,H,L triples (default: issue 22's table)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), help=f"fp8_mma modes (default {' '.join(MODES)})")
    ap.add_argument("--vt-stages", nargs="*", type=int, default=[2], help="V^T buffers of the producer (2, 3)")
    ap.add_argument("--ablate", nargs="*", type=int, default=[0],
                    help="ablation bits (0: none; 1 no S, 2 no P.V, 4 no V^T transpose: wrong results, for timing)")
    ap.add_argument("--spec", default="kimi-k2.6-tp8", help="the bf16 spec whose fp8 variants are built")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True, torch=True)
    from ddtree_gen.bench.timing import measured_peak_tflops, print_table
    from ddtree_gen.spec import find_spec

    base = find_spec(args.spec)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    peak = measured_peak_tflops()
    rows = []
    for b, h, L in shapes:
        t0 = time.perf_counter()
        f8, x8, flops, calls = shape_setup(base, b, h, L)
        calls["fp8 fused"] = (calls["fp8 default"][0], x8, {"fp8_path": "fused"})
        for name, ks in variants(f8, args.modes, args.vt_stages, args.ablate).items():
            calls[name] = (ks.tree_verify_wgmma, x8, {})
        rows += time_and_check(calls, x8, f"B={b} H={h} L={L}", flops, peak)
        print(f"B={b} H={h} L={L}: {time.perf_counter() - t0:.1f} s", flush=True)
    print_table(f"tree_verify of {base.name}'s H variants, Nq=65: bf16 default, fp8 default (dequantize path), the "
                f"fused fp8 kernel and the fp8_mma modes; CUDA-graph medians; % of the bf16 matmul peak measured in "
                f"this run ({peak:.0f} TFLOP/s); speed = bf16 default ms / ms; errors against float64 on the "
                f"dequantized cache (first {2} requests, heads 0 and H-1)",
                ["config", "build", "ms", "% peak", "speed", "worst rel", "rms rel", "worst dlse"], rows, None, None)


if __name__ == "__main__":
    main()

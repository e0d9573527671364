#!/usr/bin/env python
"""The dequantize path's attention kernel (tree_verify_wgmma_dequant) in other builds, end to end, in one process: per
shape the bf16 default (tree_verify, impl auto: the chunks or the parts grid, as the launcher picks), the fp8 default
without the parts-grid build loaded (fp8_path=None: kv_dequant, then tree_verify_wgmma_dequant, the chunks grid in the
fused kernel's slab order: the default before tree_verify_wgmma_dequant_parts shipped), and the same pre-pass
followed by other builds of the attention kernel:
* "bf16 order": the bf16 default's slab order (rope slab with the late group, S in loaded order) instead of the fused
  fp8 kernel's (rope_early, s_order "slab"): the bf16 default's build on the workspace;
* "parts" / "parts, bf16 order": the balanced parts grid (grid "parts"), which the bf16 default runs at H <= 8, B >= 8;
* "parts, inline": the parts build with convert "inline" (no pre-pass: its converter warpgroup converts the pages);
  with --inline-ablations also its ablations (INLINE_ABLATIONS: wrong results on purpose, no error column).
CUDA-graph medians, speed against bf16, and each build's error against the float64 reference on the dequantized
cache (first 2 requests, heads 0 and H - 1: worst and RMS of ||out - ref|| / ||ref||, worst |lse - ref|).
When: on an H100 / H200, to choose the dequantize path's build (docs/perf.md, "The dequantize path on the bf16
default's build").
Run: PYTHONPATH=.:scripts python3 scripts/compare_dequant_builds.py [--shapes B,H,L ...] [--spec kimi-k2.6-tp8]
"""
from __future__ import annotations

import argparse
import time

from compare_fp8_mma import SHAPES, shape_setup, time_and_check

BUILDS = {"bf16 order": {"rope_early": False, "s_order": "loaded"},
          "parts": {"grid": "parts"},
          "parts, bf16 order": {"grid": "parts", "rope_early": False, "s_order": "loaded"}}
# builds of the parts kernel (tree_verify_wgmma_dequant_parts) itself
PARTS_BUILDS = {"parts, inline": {"convert": "inline"}}
# the inline build's ablations (templates/tree_verify_seesaw.cu.j2 ABLATE with INLINE): bit 2 no conversion, bit 3 the
# producer waits on no counter, bit 4 the computing warpgroups issue their TMA loads themselves (no producer; the runs
# of docs/bench/compare_inline_convert.txt call it "relay", the first version's name)
INLINE_ABLATIONS = {"no conversion, no waits, no producer": 28, "no conversion, no waits": 12, "no waits": 8,
                    "no conversion": 4}
PARTS_MAX_H = 16     # the parts builds are timed at H <= 16 only (at H >= 64 a request has 65+ row tiles: 1-2 parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", help="B,H,L triples (default: issue 22's table)")
    ap.add_argument("--spec", default="kimi-k2.6-tp8", help="the bf16 spec whose H variants are built")
    ap.add_argument("--inline-ablations", action="store_true", help="also time the inline build's ablations")
    ap.add_argument("--only-parts", action="store_true", help="time the defaults and the parts builds only")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True, torch=True)
    from ddtree_gen.bench.timing import measured_peak_tflops, print_table
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.plans import by_name
    from ddtree_gen.plans.split_kv import COMBINE
    from ddtree_gen.plans.tree_verify_wgmma import PARTS_MIN_B
    from ddtree_gen.plans.variant import variant
    from ddtree_gen.spec import find_spec

    base = find_spec(args.spec)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    peak = measured_peak_tflops()
    rows = []
    for b, h, L in shapes:
        t0 = time.perf_counter()
        f8, x8, flops, calls = shape_setup(base, b, h, L)
        dq, dqp = by_name("tree_verify_wgmma_dequant"), by_name("tree_verify_wgmma_dequant_parts")
        for name, knobs in BUILDS.items():
            if ("parts" in name and h > PARTS_MAX_H) or (args.only_parts and "parts" not in name):
                continue
            vs = variant_set([variant(dq, f8, **knobs)], also=[COMBINE, "kv_dequant", "tree_verify_wgmma"])
            calls[f"dequant {name}"] = (vs.tree_verify, x8, {"fp8_path": "dequant"})
        extra = {f"parts, inline, ablate{bits} ({a})": {"convert": "inline", "ablate": bits}
                 for a, bits in INLINE_ABLATIONS.items()} if args.inline_ablations else {}
        for name, knobs in {**PARTS_BUILDS, **extra}.items():
            if not dqp.builds_for(f8) or b < PARTS_MIN_B:
                continue
            vs = variant_set([variant(dqp, f8, **knobs)], also=[COMBINE, "kv_dequant", "tree_verify_wgmma"])
            calls[f"dequant {name}"] = (vs.tree_verify_wgmma_dequant_parts, x8, {})
        rows += time_and_check(calls, x8, f"B={b} H={h} L={L}", flops, peak)
        print(f"B={b} H={h} L={L}: {time.perf_counter() - t0:.1f} s", flush=True)
    print_table(f"tree_verify of {base.name}'s H variants, Nq=65: the bf16 default, the fp8 default (dequantize path) "
                f"and the dequantize path with other builds of its attention kernel; CUDA-graph medians; % of the bf16 "
                f"matmul peak measured in this run ({peak:.0f} TFLOP/s); speed = bf16 default ms / ms; errors against "
                f"float64 on the dequantized cache (first 2 requests, heads 0 and H-1)",
                ["config", "build", "ms", "% peak", "speed", "worst rel", "rms rel", "worst dlse"], rows, None, None)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""tree_verify_wgmma with an fp8 (e4m3) cache, its builds side by side with the bf16 seesaw on the same shapes, in one
process: the fp8 seesaw (the default: a converter warpgroup turns the e4m3 tiles into bf16 slabs), the same with
the conversion left out (ablate bit 2: wrong results on purpose; what the conversion costs), the fp8 lockstep
kernel (the default before), and the bf16 seesaw with and without rope_early (the fp8 seesaw's slab order);
--sync adds the converter's synchronisations (convert_sync "slab", "lean", "group", "pairs"), --ablate builds with its fences or
its arithmetic left out (ablate bits 3, 4; wrong results on purpose), --no-lockstep leaves the lockstep build out.
Prints per shape the CUDA-graph times, % of the bf16 matmul peak measured in the same run, fp8 speed (bf16 ms /
fp8 ms) and how far each fp8 build's output is from the fp8 lockstep one's (relative, per row, the worst row).
When: on a GPU after a change to templates/tree_verify_seesaw.cu.j2's fp8 path (docs/perf/journal-fp8.md, "FP8 on the seesaw").
Run: PYTHONPATH=. python scripts/compare_fp8.py [--shapes B,H,L ...]
"""
from __future__ import annotations

import argparse

import numpy as np

# issue 22's table
SHAPES = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (64, 16, 2048), (8, 64, 4096), (8, 128, 4096), (8, 64, 16384)]


def main() -> None:
    from ddtree_gen.bench.compare import parse_shape, rel_rows, to_host
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", type=parse_shape, metavar="B,H,L",
                    help="B,H,L triples (default: issue 22's table)")
    ap.add_argument("--sync", action="store_true", help="also the converter's convert_sync modes")
    ap.add_argument("--ablate", action="store_true", help="also the converter without fences / without arithmetic")
    ap.add_argument("--no-lockstep", action="store_true", help="leave out the fp8 lockstep build")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True, torch=True)
    from ddtree_gen.bench.specs import SPEC_BY_HEADS, spec_variant
    from ddtree_gen.bench.timing import graph_time_ms, measured_peak_tflops, verify_flops
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load, variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.build.variant import variant
    from ddtree_gen.spec import find_spec

    shapes = args.shapes or SHAPES
    peak = measured_peak_tflops()
    wg = by_name("tree_verify_wgmma")
    rows = []
    for b, h, L in shapes:
        bf = find_spec(SPEC_BY_HEADS[h])
        f8 = spec_variant(bf, h, "fp8_e4m3")
        def fp8(**knobs):
            return variant_set([variant(wg, f8, **knobs)], also=[COMBINE]), True
        builds = {   # name -> (kernel set, is fp8)
            "bf16 seesaw": (load(bf, kernels=["tree_verify_wgmma", COMBINE]), False),
            "bf16 seesaw rope_early": (variant_set([variant(wg, bf, rope_early=True)], also=[COMBINE]), False),
            "fp8 seesaw": (load(f8, kernels=["tree_verify_wgmma", COMBINE]), True),
            "fp8 seesaw no conversion": fp8(ablate=4, convert_sync="slab"),   # the ablations are the per-slab loop's
        }
        if args.sync:
            for mode in ("slab", "lean", "group", "pairs"):
                builds[f"fp8 seesaw sync {mode}"] = fp8(convert_sync=mode)
        if args.ablate:
            for mode in ("slab", "group"):
                builds[f"fp8 {mode} no fence"] = fp8(convert_sync=mode, ablate=8)
                builds[f"fp8 {mode} no arithmetic"] = fp8(convert_sync=mode, ablate=16)
        if not args.no_lockstep:
            builds["fp8 lockstep"] = fp8(schedule="lockstep", tma=False)
        lens = np.full(b, L)
        xs = {False: verify_inputs(bf, b, lens, 65), True: verify_inputs(f8, b, lens, 65)}
        flops = verify_flops(bf, lens, 65)
        times, outs = {}, {}
        for name, (ks, is8) in builds.items():
            x = xs[is8]
            res = ks.tree_verify_wgmma(**x)
            outs[name] = to_host(res.out)
            times[name] = graph_time_ms(lambda ks=ks, res=res, x=x: ks.tree_verify_wgmma(**x, out=res.out, lse=res.lse),
                                        per_graph=5, reps=10)
        ref = outs.get("fp8 lockstep", outs["fp8 seesaw"])
        for name, ms in times.items():
            tf = flops / (ms * 1e-3) / 1e12
            diff = f"{rel_rows(outs[name], ref):.1e}" if builds[name][1] and " no " not in name else "-"
            speed = f"{times['bf16 seesaw'] / ms:.2f}x" if builds[name][1] else "-"
            rows.append((f"B={b} H={h} L={L}", name, f"{ms:.4f}", f"{100 * tf / peak:.1f}%", speed, diff))
            print(rows[-1], flush=True)
        print(f"B={b} H={h} L={L}: fp8 seesaw output finite: {bool(np.isfinite(outs['fp8 seesaw']).all())}", flush=True)
    print(f"\nmeasured bf16 peak {peak:.0f} TFLOP/s; CUDA-graph replay medians; fp8 speed = bf16 seesaw ms / ms; "
          f"diff: worst-row relative out against the fp8 lockstep build (without it: the fp8 seesaw)")
    print(f"{'config':<18} {'kernel':<28} {'ms':>8} {'% peak':>7} {'fp8 speed':>9}  diff")
    for r in rows:
        print(f"{r[0]:<18} {r[1]:<28} {r[2]:>8} {r[3]:>7} {r[4]:>9}  {r[5]}")


if __name__ == "__main__":
    main()

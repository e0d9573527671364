#!/usr/bin/env python
"""The producer warpgroup at page 64 (issue 45): on shapes drawn from served classes (bench/shapes.draw, the sweep's
draw), tree_verify's default call against the same schedule (grid and piece count: ks.tree_verify_schedule) with
page_loads "producer" (the loads by a third warpgroup; on the parts grid each segment's Q and first tiles loaded
under the previous segment's epilogue) and FlashMLA's dense decode, in one process, CUDA-graph replay medians; the
two builds' outputs bit for bit (the same tiles in the same order). Then the worst and median of each against
FlashMLA, and of producer / default. FlashMLA's package on PYTHONPATH (docs/benchmarks.md), else its columns are left
out. Besides the draw, three fixed shapes of the issue's worst class, many short requests (B = 8, Nq = 24, 6k keys
each: 1.15x FlashMLA; B = 24..64 with 0.5k-6k keys: 1.13-1.15x), where each part of the parts grid walks several
segments.
When: on a GPU after a change to the producer (templates/tree_verify_seesaw.cu.j2, PRODUCER), to decide
wgmma.DEFAULT_PAGE_LOADS["tma_tiles"].
Run: PYTHONPATH=. python scripts/compare_producer.py [--seed 47] [--count 12]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

# (class, B, H, Nq, lens) of the worst class: the parts grid's blocks walk several short segments
FIXED = [("equal", 8, 8, 24, (6144,) * 8), ("ragged-many", 32, 8, 28, tuple(int(x) for x in np.linspace(500, 6000, 32))),
         ("equal", 64, 16, 24, (2048,) * 64)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--seed", type=int, default=47, help="the draw's seed (default 47: not one the project has run)")
    ap.add_argument("--count", type=int, default=12, help="shapes drawn (default 12)")
    a = ap.parse_args()
    if a.count < 1:
        print("error: --count must be at least 1", file=sys.stderr)
        return 2
    from ddtree_gen import needs
    needs.script_requires(__file__)
    import cupy

    from ddtree_gen.bench import shapes
    from ddtree_gen.bench.peers import flashmla_peers
    from ddtree_gen.bench.specs import SPEC_BY_HEADS
    from ddtree_gen.bench.timing import graph_time_ms
    from ddtree_gen.bench.tree_verify import SWEEP_KERNELS
    from ddtree_gen.build.variant import variant
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load, variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.spec import find_spec
    rows, vs_fm, vs_default = [], {"default": [], "producer": []}, []
    for shp in [shapes.Shape(*f) for f in FIXED] + shapes.draw(a.seed, a.count):
        spec = find_spec(SPEC_BY_HEADS[shp.h])
        ks = load(spec, kernels=list(SWEEP_KERNELS))
        x = verify_inputs(spec, shp.b, np.asarray(shp.lens), shp.nq, seed=a.seed)
        plan = ks.tree_verify_schedule(shp.b, shp.nq, x["block_table"].shape[1], device=x["q_nope"].device.id)
        if not plan.kernel.startswith("tree_verify_wgmma"):
            print(f"{shp.label()}: {plan.kernel} runs, not the seesaw: skipped", flush=True)
            continue
        v = variant(by_name("tree_verify_wgmma"), spec, grid="parts" if plan.grid == "parts" else "chunks",
                    page_loads="producer")
        kp = variant_set([v], also=[COMBINE])
        d = ks.tree_verify(**x)
        p = kp.tree_verify_wgmma(**x, num_splits=plan.pieces)
        same = bool((cupy.asnumpy(d.out) == cupy.asnumpy(p.out)).all()
                    and (cupy.asnumpy(d.lse).view(np.uint32) == cupy.asnumpy(p.lse).view(np.uint32)).all())
        t = {"default": graph_time_ms(lambda: ks.tree_verify(**x, out=d.out, lse=d.lse)),
             "producer": graph_time_ms(lambda: kp.tree_verify_wgmma(**x, num_splits=plan.pieces, out=p.out,
                                                                    lse=p.lse))}
        for name, fn in flashmla_peers(ks, x).items():
            if name.startswith("FlashMLA"):
                t["FlashMLA"] = graph_time_ms(fn)
        vs_default.append(t["producer"] / t["default"])
        if "FlashMLA" in t:
            for k in vs_fm:
                vs_fm[k].append((t[k] / t["FlashMLA"], shp.label()))
        rows.append((shp.label(), f"{plan.grid} x{plan.pieces}", t, same))
        print(rows[-1][0], rows[-1][1], {k: round(1e3 * v, 1) for k, v in t.items()}, "same" if same else "DIFF",
              flush=True)
    print(f"\n{'shape':<44} {'schedule':<12} {'default us':>10} {'producer us':>11} {'prod/def':>8} "
          f"{'FlashMLA us':>11} {'def/FM':>7} {'prod/FM':>7}  bits")
    for label, sched, t, same in rows:
        fm = t.get("FlashMLA")
        peer = (f"{1e3 * fm:>11.1f} {t['default'] / fm:>7.3f} {t['producer'] / fm:>7.3f}" if fm
                else f"{'-':>11} {'-':>7} {'-':>7}")
        print(f"{label:<44} {sched:<12} {1e3 * t['default']:>10.1f} {1e3 * t['producer']:>11.1f} "
              f"{t['producer'] / t['default']:>8.3f} {peer}  {'same' if same else 'DIFF'}")
    if vs_default:
        print(f"producer / default: median {statistics.median(vs_default):.3f}, worst {max(vs_default):.3f}, "
              f"best {min(vs_default):.3f} over {len(vs_default)} shapes")
    for k, r in vs_fm.items():
        if r:
            med = statistics.median(x for x, _ in r)
            print(f"{k} / FlashMLA: worst {max(r)[0]:.3f} ({max(r)[1]}), median {med:.3f}")
    return 0 if all(same for *_, same in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""tree_verify's grids on shapes drawn from the classes of served traffic (ddtree_gen/bench/shapes.py), side by side
in one process: the default route, the chunks grid (tree_verify_wgmma, a block per request x chunk x row tile) at
several split counts, the balanced parts grid (the seesaw with grid="parts", a block per row tile x part over the
batch's key tiles) at several part counts, and FlashMLA's dense decode when flash_mla is importable. Per shape:
CUDA-graph replay medians, the ratio of each to FlashMLA; --kernels adds each launch's own time (torch.profiler).
This is the measurement behind ops/tree_verify/split.py's rules (docs/perf/journal-tree-verify.md "tree_verify on real traffic").
Run: PYTHONPATH=.:.peers/flashmla_pkg python scripts/sweep_schedule.py [--seed N] [--count K] [--kernels]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def kernel_times(fn, reps=10) -> dict:
    """name -> mean us of each kernel that fn() launches (torch.profiler / CUPTI sees CuPy's launches too)."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        cupy.cuda.Device().synchronize()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            out[e.key[:40]] = t / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--heads", type=int, nargs="*", default=None, help="draw H from these (default: 8 16 64 128)")
    ap.add_argument("--classes", nargs="*", default=None, help="draw from these classes (bench/shapes.CLASSES)")
    ap.add_argument("--extra", nargs="*", default=[], metavar="B,H,NQ,L[:L...]",
                    help="shapes of one's own besides the draw: lengths separated by ':' (one length: all B)")
    ap.add_argument("--seg-costs", type=int, nargs="*", default=[6, 0], metavar="N",
                    help="parts-grid builds with these seg_cost values (the first: also at one wave's part count)")
    ap.add_argument("--kernels", action="store_true", help="also each launch's own time, per candidate")
    ap.add_argument("--build-only", type=int, metavar="H", help="only compile the parts-grid variant of the spec "
                    "with H heads (run one per spec side by side before a sweep)")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True, torch=True)
    from ddtree_gen.bench import shapes as sh
    from ddtree_gen.bench.peers import flashmla_peers
    from ddtree_gen.bench.specs import SPEC_BY_HEADS
    from ddtree_gen.bench.timing import graph_time_ms, measured_peak_tflops
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load, variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import BM, COMBINE, choose_splits
    from ddtree_gen.ops.tree_verify.wgmma import BN, parts_for, split_rule
    from ddtree_gen.build.variant import variant
    from ddtree_gen.launch.runtime import sm_count
    from ddtree_gen.spec import find_spec

    if args.build_only:
        spec = find_spec(SPEC_BY_HEADS[args.build_only])
        load(spec)
        for seg in args.seg_costs:
            variant_set([variant(by_name("tree_verify_wgmma"), spec, grid="parts", seg_cost=seg)], also=[COMBINE])
        return
    shapes = sh.draw(args.seed, args.count, tuple(args.classes or sh.CLASSES), tuple(args.heads or sh.HEADS))
    for e in args.extra:
        b, h, nq, ls = e.split(",")
        lens = [int(v) for v in ls.split(":")]
        lens = lens * int(b) if len(lens) == 1 else lens
        shapes.append(sh.Shape("extra", int(b), int(h), int(nq), tuple(lens)))
    peak = measured_peak_tflops()
    sms = sm_count(0)
    sets = {}
    rows, summary = [], []
    t0 = time.time()
    for shp in shapes:
        spec = find_spec(SPEC_BY_HEADS[shp.h])
        if spec.name not in sets:
            sets[spec.name] = (load(spec), {seg: variant_set([variant(by_name("tree_verify_wgmma"), spec, grid="parts",
                                                                       seg_cost=seg)], also=[COMBINE])
                                            for seg in args.seg_costs})
        ks, pvs = sets[spec.name]
        x = verify_inputs(spec, shp.b, np.asarray(shp.lens), shp.nq, seed=args.seed)
        f = sh.flops(shp.h, shp.nq, shp.lens)
        max_keys = max(shp.lens) + shp.nq
        row_tiles = -(-shp.nq * shp.h // BM)
        base = shp.b * row_tiles
        s_now = choose_splits(spec, shp.b, shp.nq, -(-max_keys // spec.page_size) * spec.page_size, BN, sms,
                              *split_rule(spec))
        p_model = parts_for(spec, shp.b, shp.nq, -(-max_keys // spec.page_size) * spec.page_size, sms)
        p_wave = max(1, min(264, sms // row_tiles))
        cands = {"default": (ks.tree_verify, {}), f"chunks s={s_now}": (ks.tree_verify_wgmma, {"num_splits": s_now})}
        for seg, pv in pvs.items():
            for p in sorted({p_model, p_wave} if seg == args.seg_costs[0] else {p_model}):
                cands[f"parts{seg} p={p}"] = (pv.tree_verify_wgmma, {"num_splits": p})
        times = {}
        for name, (fn, kw) in cands.items():
            res = fn(**x, **kw)
            times[name] = graph_time_ms(lambda fn=fn, kw=kw, res=res: fn(**x, **kw, out=res.out, lse=res.lse),
                                        per_graph=3, reps=7)
            if args.kernels:
                kt = kernel_times(lambda fn=fn, kw=kw, res=res: fn(**x, **kw, out=res.out, lse=res.lse))
                print(f"  {shp.label()} {name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in kt.items()), flush=True)
        for name, fn in flashmla_peers(ks, x).items():
            if name.startswith("FlashMLA"):
                times["FlashMLA"] = graph_time_ms(fn, per_graph=3, reps=7)
        fm = times.get("FlashMLA")
        best = min((t, n) for n, t in times.items() if n != "FlashMLA")
        line = (f"{shp.label()}: base {base} | " + " | ".join(
            f"{n} {1e3 * t:.1f}" + (f" ({t / fm:.2f})" if fm else "") for n, t in times.items()) +
            f" | best {best[1]}" + (f" | FlashMLA {100 * f / (fm * 1e9) / peak:.0f}% peak" if fm else ""))
        print(line, flush=True)
        rows.append(line)
        if fm:
            summary.append((shp.label(), times["default"] / fm, best[0] / fm, best[1]))
    print(f"\nmeasured bf16 peak {peak:.0f} TFLOP/s, {sms} SMs, {time.time() - t0:.0f} s; us, (ratio to FlashMLA)")
    for s in summary:
        print(f"{s[0]:<62} default {s[1]:.2f}  best {s[2]:.2f} ({s[3]})")
    if summary:
        d = [s[1] for s in summary]
        b = [s[2] for s in summary]
        print(f"default: worst {max(d):.2f} median {statistics.median(d):.2f}; best candidate: worst {max(b):.2f} "
              f"median {statistics.median(b):.2f}")


if __name__ == "__main__":
    main()

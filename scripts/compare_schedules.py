#!/usr/bin/env python
"""tree_verify_wgmma's two schedules side by side, on the same inputs in one process: the seesaw (the default
where it fits) and the lockstep build (the variant tree_verify_wgmma.lockstep.tma, build/variant.py), with FlashMLA's dense decode and
the split path (FlashMLA prefix + our tail + merge_states) when flash_mla is importable. Prints per shape the
CUDA-graph times, % of the bf16 matmul peak measured in the same run, the ratio to FlashMLA, and how far the
seesaw's output is from the lockstep one's and from the split path's (relative, per row, the worst row).
--ablate adds seesaw builds with the S products, the P.V products or both left out (results wrong on purpose);
--parts the seesaw on the chunks grid and on the balanced "parts" grid, each by name ("seesaw" is the default kernel
set: where tree_verify_wgmma's parts build ships, B >= 8 runs it), --l2-hint with L2 evict-first key loads; --p-store the seesaw with
its P tiles stored by stmatrix (the default: 32-bit stores); --rescale the seesaw's other rescale modes ("exact": the first seesaw, "skip"; the default build is "lazy": ops/tree_verify/wgmma.RESCALES).
When: on a GPU after a change to templates/tree_verify_seesaw.cu.j2 (docs/perf/journal-tree-verify.md, "The seesaw schedule on TMA tiles").
Run: PYTHONPATH=.:.peers/flashmla_pkg python scripts/compare_schedules.py [--ablate] [--shapes B,H,L ...]
"""
from __future__ import annotations

import argparse

import numpy as np

SHAPES = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (1, 16, 4096), (64, 16, 2048), (1, 64, 4096), (8, 64, 4096),
          (8, 128, 4096), (8, 64, 16384), (64, 8, 8192)]
ALSO = {   # --flag: what it also times
    "ablate": "seesaw builds with products left out",
    "slab-order": "the seesaw with WG1's S in slab order",
    "parts": "the seesaw on the balanced 'parts' grid",
    "l2-hint": "the seesaw with L2 evict-first key loads",
    "rescale": "the seesaw's rescale modes exact and skip",
    "p-store": "the seesaw with the P tiles stored by stmatrix (the default build: 32-bit stores)",
}


def main() -> None:
    from ddtree_gen.bench.compare import parse_shape, rel_rows, to_host
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, what in ALSO.items():
        ap.add_argument(f"--{flag}", action="store_true", help=f"also time {what}")
    ap.add_argument("--part-counts", nargs="*", type=int, default=[], metavar="P",
                    help="with --parts: also the parts grid with these part counts (num_splits; default: parts_for's "
                         "one wave of blocks)")
    ap.add_argument("--shapes", nargs="*", type=parse_shape, metavar="B,H,L",
                    help="B,H,L triples (default: the issue's table)")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True, torch=True)
    from ddtree_gen.bench.peers import flashmla_peers
    from ddtree_gen.bench.specs import SPEC_BY_HEADS
    from ddtree_gen.bench.timing import graph_time_ms, measured_peak_tflops, verify_flops
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load, variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.ops.tree_verify.wgmma import schedule_for
    from ddtree_gen.build.variant import variant as make_variant
    from ddtree_gen.spec import find_spec

    shapes = args.shapes or SHAPES
    peak = measured_peak_tflops()
    rows = []
    for b, h, L in shapes:
        spec = find_spec(SPEC_BY_HEADS[h])
        assert schedule_for(spec) == "seesaw", f"{spec.name}: the build is not the seesaw"
        sets = {"seesaw": load(spec)}
        call_kw = {}   # name -> extra arguments of its calls

        def variant(schedule, ablate=0, l2_hint=None, grid="chunks", s_order="loaded", rescale="lazy",
                    p_store="sts"):
            v = make_variant(by_name("tree_verify_wgmma"), spec, schedule=schedule, ablate=ablate, l2_hint=l2_hint,
                             grid=grid, s_order=s_order, rescale=rescale, p_store=p_store)
            return variant_set([v], also=[COMBINE])
        sets["lockstep"] = variant("lockstep")
        if args.slab_order:
            sets["seesaw slab order"] = variant("seesaw", s_order="slab")
        if args.parts:   # both grids by name ("seesaw" is the default set: the parts kernel at B >= 8 where it ships)
            sets["seesaw chunks"] = variant("seesaw")
            sets["seesaw parts"] = variant("seesaw", grid="parts")
            for p in args.part_counts:   # the same build, another part count
                sets[f"seesaw parts x{p}"] = sets["seesaw parts"]
                call_kw[f"seesaw parts x{p}"] = {"num_splits": p}
        if args.l2_hint:
            sets["seesaw evict_first"] = variant("seesaw", l2_hint="evict_first")
        if args.rescale:
            for mode in ("exact", "skip"):
                sets[f"seesaw rescale {mode}"] = variant("seesaw", rescale=mode)
        if args.p_store:
            sets["seesaw p_store stmatrix"] = variant("seesaw", p_store="stmatrix")
        if args.ablate:
            for name, bits in (("seesaw no S", 1), ("seesaw no PV", 2), ("seesaw no S no PV", 3)):
                sets[name] = variant("seesaw", bits)
        lens = np.full(b, L)
        x = verify_inputs(spec, b, lens, 65)
        flops = verify_flops(spec, lens, 65)
        times, outs = {}, {}
        for name, ks in sets.items():
            kw = call_kw.get(name, {})
            res = ks.tree_verify_wgmma(**x, **kw)
            outs[name] = (to_host(res.out), to_host(res.lse))
            times[name] = graph_time_ms(lambda ks=ks, res=res, kw=kw: ks.tree_verify_wgmma(**x, **kw, out=res.out,
                                                                                           lse=res.lse),
                                        per_graph=5, reps=10)
        for name, fn in flashmla_peers(sets["seesaw"], x).items():
            o, lse = fn()
            outs[name] = (to_host(o), to_host(lse))
            times[name] = graph_time_ms(fn, per_graph=5, reps=10)
        fm = times.get("FlashMLA dense (no mask)")
        seesaw = outs["seesaw"]
        for name, ms in times.items():
            tf = flops / (ms * 1e-3) / 1e12
            diff = "-"
            if name != "seesaw" and name in outs and not name.startswith(("FlashMLA", "seesaw no")):
                d = rel_rows(seesaw[0], outs[name][0])
                diff = f"{d:.1e} / {np.max(np.abs(seesaw[1] - outs[name][1])):.1e}"
                if d > 0.05:   # where: the worst (request, row, head) and both norms
                    a, c = seesaw[0].astype(np.float64), outs[name][0].astype(np.float64)
                    per = np.linalg.norm(a - c, axis=-1) / np.maximum(np.linalg.norm(c, axis=-1), 1e-30)
                    w = np.unravel_index(int(np.argmax(per)), per.shape)
                    print(f"  {name}: worst row {w}: |seesaw| {np.linalg.norm(a[w]):.3g} |{name}| "
                          f"{np.linalg.norm(c[w]):.3g}; rows over 0.05: {int((per > 0.05).sum())} of {per.size}")
            rows.append((f"B={b} H={h} L={L}", name, f"{ms:.4f}", f"{100 * tf / peak:.1f}%",
                         f"{ms / fm:.2f}" if fm else "-", diff))
            print(rows[-1], flush=True)
        finite = np.isfinite(seesaw[0]).all() and np.isfinite(seesaw[1]).all()
        print(f"B={b} H={h} L={L}: seesaw output finite: {finite}", flush=True)
    print(f"\nmeasured bf16 peak {peak:.0f} TFLOP/s; CUDA-graph replay medians; diff: worst-row relative out / max |lse|")
    print(f"{'config':<18} {'kernel':<32} {'ms':>8} {'% peak':>7} {'/FlashMLA':>9}  diff vs seesaw")
    for r in rows:
        print(f"{r[0]:<18} {r[1]:<32} {r[2]:>8} {r[3]:>7} {r[4]:>9}  {r[5]}")


if __name__ == "__main__":
    main()

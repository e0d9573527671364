#!/usr/bin/env python
"""Can the fp8 pre-pass run under the attention instead of before it? (issue 22, an engine-level schedule)

The fp8 default is kv_dequant (the call's pages, e4m3 -> a bf16 workspace) and then the bf16-cache attention: at H = 8
the pre-pass's 16-62 us sit on the critical path before a kernel that is not bandwidth-bound. Within one call that
costs what it costs (docs/perf/journal-fp8.md "The pre-pass under the previous layer's attention": three placements measured). Across layers it need not: layer l + 1's prefix pages do
not change during the step (only the tree's pages, written by layer l + 1's own forward, do), so an engine could
convert them on a second stream while layer l's attention runs, and leave only the tree's pages for the call.

This probe measures the pieces of that schedule on one GPU, CUDA-graph replays, one process (kimi-k2.6-tp8 and its
fp8 twin, H = 8, Nq = 65):
  attn     the bf16 tree_verify (what the attention on a converted workspace costs: the same bytes, the same kernel)
  fp8      the fp8 default (kv_dequant of every page, then the attention), its kv_workspace given
  pre      kv_dequant of every page the call reads, alone
  tail     kv_dequant of the tree's pages only (the prefix pages' table entries -1: not read), alone
  conc     attn on one stream and pre (another cache) on a second, forked and joined in the graph; the variants:
           which is launched first, and the attention's stream at high priority
The schedule's per-layer time is conc + tail (tail could also go under the attention of the same layer's
projections; counted here on the critical path). Nothing here is a kernel of the package: the probe only times
its calls. Prints a table last.
Run (GPU): PYTHONPATH=. python scripts/probe_overlap_dequant.py [--shapes 8,4096 32,4096 1,4096]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def graph_ms(body, streams, reps=20, per_graph=10) -> float:
    """Median ms of body() per replay of a graph of per_graph bodies captured on streams[0] (body may fork to
    the other streams through events and must join them back)."""
    import cupy
    from ddtree_gen.bench.timing import gpu_time_ms
    cupy.cuda.Device().synchronize()
    main = streams[0]
    with main:
        body()
        main.synchronize()
        for s in streams[1:]:
            s.synchronize()
        main.begin_capture()
        for _ in range(per_graph):
            body()
        graph = main.end_capture()
        return gpu_time_ms(lambda: graph.launch(main), warmup=3, reps=reps) / per_graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8,4096", "32,4096", "1,4096"], help="B,L pairs")
    args = ap.parse_args()
    shapes = []
    for shape in args.shapes:
        try:
            b, l = map(int, shape.split(","))
        except ValueError:
            ap.error(f"--shapes: {shape!r}, expected B,L (two integers)")
        if b < 1 or l < 0:
            ap.error(f"--shapes: {shape!r}, expected B >= 1 and L >= 0")
        shapes.append((b, l))
    from ddtree_gen.errors import DdtreeError
    from ddtree_gen.needs import require
    try:   # (the fp8 cache's inputs are made through torch)
        require("probe_overlap_dequant.py", gpu=True, torch=True)
    except DdtreeError as e:
        print(e)
        return 2
    import cupy
    from ddtree_gen.bench.specs import VERIFY_KERNELS
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load
    from ddtree_gen.ops.kv_dequant.plan import workspace_elems
    from ddtree_gen.spec import find_spec

    s16, s8 = find_spec("kimi-k2.6-tp8"), find_spec("kimi-k2.6-tp8-fp8")
    k16 = load(s16, kernels=list(VERIFY_KERNELS))
    k8 = load(s8, kernels=list(VERIFY_KERNELS) + ["kv_dequant"])
    lo, hi = 0, -5   # stream priorities: lower is more urgent; CUDA clamps a value outside the device's range
    nq, rows = 65, []
    for b, l in shapes:
        lens = np.full(b, l)
        x16, x8 = verify_inputs(s16, b, lens, nq, seed=1), verify_inputs(s8, b, lens, nq, seed=2)
        x8b = verify_inputs(s8, b, lens, nq, seed=3)   # the "next layer's" cache the concurrent pre-pass converts
        r16 = k16.tree_verify(**x16)
        kvw = cupy.empty(workspace_elems(s8, b, x8["block_table"].shape[1]), np.uint16)
        r8 = k8.tree_verify(**x8, kv_workspace=kvw)
        dq = k8.kv_dequant(x8b["kv_cache"], x8b["block_table"], x8b["prefix_lens"], x8b["q_lens"])
        # the tree's pages only: every page wholly below prefix_len gets table entry -1 (not read, not converted)
        table = cupy.asnumpy(x8b["block_table"]).copy()
        first_tree_page = (cupy.asnumpy(x8b["prefix_lens"]) // s8.page_size)[:, None]
        table[np.arange(table.shape[1])[None, :] < first_tree_page] = -1
        tail_table = cupy.asarray(table)
        dq_tail = k8.kv_dequant(x8b["kv_cache"], tail_table, x8b["prefix_lens"], x8b["q_lens"])

        def attn():
            k16.tree_verify(**x16, out=r16.out, lse=r16.lse)

        def fp8():
            k8.tree_verify(**x8, out=r8.out, lse=r8.lse, kv_workspace=kvw)

        def pre():
            k8.kv_dequant(x8b["kv_cache"], x8b["block_table"], x8b["prefix_lens"], x8b["q_lens"], out=dq)

        def tail():
            k8.kv_dequant(x8b["kv_cache"], tail_table, x8b["prefix_lens"], x8b["q_lens"], out=dq_tail)

        def conc(a_stream, b_stream, first):
            def body():
                fork = cupy.cuda.Event()
                fork.record(a_stream)
                b_stream.wait_event(fork)
                order = (("b", pre), ("a", attn)) if first == "pre" else (("a", attn), ("b", pre))
                for which, fn in order:
                    with (a_stream if which == "a" else b_stream):
                        fn()
                join = cupy.cuda.Event()
                join.record(b_stream)
                a_stream.wait_event(join)
            return body

        plain = cupy.cuda.Stream(non_blocking=True)
        t = {"attn": graph_ms(attn, [plain]), "fp8": graph_ms(fp8, [plain]), "pre": graph_ms(pre, [plain]),
             "tail": graph_ms(tail, [plain])}
        for name, (pa, pb, first) in {"conc, pre first": (None, None, "pre"),
                                      "conc, attn first": (None, None, "attn"),
                                      "conc, attn high priority": (hi, lo, "pre")}.items():
            sa = cupy.cuda.Stream(non_blocking=True, priority=pa)
            sb = cupy.cuda.Stream(non_blocking=True, priority=pb)
            t[name] = graph_ms(conc(sa, sb, first), [sa, sb])
        best = min(v for k, v in t.items() if k.startswith("conc"))
        print(f"B={b} L={l}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in t.items()), flush=True)
        rows.append((f"B={b} H=8 L={l}", t["attn"], t["fp8"], t["pre"], t["tail"], t["conc, pre first"],
                     t["conc, attn first"], t["conc, attn high priority"], best + t["tail"]))
    print("\nus per call (CUDA-graph replay medians); speed = attn / time")
    print(f"{'shape':>16} {'attn':>7} {'fp8 default':>16} {'pre':>7} {'tail':>6} {'conc pre 1st':>13} "
          f"{'conc attn 1st':>14} {'conc attn hi':>13} {'schedule (best conc + tail)':>28}")
    for name, a, f, p, tl, c1, c2, c3, sched in rows:
        print(f"{name:>16} {a * 1e3:7.1f} {f * 1e3:8.1f} ({a / f:.2f}x) {p * 1e3:7.1f} {tl * 1e3:6.1f} "
              f"{c1 * 1e3:13.1f} {c2 * 1e3:14.1f} {c3 * 1e3:13.1f} {sched * 1e3:19.1f} ({a / sched:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())

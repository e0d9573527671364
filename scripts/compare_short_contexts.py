#!/usr/bin/env python
"""tree_verify at short contexts, where the parts grid and split-KV may cost more than they balance: per shape the
default call (tree_verify, impl auto: the parts grid at B >= PARTS_MIN_B where it ships), the chunks grid with one
chunk and with the launcher's split count, and the parts grid with given part counts; CUDA-graph medians in one
process, every result checked against the default's (worst row of ||out - ref|| / ||ref||).
When: on a GPU after a change to the split or parts policy (ops/tree_verify/split.choose_splits,
ops/tree_verify/wgmma.parts_for; docs/perf/journal-tree-verify.md "Short contexts").
Run: PYTHONPATH=. python scripts/compare_short_contexts.py [--spec kimi-k2.6-tp8] [--shapes B,L ...] [--parts 1 2 4]
"""
from __future__ import annotations

import argparse

import numpy as np

SHAPES = [(8, 0), (8, 64), (8, 192), (8, 448), (8, 960), (8, 1984), (16, 192), (16, 960), (32, 192), (32, 960),
          (64, 448)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="kimi-k2.6-tp8")
    ap.add_argument("--shapes", nargs="*", help="B,L pairs (prefix length L, 65 tree queries a request)")
    ap.add_argument("--parts", nargs="*", type=int, default=[1, 2, 4, 8], help="part counts of the parts grid")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True)
    from ddtree_gen.bench.compare import rel_rows, to_host
    from ddtree_gen.bench.timing import graph_time_ms, print_table
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load, variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.build.variant import variant
    from ddtree_gen.spec import find_spec

    spec = find_spec(args.spec)
    ks = load(spec, kernels=["tree_verify_wgmma", COMBINE])
    chunks = load(spec, kernels=["tree_verify_wgmma", COMBINE])          # no parts kernel: the chunks grid always
    parts = variant_set([variant(by_name("tree_verify_wgmma"), spec, grid="parts")], also=[COMBINE])
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    rows = []
    for b, L in shapes:
        x = verify_inputs(spec, b, np.full(b, L), 65)
        calls = {"default": (ks.tree_verify, {}), "chunks 1": (chunks.tree_verify_wgmma, {"num_splits": 1}),
                 "chunks auto": (chunks.tree_verify_wgmma, {})}
        for p in args.parts:
            calls[f"parts {p}"] = (parts.tree_verify_wgmma, {"num_splits": p})
        calls["parts auto"] = (parts.tree_verify_wgmma, {})
        ref, times = None, {}
        for name, (fn, kw) in calls.items():
            res = fn(**x, **kw)
            out = to_host(res.out)
            ref = out if ref is None else ref
            times[name] = graph_time_ms(lambda fn=fn, kw=kw, res=res: fn(**x, **kw, out=res.out, lse=res.lse),
                                        per_graph=10, reps=10)
            rows.append([f"B={b} L={L}", name, f"{times[name] * 1e3:.1f}", f"{times['default'] / times[name]:.2f}x",
                         f"{rel_rows(out, ref):.1e}"])
            print(rows[-1], flush=True)
    print_table(f"tree_verify of {spec.name} at short contexts, Nq=65; us per call, CUDA-graph replay medians; "
                f"speed = default us / us; diff = worst row against the default's output",
                ["config", "call", "us", "speed", "diff"], rows, None, None)


if __name__ == "__main__":
    main()

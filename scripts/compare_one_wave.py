#!/usr/bin/env python
"""One request of few rows over a long table (issue 45): tree_verify's automatic chunk count with split.ONE_WAVE on
(split.one_wave_splits: up to one wave of blocks past MAX_SPLITS; the script turns it on) against the cap
(num_splits = MAX_SPLITS) and FlashMLA's dense decode (same FLOPs, no mask), in one process, CUDA-graph replay
medians; the two counts' outputs within the contract's bar of each other. FlashMLA's package on PYTHONPATH
(docs/benchmarks.md), else its column is left out.
When: on a GPU after a change to the split rule (ddtree_gen/ops/tree_verify/split.py).
Run: PYTHONPATH=. python scripts/compare_one_wave.py
"""
from __future__ import annotations

import numpy as np

from ddtree_gen.bench.peers import flashmla_peers
from ddtree_gen.bench.specs import SPEC_BY_HEADS
from ddtree_gen.bench.tree_verify import SWEEP_KERNELS
from ddtree_gen.bench.timing import graph_time_ms
from ddtree_gen.inputs import verify_inputs
from ddtree_gen.kernel_set import load
from ddtree_gen.ops.tree_verify.split import MAX_SPLITS
from ddtree_gen.spec import find_spec

SHAPES = [(8, 22, 193484), (8, 16, 65536), (8, 24, 32768), (16, 16, 131072)]   # H, Nq, keys (B = 1)


def main() -> None:
    import cupy
    from ddtree_gen.ops.tree_verify import split
    split.ONE_WAVE = True
    rows = []
    for h, nq, keys in SHAPES:
        spec = find_spec(SPEC_BY_HEADS[h])
        ks = load(spec, kernels=list(SWEEP_KERNELS))   # (FlashMLA's split path runs our tail and merge)
        x = verify_inputs(spec, 1, np.array([keys]), nq)
        plan = ks.tree_verify_schedule(1, nq, x["block_table"].shape[1], device=x["q_nope"].device.id)
        auto = ks.tree_verify(**x)
        capped = ks.tree_verify(**x, num_splits=MAX_SPLITS)
        a = (auto.out.astype(cupy.uint32) << 16).view(cupy.float32)
        c = (capped.out.astype(cupy.uint32) << 16).view(cupy.float32)
        rel = float((cupy.linalg.norm(a - c, axis=-1) / cupy.maximum(cupy.linalg.norm(c, axis=-1), 1e-30)).max())
        t_auto = graph_time_ms(lambda: ks.tree_verify(**x, out=auto.out, lse=auto.lse), per_graph=5, reps=10)
        t_cap = graph_time_ms(lambda: ks.tree_verify(**x, num_splits=MAX_SPLITS, out=capped.out, lse=capped.lse),
                              per_graph=5, reps=10)
        fm = [graph_time_ms(fn, per_graph=5, reps=10) for name, fn in flashmla_peers(ks, x).items()
              if name.startswith("FlashMLA")]
        rows.append((f"B=1 H={h} Nq={nq} L={keys}", plan.pieces, 1e3 * t_auto, 1e3 * t_cap,
                     1e3 * fm[0] if fm else None, rel))
        print(rows[-1], flush=True)
    print(f"\n{'shape':<28} {'chunks':>6} {'auto us':>8} {f'{MAX_SPLITS} chunks us':>14} {'FlashMLA us':>11} "
          f"{'auto / FlashMLA':>15} {'before / FlashMLA':>17} {'rel diff':>9}")
    for label, pieces, ta, tc, tf, rel in rows:
        fm = f"{tf:11.1f} {ta / tf:15.2f} {tc / tf:17.2f}" if tf else f"{'-':>11} {'-':>15} {'-':>17}"
        print(f"{label:<28} {pieces:>6} {ta:8.1f} {tc:14.1f} {fm} {rel:9.1e}")


if __name__ == "__main__":
    from ddtree_gen import needs
    needs.script_without_options(__file__, __doc__)
    main()

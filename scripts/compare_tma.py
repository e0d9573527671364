#!/usr/bin/env python
"""tree_verify_wgmma's lockstep schedule with TMA key tiles against the same kernel with cp.async key tiles (the
variants tree_verify_wgmma.lockstep.tma and .lockstep.cpasync, build/variant.py; the default build is the seesaw,
scripts/compare_schedules.py), on the same inputs in one process: the outputs must be
bit-identical (same math on the same tiles), then both are timed (CUDA-graph replay).
When: on a GPU after changing the TMA path of templates/tree_verify_wgmma.cu.j2 (docs/perf/journal-tree-verify.md, "TMA key tiles").
Run: PYTHONPATH=. python scripts/compare_tma.py
"""
from __future__ import annotations

import numpy as np

from ddtree_gen.bench.specs import SPEC_BY_HEADS
from ddtree_gen.bench.timing import graph_time_ms
from ddtree_gen.inputs import verify_inputs
from ddtree_gen.kernel_set import KernelSet, variant_set
from ddtree_gen.ops import by_name
from ddtree_gen.ops.tree_verify.split import COMBINE
from ddtree_gen.build.variant import variant
from ddtree_gen.spec import find_spec

SHAPES = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (64, 16, 2048), (8, 64, 4096), (8, 128, 4096), (8, 64, 16384)]


def lockstep_set(spec, tma: bool) -> KernelSet:
    """A kernel set whose tree_verify_wgmma is the lockstep schedule's build with TMA key tiles, or with
    cp.async ones."""
    v = variant(by_name("tree_verify_wgmma"), spec, schedule="lockstep", tma=tma)
    return variant_set([v], also=[COMBINE])


def main() -> None:
    import cupy
    rows = []
    for b, h, L in SHAPES:
        spec = find_spec(SPEC_BY_HEADS[h])
        tma = lockstep_set(spec, True)
        assert tma.constants("tree_verify_wgmma")["USE_TMA"] == 1, "this spec's build does not use TMA"
        cp = lockstep_set(spec, False)
        assert cp.constants("tree_verify_wgmma")["USE_TMA"] == 0
        x = verify_inputs(spec, b, np.full(b, L), 65)
        times, outs = {}, {}
        for name, ks in (("cp.async", cp), ("TMA", tma)):
            o = ks.tree_verify_wgmma(**x)
            outs[name] = (cupy.asnumpy(o.out), cupy.asnumpy(o.lse))
            times[name] = graph_time_ms(lambda: ks.tree_verify_wgmma(**x, out=o.out, lse=o.lse), per_graph=5, reps=10)
        same = (np.array_equal(outs["TMA"][0], outs["cp.async"][0])
                and np.array_equal(outs["TMA"][1].view(np.uint32), outs["cp.async"][1].view(np.uint32)))
        rows.append((f"B={b} H={h} L={L}", times["cp.async"], times["TMA"], same))
        print(rows[-1], flush=True)
    print(f"\n{'config':<20} {'cp.async ms':>11} {'TMA ms':>8} {'speed-up':>8} {'bits equal':>10}")
    for cfg, a, t, same in rows:
        print(f"{cfg:<20} {a:>11.3f} {t:>8.3f} {a / t:>7.2f}x {'yes' if same else 'NO':>10}")


if __name__ == "__main__":
    from ddtree_gen import needs
    needs.script_without_options(__file__, __doc__)
    main()

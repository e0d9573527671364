#!/usr/bin/env python
"""The seesaw's key-tile loads against each other (issue 46), one logical cache laid out in pages of 64, 16 and 1, in
one process: tree_verify_wgmma's seesaw with a TMA box per tile (page 64, the default), with the row gather at page 64
(tma=False: the gather's own cost, the pages the same), a TMA box per page (page 16, its default) and the gather at
page 16 (tma=False), and the gather at page 1 (its default). The outputs must be bit-identical (the same tiles in the
same order), then each is timed (CUDA-graph replay). What it separates: the cost of the gather itself (page 64 gather
against page 64 TMA) from the cost of small TMA boxes (page 16 TMA against page 64 TMA); and each page-by-page build
against its page_loads "spread" form (marked +: a row's chunks by side-by-side lanes, a warp per page's boxes) and its
"producer" form (marked *: a third warpgroup loads, a warp per buffer and slab group; the computing warps load nothing).
When: on a GPU after changing the seesaw's loads (templates/tree_verify_seesaw.cu.j2, tile_row / load_slabs).
Run: PYTHONPATH=. python scripts/compare_loads.py
"""
from __future__ import annotations

import numpy as np

from ddtree_gen.bench.specs import page_variant
from ddtree_gen.bench.timing import graph_time_ms
from ddtree_gen.build.variant import variant
from ddtree_gen.inputs import relayout, verify_inputs
from ddtree_gen.kernel_set import variant_set
from ddtree_gen.ops import by_name
from ddtree_gen.ops.tree_verify.split import COMBINE
from ddtree_gen.spec import find_spec

# B, base spec, keys a request, grid (a batch: the parts grid, which the route takes at B >= 2)
SHAPES = [(1, "kimi-k2.6-tp8", 4096, "chunks"), (1, "kimi-k2.6-tp8", 65536, "chunks"),
          (1, "kimi-k2.6", 16384, "chunks"), (8, "kimi-k2.6-tp8", 8192, "parts")]
# page, TMA, page_loads ("spread": the gather's lanes a row's chunks side by side, a warp per page's TMA boxes;
# "producer": the loads by a third warpgroup)
BUILDS = [(64, True, "serial"), (64, True, "producer"), (64, False, "serial"), (64, False, "spread"),
          (64, False, "producer"), (16, True, "serial"), (16, True, "spread"), (16, True, "producer"),
          (16, False, "spread"), (1, False, "serial"), (1, False, "spread"), (1, False, "producer")]
MARK = {"serial": "", "spread": "+", "producer": "*"}


def main() -> None:
    import cupy
    rows = []
    for b, base_name, keys, grid in SHAPES:
        base = find_spec(base_name)
        nq = base.max_tree_size
        x = verify_inputs(base, b, np.full(b, keys), nq)
        lens = np.full(b, keys) + nq
        ref, line = None, [f"B={b} H={base.num_heads} L={keys}" + (" parts" if grid == "parts" else "")]
        for page, tma, loads in BUILDS:
            spec = page_variant(base, page)
            build = variant(by_name("tree_verify_wgmma"), spec, tma=tma, grid=grid, page_loads=loads)
            ks = variant_set([build], also=[COMBINE])
            kv, table = relayout(x["kv_cache"], x["block_table"], lens, page, np.random.default_rng(page))
            xp = dict(x, kv_cache=kv, block_table=table)
            o = ks.tree_verify_wgmma(**xp)
            got = (cupy.asnumpy(o.out), cupy.asnumpy(o.lse).view(np.uint32))
            ref = ref or got
            same = np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])
            ms = graph_time_ms(lambda ks=ks, xp=xp, o=o: ks.tree_verify_wgmma(**xp, out=o.out, lse=o.lse),
                               per_graph=5, reps=10)
            line.append((page, ("TMA" if tma else "gather") + MARK[loads], 1e3 * ms, same))
            print(line[0], line[-1], flush=True)
        rows.append(line)
    print("(+: page_loads 'spread'; *: page_loads 'producer')")
    print(f"\n{'shape':<22}" + "".join(f"{f'page {p} {t}':>18}" for p, t, _, _ in rows[0][1:]))
    for line in rows:
        first = line[1][2]
        cells = [f"{us:.1f} us {us / first:.2f}x" + ("" if same else " DIFF") for _, _, us, same in line[1:]]
        print(f"{line[0]:<22}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    from ddtree_gen import needs
    needs.script_without_options(__file__, __doc__)
    main()

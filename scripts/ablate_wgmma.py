"""Development aid (not a test): time tree_verify_wgmma's lockstep schedule with parts of the tile loop removed
(results are wrong on purpose), to see where a tile's time goes. (The seesaw schedule, the default build, has its
ablation in scripts/compare_schedules.py --ablate.)

When: on a GPU after changing the tile loop of templates/tree_verify_wgmma.cu.j2, to redo the
ablation table of docs/perf/journal-tree-verify.md; each cut in CUTS must still occur in the rendered source (asserted).
The cuts are written for the TMA build (bf16 cache, 64-key pages: every spec in specs/).
Run: PYTHONPATH=. python scripts/ablate_wgmma.py
"""
from __future__ import annotations

import numpy as np

from ddtree_gen.build import artifacts
from ddtree_gen.bench.specs import SPEC_BY_HEADS
from ddtree_gen.bench.timing import graph_time_ms
from ddtree_gen.inputs import verify_inputs
from ddtree_gen.kernel_set import KernelSet
from ddtree_gen.ops import by_name
from ddtree_gen.build.variant import variant
from ddtree_gen.build.render import render
from ddtree_gen.spec import find_spec

REFILL = "if (nn < n_tiles) stage_tile(nn, next_src);"
WAIT = "mbar_wait(sBar + 8 * stage, (uint32_t)(n / STAGES) & 1u);"
S_MMA = "wgmma_s(s, q_desc + koff, k_desc0 + tile_off + koff, ks > 0);"
PV_MMA = "wgmma_pv(o, p_desc + (uint64_t)((ks * 32) >> 4), v_desc0 + tile_off + (uint64_t)((ks * 16 * 128) >> 4));"
NO_S = [(S_MMA, "if (ks == 0) { for (int i = 0; i < NS; ++i) s[i] = 0.0f; }")]
NO_PV = [(PV_MMA, "")]
# the TMA build (a page of 64 keys): each stage loaded once, its later phases not waited for
NO_REFILL = [(REFILL, "if (nn < STAGES) stage_tile(nn, next_src);"), (WAIT, "if (n < STAGES) " + WAIT)]
CUTS = {
    "base": [],
    "no-S": NO_S,
    "no-PV": NO_PV,
    "no-refill": NO_REFILL,
    "no-S-no-PV": NO_S + NO_PV,
    "no-S-no-PV-no-refill": NO_S + NO_PV + NO_REFILL,
}


def main():
    for b, h, l in [(8, 128, 4096), (8, 64, 16384)]:
        spec = find_spec(SPEC_BY_HEADS[h])
        base = artifacts.ensure_built(spec, kernels=["tree_verify_mma_combine"])
        x = verify_inputs(spec, b, np.full(b, l), 65)
        v = variant(by_name("tree_verify_wgmma"), spec, schedule="lockstep")   # tree_verify_wgmma.lockstep.tma
        src0 = render(v)
        row = [f"B={b} H={h} L={l}"]
        for name, cuts in CUTS.items():
            src = src0
            for a, c in cuts:
                assert a in src, (name, a)
                src = src.replace(a, c)
            built = artifacts.compile_variant(v, source=src)    # a cut: another source, so another cache key
            ks = KernelSet(spec, {"tree_verify_wgmma": built, **base})
            out = ks.tree_verify_wgmma(**x, num_splits=1)
            ms = graph_time_ms(lambda: ks.tree_verify_wgmma(**x, out=out.out, lse=out.lse, num_splits=1),
                               per_graph=5, reps=10)
            row.append(f"{name} {ms:.3f} (regs {built.report.registers})")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    from ddtree_gen import needs
    needs.script_without_options(__file__, __doc__)
    main()

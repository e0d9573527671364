"""Where tree_build's time goes: graph-replayed time per step against the budget (pops).

The slope is the cost of one pop, the intercept the fixed cost (launch, staging, epilogue).
`ddtree-gen bench tree_build` times the full budget only; this sweep splits the time.
When: on a GPU after changing the pop loop of templates/tree_build.cu.j2, to compare with the
probe numbers in docs/perf.md ("tree_build").
Run: PYTHONPATH=. python scripts/probe_tree_build.py
"""
import numpy as np
import cupy
import ddtree_gen
from ddtree_gen.artifacts import find_spec
from ddtree_gen.bench import graph_time_ms, tree_build_inputs

spec = find_spec("kimi-k2.6-tp8")
ks = ddtree_gen.load(spec, kernels=["tree_build"])
dev = [cupy.asarray(x) for x in tree_build_inputs(spec, 64, np.random.default_rng(0))]
rows = []
for budget in (0, 1, 8, 16, 32, 64):
    out = ks.tree_build(*dev, budget)
    rows.append((budget, graph_time_ms(lambda: ks.tree_build(*dev, budget, out=out)) * 1e3))
empty = cupy.ElementwiseKernel("", "int32 x", "x = 0", "probe_empty")
z = cupy.zeros(1, cupy.int32)
base = graph_time_ms(lambda: empty(z)) * 1e3
slope, icept = np.polyfit([b for b, _ in rows], [t for _, t in rows], 1)
print("budget  us/step")
for b, t in rows:
    print(f"{b:6d}  {t:7.2f}")
print(f"empty kernel in the same graph: {base:.2f} us; fit: {icept:.2f} us + {slope * 1e3:.0f} ns per pop")

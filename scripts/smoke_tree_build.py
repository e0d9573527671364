"""Quick device check of tree_build against the reference (used while bringing up the pipeline)."""
import numpy as np
import cupy
import ddtree_gen
from ddtree_gen import reference
from ddtree_gen.artifacts import all_specs
from ddtree_gen.bench import tree_build_inputs

for spec in all_specs():
    ks = ddtree_gen.load(spec, kernels=["tree_build"])
    rng = np.random.default_rng()
    for b, budget, k, mode in [(64, 64, 64, "plain"), (7, 0, 3, "plain"), (5, 1, 2, "plain"), (9, 64, 1, "plain"),
                               (16, 64, 8, "ties"), (16, 64, 8, "naninf")]:
        h = list(tree_build_inputs(spec, b, rng, k=k))
        if mode == "ties":
            h[1][:] = -1.0
        if mode == "naninf":
            h[1][:, :, 1::3] = -np.inf
            h[1][:, 1::2, 2::4] = np.nan
        out = ks.tree_build(*[cupy.asarray(x) for x in h], budget)
        ref = reference.tree_build(*h, budget, max_tree_size=spec.max_tree_size)
        bad = [f for f, g, r in zip(ref._fields, out, ref)
               if not np.array_equal(cupy.asnumpy(g).view(np.uint32) if r.dtype == np.float32 else cupy.asnumpy(g),
                                     r.view(np.uint32) if r.dtype == np.float32 else r)]
        print(spec.name, b, budget, k, mode, "OK" if not bad else f"MISMATCH {bad}")

# -0.0 log-probs: scores are sums (root 0 + -0.0 = +0.0), bit-exact with the reference
for spec in all_specs():
    ks = ddtree_gen.load(spec, kernels=["tree_build"])
    h = list(tree_build_inputs(spec, 4, np.random.default_rng(3), k=4))
    h[1][:] = -0.0
    out = ks.tree_build(*[cupy.asarray(x) for x in h], 64)
    ref = reference.tree_build(*h, 64, max_tree_size=spec.max_tree_size)
    print(spec.name, "-0.0", "OK" if np.array_equal(cupy.asnumpy(out.scores).view(np.uint32), ref.scores.view(np.uint32)) else "MISMATCH")

"""`ddtree-gen bench tree_build`: the kernel next to the CPU heap builder an engine would run today, at B = 1,
8, 64 with the spec's budget and depth; bit-exactness against the numpy reference."""
from __future__ import annotations

import numpy as np

from .. import reference
from ..inputs import tree_build_inputs
from .peers import cpu_heap_builder
from .timing import cpu_time_ms, gpu_time_ms, graph_time_ms, print_table


def run(args) -> None:
    import cupy
    from ..spec import find_spec
    from ..kernel_set import load
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec, kernels=["tree_build"])
    budget = spec.max_tree_size - 1
    rows = []
    rng = np.random.default_rng(0)
    for b in (1, 8, 64):
        host = tree_build_inputs(spec, b, rng)
        dev = [cupy.asarray(x) for x in host]
        out = ks.tree_build(*dev, budget)
        ref = reference.tree_build(*host, budget, max_tree_size=spec.max_tree_size)
        same = all(np.array_equal(cupy.asnumpy(g).view(np.uint32) if g.dtype == np.float32 else cupy.asnumpy(g),
                                  r.view(np.uint32) if r.dtype == np.float32 else r)
                   for g, r in zip(out, ref))
        step = lambda: ks.tree_build(*dev, budget, out=out)  # noqa: E731
        gpu = graph_time_ms(step)
        eager = gpu_time_ms(step, warmup=10, reps=100)
        cpu = cpu_time_ms(lambda: cpu_heap_builder(*host, budget))
        nodes_match = [len(t[0]) for t in cpu_heap_builder(*host, budget)] == ref.num_nodes.tolist()
        rows.append([b, budget, spec.max_depth, f"{gpu * 1e3:.1f}", f"{eager * 1e3:.1f}", f"{cpu * 1e3:.0f}",
                     f"{cpu / gpu:.0f}x", "yes" if same else "NO"])
        assert nodes_match, "the CPU heap peer built trees of other sizes"
    print_table(f"tree_build on {spec.name} (N={spec.max_tree_size}, K'={spec.max_tree_size - 1}, "
                f"D'={spec.max_depth}); gpu: CUDA-graph replay, event median per step; eager: one Python "
                f"launch per step incl. argument checks; cpu: heapq builder, median",
                ["B", "budget", "depth", "gpu us", "eager us", "cpu heap us", "speedup", "bit-exact"], rows, args.out,
                "bench_tree_build")



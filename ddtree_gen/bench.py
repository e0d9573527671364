"""`ddtree-gen bench`: our kernels next to their peers, side by side in one process on the GPU.

Times are CUDA-event medians after warm-up (host wall-clock medians for CPU peers). Each
benchmark prints a table last; --out DIR also writes it (and a plot where there is one).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from . import reference


def gpu_time_ms(fn, *, warmup=5, reps=30) -> float:
    """Median milliseconds of fn() on the current stream, by CUDA events around each call."""
    import cupy
    for _ in range(warmup):
        fn()
    stream = cupy.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def graph_time_ms(fn, *, per_graph=20, warmup=3, reps=20) -> float:
    """Median milliseconds of one fn() when per_graph calls are replayed from a CUDA graph.

    This is the GPU time an engine sees when it captures its step: no Python launch overhead.
    """
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # warm up outside the capture (module load, allocations)
        stream.synchronize()
        stream.begin_capture()
        for _ in range(per_graph):
            fn()
        graph = stream.end_capture()
        ms = gpu_time_ms(lambda: graph.launch(stream), warmup=warmup, reps=reps)
    return ms / per_graph


def cpu_time_ms(fn, *, warmup=1, reps=5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measured_peak_tflops() -> float:
    """Dense bf16 matmul rate measured now on this GPU (torch, random data, 8192^3)."""
    import torch
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = gpu_time_ms(lambda: torch.matmul(a, b), warmup=3, reps=10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def print_table(title: str, header: list[str], rows: list[list], out: str | None, name: str) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    lines = [title, "  ".join(str(h).rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.txt").write_text(text + "\n")
    return text


# ---------------------------------------------------------------- tree_build

def tree_build_inputs(spec, b: int, rng, depth: int | None = None, k: int | None = None):
    d = depth or spec.max_depth
    k = k or spec.max_tree_size - 1
    ids = rng.integers(0, 150000, size=(b, d, k), dtype=np.int32)
    lps = -np.sort(rng.exponential(1.0, size=(b, d, k)).astype(np.float32), axis=-1)
    roots = rng.integers(0, 150000, size=b, dtype=np.int32)
    prefix = rng.integers(0, 100000, size=b, dtype=np.int32)
    return ids, np.ascontiguousarray(lps), roots, prefix


def bench_tree_build(args) -> None:
    import cupy
    import ddtree_gen
    from .artifacts import find_spec
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = ddtree_gen.load(spec, kernels=["tree_build"])
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
        cpu = cpu_time_ms(lambda: reference.tree_build_heap(*host, budget, max_tree_size=spec.max_tree_size))
        rows.append([b, budget, spec.max_depth, f"{gpu * 1e3:.1f}", f"{eager * 1e3:.1f}", f"{cpu * 1e3:.0f}",
                     f"{cpu / gpu:.0f}x",
                     "yes" if same else "NO"])
    print_table(f"tree_build on {spec.name} (N={spec.max_tree_size}, K'={spec.max_tree_size - 1}, "
                f"D'={spec.max_depth}); gpu: CUDA-graph replay, event median per step; eager: one Python "
                f"launch per step incl. argument checks; cpu: heapq builder, median",
                ["B", "budget", "depth", "gpu us", "eager us", "cpu heap us", "speedup", "bit-exact"], rows, args.out,
                "bench_tree_build")


BENCHES = {"tree_build": bench_tree_build}


def main(args) -> int:
    from .errors import DdtreeError
    for name in args.kernels:
        if name not in BENCHES:
            raise DdtreeError(f"no benchmark for {name!r} (have: {', '.join(BENCHES)})")
    for name in args.kernels:
        BENCHES[name](args)
    return 0

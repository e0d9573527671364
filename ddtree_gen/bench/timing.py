"""The timing of `ddtree-gen bench` and the rates its tables compare against.

Times are CUDA-event medians after warm-up (host wall-clock medians for CPU peers); a CUDA-graph replay
is the GPU time an engine sees when it captures its step. The rates: the contract's FLOPs of a
tree_verify call, the dense bf16 matmul peak and the device-to-device copy rate measured in the same
run. print_table / emit print a bench's table last and write it to --out DIR.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np


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
    # the capture stream does not wait for the legacy default stream: work queued there (inputs being made,
    # a slow peer's launch) must be done before fn's first call on it
    cupy.cuda.Device().synchronize()
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


def call_time_ms(fn) -> float:
    """Median ms of one fn(): CUDA events for a call over 2 ms, else a CUDA-graph replay of as many calls as
    make about 2 ms (host launch overhead would dominate the short calls); the tuning scripts' timer."""
    eager = gpu_time_ms(fn, warmup=3, reps=10)
    if eager > 2.0:
        return gpu_time_ms(fn, warmup=1, reps=15)
    return graph_time_ms(fn, per_graph=max(1, min(20, int(2.0 / max(eager, 1e-3)))), warmup=3, reps=15)


def checked_graph_time_ms(fn, what: str, min_ms: float) -> float:
    """graph_time_ms(fn), refused when it is faster than `min_ms`, the call's FLOPs at the matmul peak measured
    in the same run: no kernel beats that, so such a time is a failed measurement (bench kv-dtype once printed
    0.004 ms for a 0.67 ms call, bench tree_verify 0.006 ms for a 0.87 ms one, before graph_time_ms waited for
    the legacy stream). It is measured again once; a second impossible time is an error, not a table row."""
    ms = graph_time_ms(fn, per_graph=5, reps=10)
    if ms < min_ms:
        again = graph_time_ms(fn, per_graph=5, reps=10)
        print(f"WARNING: {what}: CUDA-graph replay {ms:.4f} ms is faster than its FLOPs at the measured peak "
              f"({min_ms:.4f} ms); measured again: {again:.4f} ms")
        if again < min_ms:
            raise RuntimeError(f"{what}: {again:.4f} ms twice below the peak's {min_ms:.4f} ms: not a measurement")
        ms = again
    return ms


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


def verify_flops(spec, lens, nq: int) -> float:
    """The contract's FLOP count of one tree_verify call (docs/contract.md section 13), summed over requests."""
    return float(sum(2 * spec.num_heads * nq * (int(li) + nq) * (2 * spec.kv_lora_rank + spec.qk_rope_head_dim)
                     for li in lens))


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate measured now: bytes read plus bytes written per second, in GB/s."""
    import cupy
    src = cupy.empty(nbytes // 4, np.float32)
    src.fill(1.0)
    dst = cupy.empty_like(src)
    ms = graph_time_ms(lambda: cupy.copyto(dst, src), per_graph=5, reps=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def torch_graph_time_ms(fn, *, per_graph=10, reps=20) -> float:
    """Median milliseconds of one fn() (torch ops) replayed from a torch CUDA graph of per_graph calls."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    torch.cuda.synchronize()
    return gpu_time_ms(g.replay, warmup=3, reps=reps) / per_graph




def emit(out: str | None, name: str, text: str) -> None:
    """Print `text`; with --out DIR also write it to DIR/name."""
    print(text)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(text + "\n")

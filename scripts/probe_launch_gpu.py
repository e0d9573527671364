#!/usr/bin/env python
"""Host time per eager call on a real GPU, taken apart: the probe behind issue 23 part 2's H200 rows.

When: after a launch-path change, or when `ddtree-gen bench launch` on the GPU and scripts/profile_launch.py
(the CPU harness: stand-in binaries, no driver) disagree (tree_build plain: 17.6 us in the harness, 24.6-32.4 us
on the H200), to see which stage costs more on the real GPU.
What, one table, torch CUDA inputs of `bench launch`'s tiny problem (its call table, ddtree_gen/bench/launch.py):
  * per row: the eager wall time per call of the plain launcher, of the torch op and of the op's direct entry
    (torch_ops.direct) (best of --runs runs of --calls back-to-back calls, synchronised at the end of each run, as
    `bench launch`'s eager column);
  * per row: the stages of one cached plain call (ddtree_gen.bench.launch.stage_times on the real kernel set:
    launcher + signature + lookup, the compiled function's checks, outputs, launch(es), result), wall time per
    call of --stage-calls calls issued after the GPU's queue is drained (so the launch stage is the host's,
    not a wait for a full queue);
  * reference points on the same path: torch.empty((16,), device="cuda"), torch.empty_strided, a view, two
    outputs as two allocations and as one buffer with views, torch.add of 16 floats, torch.cuda.current_stream(),
    the raw stream lookup the runtime uses (torch._C._cuda_getCurrentRawStream), and one bare cuLaunchKernel of an
    empty kernel (cupy.cuda.driver.launchKernel, the runtime's entry point), alone, with the runtime's per-call
    device and stream lookups around it (the runtime's bound launch), and through ctypes (docs/perf/journal-host.md round 6).
Run: python scripts/probe_launch_gpu.py [--spec kimi-k2.6-tp8] [--calls 2000] [--runs 5] [--stage-calls 200]
Needs a CUDA device (torch with CUDA, CuPy); refuses in one line without one.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time

EMPTY = 'extern "C" __global__ void ddtree_probe_empty() {}'


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="kimi-k2.6-tp8", help="spec name (default kimi-k2.6-tp8)")
    ap.add_argument("--calls", type=int, default=2000, help="back-to-back calls per eager run (default 2000)")
    ap.add_argument("--runs", type=int, default=5, help="eager runs per figure, the best kept (default 5)")
    ap.add_argument("--stage-calls", type=int, default=200,
                    help="calls per run of each stage's timing, the queue drained before each run (default 200)")
    args = ap.parse_args(argv)
    for name in ("calls", "runs", "stage_calls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: {getattr(args, name)}, must be >= 1")
    return args


def no_device() -> str | None:
    """Why this machine cannot run the probe (None: it can)."""
    try:
        import torch
    except ImportError:
        return "probe_launch_gpu.py needs torch with CUDA (pip install torch) and a CUDA device"
    if not torch.cuda.is_available():
        return (f"probe_launch_gpu.py needs a CUDA device: torch {torch.__version__} sees none "
                f"(torch.cuda.is_available() is False); run it on the GPU machine")
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # noqa: BLE001 - the message is the point
        return f"probe_launch_gpu.py needs CuPy on a CUDA device: {type(e).__name__}: {e}"
    return None


def references(calls: int, runs: int) -> list:
    """(what, us per call) of the reference points (module docstring)."""
    import cupy
    import torch

    from ddtree_gen.launch import runtime
    from ddtree_gen.bench.launch import eager_us
    sync = torch.cuda.synchronize
    cuda = runtime.cuda_entries()
    dev = torch.cuda.current_device()
    kernel = cupy.RawModule(code=EMPTY).get_function("ddtree_probe_empty")
    fn = getattr(kernel, "kernel", kernel)   # CuPy 13: a RawKernel, whose .kernel is the driver Function
    params = (ctypes.c_void_p * 1)()
    addr = ctypes.addressof(params)
    launch, raw_stream, get_device = cuda["launch"], cuda["torch_stream"], cuda["get_device"]
    stream = raw_stream(dev)

    def bare():
        launch(fn.ptr, 1, 1, 1, 32, 1, 1, 0, stream, addr, 0)

    def runtime_path():   # what the runtime's bound launch does around it: the stream and device lookups
        s = raw_stream(dev)
        if get_device() != dev:
            cuda["set_device"](dev)
        launch(fn.ptr, 1, 1, 1, 32, 1, 1, 0, s, addr, 0)

    # the same launch through ctypes (the alternative to CuPy's Cython binding)
    lib = ctypes.CDLL("libcuda.so.1")
    cu_launch = lib.cuLaunchKernel
    cu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    cu_launch.restype = ctypes.c_int

    def by_ctypes():
        cu_launch(fn.ptr, 1, 1, 1, 32, 1, 1, 0, stream, addr, None)

    # the torch objects an output costs: one allocation, a view, and two outputs as two allocations or one buffer
    x = torch.empty((1, 65, 8, 512), dtype=torch.bfloat16, device="cuda")
    two = (((1, 65, 8, 512), torch.bfloat16), ((1, 65, 8), torch.float32))

    def two_empty():
        return [torch.empty(s, dtype=d, device=x.device) for s, d in two]

    def one_buffer():
        b = torch.empty(532480 + 2080, dtype=torch.uint8, device=x.device)
        return b[:532480].view(torch.bfloat16).view(two[0][0]), b[532480:].view(torch.float32).view(two[1][0])

    def t(fn_):
        return eager_us(fn_, sync, calls, runs)
    return [("torch.empty((16,), device='cuda')", t(lambda: torch.empty((16,), device="cuda"))),
            ("torch.empty_strided (one output)", t(lambda: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                                               device=x.device))),
            ("x.view(shape) of a CUDA tensor", t(lambda: x.view(65, 8, 512))),
            ("two outputs: two torch.empty", t(two_empty)),
            ("two outputs: one uint8 buffer, dtype + shape views", t(one_buffer)),
            ("torch.add of 16 floats", t(lambda: torch.add(x[0, 0, 0, :16], x[0, 0, 0, :16]))),
            ("torch.cuda.current_stream()", t(torch.cuda.current_stream)),
            ("torch._C._cuda_getCurrentRawStream(dev)", t(lambda: raw_stream(dev))),
            ("cuLaunchKernel, empty kernel (bare)", t(bare)),
            ("  + stream and device lookups", t(runtime_path)),
            ("  the bare launch through ctypes", t(by_ctypes))]


def main(argv=None) -> int:
    args = parse(argv)
    why = no_device()
    if why:
        print(why)
        return 2
    import torch

    from ddtree_gen.bench.launch import STAGES, call_table, eager_us, stage_split, stage_times, tiny_inputs
    from ddtree_gen.kernel_set import load
    from ddtree_gen.spec import find_spec
    spec = find_spec(args.spec)
    ks = load(spec)
    sync = torch.cuda.synchronize
    table = call_table(ks, spec, tiny_inputs(spec, "torch"), ops=True)
    print(f"host time per eager call on {torch.cuda.get_device_name()}, spec {spec.name}, B = 1, prefix 64, Nq = N, "
          f"torch CUDA inputs (eager: best of {args.runs} x {args.calls} calls; stages: the plain call, "
          f"best of 5 x {args.stage_calls} calls after a sync)")
    head = f"{'call':<24} {'plain us':>8} {'op us':>7} {'op-plain':>8} {'direct us':>9} |" + "".join(
        f" {s:>11}" for s in ("launcher+", "checks", "outputs", "launch(es)", "result")) + f" {'stage sum':>9}"
    print(head)
    for name, c in table.items():
        p = eager_us(c.plain, sync, args.calls, args.runs)
        o = eager_us(c.op, sync, args.calls, args.runs) if c.op is not None else float("nan")
        d = eager_us(c.direct, sync, args.calls, args.runs) if c.direct is not None else float("nan")
        # wall time, the GPU's queue drained before each run
        st = stage_split(stage_times(ks, c.plain, args.stage_calls, clock=time.perf_counter, sync=sync)[1:])
        sync()
        print(f"{name:<24} {p:8.1f} {o:7.1f} {o - p:8.1f} {d:9.1f} |" + "".join(f" {st[s]:11.1f}" for s in STAGES)
              + f" {sum(st.values()):9.1f}")
    print("(stages, us: launcher+ = the launcher, its signature and the cache lookup; then the compiled call's parts)")
    print("reference points (us per call, best of the same runs):")
    for what, us in references(args.calls, args.runs):
        print(f"  {what:<42} {us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The host (Python) time of one cached eager call, per launcher and per torch op, without a GPU.

When: after changing the launch path (runtime.run_call, arrays, the launchers, torch_ops), to see what a
call costs on the host before a GPU run of `ddtree-gen bench launch` (which measures the same calls on
the GPU, with the driver and CUDA allocations).
How: ddtree_gen.bench.stand_in's kernel set (a real KernelSet of the spec whose binaries are stand-ins, on a
stand-in device 0 of compute capability 9.0, so impl="auto" picks wgmma as on an H200; the driver's
cuLaunchKernel, stream and device calls replaced by no-ops that count the launches; torch CPU tensors passed as if
they lived on device 0, outputs allocated on the CPU), so the torch path is the engine's path minus the driver and
the CUDA caching allocator; the torch ops are the registered CUDA implementations, registered for the CPU key.
The calls are `bench launch`'s call table (ddtree_gen.bench.launch.call_table) on its tiny problem: B = 1,
prefix 64, Nq = N; kv_commit with 61 layers.
Run: PYTHONPATH=. python scripts/profile_launch.py [--spec kimi-k2.6-tp8] [--calls 5000] [--clock cpu|wall]
                                                   [--profile CALL] [--stages CALL] [--source CALL]
It prints one row per call: host us per call (best of 5 runs of --calls calls), launches per call.
--profile CALL prints a cProfile of that call (cumulative, top 25); --stages CALL the time of each stage
of the cached call (the launcher, signature and lookup; its compiled function's checks, outputs, launch,
result); --source CALL that compiled function. Times are this thread's CPU time (--clock wall: wall time).
Needs torch (CPU build) and no GPU; a GPU is not touched.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="CPU only: stand-in binaries and a counting stand-in for cuLaunchKernel.")
    ap.add_argument("--spec", default="kimi-k2.6-tp8", help="spec name (default kimi-k2.6-tp8)")
    ap.add_argument("--calls", type=int, default=5000, help="calls per timing run (best of 5)")
    ap.add_argument("--profile", metavar="CALL", help="cProfile this call's plain launcher (a row name, or its "
                                                      "prefix), 'op:CALL' its torch op, 'direct:CALL' the op's "
                                                      "direct entry")
    ap.add_argument("--stages", metavar="CALL", help="time each stage of this call (its compiled function's "
                                                     "checks, outputs, launch, result; the rest before it)")
    ap.add_argument("--source", metavar="CALL", help="print this call's compiled function (hostcode.compile_runner)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: this thread's CPU time (default; on a shared machine, others' load does not count); "
                         "wall: wall time")
    args = ap.parse_args(argv)
    clock = CLOCKS[args.clock]
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=False, torch=True)   # (its CPU build is enough)
    import torch

    from ddtree_gen.bench.launch import compiled_sources, per_call_us, stage_times
    from ddtree_gen.bench.stand_in import harness
    from ddtree_gen.spec import find_spec
    spec = find_spec(args.spec)
    h = harness(spec)   # (held: its torch library keeps the ops registered)
    ks, launches = h.kset, h.launches
    table = {name: (c.plain, c.op, c.direct) for name, c in h.calls.items()}
    a, b = torch.ones(16), torch.ones(16)
    table["torch.add, 16 floats (CPU)"] = (lambda: torch.add(a, b), None, None)
    if args.profile or args.stages or args.source:
        want = args.profile or args.stages or args.source
        form, _, rest = want.partition(":")
        form, want = (form, rest) if rest and form in ("op", "direct") else ("plain", want)
        name = next((k for k in table if k.startswith(want)), None)
        if name is None:
            ap.error(f"no call named {want!r}: {', '.join(table)}")
        fn = table[name][("plain", "op", "direct").index(form)]
        if fn is None:
            ap.error(f"{name!r} has no {form} form")
        if args.stages:
            print(f"stages of {name} ({form}), {args.calls} calls")
            for label, us in stage_times(ks, fn, args.calls, clock=clock):
                print(f"  {label:<45} {us:6.1f} us")
            return 0
        if args.source:
            print("\n".join(compiled_sources(ks, fn)))
            return 0
        for _ in range(50):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        return 0
    print(f"host time per cached eager call, spec {spec.name}, B = 1, prefix 64, Nq = N, torch CPU tensors "
          f"standing for CUDA ones, no driver (best of 5 x {args.calls} calls; this machine's CPU, {args.clock} time)")
    print(f"{'call':<30} {'plain us':>9} {'torch op us':>12} {'op - plain':>11} {'direct us':>10} "
          f"{'direct - plain':>15} {'launches':>9}")
    for name, (plain, op, direct) in table.items():
        before = len(launches)
        plain()
        n_launch = len(launches) - before
        p = per_call_us(plain, args.calls, clock=clock)
        o = per_call_us(op, args.calls, clock=clock) if op is not None else float("nan")
        d = per_call_us(direct, args.calls, clock=clock) if direct is not None else float("nan")
        launches.clear()
        print(f"{name:<30} {p:9.1f} {o:12.1f} {o - p:11.1f} {d:10.1f} {d - p:15.1f} {n_launch:9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

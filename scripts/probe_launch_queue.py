#!/usr/bin/env python
"""Host time per eager call against the launch queue's state: `bench launch`'s own calls (torch inputs, kimi-k2.6-tp8),
each issued in bursts of 10 / 25 / 50 / 200 / 400 calls without waiting (the clock stopped before the
synchronisation), and one call timed alone on an idle GPU (best of 200). A call whose time grows with the burst is
held back by the GPU; one whose time falls with it pays something per burst (docs/perf/journal-host.md, host time round 3,
"Measured after that reading").
When: after a change to the launch path, where `bench launch`'s "host us" and the CPU harness disagree.
Run: PYTHONPATH=. python scripts/probe_launch_queue.py [--calls NAME ...]
"""
from __future__ import annotations

import argparse
import time

BURSTS = (10, 25, 50, 200, 400)
CALLS = ("tree_verify (auto)", "tree_verify_tail", "merge_states", "tree_build")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", nargs="*", default=list(CALLS), help=f"bench launch rows (default: {', '.join(CALLS)})")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True, torch=True)
    import torch

    from ddtree_gen.bench.launch import call_table, host_us, tiny_inputs
    from ddtree_gen.kernel_set import load
    from ddtree_gen.spec import find_spec
    spec = find_spec("kimi-k2.6-tp8")
    table = call_table(load(spec), spec, tiny_inputs(spec, "torch"))
    sync = torch.cuda.synchronize
    print(f"{'call':<22} " + " ".join(f"{n:>6}" for n in BURSTS) + "   one call, idle GPU   (us per call)")
    for name in args.calls:
        fn = table[name].plain
        bursts = [host_us(fn, sync, calls=n) for n in BURSTS]
        for _ in range(20):
            fn()
        sync()
        alone = float("inf")
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync()
            alone = min(alone, (t1 - t0) * 1e6)
        print(f"{name:<22} " + " ".join(f"{b:6.1f}" for b in bursts) + f"   {alone:.1f}", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Tune the split-KV table of tree_verify_wgmma: time the kernel (with its combine) at every useful split
count, per spec and batch size, and pick the fastest per shape class (B x row tiles rounded up to a
power of two, as ops/tree_verify/split.choose_splits looks it up).
When: on the GPU after changing templates/tree_verify_wgmma.cu.j2 or the combine kernel, or on a new GPU
model. --write stores the table under specs.<spec>.wgmma in ddtree_gen/ops/tree_verify/tree_verify_tuning.json
(the mma.sync table beside it is scripts/tune_tree_verify.py's and is kept).
Run: PYTHONPATH=. python scripts/sweep_splits.py [SPEC ...] [--L 4096] [--batches 1 8 32] [--write]
It prints, per (spec, B), every split count's time (attention + combine) and the combine's alone, then a
summary: the split count used before the table (the mma.sync table) against the best.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import ddtree_gen
from ddtree_gen.build import artifacts
from ddtree_gen.bench.timing import call_time_ms
from ddtree_gen.inputs import chain_verify_inputs
from ddtree_gen.ops.tree_verify import split as mod
from ddtree_gen.ops.tree_verify import mma as mma_plans
from ddtree_gen.spec import all_specs, find_spec

BATCHES = (1, 2, 4, 8, 16, 32, 64)
MAX_SPLITS = 16
MAX_WAVES = 8          # split counts whose blocks exceed this many waves are not timed


def inputs(spec, b, L, nq):
    """chain_verify_inputs, with an e4m3 cache (no NaN byte) and kv_scale for an fp8 spec."""
    import cupy
    dev = chain_verify_inputs(spec, b, L, nq)
    extra = {}
    if spec.kv_fp8:
        x = cupy.random.randint(0, 256, dev["kv_cache"].shape, dtype=np.int32).astype(np.uint8)
        x[(x & 0x7F) == 0x7F] = 0
        dev["kv_cache"] = x
        extra["kv_scale"] = 0.5
    return dev, extra


def sweep(ks, spec, b, L, nq, sms):
    """{splits: (ms attention + combine, ms combine alone or None)} for one shape."""
    import cupy
    dev, extra = inputs(spec, b, L, nq)
    base = b * -(-nq * spec.num_heads // mod.BM)
    useful = max(1, -(-(L + nq) // (2 * 64)))
    choices = [s for s in range(1, MAX_SPLITS + 1) if s == 1 or (s <= useful and base * s <= MAX_WAVES * sms)]
    out = cupy.empty(dev["q_nope"].shape[:3] + (spec.kv_lora_rank,), np.uint16)
    lse = cupy.empty(dev["q_nope"].shape[:3], np.float32)
    ws = cupy.empty(max(1, mod.workspace_elems(spec, b, nq, max(choices))), np.float32)
    times = {}
    for s in choices:
        def call(s=s):
            ks.tree_verify_wgmma(**dev, softmax_scale=192 ** -0.5, out=out, lse=lse, workspace=ws, num_splits=s,
                                 **extra)
        total = call_time_ms(call)
        comb = None
        if s > 1:   # the combine kernel alone, on the partials the call left
            comb = call_time_ms(lambda s=s: ks.tree_verify_mma_combine(ws, dev["prefix_lens"], dev["q_lens"], s, out, lse))
        times[s] = (total, comb)
    return base, times


def main(argv=None) -> int:
    import cupy
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="*", help="spec names (default: every spec)")
    p.add_argument("--L", type=int, default=4096, help="prefix length (default 4096)")
    p.add_argument("--nq", type=int, default=65, help="query tokens per request (default 65, at most N)")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--write", action="store_true", help="store the table in the tuning file")
    args = p.parse_args(argv)
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True)
    sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    specs = [find_spec(n) for n in args.specs] if args.specs else all_specs()
    summary, tables = [], {}
    for spec in specs:
        ks = ddtree_gen.load(spec, kernels=["tree_verify_wgmma", mod.COMBINE])
        nq = min(args.nq, spec.max_tree_size)
        best_by_class, measured = {}, {}
        for b in args.batches:
            base, times = sweep(ks, spec, b, args.L, nq, sms)
            print(f"{spec.name} B={b} L={args.L} Nq={nq} base={base}")
            print("  " + " ".join(f"{s}:{t * 1e3:.0f}" for s, (t, _) in times.items()) + "  (us, attention + combine)")
            if len(times) > 1:
                print("  " + " ".join(f"{s}:{c * 1e3:.0f}" for s, (_, c) in times.items() if c is not None)
                      + "  (us, combine alone)")
            before = mod.choose_splits(spec, b, nq, args.L + nq, 64, sms, *mma_plans.split_rule(spec))
            best = min(times, key=lambda s: times[s][0])
            t_before = times[before][0] if before in times else float("nan")
            summary.append((spec.name, b, base, before, t_before, best, times[best][0]))
            cls = mod.shape_class(base)
            if cls not in best_by_class or b > best_by_class[cls][0]:   # the largest B of a class decides
                best_by_class[cls] = (b, best)
            measured[f"B={b},L={args.L}"] = {str(s): round(t * 1e3, 1) for s, (t, _) in times.items()}
            cupy.get_default_memory_pool().free_all_blocks()
        tables[spec.name] = {"splits": {c: s for c, (_, s) in best_by_class.items()}, "measured_us": measured,
                             "device": device, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"\n{'spec':<18} {'B':>3} {'base':>5} {'before s':>8} {'us':>8} {'best s':>6} {'us':>8} {'gain':>6}")
    for name, b, base, before, tb, best, tt in summary:
        print(f"{name:<18} {b:>3} {base:>5} {before:>8} {tb * 1e3:>8.1f} {best:>6} {tt * 1e3:>8.1f} {tb / tt:>6.2f}x")
    if args.write:
        path = mod.TUNING_FILE
        data = json.loads(path.read_text())
        for name, entry in tables.items():
            data.setdefault("specs", {}).setdefault(name, {})["wgmma"] = entry
        artifacts.atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote the wgmma split tables of {', '.join(tables)} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

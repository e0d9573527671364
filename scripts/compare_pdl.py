#!/usr/bin/env python
"""tree_verify's split-KV combine launched as a programmatic dependent of the attention kernel (split.PDL_COMBINE on:
cuLaunchKernelEx with programmatic stream serialization, launch/pdl.py; griddepcontrol.wait in the combine) against
the plain second launch (PDL_COMBINE off, the default), at small batches where the gap between the two launches is
a visible part of the call: the default call (impl "auto"), CUDA-graph replay medians in one process, PDL off, on and
their ratio, FlashMLA's dense decode beside them (same FLOPs, no mask) where it is importable (docs/benchmarks.md);
the two launches' outputs must be bitwise equal. A shape whose call does not split has no combine: its ratio is noise.
When: on a GPU, before turning split.PDL_COMBINE on (off until this has run), and after a change to the combine's
launch or template.
Run: PYTHONPATH=. python scripts/compare_pdl.py [--per-graph N] [--reps N] [--no-flashmla]
"""
from __future__ import annotations

import argparse

import numpy as np

SHAPES = [(1, 8, 65, 4096), (1, 8, 22, 65536), (4, 8, 32, 8192), (1, 64, 30, 16384)]   # B, H, Nq, L


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-graph", type=int, default=10, help="calls captured in one CUDA graph (default 10)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed, their median reported (default 20)")
    ap.add_argument("--no-flashmla", action="store_true", help="leave FlashMLA's column out")
    args = ap.parse_args(argv)
    if args.per_graph < 1 or args.reps < 1:
        ap.error("--per-graph and --reps: at least 1")
    return args


def label(b: int, h: int, nq: int, keys: int) -> str:
    return f"B={b} H={h} Nq={nq} L={keys}"


def main(argv=None) -> None:
    args = parse_args(argv)
    from ddtree_gen import needs
    needs.script_requires(__file__)
    import cupy
    from ddtree_gen.bench.peers import flashmla_peers
    from ddtree_gen.bench.specs import SPEC_BY_HEADS
    from ddtree_gen.bench.timing import graph_time_ms
    from ddtree_gen.bench.tree_verify import SWEEP_KERNELS
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load
    from ddtree_gen.ops.tree_verify import split
    from ddtree_gen.spec import find_spec

    kits, rows = {}, []
    for b, h, nq, keys in SHAPES:
        spec = find_spec(SPEC_BY_HEADS[h])
        if spec.name not in kits:   # (FlashMLA's split-path peer runs our tail and merge)
            kits[spec.name] = load(spec, kernels=list(SWEEP_KERNELS))
        ks = kits[spec.name]
        x = verify_inputs(spec, b, np.full(b, keys), nq)
        device = x["q_nope"].device.id
        plan = ks.tree_verify_schedule(b, nq, x["block_table"].shape[1], device=device)
        ws = cupy.empty(max(plan.workspace, 1), np.float32)
        times, bits = {}, {}
        for on in (False, True):
            split.PDL_COMBINE = on   # (a key of the call cache: each setting its own prepared call)
            try:
                res = ks.tree_verify(**x, workspace=ws)
                cupy.cuda.get_current_stream().synchronize()
                bits[on] = (cupy.asnumpy(res.out), cupy.asnumpy(res.lse).view(np.uint32))
                times[on] = 1e3 * graph_time_ms(
                    lambda r=res: ks.tree_verify(**x, out=r.out, lse=r.lse, workspace=ws),
                    per_graph=args.per_graph, reps=args.reps)
            finally:
                split.PDL_COMBINE = False
        # the combine launched so on this device (its sm_90a build: the one that waits for the partials)
        pdl = plan.combine and ks.arch_for(split.COMBINE, device) in split.PDL_TARGETS
        same = all((bits[False][k] == bits[True][k]).all() for k in (0, 1))
        fm = None
        if not args.no_flashmla:
            peers = [fn for name, fn in flashmla_peers(ks, x).items() if name.startswith("FlashMLA")]
            fm = 1e3 * graph_time_ms(peers[0], per_graph=args.per_graph, reps=args.reps) if peers else None
        rows.append((label(b, h, nq, keys), f"{plan.grid} x{plan.pieces}", pdl, times[False], times[True], fm, same))
        print(rows[-1], flush=True)
    print(f"\n{'shape':<26} {'schedule':>12} {'PDL':>4} {'off us':>8} {'on us':>8} {'on / off':>8} {'FlashMLA us':>11} "
          f"{'off / FM':>8} {'on / FM':>8} {'bits':>5}")
    for name, sched, pdl, off, on, fm, same in rows:
        peer = f"{fm:11.1f} {off / fm:8.2f} {on / fm:8.2f}" if fm else f"{'-':>11} {'-':>8} {'-':>8}"
        print(f"{name:<26} {sched:>12} {'yes' if pdl else 'no':>4} {off:8.1f} {on:8.1f} {on / off:8.3f} {peer} "
              f"{'same' if same else 'DIFF':>5}")
    if not all(r[-1] for r in rows):
        raise SystemExit("PDL changed the outputs (a race: the combine read partials before they were written?)")


if __name__ == "__main__":
    main()

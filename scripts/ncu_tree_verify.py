#!/usr/bin/env python
"""Where a tree_verify call's time goes, by Nsight Compute: the attention kernel and the split-KV combine of one call,
each's duration, SM and tensor-pipe activity, L2 and DRAM traffic and its main warp stalls, at the shapes issue 45 names
(B = 1, H = 8, Nq = 65, 4k keys: the 20 us goal; one request of 65k keys; a ragged batch on the parts grid), for the
default build or a page_loads build (--loads). The graph-replay time of the same call (scripts/compare_*.py, bench)
minus the two durations is what the launches and the gap between them cost.
When: on a GPU before and after a change to tree_verify_wgmma's schedule or loads (issue 45: "measure the limit
first"). The metrics are probe_l2_feed.py's FEED_METRICS that this ncu knows.
Run: PYTHONPATH=. python scripts/ncu_tree_verify.py [--shape B,H,NQ,L ...] [--loads producer] [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

from ddtree_gen.bench.specs import SPEC_BY_HEADS

SHAPES = ["1,8,65,4096", "1,8,22,65536", "8,8,32,8192"]   # B, H, Nq, keys a request
# the columns of the table (ncu's raw names; absent ones are left out) and their short names
COLUMNS = [("gpu__time_duration.sum", "time"), ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM %"),
           ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed", "gmma %"),
           ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "L2 %"),
           ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM %"),
           ("smsp__warp_issue_stalled_barrier_per_warp_active.pct", "st.bar"),
           ("smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct", "st.long"),
           ("smsp__warp_issue_stalled_wait_per_warp_active.pct", "st.wait"),
           ("smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct", "st.math")]


def parse_shape(text: str) -> tuple:
    try:
        b, h, nq, keys = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected B,H,NQ,L (four integers)") from None
    if h not in SPEC_BY_HEADS or min(b, nq, keys) < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: B, NQ, L >= 1 and H one of {sorted(SPEC_BY_HEADS)}")
    return b, h, nq, keys


def target(shape: tuple, loads: str) -> None:
    """Three calls of tree_verify at `shape` (the default route, or the chunks / parts build with page_loads `loads`)."""
    import cupy
    import numpy as np

    from ddtree_gen.bench.tree_verify import SWEEP_KERNELS
    from ddtree_gen.build.variant import variant
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load, variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.spec import find_spec
    b, h, nq, keys = shape
    spec = find_spec(SPEC_BY_HEADS[h])
    x = verify_inputs(spec, b, np.full(b, keys), nq)
    if loads == "default":
        ks = load(spec, kernels=list(SWEEP_KERNELS))
        call = lambda: ks.tree_verify(**x)                       # noqa: E731
    else:
        v = variant(by_name("tree_verify_wgmma"), spec, grid="parts" if b > 1 else "chunks", page_loads=loads)
        ks = variant_set([v], also=[COMBINE])
        call = lambda: ks.tree_verify_wgmma(**x)                 # noqa: E731
    for _ in range(3):
        call()
    cupy.cuda.Device().synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", action="append", type=parse_shape, help=f"B,H,NQ,L (repeatable; default {SHAPES})")
    ap.add_argument("--loads", default="default", choices=("default", "serial", "spread", "producer"),
                    help="the default route, or tree_verify_wgmma with this page_loads (default: the route)")
    ap.add_argument("--out", help="write ncu's raw CSV of each shape to OUT/ncu_<shape>.csv")
    ap.add_argument("--target", type=parse_shape, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.target:
        target(a.target, a.loads)
        return 0
    from ddtree_gen import needs
    needs.script_requires(__file__)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from probe_l2_feed import FEED_METRICS, find_ncu, known_metrics
    ncu = find_ncu()
    if not ncu:
        print("error: scripts/ncu_tree_verify.py needs Nsight Compute (ncu): not on PATH", file=sys.stderr)
        return needs.EXIT_MISSING
    metrics = known_metrics(ncu, FEED_METRICS)
    shapes = a.shape or [parse_shape(s) for s in SHAPES]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    print(f"{'shape':<20} {'kernel':<28}" + "".join(f"{short:>9}" for _, short in COLUMNS))
    rc = 0
    for shape in shapes:
        tag = "B={} H={} Nq={} L={}".format(*shape)
        # every launch of the three calls (the attention kernel and, where the call splits, the combine); the table
        # shows each kernel's last (the third call's: caches warm)
        cmd = [ncu, "--target-processes", "all", "--clock-control", "none", "-k", "regex:tree_verify",
               "--launch-count", "6", "--csv", "--page", "raw", "--metrics", ",".join(metrics),
               sys.executable, os.path.abspath(__file__), "--target", ",".join(map(str, shape)), "--loads", a.loads]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        text = r.stdout[r.stdout.find('"ID"'):] if '"ID"' in r.stdout else ""
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "ncu_{}_{}_{}_{}.csv".format(*shape)), "w") as f:
                f.write(r.stdout + r.stderr)
        rows = list(csv.DictReader(io.StringIO(text)))
        if r.returncode != 0 or len(rows) < 2:
            print(f"{tag:<20} ncu failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}")
            rc = 1
            continue
        last = {}
        for row in rows[1:]:                      # rows[0]: the units
            last[row.get("Kernel Name", "?").split("(")[0]] = row
        for name, row in last.items():
            cells = "".join(f"{row.get(m, '-'):>9}" for m, _ in COLUMNS)
            print(f"{tag:<20} {name[-28:]:<28}{cells}")
    print(f"(time in {rows[0].get('gpu__time_duration.sum', '?') if rows else '?'}; the loads: {a.loads})")
    return rc


if __name__ == "__main__":
    sys.exit(main())

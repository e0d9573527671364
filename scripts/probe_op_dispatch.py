#!/usr/bin/env python
"""Where a torch op's time over its plain call goes, without a GPU (docs/perf/journal-host.md "Host time per eager call, round 4").

When: before changing how torch_ops registers or dispatches the ops, to see which part of op - plain a change
can reach. How: scripts/profile_launch.py's stand-in kernel set and calls (ddtree_gen.bench.stand_in and
ddtree_gen.bench.launch.call_table: torch CPU tensors standing for CUDA ones, the ops' implementations registered
for the CPU key). Per op, us per call (this thread's CPU time, best of
5 x --calls):
  plain       the plain launcher, called in a loop (what profile_launch.py reports)
  op          the torch op
  dispatcher  the op with its implementation replaced by one returning a fixed result of the right kind: the
              dispatcher's own cost for this schema and these arguments (argument and result conversion)
  penalty     op - dispatcher - plain: what the plain call costs more when it runs after the dispatcher
  after null  how much more the plain call costs when a null op (one tensor, no result) runs before it, outside
              any op: the same kind of penalty with no op around the call
Run: PYTHONPATH=. python scripts/probe_op_dispatch.py [--spec kimi-k2.6-tp8] [--calls 2000]
"""
from __future__ import annotations

import argparse
import sys
import warnings

from ddtree_gen.bench.launch import KV_COMMIT, KV_STACKED

OPS = {"tree_build": "tree_build", "tree_verify (auto)": "tree_verify", "tree_verify_tail": "tree_verify_tail",
       "merge_states": "merge_states", "tree_accept": "tree_accept", "tree_walk": "tree_walk",
       KV_COMMIT: "kv_commit", KV_STACKED: "kv_commit_stacked", "draft_topk": "draft_topk"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="kimi-k2.6-tp8", help="spec name (default kimi-k2.6-tp8)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per timing run (best of 5)")
    args = ap.parse_args(argv)
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=False, torch=True)   # (its CPU build is enough)
    import torch

    from ddtree_gen import torch_ops
    from ddtree_gen.bench.launch import per_call_us
    from ddtree_gen.bench.stand_in import harness
    from ddtree_gen.spec import find_spec
    spec = find_spec(args.spec)
    h = harness(spec)
    lib, table = h.library, h.calls
    null = torch.library.Library("ddtree_probe", "DEF")
    null.define("null(Tensor a) -> ()")
    null.impl("null", lambda a: None, "CPU")
    one = torch.zeros(4)
    null_op = torch.ops.ddtree_probe.null
    us = per_call_us
    n = args.calls
    base = us(lambda: null_op(one), n)
    print(f"us per call, spec {spec.name}, this machine's CPU time (best of 5 x {n}); a null op alone: {base:.1f}")
    print(f"{'call':<22} {'plain':>6} {'op':>6} {'dispatcher':>11} {'penalty':>8} {'after null':>11}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the replaced CPU kernels ("Overriding a previously registered kernel")
        for row, name in OPS.items():
            if row not in table or table[row].op is None:
                continue
            plain, op = table[row].plain, table[row].op
            impl = torch_ops.implementation(name)
            p, o = us(plain, n), us(op, n)
            result = op()
            lib.impl(name, lambda *a, r=result: r, "CPU")
            d = us(op, n)
            lib.impl(name, impl, "CPU")
            after = us(lambda: (null_op(one), plain()), n) - base - p
            print(f"{row:<22} {p:6.1f} {o:6.1f} {d:11.1f} {o - d - p:8.1f} {after:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

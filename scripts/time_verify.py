"""Quick timing of the tensor-core tree_verify kernels on the issue's shapes (a development aid;
`ddtree-gen bench tree_verify` is the full benchmark with peers and plot).

PYTHONPATH=. python scripts/time_verify.py [impl ...]     (default: wgmma mma)
Prints ms (CUDA-graph replay median), TFLOP/s and % of the bf16 matmul peak measured in the run.
"""
from __future__ import annotations

import sys

import numpy as np

import ddtree_gen
from ddtree_gen import artifacts
from ddtree_gen.bench import SPEC_BY_HEADS, graph_time_ms, measured_peak_tflops, verify_inputs

CONFIGS = [(1, 8, 4096), (32, 8, 4096), (8, 16, 4096), (8, 64, 4096), (8, 128, 4096), (8, 64, 512),
           (8, 64, 16384)]


def main(impls):
    peak = measured_peak_tflops()
    nq = 65
    print(f"peak {peak:.0f} TFLOP/s")
    rows = []
    for b, h, l in CONFIGS:
        spec = artifacts.find_spec(SPEC_BY_HEADS[h])
        ks = ddtree_gen.load(spec)
        x = verify_inputs(spec, b, np.full(b, l), nq)
        flops = 2 * h * nq * (l + nq) * (2 * spec.kv_lora_rank + spec.qk_rope_head_dim) * b
        row = [f"B={b} H={h} L={l}"]
        for impl in impls:
            out = ks.tree_verify(**x, impl=impl)
            ms = graph_time_ms(lambda: ks.tree_verify(**x, out=out.out, lse=out.lse, impl=impl), per_graph=5, reps=10)
            tf = flops / (ms * 1e-3) / 1e12
            row.append(f"{impl} {ms:.3f} ms {tf:.0f} TF {100 * tf / peak:.1f}%")
        rows.append(row)
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["wgmma", "mma"])

"""`ddtree-gen bench draft_topk`: the kernel next to torch.topk + logsumexp (what engines run today) on the
same bf16 logits, and the floor: a read-only kernel that reads the same logits once (and does nothing else),
timed in the same run."""
from __future__ import annotations

import numpy as np

from .. import reference
from .peers import torch_topk
from .timing import graph_time_ms, print_table, torch_graph_time_ms

# The floor: every 16-byte vector of the logits read once, over a grid that fills the GPU (READ_BLOCKS_PER_SM blocks of
# 256 threads an SM, a grid stride, four independent loads in flight per thread), folded into one word per warp so the
# loads cannot be dropped. A read-only pass runs at the HBM read rate, not at the copy rate (read + write) this bench
# used before (2764 GB/s on an H200: it overstated draft_topk's share of the floor, 83-89 % at B = 64 for 54-59 %).
READ_ONLY_SRC = r"""
extern "C" __global__ void __launch_bounds__(256) read_once(const uint4* __restrict__ p, long long n,
                                                            unsigned* __restrict__ out) {
    unsigned acc = 0u;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = __ldg(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    for (int o = 16; o >= 1; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) out[(blockIdx.x * blockDim.x + threadIdx.x) >> 5] = acc;
}
"""
READ_BLOCKS_PER_SM = 8


def read_only_time_us(x, sms: int) -> float:
    """CUDA-graph replay median (us) of the read-only kernel over x's bytes (a CuPy array, a multiple of 16 bytes)."""
    import cupy
    kern = cupy.RawKernel(READ_ONLY_SRC, "read_once")
    n = x.nbytes // 16
    assert n * 16 == x.nbytes
    grid = sms * READ_BLOCKS_PER_SM
    out = cupy.zeros(grid * 256 // 32, np.uint32)
    vecs = x.reshape(-1).view(np.uint8)
    return graph_time_ms(lambda: kern((grid,), (256,), (vecs, np.int64(n), out)), per_graph=10) * 1e3


def table_row(v: int, b: int, dp: int, nbytes: int, floor_us: float, ours_us: float, torch_us: float, ok: bool) -> list:
    """One row of the table: the shape, the read-only floor (us and its read rate), ours and torch's times and each as
    a % of the floor (floor / time), the speedup, the check."""
    return [v, b, b * dp, f"{nbytes / 1e6:.1f}", f"{floor_us:.1f}", f"{nbytes / (floor_us * 1e-6) / 1e9:.0f}",
            f"{ours_us:.1f}", f"{100 * floor_us / ours_us:.0f}%", f"{torch_us:.1f}", f"{100 * floor_us / torch_us:.0f}%",
            f"{torch_us / ours_us:.1f}x", "yes" if ok else "NO"]


HEADER = ["V", "B", "rows", "MB", "floor us", "read GB/s", "ours us", "% floor", "torch us", "torch % floor", "speedup",
          "checked"]


def run(args) -> None:
    """draft_topk next to torch.topk + logsumexp (what engines run today) on the same bf16 logits, B = 1, 8, 64,
    D' = 15, k = 64, V = 129280 (DeepSeek-V3) and 163840 (Kimi K2): CUDA-graph replay medians of both, and the floor:
    a read-only kernel reading the same logits once, timed in this run (% floor = its time / ours)."""
    import cupy
    import torch
    from ..spec import find_spec
    from ..kernel_set import load
    from ..ops.draft_topk.launch import workspace_elems
    from ..launch.runtime import sm_count
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec, kernels=["draft_topk"])
    k, dp = min(64, spec.max_tree_size - 1), min(15, spec.max_depth)
    sms = sm_count(cupy.cuda.Device().id)
    rows = []
    rng = np.random.default_rng(0)
    for v in (129280, 163840):
        for b in (1, 8, 64):
            t = (torch.randn(b, dp, v, device="cuda") * 3).to(torch.bfloat16)
            x = cupy.asarray(t.view(torch.int16)).view(np.uint16)          # the same bytes, CuPy bf16 bits
            out = ks.draft_topk(x, k)
            ws = cupy.empty(max(1, workspace_elems(b, dp, v, k)), np.int32)
            floor = read_only_time_us(x, sms)
            ours = graph_time_ms(lambda: ks.draft_topk(x, k, out=out, workspace=ws), per_graph=10) * 1e3
            theirs = torch_graph_time_ms(lambda: torch_topk(t, k)) * 1e3
            # checks: against the numpy reference on two rows (ids bit-exact, log-probs within the bar)
            pick = rng.integers(0, b * dp, 2)
            host = cupy.asnumpy(x).reshape(b * dp, v)[pick][None]
            want = reference.draft_topk(host, k)
            got_ids = cupy.asnumpy(out.topk_ids).reshape(b * dp, k)[pick][None]
            got_lps = cupy.asnumpy(out.topk_logprobs).reshape(b * dp, k)[pick][None].astype(np.float64)
            ok = (np.array_equal(got_ids, want.topk_ids) and
                  np.all(np.abs(got_lps - want.topk_logprobs) <= 1e-5 + 2.0**-22 * np.abs(want.topk_logprobs)))
            rows.append(table_row(v, b, dp, b * dp * v * 2, floor, ours, theirs, ok))
            del t, x, out, ws
    print_table(f"draft_topk on {spec.name} (k={k}, D'={dp}, bf16 logits); GPU times: CUDA-graph replay medians per "
                f"call; floor: a read-only kernel reading the same logits once ({sms} x {READ_BLOCKS_PER_SM} blocks of "
                f"256 threads, a grid stride), timed in this run; % floor: its time / ours; torch: torch.topk + "
                f"logsumexp (fp32) on the same logits; checked: two rows against reference.draft_topk",
                HEADER, rows, args.out, "bench_draft_topk")

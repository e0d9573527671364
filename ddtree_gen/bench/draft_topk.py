"""`ddtree-gen bench draft_topk`: the kernel next to torch.topk + logsumexp (what engines run today) on the
same bf16 logits, and the bandwidth floor (the logits read once at the copy rate measured in this run)."""
from __future__ import annotations

import numpy as np

from .. import reference
from .peers import torch_topk
from .timing import copy_bandwidth_gbs, graph_time_ms, print_table, torch_graph_time_ms


def run(args) -> None:
    """draft_topk next to torch.topk + logsumexp (what engines run today) on the same bf16 logits, B = 1, 8, 64,
    D' = 15, k = 64, V = 129280 (DeepSeek-V3) and 163840 (Kimi K2): CUDA-graph replay medians of both, and the
    bandwidth floor (the logits read once at the device-to-device copy rate measured in this run)."""
    import cupy
    import torch
    from ..spec import find_spec
    from ..kernel_set import load
    from ..kernels.draft_topk import workspace_elems
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec, kernels=["draft_topk"])
    k, dp = min(64, spec.max_tree_size - 1), min(15, spec.max_depth)
    gbs = copy_bandwidth_gbs()
    rows = []
    rng = np.random.default_rng(0)
    for v in (129280, 163840):
        for b in (1, 8, 64):
            t = (torch.randn(b, dp, v, device="cuda") * 3).to(torch.bfloat16)
            x = cupy.asarray(t.view(torch.int16)).view(np.uint16)          # the same bytes, CuPy bf16 bits
            out = ks.draft_topk(x, k)
            ws = cupy.empty(max(1, workspace_elems(b, dp, v, k)), np.int32)
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
            nbytes = b * dp * v * 2
            floor = nbytes / (gbs * 1e9) * 1e6
            rows.append([v, b, b * dp, f"{nbytes / 1e6:.1f}", f"{floor:.1f}", f"{ours:.1f}", f"{100 * floor / ours:.0f}%",
                         f"{theirs:.1f}", f"{100 * floor / theirs:.0f}%", f"{theirs / ours:.1f}x", "yes" if ok else "NO"])
            del t, x, out, ws
    print_table(f"draft_topk on {spec.name} (k={k}, D'={dp}, bf16 logits); GPU times: CUDA-graph replay medians per "
                f"call; floor: the logits read once at the device copy rate measured now ({gbs:.0f} GB/s, read + "
                f"write); torch: torch.topk + logsumexp (fp32) on the same logits; checked: two rows against "
                f"reference.draft_topk",
                ["V", "B", "rows", "MB", "floor us", "ours us", "% floor", "torch us", "torch % floor", "speedup",
                 "checked"], rows, args.out, "bench_draft_topk")

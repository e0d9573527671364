"""tree_verify's schedule on the GPU: a CUDA graph captured once replays correctly when the lengths change.

The schedule's counts (the grid, the chunks or parts) come from shapes only, and the parts grid cuts the batch's work
from prefix_lens and q_lens on the device in every block (docs/engine.md "The schedule"): so a graph captured with
one set of lengths, replayed after new lengths were written in place, gives the eager call's bits on the new lengths.
Checked for the default call (impl "auto") on a ragged batch with a long block table (the parts grid) and on one
request (the chunks grid), with every row < q_len written, the rows past it untouched, against the float64 bar too.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_gpu_tree_verify import check_against, check_rows_written, poisoned, reference_for
from verify_cases import fresh_seed, make_inputs, random_bf16_normal, to_host

pytestmark = pytest.mark.gpu

# (lengths, q_lens) captured, then (lengths, q_lens) replayed: each request's new keys fit the pages it was given
CASES = {
    "ragged B=4": (([9000, 300, 12000, 64], [65, 65, 65, 65]), ([100, 250, 11990, 0], [65, 20, 40, 1])),
    "B=1": (([20000], [65]), ([5000], [30])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_graph_replays_new_lengths(spec, case):
    import cupy
    from ddtree_gen.kernel_set import load
    from ddtree_gen.ops.tree_verify.which import schedule
    from ddtree_gen.ops.tree_verify import split as split_kv
    if spec.kv_fp8:
        pytest.skip(f"spec {spec.name!r}: an fp8 spec's default path is covered by test_gpu_kv_dequant."
                    f"test_dequant_path_torch_op_and_cuda_graph (its graph replays new q and cache)")
    ks = load(spec)
    (lens, qlens), (lens2, qlens2) = CASES[case]
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, lens, qlens, "random", seed=seed, bf16=random_bf16_normal)
    b, nq = inp.shape[:2]
    dev = inp.device()
    plan = schedule(ks, b, nq, inp.block_table.shape[1], device=dev["q_nope"].device.id)
    want_grid = "parts" if b > 1 else "chunks"
    assert plan.grid == want_grid, plan
    ws = cupy.empty(max(split_kv.workspace_elems(spec, b, nq, split_kv.MAX_SPLITS),
                        split_kv.parts_workspace_elems(spec, b, nq, split_kv.MAX_PARTS)), np.float32)
    scale = 192 ** -0.5
    out, lse = poisoned(inp.shape)
    ks.tree_verify(**dev, softmax_scale=scale, out=out, lse=lse, workspace=ws)   # prepared outside the capture
    cupy.cuda.get_current_stream().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        ks.tree_verify(**dev, softmax_scale=scale, out=out, lse=lse, workspace=ws)
        graph = stream.end_capture()
    # the new lengths, in place
    dev["prefix_lens"].set(np.asarray(lens2, np.int32))
    dev["q_lens"].set(np.asarray(qlens2, np.int32))
    cupy.cuda.get_current_stream().synchronize()
    g_out, g_lse = poisoned(inp.shape)
    out[...] = g_out
    lse[...] = g_lse
    cupy.cuda.get_current_stream().synchronize()
    graph.launch(stream)
    stream.synchronize()
    eager_o, eager_l = poisoned(inp.shape)
    ks.tree_verify(**dev, softmax_scale=scale, out=eager_o, lse=eager_l, workspace=cupy.empty_like(ws))
    cupy.cuda.get_current_stream().synchronize()
    tag = f"{spec.name} {case} seed={seed}"
    got_o, got_l, want_o, want_l = to_host(out), to_host(lse), to_host(eager_o), to_host(eager_l)
    check_rows_written(got_o, got_l, np.asarray(qlens2), f"{tag} replay")
    assert (got_o == want_o).all(), f"{tag}: the replay's out differs from the eager call's on the new lengths"
    assert (got_l.view(np.uint32) == want_l.view(np.uint32)).all(), f"{tag}: lse differs"
    # and the float64 bar on the new lengths, on the first and the last head
    heads = np.array(sorted({0, spec.num_heads - 1}))
    new = {"prefix_lens": np.asarray(lens2, np.int32), "q_lens": np.asarray(qlens2, np.int32)}
    ref = reference_for("tree_verify", inp, scale, heads, **new)
    check_against(got_o, got_l, ref, new["q_lens"], heads, f"{tag} replay vs float64")

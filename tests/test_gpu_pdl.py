"""tree_verify's split-KV combine as a programmatic dependent launch on the GPU (split.PDL_COMBINE, off by default until
measured; launch/pdl.py, griddepcontrol.wait in templates/tree_verify_combine.cu.j2): the bits of the plain launch.

Per spec, calls that split (a forced count and the launcher's own; one request and a ragged batch, which takes the
parts grid on a bf16 spec; tree_verify and tree_verify_tail; an fp8 spec's default call takes its dequantize path):
with the switch on, eager and a captured CUDA graph replayed three times, each into poisoned out / lse and a
workspace filled with NaN just before (a combine that read a partial before the attention kernel wrote it would carry
NaN or stale values into out); every row < q_len written, every row past it untouched, out / lse bitwise those of the
same call with the switch off, which is also held to the float64 bar on two heads. The combine's step is a
programmatic dependent one where its sm_90a build runs, a plain one elsewhere (its sm_80 PTX has no wait).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_gpu_tree_verify import check_against, check_rows_written, poisoned, reference_for
from verify_cases import fresh_seed, make_inputs, random_bf16_normal, to_host

pytestmark = pytest.mark.gpu

SCALE = 192 ** -0.5
# launcher, prefix lens, q lens, num_splits (None: the launcher's own count; where that is one chunk, 4)
CASES = {
    "B=1 auto": ("tree_verify", [20000], [65], None),
    "B=1 5 chunks": ("tree_verify", [3000], [40], 5),
    "ragged B=4 auto": ("tree_verify", [9000, 300, 12000, 64], [65, 20, 40, 1], None),
    "tail 3 chunks": ("tree_verify_tail", [500, 70], [65, 33], 3),
}


def _combine_flags(ks) -> set:
    """The pdl flag of every combine step in ks's prepared calls."""
    from ddtree_gen.launch.runtime import Prepared
    from ddtree_gen.ops.tree_verify.split import COMBINE
    return {s.pdl for p in ks.prepared_calls.values() if isinstance(p, Prepared) for s in p.steps
            if s.kernel == COMBINE}


@pytest.mark.parametrize("case", list(CASES))
def test_pdl_combine_gives_the_plain_launchs_bits(spec, case, monkeypatch):
    import cupy
    import ddtree_gen
    from ddtree_gen.ops.kv_dequant.plan import workspace_elems as kv_workspace_elems
    from ddtree_gen.ops.tree_verify import split as split_kv
    launcher, lens, qlens, splits = CASES[case]
    ks = ddtree_gen.load(spec)
    device = cupy.cuda.Device().id
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, lens, qlens, "random", seed=seed, bf16=random_bf16_normal)
    b, nq = inp.shape[:2]
    max_pages = inp.block_table.shape[1]
    # an fp8 spec's tree_verify: the dequantize path's workspace given (nothing allocated inside the capture)
    kvw = (cupy.empty(kv_workspace_elems(spec, b, max_pages), np.uint16)
           if spec.kv_fp8 and launcher == "tree_verify" else None)

    def plan_of(n):
        return ks.tree_verify_schedule(b, nq, max_pages, device=device, name=launcher, num_splits=n,
                                       kv_workspace=kvw is not None)
    plan = plan_of(splits)
    if not plan.combine and splits is None:
        splits, plan = 4, plan_of(4)
    if not plan.combine:
        pytest.skip(f"{plan.kernel} runs here ({plan.grid} grid): no split-KV combine on this device")
    ws = cupy.empty(max(split_kv.workspace_elems(spec, b, nq, split_kv.MAX_SPLITS),
                        split_kv.parts_workspace_elems(spec, b, nq, split_kv.MAX_PARTS)), np.float32)
    extra = {"workspace": ws, **({"kv_workspace": kvw} if kvw is not None else {})}
    fn, dev = getattr(ks, launcher), inp.device()
    tag = f"{spec.name} {case} ({plan.kernel}, {plan.grid} x{plan.pieces}) seed={seed}"

    def call(out, lse):
        res = fn(**dev, softmax_scale=SCALE, out=out, lse=lse, num_splits=splits, **extra)
        assert res.out is out and res.lse is lse

    def eager(on):
        monkeypatch.setattr(split_kv, "PDL_COMBINE", on)
        ws.fill(np.nan)
        out, lse = poisoned(inp.shape)
        call(out, lse)
        cupy.cuda.get_current_stream().synchronize()
        return to_host(out), to_host(lse)

    want_o, want_l = eager(False)
    check_rows_written(want_o, want_l, inp.q_lens, f"{tag} off")
    heads = np.array(sorted({0, spec.num_heads - 1}))
    check_against(want_o, want_l, reference_for(launcher, inp, SCALE, heads), inp.q_lens, heads, f"{tag} off")

    def same(got_o, got_l, what):
        check_rows_written(got_o, got_l, inp.q_lens, f"{tag} {what}")
        assert (got_o == want_o).all(), f"{tag} {what}: out differs from the plain launch's at " \
                                        f"{np.argwhere(got_o != want_o)[:3].tolist()}"
        assert (got_l.view(np.uint32) == want_l.view(np.uint32)).all(), f"{tag} {what}: lse differs"

    same(*eager(True), "PDL eager")
    pdl = ks.arch_for(split_kv.COMBINE, device) in split_kv.PDL_TARGETS
    assert _combine_flags(ks) == ({False, True} if pdl else {False}), f"{tag}: combine steps {_combine_flags(ks)}"
    # captured with the switch on (prepared by the eager call above), replayed into fresh poison and NaN partials
    out, lse = poisoned(inp.shape)
    cupy.cuda.get_current_stream().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        call(out, lse)
        graph = stream.end_capture()
    for k in range(3):
        p_o, p_l = poisoned(inp.shape)
        out[...] = p_o
        lse[...] = p_l
        ws.fill(np.nan)
        cupy.cuda.get_current_stream().synchronize()   # (the capture stream does not wait for the current one)
        graph.launch(stream)
        stream.synchronize()
        same(to_host(out), to_host(lse), f"PDL graph replay {k}")

"""ddtree_gen.torch_api on the GPU: a step written with the named records gives, bit for bit, what the same step
through the bare ops gives (tests/test_gpu_engine.py's step), eager, compiled (fullgraph) and captured in a CUDA
graph, for a bf16 and an fp8 spec."""
from __future__ import annotations

import numpy as np
import pytest

from test_gpu_engine import SPEC, SPEC_FP8, _load, _need_gpus, _step, _step_inputs, captured_step
from verify_cases import fresh_seed

pytestmark = pytest.mark.gpu


def _records_step(ks, x, kv, kv_layers):
    """_step of test_gpu_engine written with torch_api: the same calls, fields read by name."""
    import torch
    tree = ks.tree_build(x["ids"], x["lps"], x["roots"], x["prefix"], 64)
    q_lens = torch.full_like(x["prefix"], x["q_nope"].shape[1])
    att = ks.tree_verify(x["q_nope"], x["q_pe"], kv, x["table"], x["prefix"], q_lens, tree.tree_mask, 0.07,
                         kv_scale=x["kv_scale"])
    target = torch.where(tree.first_child >= 0, torch.gather(tree.tokens, 1, tree.first_child.clamp(min=0).long()),
                         x["target"])
    acc = ks.tree_accept(tree, target, x["prefix"], kv, x["table"])
    walk = ks.tree_accept(tree, target, x["prefix"])
    ks.kv_commit(walk, x["prefix"], kv_layers, x["table"])
    return (*tree, *att, *acc, *walk)


def _same(got, want):
    import torch
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.view(torch.uint8) if g.dtype.is_floating_point else g,
                           w.view(torch.uint8) if w.dtype.is_floating_point else w)


@pytest.mark.parametrize("mode", ["eager", "dispatcher", "compiled", "graph"])
@pytest.mark.parametrize("spec_name", [SPEC, SPEC_FP8])
def test_records_step_is_the_ops_step(spec_name, mode):
    torch = _need_gpus(1)
    import ddtree_gen.torch_api
    x = _step_inputs(_load(spec_name).spec, torch, np.random.default_rng(fresh_seed()))
    ks = ddtree_gen.torch_api.load(spec_name, dispatcher=mode == "dispatcher")
    kv_ops, kv_rec = x["kv"].clone(), x["kv"].clone()
    layers_ops, layers_rec = [x["kv"].clone() for _ in range(2)], [x["kv"].clone() for _ in range(2)]
    want = _step(x, kv_ops, layers_ops)
    if mode in ("eager", "dispatcher"):
        got = _records_step(ks, x, kv_rec, layers_rec)
    elif mode == "compiled":
        torch._dynamo.reset()
        got = torch.compile(_records_step, fullgraph=True)(ks, x, kv_rec, layers_rec)
    else:
        got = captured_step(torch, lambda kv, layers: _records_step(ks, x, kv, layers), x["kv"], kv_rec, layers_rec)
    _same(got, want)
    for a, b in zip([kv_rec, *layers_rec], [kv_ops, *layers_ops]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert int(want[-8].max()) > 0   # some request accepted drafts: the commits moved entries

"""`bench step` without a GPU: its table and absolute-cost lines from given times, and plain decoding's attention
(peers.flashmla_decode: FlashMLA at s_q = 1 in every layer) called with the right arguments on a stand-in flash_mla,
or reported as not measured where flash_mla is not importable."""
from __future__ import annotations

import contextlib
import sys
import types

import numpy as np
import pytest

from ddtree_gen.bench import peers, step
from ddtree_gen.bench.specs import LAYERS

PARTS = ("draft_topk", "tree_build", step.VERIFY, "tree_accept + kv_commit")


def _rows():
    # the figures of docs/bench/bench_step.txt (H200, 2026-12-01) at B = 1 and 64
    return [(1, 1613.8, dict(zip(PARTS, (17.5, 13.3, 1569.0, 9.0)))),
            (64, 39623.6, dict(zip(PARTS, (116.6, 14.9, 38516.4, 14.0))))]


def test_table_rows_and_the_absolute_cost_beside_plain_decoding():
    lines = step.step_table("kimi-k2.6-tp8", 15, 64, 4096, 65, _rows(), {1: 610.0}, None)
    assert lines[0].startswith("one DDTree step from the drafter's logits, spec kimi-k2.6-tp8, bf16 logits "
                               "[B, 15, 129280], k = 64, 61 layers, L = 4096, N = 65")
    assert lines[1].split()[:3] == ["B", "step", "draft_topk"]
    assert lines[2].split()[:2] == ["1", "1613.8"] and "1569.0 ( 97.2 %)" in lines[2]
    assert "absolute cost" in lines[4] and "s_q = 1" in lines[4]
    # B = 1: the step, tree_verify a layer (1569.0 / 61 = 25.7), FlashMLA a step and a layer (610 / 61 = 10.0)
    assert lines[5] == (f"B =  1: DDTree step    1613.8 us, tree_verify {1569.0 / LAYERS:7.1f} us a layer; plain "
                        f"decode attention     610.0 us a step, {610.0 / LAYERS:7.1f} us a layer (DDTree step / "
                        f"plain attention: {1613.8 / 610.0:.2f}x)")
    assert "   25.7 us a layer" in lines[5] and "   10.0 us a layer" in lines[5] and "2.65x" in lines[5]
    # B = 64 had no FlashMLA time: said so, with the reason given
    assert lines[6].startswith("B = 64: DDTree step   39623.6 us, tree_verify   631.4 us a layer; ")
    assert lines[6].endswith("plain decode attention not measured (no FlashMLA)")
    why = "flash_mla is not importable (No module named 'flash_mla')"
    assert step.step_table("s", 15, 64, 4096, 65, _rows(), {}, why)[5].endswith(f"not measured ({why})")


def test_flashmla_decode_without_flash_mla_says_why(monkeypatch):
    monkeypatch.delenv("DDTREE_GEN_FLASHMLA", raising=False)
    monkeypatch.setitem(sys.modules, "flash_mla", None)   # an import of it fails, whatever is installed
    fn, why = peers.flashmla_decode([])
    assert fn is None and why.startswith("flash_mla is not importable")


def test_flashmla_decode_calls_every_layer_at_s_q_1(monkeypatch):
    """On a stand-in flash_mla (torch CPU tensors; no stream to switch): one call a layer, each on that layer's cache,
    the first query row of each request (q = [q_nope | q_pe], [B, 1, H, R+P]), L + 1 keys, head_dim_v R, no mask."""
    torch = pytest.importorskip("torch", reason="torch is not installed (optional: pip install -e \".[torch]\")")
    import cupy
    calls = []
    fake = types.ModuleType("flash_mla")
    fake.get_mla_metadata = lambda: ("meta", "splits")
    fake.flash_mla_with_kvcache = lambda *a, **kw: calls.append((a, kw))
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr: None)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: types.SimpleNamespace(ptr=0))
    rng = np.random.default_rng(0)
    b, n, h, r, p, page, pages = 2, 5, 4, 32, 16, 8, 6
    bits = lambda *shape: rng.integers(0, 1 << 16, shape).astype(np.uint16)
    layers = [dict(q_nope=bits(b, n, h, r), q_pe=bits(b, n, h, p), kv_cache=bits(pages, page, r + p),
                   block_table=np.arange(pages, dtype=np.int32).reshape(b, 3), softmax_scale=0.1,
                   prefix_lens=np.array([9, 4], np.int32)) for _ in range(3)]
    fn, why = peers.flashmla_decode(layers)
    assert why is None
    fn()
    assert len(calls) == 3
    for (args, kw), x in zip(calls, layers):
        q, kv, table, lens, dv, meta, splits = args
        assert tuple(q.shape) == (b, 1, h, r + p) and q.dtype == torch.bfloat16
        want = np.concatenate([x["q_nope"][:, :1], x["q_pe"][:, :1]], -1)
        assert np.array_equal(q.view(torch.int16).numpy().view(np.uint16), want)
        assert tuple(kv.shape) == (pages, page, 1, r + p)
        assert np.array_equal(kv.view(torch.int16).numpy().view(np.uint16)[:, :, 0], x["kv_cache"])
        assert lens.tolist() == [10, 5] and lens.dtype == torch.int32 and dv == r
        assert (meta, splits) == ("meta", "splits") and kw == {"softmax_scale": 0.1, "causal": False}
        assert np.array_equal(table.numpy(), x["block_table"])

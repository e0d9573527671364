"""ddtree_gen.hf against transformers' own DeepseekV3 forward, on the CPU (numpy reference attention).

Each case runs the model once over prefix + tree under a 4-D additive tree mask with explicit position ids
(transformers' eager attention) and compares: every layer's attention output on the tree rows (forward hooks on the
model's attention modules) with TreeTarget's, which prefills a paged cache through the adapter and verifies the tree
through reference.tree_verify; and the top-1 token of every tree node. Cases cover yarn on / off (and mscale !=
mscale_all_dim), q_lora_rank set / None, H 8 / 16, 1-2 layers (dense and MoE), prefixes 100-1000, trees of 1-65
nodes, float32 and bf16 caches. The controls (a wrong softmax scale, rope layout, latent layernorm placement) must
give a large error. Also: tensor-parallel ranks, the mask packer, make_spec, write_kv, accept + kv_commit.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import need

torch, _ = need("torch", "transformers")

import ddtree_gen  # noqa: E402
from ddtree_gen import hf, inputs, reference  # noqa: E402
from ddtree_gen.trees import ancestor_mask, pack_tree_mask, tree_parents  # noqa: E402
from ddtree_gen.ops.tree_verify.wgmma import DEQUANT, PARTS_KERNEL  # noqa: E402

# (H, yarn / rope extras, q_lora_rank, rope_interleave, layers, prefix, tree kind, nodes); OTHER_DIMS: other R, P,
# qk_nope_head_dim, v_head_dim and hidden size (the last case)
OTHER_DIMS = dict(kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=48, hidden_size=96)
CASES = [
    pytest.param(8, True, 32, True, 2, 1000, "random", 65, id="h8-yarn-qlora-inter-2l-L1000-n65"),
    pytest.param(16, False, None, False, 1, 100, "chain", 1, id="h16-plain-noqlora-half-1l-L100-n1"),
    pytest.param(16, {"factor": 32.0, "mscale": 0.707}, None, True, 2, 517, "binary", 33,
                 id="h16-yarn32-mscale-noqlora-inter-2l-L517-n33"),
    pytest.param(8, False, 48, False, 2, 250, "star", 9, id="h8-plain-qlora-half-2l-L250-n9"),
    pytest.param(16, True, None, True, 2, 700, "random", 40, id="h16-r128-p32-dn64-dv48-yarn-2l-L700-n40"),
]


def _config(h, yarn, q_lora, inter, layers, other=False):
    kw = dict(**(OTHER_DIMS if other else {}), num_attention_heads=h, num_key_value_heads=h, q_lora_rank=q_lora, rope_interleave=inter,
              num_hidden_layers=layers, yarn=bool(yarn))
    if isinstance(yarn, dict):
        kw["rope"] = yarn
    return hf.tiny_config(**kw)


def _case(h, yarn, q_lora, inter, layers, prefix, kind, nodes, seed=0, other=False):
    model = hf.tiny_model(_config(h, yarn, q_lora, inter, layers, other), seed=seed)
    rng = np.random.default_rng(seed)
    parents = tree_parents(kind, nodes, rng)
    ids = rng.integers(0, model.config.vocab_size, prefix + nodes)
    return model, parents, ids


def _transformers(model, prefix, parents, ids):
    """Tree rows' logits and each layer's attention output from the model's own forward (4-D mask, position ids)."""
    depth = hf.tree_depths(parents)
    pos = torch.from_numpy(np.concatenate([np.arange(prefix), prefix + depth]))[None]
    seen = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out: seen.append(out[0][0, prefix:].clone()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None], attention_mask=hf.additive_tree_mask(prefix, parents),
                           position_ids=pos).logits[0, prefix:]
    finally:
        for hk in hooks:
            hk.remove()
    return logits, seen


def _ours(model, prefix, parents, ids, cache_dtype="float32", page=64, mla_change=None):
    target = hf.TreeTarget(model)
    if mla_change:
        target.adapters = [dataclasses.replace(a, **mla_change) for a in target.adapters]
    n = len(parents)
    table, pages = inputs.block_table(np.random.default_rng(1), [prefix + n], page, extra_pages=1)   # scattered pages
    caches = target.new_caches(pages, page, cache_dtype)
    target.prefill(ids[None, :prefix], caches, table)
    tree = hf.tree_record(parents[None], ids[None, prefix:], [prefix])
    logits, attns = target.verify(tree, caches, table, [prefix], return_attention=True)
    return logits[0], [a[0] for a in attns], target, tree, caches, table


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _top1_agrees(ours, theirs, slack):
    """Same argmax at every node, except where transformers' own top-2 gap is within `slack` times the largest |logit|
    (a near tie: a bf16 cache moves the logits by ~1e-2 of their range, more where it flips a MoE routing choice)."""
    top = theirs.topk(2, -1)
    slack = slack * float(theirs.abs().max())
    gap = top.values[:, 0] - top.values[:, 1]
    same = ours.argmax(-1) == top.indices[:, 0]
    return bool((same | (gap <= slack)).all()), int((~same).sum())


@pytest.mark.parametrize("h,yarn,q_lora,inter,layers,prefix,kind,nodes", CASES)
def test_tree_verify_matches_transformers(h, yarn, q_lora, inter, layers, prefix, kind, nodes, request):
    other = "r128" in request.node.callspec.id
    model, parents, ids = _case(h, yarn, q_lora, inter, layers, prefix, kind, nodes, seed=5 if other else 0,
                                other=other)
    want_logits, want_attn = _transformers(model, prefix, parents, ids)
    for cache, tol in (("float32", 2e-5), ("bf16", 2e-2)):
        logits, attn, *_ = _ours(model, prefix, parents, ids, cache)
        assert len(attn) == layers
        for i, (a, w) in enumerate(zip(attn, want_attn)):
            assert _rel(a, w) <= tol, f"{cache} cache, layer {i}: attention output off by {_rel(a, w):.2e}"
        if cache == "float32":
            assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
            assert _rel(logits, want_logits) <= 1e-4
        else:
            ok, diff = _top1_agrees(logits, want_logits, 2e-2)
            assert ok, f"bf16 cache: {diff} nodes' top-1 differ outside a near tie"


@pytest.mark.parametrize("change", [
    pytest.param({"softmax_scale": 48 ** -0.5}, id="plain-scale"),
    pytest.param({"rope_interleave": False}, id="rotate-half-rope"),
    pytest.param({"latent_norm": False}, id="latent-before-kv_a_layernorm"),
])
def test_controls_fail(change):
    """The yarn, interleaved-rope case with one mapping wrong: the attention output is far off (> 20 %)."""
    model, parents, ids = _case(8, True, 32, True, 1, 300, "random", 17)
    _, want_attn = _transformers(model, 300, parents, ids)
    _, ok_attn, *_ = _ours(model, 300, parents, ids, "bf16")
    _, bad_attn, *_ = _ours(model, 300, parents, ids, "bf16", mla_change=change)
    assert _rel(ok_attn[0], want_attn[0]) <= 2e-2
    assert _rel(bad_attn[0], want_attn[0]) > 0.2, f"{change}: error only {_rel(bad_attn[0], want_attn[0]):.3f}"


def test_softmax_scale_is_the_models():
    """yarn: qk_head_dim^-0.5 mscale(factor, mscale_all_dim)^2 (DeepSeek-V3's 1.87x, Kimi K2's 1.81x); default: plain;
    always the module's own `scaling`."""
    v3 = hf.tiny_config(rope={"factor": 40.0, "mscale_all_dim": 1.0}, qk_nope_head_dim=128, qk_rope_head_dim=64)
    k2 = hf.tiny_config(rope={"factor": 32.0, "mscale_all_dim": 1.0}, qk_nope_head_dim=128, qk_rope_head_dim=64)
    assert hf.softmax_scale(v3) / 192 ** -0.5 == pytest.approx((0.1 * np.log(40) + 1) ** 2)
    assert round(hf.softmax_scale(v3) * 192 ** 0.5, 2) == 1.87 and round(hf.softmax_scale(k2) * 192 ** 0.5, 2) == 1.81
    assert hf.softmax_scale(hf.tiny_config(yarn=False)) == 48 ** -0.5
    assert hf.softmax_scale(hf.tiny_config(rope={"mscale_all_dim": 0})) == 48 ** -0.5
    m = hf.tiny_model(hf.tiny_config(num_hidden_layers=1, rope={"factor": 32.0}))
    assert hf.MlaAdapter.from_module(m.model.layers[0].self_attn).softmax_scale == m.model.layers[0].self_attn.scaling


def test_tensor_parallel_ranks_sum_to_the_layer():
    """tp = 4 ranks of 4 heads: each rank's spec has 4 heads; the ranks' partial outputs add up to the layer's."""
    model = hf.tiny_model(hf.tiny_config(num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=1))
    attn = model.model.layers[0].self_attn
    rng = np.random.default_rng(0)
    L, parents = 120, tree_parents("random", 12, rng)
    ids = rng.integers(0, 256, L + 12)
    _, want = _transformers(model, L, parents, ids)
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.from_numpy(ids)[None])).detach()
    pos = torch.from_numpy(np.concatenate([np.arange(L), L + hf.tree_depths(parents)]))[None]
    total = 0
    for rank in range(4):
        mla = hf.MlaAdapter.from_module(attn, rotary=model.model.rotary_emb, tp_size=4, tp_rank=rank)
        assert (mla.spec().num_heads, mla.spec().kv_lora_rank, mla.spec().qk_rope_head_dim) == (4, 64, 16)
        cache = np.zeros((3, 64, 80), np.float32)
        ckv, kpe = mla.latents(x, pos)
        hf.write_kv(cache, [[0, 1, 2]], np.arange(L + 12)[None], ckv, kpe)
        qn, qp = mla.queries(x[:, L:], pos[:, L:])
        assert qn.shape == (1, 12, 4, 64) and qp.shape == (1, 12, 4, 16)
        r = reference.tree_verify(qn.detach().numpy(), qp.detach().numpy(), cache, np.array([[0, 1, 2]]), [L], [12],
                                  pack_tree_mask(parents)[None], mla.softmax_scale)
        total = total + mla.output(torch.from_numpy(r.out).float())[0]
    assert _rel(total.detach(), want[0]) <= 2e-5


def test_accept_and_commit_leave_the_cache_as_plain_decoding():
    """A chain tree of the model's own greedy tokens is accepted whole; after kv_commit the cache holds exactly the
    KV a prefill of prefix + accepted tokens writes."""
    model = hf.tiny_model(hf.tiny_config(num_hidden_layers=2))
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 256, 40)
    with torch.no_grad():
        gen = model.generate(torch.from_numpy(prompt)[None], max_new_tokens=6, do_sample=False)[0].numpy()
    # the tree: root = prompt[-1], a branch of wrong tokens, then the greedy chain gen[40:45]
    L = 39
    parents = np.array([-1, 0, 0, 2, 3, 4, 5])
    tokens = np.array([prompt[-1], (gen[40] + 1) % 256, *gen[40:45]])
    target = hf.TreeTarget(model)
    caches = target.new_caches(2, 64)
    table = np.array([[1, 0]], np.int32)
    target.prefill(prompt[None, :L], caches, table)
    tree = hf.tree_record(parents[None], tokens[None], [L])
    logits = target.verify(tree, caches, table, [L])
    acc = target.accept(tree, logits, caches, table, [L])
    assert int(acc.accept_lens[0]) == 5 and int(acc.new_prefix_lens[0]) == L + 6
    assert list(acc.out_tokens[0, :6]) == list(gen[40:46])
    fresh = target.new_caches(2, 64)
    target.prefill(gen[None, :L + 6], fresh, table)
    for a, b in zip(caches, fresh):
        flat_a, flat_b = a[table[0]].reshape(-1, 80)[:L + 6], b[table[0]].reshape(-1, 80)[:L + 6]
        np.testing.assert_allclose(flat_a, flat_b, rtol=1e-5, atol=1e-6)


def test_pack_tree_mask_numpy_and_torch():
    rng = np.random.default_rng(0)
    parents = np.stack([tree_parents(k, 65, rng) for k in ("chain", "star", "binary", "random")])
    parents[3, 50:] = -1                                                   # padding rows
    m = pack_tree_mask(parents, 3)
    assert m.shape == (4, 65, 3) and m.dtype == np.uint32
    for b in range(3):
        assert np.array_equal(m[b], ancestor_mask(parents[b], 3))
    assert np.array_equal(m[3, :50], ancestor_mask(parents[3, :50], 3)) and not m[3, 50:].any()
    t = pack_tree_mask(torch.from_numpy(parents), 3)
    assert t.dtype == torch.uint32 and np.array_equal(t.view(torch.int32).numpy().view(np.uint32), m)
    cut = pack_tree_mask(parents, 3, num_nodes=[65, 65, 10, 50])
    assert not cut[2, 10:].any() and np.array_equal(cut[2, :10], m[2, :10])
    assert np.array_equal(pack_tree_mask(parents[0]), ancestor_mask(parents[0], 3))   # one tree, W = ceil(N / 32)
    with pytest.raises(ValueError):
        pack_tree_mask(np.array([-1, 2, 0]))
    with pytest.raises(ValueError):
        pack_tree_mask(parents, 2)
    # the reference takes it as tree_build's
    ref = reference.tree_build(rng.integers(0, 99, (2, 4, 3)).astype(np.int32),
                               -np.sort(rng.exponential(size=(2, 4, 3)), -1).astype(np.float32),
                               np.array([1, 2], np.int32), np.array([5, 6], np.int32), 20, max_tree_size=65)
    assert np.array_equal(pack_tree_mask(ref.parents, 3, ref.num_nodes), ref.tree_mask)
    rec = hf.tree_record(ref.parents, ref.tokens, [5, 6], 3)
    for f in ("num_nodes", "tokens", "parents", "depths", "positions", "tree_mask", "first_child", "next_sibling"):
        assert np.array_equal(getattr(rec, f), getattr(ref, f)), f


def test_make_spec_and_spec_for():
    s = ddtree_gen.make_spec("my-model-tp8", 16, 512, 64, page_size=32, kv_dtype="fp8_e4m3")
    assert (s.num_heads, s.kv_lora_rank, s.qk_rope_head_dim, s.page_size, s.max_tree_size, s.kv_fp8) == \
        (16, 512, 64, 32, 65, True)
    with pytest.raises(ddtree_gen.SpecError, match="kv_lora_rank"):
        ddtree_gen.make_spec("bad", 16, 500, 64)
    cfg = hf.tiny_config(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)
    s = hf.spec_for(cfg, tp_size=2, page_size=16)
    assert (s.num_heads, s.kv_lora_rank, s.qk_rope_head_dim, s.page_size) == (8, 512, 64, 16)
    with pytest.raises(ValueError, match="tp_size"):
        hf.spec_for(cfg, tp_size=3)


@pytest.mark.parametrize("kind", ["float32", "bf16", "fp8", "torch-bf16", "torch-fp8"])
def test_write_kv_layout(kind):
    """Entry of position t = [ckv, kpe] at page block_table[t // page], slot t % page, in the cache's dtype."""
    rng = np.random.default_rng(0)
    ckv, kpe = rng.standard_normal((2, 5, 64)), rng.standard_normal((2, 5, 16))
    pos = np.array([[0, 1, 7, 8, -1], [3, 4, 5, 6, 15]])
    table = np.array([[2, 0], [1, 3]])
    scale = 0.05 if "fp8" in kind else None
    cache = {"float32": lambda: np.zeros((4, 8, 80), np.float32), "bf16": lambda: np.zeros((4, 8, 80), np.uint16),
             "fp8": lambda: np.zeros((4, 8, 80), np.uint8),
             "torch-bf16": lambda: torch.zeros((4, 8, 80), dtype=torch.bfloat16),
             "torch-fp8": lambda: torch.zeros((4, 8, 80), dtype=torch.float8_e4m3fn)}[kind]()
    hf.write_kv(cache, table, pos, torch.from_numpy(ckv), torch.from_numpy(kpe), kv_scale=scale)
    if isinstance(cache, torch.Tensor):
        cache = cache.float().numpy()
    elif kind == "bf16":
        cache = ddtree_gen.bf16.from_bits(cache)
    elif kind == "fp8":
        cache = ddtree_gen.fp8.to_float64(cache)
    vals = cache * (scale or 1.0)
    want = np.concatenate([ckv, kpe], -1)
    tol = {"float32": 1e-6, "bf16": 2 ** -8, "torch-bf16": 2 ** -8}.get(kind, 2 ** -3)
    for b in range(2):
        for t in range(5):
            p = pos[b, t]
            if p < 0:
                continue
            got = vals[table[b, p // 8], p % 8]
            np.testing.assert_allclose(got, want[b, t], rtol=tol, atol=(scale or 0) * 2 ** -6 + 1e-7)
    written = {(table[b, p // 8], p % 8) for b in range(2) for p in pos[b] if p >= 0}
    others = [vals[pg, sl] for pg in range(4) for sl in range(8) if (pg, sl) not in written]
    assert not np.any(others)



def test_which_kernel_reports_the_launchers_choice():
    """ops.tree_verify.which.which_kernel on stand-in kernel sets (every kernel 'runs': the sm_90a view of a Hopper GPU)."""
    from ddtree_gen import kernel_set
    from ddtree_gen.ops.tree_verify.which import which_kernel
    from ddtree_gen.spec import find_spec
    ks = kernel_set.StandInKernelSet(find_spec("kimi-k2.6-tp8"))
    assert which_kernel(ks, 1, 65, 2)[:4] == ("tree_verify", "wgmma", "tree_verify_wgmma", "seesaw")
    assert which_kernel(ks, 8, 65, 64).kernel == PARTS_KERNEL          # B >= 2, the parts pay (parts_pay)
    assert which_kernel(ks, 8, 65, 64, num_splits=4).kernel == "tree_verify_wgmma"
    assert which_kernel(ks, 1, 65, 2, impl="simple")[1:3] == ("simple", "tree_verify")
    assert which_kernel(ks, 1, 65, 2, impl="mma")[1:4] == ("mma", "tree_verify_mma", None)
    assert which_kernel(ks, 1, 65, 2, name="tree_verify_tail").kernel == "tree_verify_tail_wgmma"
    ks8 = kernel_set.StandInKernelSet(find_spec("kimi-k2.6-tp8-fp8"))
    c = which_kernel(ks8, 1, 65, 2)
    assert (c.kernel, c.fp8_path) == (DEQUANT, "dequant") and "KV_WORKSPACE_LIMIT" in c.reason
    assert which_kernel(ks8, 1, 65, 2, fp8_path="fused")[1:3] + (which_kernel(ks8, 1, 65, 2, fp8_path="fused").fp8_path,) \
        == ("wgmma", "tree_verify_wgmma", "fused")
    with pytest.raises(ddtree_gen.ArgumentError, match="impl"):
        which_kernel(ks8, 1, 65, 2, impl="mma")
    lock = kernel_set.StandInKernelSet(ddtree_gen.make_spec("r256", 8, 256, 32))
    assert which_kernel(lock, 1, 65, 2).schedule == "lockstep"                        # the seesaw needs R = 512, P = 64


def test_schedule_reports_grid_pieces_and_workspace():
    """ops.tree_verify.which.schedule (ks.tree_verify_schedule) on stand-in kernel sets: the launchers' grid and count rules
    (ops/tree_verify/wgmma.parts_for, ops/tree_verify/split.choose_splits), the blocks and the workspace they need."""
    from ddtree_gen import kernel_set
    from ddtree_gen.ops.tree_verify.which import schedule
    from ddtree_gen.ops.tree_verify import split as split_kv
    from ddtree_gen.spec import find_spec
    spec = find_spec("kimi-k2.6-tp8")
    ks = kernel_set.StandInKernelSet(spec)
    one = schedule(ks, 1, 65, 1026)                 # B = 1, 64k keys: 14 chunks, one wave of 126 blocks
    assert (one.kernel, one.grid, one.pieces, one.blocks, one.combine) == ("tree_verify_wgmma", "chunks", 14, 126, True)
    assert one.workspace_elems == split_kv.workspace_elems(spec, 1, 65, 14)
    rag = schedule(ks, 8, 65, 2050)                 # B = 8, 128k keys: the parts grid, one wave
    assert (rag.kernel, rag.grid, rag.pieces, rag.blocks) == (PARTS_KERNEL, "parts", 14, 126)
    assert rag.workspace_elems == split_kv.parts_workspace_elems(spec, 8, 65, 14)
    assert schedule(ks, 8, 65, 2050, num_splits=3).grid == "chunks"   # num_splits: the chunks grid's count
    short = schedule(ks, 2, 65, 65)                 # B = 2, 4096 keys: the chunks grid (parts_pay)
    assert short.grid == "chunks" and short.blocks == 2 * 9 * short.pieces
    simple = schedule(ks, 2, 65, 65, impl="simple")
    assert (simple.grid, simple.combine, simple.workspace_elems) == ("rows", False, 0)

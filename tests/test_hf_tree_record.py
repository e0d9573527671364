"""One tree record of hf.tree_record, of fewer rows than the spec's max_tree_size, taken alike by every path of
hf.TreeTarget: the numpy reference, a bf16 and an fp8 kernel set. Without a GPU the kernel sets are the CPU stand-in
(bench/stand_in.py: real kernel sets whose launches are counted, not run; torch CPU tensors standing for device 0's),
so every launcher's argument checks run on what TreeTarget passes; on a GPU (gpu-marked) the real kernels run and the
walk is checked against the reference's on the same target tokens. Needs torch and transformers (the [hf] extra)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (optional: pip install -e \".[hf]\")")
pytest.importorskip("transformers", reason="transformers is not installed (optional: pip install -e \".[hf]\")")

from ddtree_gen import hf, reference  # noqa: E402
from ddtree_gen.trees import tree_parents  # noqa: E402

NODES, PREFIX, N = 40, 70, 65     # the record's rows, the prompt, the spec's max_tree_size
KV_SCALE = 1 / 16


def _problem(seed=0):
    model = hf.tiny_model(hf.tiny_config(), seed=seed)
    rng = np.random.default_rng(seed)
    parents = tree_parents("random", NODES, rng)
    ids = rng.integers(0, model.config.vocab_size, PREFIX + NODES)
    tree = hf.tree_record(parents[None], ids[None, PREFIX:], [PREFIX])
    return model, ids, tree


def _torch(tree, device="cpu"):
    """The record as torch tensors (the mask as torch.uint32), as an engine on the GPU holds it."""
    def one(f):
        f = np.ascontiguousarray(f)
        if f.dtype == np.uint32:
            return torch.from_numpy(f.view(np.int32)).view(torch.uint32).to(device)
        return torch.from_numpy(f).to(device)
    return type(tree)(*[one(f) for f in tree])


def _step(target, ids, tree, table, launches=None):
    """prefill, verify, accept: the calls an engine makes with the record (numpy, as tree_record makes it).
    `launches` (the stand-in's list): verify launches tree_verify once a layer, accept the walk and the commit."""
    pages = table.shape[1]
    caches = target.new_caches(pages, 64, dtype="float32")
    target.prefill(ids[None, :PREFIX], caches, table)
    seen = len(launches or ())
    logits = target.verify(tree, caches, table, [PREFIX])
    assert tuple(logits.shape[:2]) == (1, NODES)
    if launches is not None:
        assert len(launches) - seen == len(target.layers), launches[seen:]
        seen = len(launches)
    acc = target.accept(tree, logits, caches, table, [PREFIX])
    if launches is not None:
        assert len(launches) - seen == 2, launches[seen:]    # tree_accept's walk, kv_commit of every layer
    return logits, acc


def test_pad_tree_is_what_tree_build_writes_in_padding_rows():
    _, _, tree = _problem()
    padded = hf.pad_tree(tree, N)
    assert padded.tokens.shape == (1, N) and padded.tree_mask.shape == (1, N, tree.tree_mask.shape[2])
    assert np.array_equal(padded.num_nodes, tree.num_nodes)
    for name in ("tokens", "parents", "depths", "positions", "first_child", "next_sibling"):
        got = getattr(padded, name)
        assert np.array_equal(got[:, :NODES], getattr(tree, name)) and (got[:, NODES:] == -1).all(), name
    assert np.isneginf(padded.scores[:, NODES:]).all() and not padded.tree_mask[:, NODES:].any()
    made = hf.tree_record(tree.parents[:, :NODES], tree.tokens, [PREFIX], max_tree_size=N)   # made at the spec's N
    for a, b in zip(made, padded):
        assert np.array_equal(a, b)
    t = hf.pad_tree(_torch(tree), N)
    assert t.tree_mask.dtype == torch.uint32 and t.tree_mask.shape == (1, N, tree.tree_mask.shape[2])
    assert np.array_equal(t.tree_mask.view(torch.int32).numpy().view(np.uint32), padded.tree_mask)
    with pytest.raises(ValueError, match="max_tree_size: 30, fewer than the 40 rows"):
        hf.tree_record(tree.parents, tree.tokens, [PREFIX], max_tree_size=30)


@pytest.mark.parametrize("held", ["numpy", "torch"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_one_record_through_the_reference_and_both_kernel_sets(kv_dtype, held, monkeypatch):
    """The reference accepts a path of the record; the stand-in kernel set of the model's spec (N = 65, bf16 or
    fp8) takes the same record of 40 rows through verify (tree_verify in each layer) and accept (tree_accept's walk,
    kv_commit of both layers): every launcher's checks pass and each kernel launches (a 40-row tree was refused,
    "tree.tokens: N = 40 (dimension 1) must equal max_tree_size = 65")."""
    from ddtree_gen.bench.stand_in import stand_in_kset
    model, ids, tree = _problem()
    table = np.array([[2, 0, 3]], np.int32)
    _, acc = _step(hf.TreeTarget(model), ids, tree, table)
    assert 0 <= int(acc.accept_lens[0]) < NODES and int(acc.new_prefix_lens[0]) == PREFIX + 1 + int(acc.accept_lens[0])

    target = hf.TreeTarget(model)
    spec = target.spec(max_tree_size=N, kv_dtype=kv_dtype)
    ks, launches = stand_in_kset(spec, monkeypatch.setattr, monkeypatch.setitem)
    kernels = hf.TreeTarget(model, kernels=ks, kv_scale=KV_SCALE if kv_dtype != "bf16" else None)
    _, acc = _step(kernels, ids, tree if held == "numpy" else _torch(tree), torch.from_numpy(table), launches)
    assert acc.accepted_nodes.shape == (1, spec.max_depth + 1)   # the kernel set's record (its outputs, not run here)


@pytest.mark.gpu
@pytest.mark.parametrize("held", ["numpy", "torch"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_one_record_through_the_kernels_on_the_gpu(kv_dtype, held):
    """On a GPU: the same 40-row record through the real kernel set (bf16 and fp8): verify's logits for the 40 rows,
    and accept's walk equal to the reference walk on the same target tokens (the argmax of those logits)."""
    import ddtree_gen
    model, ids, tree = _problem()
    model = model.cuda()
    target = hf.TreeTarget(model)
    spec = target.spec(max_tree_size=N, kv_dtype=kv_dtype)
    ks = ddtree_gen.load(spec, kernels=["tree_verify", "tree_accept", "kv_commit"])
    kernels = hf.TreeTarget(model, kernels=ks, kv_scale=KV_SCALE if kv_dtype != "bf16" else None)
    table = np.array([[2, 0, 3]], np.int32)
    logits, acc = _step(kernels, ids, tree if held == "numpy" else _torch(tree, "cuda"), torch.from_numpy(table).cuda())
    want = reference.tree_accept(tree, logits.argmax(-1).to(torch.int32).cpu().numpy(), np.array([PREFIX], np.int32),
                                 None, None, max_depth=int(tree.depths.max()))
    for name in ("accept_lens", "new_prefix_lens"):
        assert np.array_equal(getattr(acc, name).cpu().numpy(), getattr(want, name)), name
    k = int(want.accept_lens[0])
    assert np.array_equal(acc.out_tokens[0, :k + 1].cpu().numpy(), want.out_tokens[0, :k + 1])

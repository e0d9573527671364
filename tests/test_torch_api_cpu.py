"""ddtree_gen.torch_api without a GPU: the named records on torch tensors, eager and under torch.compile.

Two CPU paths: the ops' CUDA implementations on a kernel set that logs its launches (CPU tensors standing for device
0's: the launchers' checks run, nothing launches), and the ops given CPU implementations that compute with the numpy
references (so the records' values can be compared field by field, eager and compiled). Skipped where torch is not
installed (torch is optional)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (optional: pip install -e \".[torch]\")")

import ddtree_gen.torch_api as torch_api  # noqa: E402
from ddtree_gen import reference  # noqa: E402
from ddtree_gen.errors import ArgumentError  # noqa: E402
from ddtree_gen.reference import DraftTopkOutput  # noqa: E402
from ddtree_gen.spec import find_spec  # noqa: E402
from ddtree_gen.types import AttentionOutput, TreeAcceptOutput, TreeBuildOutput  # noqa: E402

SPEC = "kimi-k2.6-tp8"


def _inputs(spec, b=2, seed=0):
    """A small step's inputs as torch CPU tensors: the drafter's top-k, roots, prefix lengths, queries, one layer's
    cache and a three-layer stacked cache, a block table (disjoint pages per request), the target's tokens."""
    rng = np.random.default_rng(seed)
    n, d, h, r, p, page = (spec.max_tree_size, spec.max_depth, spec.num_heads, spec.kv_lora_rank,
                           spec.qk_rope_head_dim, spec.page_size)
    pages = -(-(100 + n) // page)
    bf16 = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16)
    return dict(
        ids=torch.from_numpy(rng.integers(0, 50, (b, d, 4)).astype(np.int32)),
        lps=torch.from_numpy(-np.sort(rng.exponential(size=(b, d, 4)), axis=-1).astype(np.float32)),
        roots=torch.tensor([11, 12][:b], dtype=torch.int32), lens=torch.tensor([100, 7][:b], dtype=torch.int32),
        q=bf16(b, n, h, r), qp=bf16(b, n, h, p), kv=bf16(b * pages, page, r + p),
        stacked=bf16(3, b * pages, page, r + p),
        table=torch.from_numpy(rng.permutation(b * pages).reshape(b, pages).astype(np.int32)),
        target=torch.from_numpy(rng.integers(0, 50, (b, n)).astype(np.int32)))


def _step(ks, x, budget=16):
    """One engine step through the records: fields read by name, never by index."""
    tree = ks.tree_build(x["ids"], x["lps"], x["roots"], x["lens"], budget)
    att = ks.tree_verify(x["q"], x["qp"], x["kv"], x["table"], x["lens"], tree.num_nodes, tree.tree_mask, 0.1)
    acc = ks.tree_accept(tree, x["target"], x["lens"])
    ks.kv_commit(acc, x["lens"], x["stacked"], x["table"])
    return tree, att, acc


# ------------------------------------------------------------------ the ops' implementations, launches logged

@pytest.fixture
def logged(monkeypatch):
    """torch_ops' kernel set a LaunchLog of the spec (conftest: every launch recorded, none run), CPU tensors
    standing for device 0's."""
    from conftest import LaunchLog
    from ddtree_gen import torch_ops
    from ddtree_gen.bench.stand_in import torch_cpu_as_device0
    torch_cpu_as_device0(monkeypatch.setattr, monkeypatch.setitem)
    kset = LaunchLog(find_spec(SPEC))
    monkeypatch.setattr(torch_ops, "_kset", lambda name: kset)
    return kset


def test_every_method_returns_its_record_through_the_launchers(logged):
    """Each method calls its op's implementation (the direct entry, eager) and names what comes back: the records of
    the CuPy path, with the fakes' shapes and dtypes; the launchers' checks pass and each kernel is launched once."""
    spec = logged.spec
    ks = torch_api.load(SPEC)
    x = _inputs(spec)
    b, n, w, d1 = 2, spec.max_tree_size, spec.mask_words, spec.max_depth + 1
    tree, att, acc = _step(ks, x)
    assert type(tree) is TreeBuildOutput and type(att) is AttentionOutput and type(acc) is TreeAcceptOutput
    assert tree.tree_mask.shape == (b, n, w) and tree.tree_mask.dtype == torch.uint32
    assert tree.first_child.shape == (b, n) and tree.num_nodes.shape == (b,)
    assert att.out.shape == x["q"].shape and att.out.dtype == torch.bfloat16 and att.lse.shape == (b, n, spec.num_heads)
    assert acc.accepted_nodes.shape == (b, d1) and acc.new_prefix_lens.dtype == torch.int32
    tail = ks.tree_verify_tail(x["q"], x["qp"], x["kv"], x["table"], x["lens"], tree.num_nodes, tree.tree_mask, 0.1)
    merged = ks.merge_states(att.out, att.lse, tail.out, tail.lse)
    assert type(tail) is AttentionOutput and type(merged) is AttentionOutput and merged.out.shape == att.out.shape
    ks.tree_accept(tree, x["target"], x["lens"], x["kv"], x["table"])      # one layer: walk + that layer's commit
    ks.kv_commit(acc, x["lens"], [x["kv"], x["kv"]], x["table"])           # the list form
    top = ks.draft_topk(torch.zeros(b, spec.max_depth, 1000, dtype=torch.bfloat16), 8)
    assert type(top) is DraftTopkOutput and top.topk_ids.shape == (b, spec.max_depth, 8)
    launched = [name for name, _ in logged.seen]
    assert launched[0] == "tree_build" and launched[-1] == "draft_topk", launched
    assert {"tree_verify", "tree_verify_tail", "merge_states", "tree_accept", "kv_commit"} <= set(launched), launched


def test_bad_arguments_are_named_before_any_launch(logged):
    ks = torch_api.load(SPEC)
    x = _inputs(logged.spec)
    tree = ks.tree_build(x["ids"], x["lps"], x["roots"], x["lens"], 16)
    before = len(logged.seen)
    with pytest.raises(ArgumentError, match=r"^tree: has no field 'first_child'"):
        ks.tree_accept(SimpleNamespace(num_nodes=tree.num_nodes, tokens=tree.tokens), x["target"], x["lens"])
    with pytest.raises(ArgumentError, match=r"^block_table: required with the other"):
        ks.tree_accept(tree, x["target"], x["lens"], x["kv"])
    with pytest.raises(ArgumentError, match=r"^accepted: has no field 'accept_lens'"):
        ks.kv_commit(tree, x["lens"], x["stacked"], x["table"])
    with pytest.raises(ArgumentError, match=r"^tree_mask"):   # the launcher's own check, through the op
        ks.tree_verify(x["q"], x["qp"], x["kv"], x["table"], x["lens"], tree.num_nodes, tree.tree_mask[1:], 0.1)
    assert len(logged.seen) == before
    with pytest.raises(ArgumentError, match=r"^spec: Spec, expected a spec's name"):
        torch_api.load(logged.spec)
    from ddtree_gen.errors import SpecError
    with pytest.raises(SpecError, match="unknown spec 'no-such-spec'"):
        torch_api.load("no-such-spec")


# ------------------------------------------------------------------ the ops computing with the numpy references

def _np(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)   # bf16 bits, as the references take them
    if t.dtype == torch.uint32:
        return t.view(torch.int32).numpy().view(np.uint32)
    return t.numpy()


def _t(a, dtype):
    a = np.ascontiguousarray(a)
    if dtype == torch.uint32:
        return torch.from_numpy(a.astype(np.uint32).view(np.int32)).view(torch.uint32)
    return torch.from_numpy(a).to(dtype)


@pytest.fixture
def reference_ops():
    """torch.ops.ddtree.{tree_build, tree_verify, tree_walk, kv_commit_stacked} for the CPU key, computed by the
    numpy references (float64 attention rounded to bf16): a CPU stand-in for the GPU kernels whose outputs can be
    checked. Removed after the test (other tests expect no CPU kernel)."""
    spec = find_spec(SPEC)
    n, d = spec.max_tree_size, spec.max_depth
    i32 = torch.int32

    def tree_build(name, ids, lps, roots, lens, budget):
        rec = reference.tree_build(_np(ids), _np(lps), _np(roots), _np(lens), budget, max_tree_size=n)
        return tuple(_t(f, dt) for f, dt in zip(rec, (i32,) * 5 + (torch.float32, torch.uint32, i32, i32)))

    def tree_verify(name, q, qp, kv, table, lens, q_lens, mask, scale, impl="auto", kv_scale=None, fp8_path=None):
        rec = reference.tree_verify(_np(q), _np(qp), _np(kv), _np(table), _np(lens), _np(q_lens), _np(mask), scale)
        return _t(np.nan_to_num(rec.out), torch.bfloat16), _t(rec.lse, torch.float32)

    def tree_walk(name, num_nodes, tokens, first_child, next_sibling, target, lens):
        tree = TreeBuildOutput(_np(num_nodes), _np(tokens), None, None, None, None, None, _np(first_child),
                               _np(next_sibling))
        rec = reference.tree_accept(tree, _np(target), _np(lens), None, None, max_depth=d)
        return tuple(_t(f, i32) for f in rec)

    def kv_commit_stacked(name, accept_lens, accepted_nodes, lens, kv, table):
        caches = _np(kv).copy()
        reference.kv_commit(TreeAcceptOutput(_np(accept_lens), _np(accepted_nodes), None, None), _np(lens), caches,
                            _np(table))
        kv.copy_(torch.from_numpy(caches.view(np.int16)).view(torch.bfloat16))

    import warnings
    lib = torch.library.Library("ddtree", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in (tree_build, tree_verify, tree_walk, kv_commit_stacked):
            lib.impl(fn.__name__, fn, "CPU")
    yield spec
    lib._destroy()


def _expected(spec, x, budget):
    """The same step on the numpy references alone."""
    tree = reference.tree_build(_np(x["ids"]), _np(x["lps"]), _np(x["roots"]), _np(x["lens"]), budget,
                                max_tree_size=spec.max_tree_size)
    att = reference.tree_verify(_np(x["q"]), _np(x["qp"]), _np(x["kv"]), _np(x["table"]), _np(x["lens"]),
                                tree.num_nodes, tree.tree_mask, 0.1)
    acc = reference.tree_accept(tree, _np(x["target"]), _np(x["lens"]), None, None, max_depth=spec.max_depth)
    stacked = _np(x["stacked"]).copy()
    reference.kv_commit(acc, _np(x["lens"]), stacked, _np(x["table"]))
    return tree, att, acc, stacked


def _check(got, want):
    tree, att, acc, stacked = got
    w_tree, w_att, w_acc, w_stacked = want
    for name in TreeBuildOutput._fields:
        np.testing.assert_array_equal(_np(getattr(tree, name)), getattr(w_tree, name), err_msg=name)
    for name in TreeAcceptOutput._fields:
        np.testing.assert_array_equal(_np(getattr(acc, name)), getattr(w_acc, name), err_msg=name)
    np.testing.assert_array_equal(_np(att.out), _np(_t(np.nan_to_num(w_att.out), torch.bfloat16)))
    np.testing.assert_allclose(att.lse.numpy(), w_att.lse.astype(np.float32))
    np.testing.assert_array_equal(stacked, w_stacked)


def test_records_carry_the_ops_outputs_in_their_order(reference_ops):
    """Eager, through the dispatcher: each record's field is the op's output of that name (tree.tree_mask is
    tree_build's mask, acc.accepted_nodes the walk's nodes ...), as the references compute them, and kv_commit moves
    the stacked cache as the reference's commit does. A target that agrees with the drafter's first choice makes the
    walk accept a path, so the commit moves entries."""
    spec = reference_ops
    x = _inputs(spec, seed=1)
    ref_tree = reference.tree_build(_np(x["ids"]), _np(x["lps"]), _np(x["roots"]), _np(x["lens"]), 16,
                                    max_tree_size=spec.max_tree_size)
    x["target"] = torch.from_numpy(np.take_along_axis(ref_tree.tokens, np.maximum(ref_tree.first_child, 0), axis=1))
    want = _expected(spec, x, 16)
    assert int(want[2].accept_lens.min()) >= 1
    ks = torch_api.load(SPEC, dispatcher=True)
    tree, att, acc = _step(ks, x)
    _check((tree, att, acc, _np(x["stacked"])), want)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_step_through_the_records_compiles_to_one_graph_and_runs(reference_ops, backend):
    """torch.compile(fullgraph=True) of a step written with the records (direct entries, the default): dynamo traces
    through the wrapper (no graph break), records the ops in order, and the compiled step computes what the eager one
    does (aot_eager: functionalized, the stacked cache's mutation written back)."""
    spec = reference_ops
    ks = torch_api.load(SPEC)
    graphs = []

    def backend_fn(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(backend)(gm, example_inputs)

    def step(ids, lps, roots, lens, q, qp, kv, stacked, table, target):
        tree = ks.tree_build(ids, lps, roots, lens, 16)
        att = ks.tree_verify(q, qp, kv, table, lens, tree.num_nodes, tree.tree_mask, 0.1)
        acc = ks.tree_accept(tree, target, lens)
        ks.kv_commit(acc, lens, stacked, table)
        return tree, att, acc

    x = _inputs(spec, seed=2)
    want = _expected(spec, x, 16)
    args = [x[k] for k in ("ids", "lps", "roots", "lens", "q", "qp", "kv", "stacked", "table", "target")]
    torch._dynamo.reset()
    tree, att, acc = torch.compile(step, fullgraph=True, backend=backend_fn)(*args)
    assert len(graphs) == 1
    called = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    ops = [t.split("ddtree.")[-1].split(".")[0] for t in called if "ddtree" in t]
    assert ops == ["tree_build", "tree_verify", "tree_walk", "kv_commit_stacked"], called
    assert type(tree) is TreeBuildOutput and type(acc) is TreeAcceptOutput
    _check((tree, att, acc, _np(x["stacked"])), want)

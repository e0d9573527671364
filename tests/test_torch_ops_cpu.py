"""torch custom ops without a GPU: registration, schemas and the fake (meta) implementations that
torch.compile traces with. Skipped where torch is not installed (torch is optional)."""
from __future__ import annotations

import pytest

from conftest import need

torch = need("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import ddtree_gen.torch_ops  # noqa: E402


def test_ops_are_registered_with_the_kv_cache_mutation():
    from ddtree_gen import registry
    ops = torch.ops.ddtree
    names = [op.name for _, op in registry.torch_ops()]   # every declared op (kernels/: Declaration.torch_ops)
    assert {"tree_build", "tree_verify", "tree_accept", "tree_walk", "kv_commit", "draft_topk"} <= set(names)
    for name in names:
        assert hasattr(ops, name), name
    assert "Tensor(a!)[] kv_caches" in str(ops.kv_commit.default._schema)
    # the stacked form: one tensor written, the same arguments otherwise
    assert str(ops.kv_commit_stacked.default._schema) == (
        "ddtree::kv_commit_stacked(str spec, Tensor accept_lens, Tensor accepted_nodes, Tensor prefix_lens, "
        "Tensor(a!) kv_cache, Tensor block_table) -> ()")
    schema = str(ops.tree_accept.default._schema)
    assert "Tensor(a!) kv_cache" in schema and schema.count("!") == 1, schema   # the one tensor it writes
    assert "!" not in str(ops.tree_verify.default._schema)
    for op in (ops.tree_verify, ops.tree_verify_tail):   # an fp8 spec's scale; optional, after impl
        assert 'str impl="auto", float? kv_scale=None' in str(op.default._schema)
    # tree_verify's fp8 path (ops/tree_verify/launch.py: None = fp8_default's choice, "fused" or "dequant"), last;
    # the tail has none
    assert str(ops.tree_verify.default._schema).endswith('float? kv_scale=None, str? fp8_path=None) -> (Tensor, Tensor)')
    assert str(ops.tree_verify_tail.default._schema).endswith('float? kv_scale=None) -> (Tensor, Tensor)')


def test_fake_shapes_follow_the_spec(spec):
    n, w, d1, h, r, p = (spec.max_tree_size, spec.mask_words, spec.max_depth + 1, spec.num_heads,
                         spec.kv_lora_rank, spec.qk_rope_head_dim)
    with FakeTensorMode():
        b = 3
        ids = torch.empty(b, spec.max_depth, n - 1, dtype=torch.int32)
        vec = torch.empty(b, dtype=torch.int32)
        tree = torch.ops.ddtree.tree_build(spec.name, ids, ids.float(), vec, vec, n - 1)
        assert [tuple(t.shape) for t in tree] == [(b,)] + [(b, n)] * 5 + [(b, n, w), (b, n), (b, n)]
        assert tree[5].dtype == torch.float32 and tree[6].dtype == torch.uint32
        q = torch.empty(b, n, h, r, dtype=torch.bfloat16)
        qp = torch.empty(b, n, h, p, dtype=torch.bfloat16)
        # the cache of the spec's kv_dtype: torch.bfloat16, or torch.float8_e4m3fn with a kv_scale
        kv = torch.empty(10, spec.page_size, r + p, dtype=torch.float8_e4m3fn if spec.kv_fp8 else torch.bfloat16)
        scale = (0.5,) if spec.kv_fp8 else ()
        table = torch.empty(b, 4, dtype=torch.int32)
        for op in (torch.ops.ddtree.tree_verify, torch.ops.ddtree.tree_verify_tail):
            out, lse = op(spec.name, q, qp, kv, table, vec, vec, tree[6], 0.1, "auto", *scale)
            assert out.shape == q.shape and out.dtype == torch.bfloat16
            assert lse.shape == (b, n, h) and lse.dtype == torch.float32
            out, lse = op(spec.name, q, qp, kv, table, vec, vec, tree[6], 0.1, kv_scale=scale[0] if scale else None)
            assert out.shape == q.shape and lse.shape == (b, n, h)
        for path in ("fused", "dequant", None) if spec.kv_fp8 else ():   # every fp8 path: the same outputs
            out, lse = torch.ops.ddtree.tree_verify(spec.name, q, qp, kv, table, vec, vec, tree[6], 0.1, "auto", 0.5,
                                                    path)
            assert out.shape == q.shape and out.dtype == torch.bfloat16
            assert lse.shape == (b, n, h) and lse.dtype == torch.float32
        out, lse = torch.ops.ddtree.merge_states(spec.name, q, lse, q, lse)
        assert out.shape == q.shape and lse.shape == (b, n, h)
        acc = torch.ops.ddtree.tree_accept(spec.name, tree[0], tree[1], tree[7], tree[8], tree[1], vec, kv, table)
        assert [tuple(a.shape) for a in acc] == [(b,), (b, d1), (b, d1), (b,)]
        assert all(a.dtype == torch.int32 for a in acc)
        walk = torch.ops.ddtree.tree_walk(spec.name, tree[0], tree[1], tree[7], tree[8], tree[1], vec)
        assert [tuple(a.shape) for a in walk] == [(b,), (b, d1), (b, d1), (b,)]
        assert torch.ops.ddtree.kv_commit(spec.name, walk[0], walk[1], vec, [kv, kv], table) is None
        assert torch.ops.ddtree.kv_commit_stacked(spec.name, walk[0], walk[1], vec, torch.stack([kv, kv]),
                                                  table) is None
        logits = torch.empty(b, spec.max_depth, 1000, dtype=torch.bfloat16)
        top = torch.ops.ddtree.draft_topk(spec.name, logits, n - 1, 0.7)
        assert [tuple(t.shape) for t in top] == [(b, spec.max_depth, n - 1)] * 2
        assert top[0].dtype == torch.int32 and top[1].dtype == torch.float32


class _NotRun(Exception):
    """Raised by the captured graph: the test traces a step, it never runs one (no GPU here)."""


def _entries(entry: str):
    """The namespace a step calls: torch.ops.ddtree, or the ops' direct entries (torch_ops.direct)."""
    return ddtree_gen.torch_ops.direct if entry == "direct" else torch.ops.ddtree


@pytest.mark.parametrize("entry", ["op", "direct"])
def test_a_step_compiles_to_one_graph_on_fake_tensors(entry):
    """torch.compile(fullgraph=True) traces tree_build -> tree_verify -> tree_walk -> kv_commit (the list, then
    the stacked form) through the
    fake implementations (dynamo runs them on fake tensors): one graph, no break, the ops in order. Written with
    the direct entries, the step compiles to the same graph: dynamo records the ops."""
    from ddtree_gen.spec import find_spec
    spec = find_spec("kimi-k2.6-tp8")
    n, h, r, p, b = spec.max_tree_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, 2
    name = spec.name
    ops = _entries(entry)

    def step(ids, lps, roots, lens, q, qp, kv, table, target, layers):
        tree = ops.tree_build(name, ids, lps, roots, lens, n - 1)
        out, lse = ops.tree_verify(name, q, qp, kv, table, lens, lens, tree[6], 0.1, "auto")
        acc = ops.tree_walk(name, tree[0], tree[1], tree[7], tree[8], target, lens)
        ops.kv_commit(name, acc[0], acc[1], lens, [kv], table)
        ops.kv_commit_stacked(name, acc[0], acc[1], lens, layers, table)
        return out * 2, lse, acc[2]

    i32 = dict(dtype=torch.int32)
    args = (torch.zeros(b, spec.max_depth, n - 1, **i32), torch.zeros(b, spec.max_depth, n - 1),
            torch.zeros(b, **i32), torch.ones(b, **i32), torch.zeros(b, n, h, r, dtype=torch.bfloat16),
            torch.zeros(b, n, h, p, dtype=torch.bfloat16), torch.zeros(4, spec.page_size, r + p, dtype=torch.bfloat16),
            torch.zeros(b, 2, **i32), torch.zeros(b, n, **i32),
            torch.zeros(3, 4, spec.page_size, r + p, dtype=torch.bfloat16))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def never(*a):
            raise _NotRun
        return never

    torch._dynamo.reset()
    with pytest.raises(_NotRun):
        torch.compile(step, fullgraph=True, backend=backend)(*args)
    assert len(graphs) == 1
    called = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    ops = [str(t).split("ddtree.")[-1].split(".")[0] for t in called if "ddtree" in str(t)]
    assert ops == ["tree_build", "tree_verify", "tree_walk", "kv_commit", "kv_commit_stacked"], called


def _commit_args(spec, b=2):
    i32 = dict(dtype=torch.int32)
    return (torch.zeros(b, **i32), torch.zeros(b, spec.max_depth + 1, **i32), torch.zeros(b, **i32))


def _kv(spec, *shape):
    return torch.zeros(*shape, spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim,
                       dtype=torch.float8_e4m3fn if spec.kv_fp8 else torch.bfloat16)


def _stand_in_device0(spec, monkeypatch):
    """CPU tensors standing for device 0's, and torch_ops' kernel set a stand-in that refuses to launch."""
    from conftest import FakeKernelSet
    from ddtree_gen import torch_ops
    from ddtree_gen.bench.stand_in import torch_cpu_as_device0
    torch_cpu_as_device0(monkeypatch.setattr, monkeypatch.setitem)
    kset = FakeKernelSet(spec)
    monkeypatch.setattr(torch_ops, "_kset", lambda name: kset)
    return kset


def test_stacked_commit_refuses_a_list_and_another_rank(spec, monkeypatch):
    """kv_commit_stacked takes one tensor: the schema refuses a list (torch's message names kv_cache), and a
    kv_cache that is not 4-D is an ArgumentError naming kv_cache when traced (the fake) and in the op's
    implementation (the launcher's checks, before any launch)."""
    from conftest import LaunchReached
    from ddtree_gen import torch_ops
    from ddtree_gen.errors import ArgumentError
    lens, nodes, prefix = _commit_args(spec)
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="for argument 'kv_cache' but instead found type 'list'"):
        torch.ops.ddtree.kv_commit_stacked(spec.name, lens, nodes, prefix, [_kv(spec, 4)] * 2, table)
    with FakeTensorMode():
        args = [torch.empty(a.shape, dtype=a.dtype) for a in (lens, nodes, prefix, table)]
        with pytest.raises(ArgumentError, match=r"^kv_cache: 3 dimensions \(4, "):
            torch.ops.ddtree.kv_commit_stacked(spec.name, *args[:3], _kv(spec, 4), args[3])
    # the implementation (what the dispatcher runs on a GPU), CPU tensors standing for device 0's, on a stand-in
    # kernel set that refuses to launch
    _stand_in_device0(spec, monkeypatch)
    stacked = torch_ops.implementation("kv_commit_stacked")
    with pytest.raises(ArgumentError, match=r"^kv_cache: a list of 2 caches, expected one \[layers, "):
        stacked(spec.name, lens, nodes, prefix, [_kv(spec, 4)] * 2, table)
    with pytest.raises(ArgumentError, match=r"^kv_cache: 3 dimensions \(4, .*one layer's cache: add a leading"):
        stacked(spec.name, lens, nodes, prefix, _kv(spec, 4), table)
    with pytest.raises(ArgumentError, match=r"^kv_cache: 5 dimensions .*expected 4: \[layers, num_pages"):
        stacked(spec.name, lens, nodes, prefix, _kv(spec, 1, 2, 4), table)
    with pytest.raises(ArgumentError, match=r"^kv_cache: page_size"):
        stacked(spec.name, lens, nodes, prefix, _kv(spec, 2, 4).transpose(1, 2).contiguous(), table)
    with pytest.raises(LaunchReached):   # a [layers, num_pages, page_size, R+P] cache passes every check
        stacked(spec.name, lens, nodes, prefix, _kv(spec, 3, 4), table)


# ------------------------------------------------------------------ the direct entries (torch_ops.direct)

def test_direct_entries_take_the_ops_arguments():
    """One direct entry per declared op, with the op's schema as its signature: the same argument names in the same
    order, the same defaults (so any call the op takes, positional or by keyword, binds the same way)."""
    import inspect

    from ddtree_gen import registry
    direct = ddtree_gen.torch_ops.direct
    names = [op.name for _, op in registry.torch_ops()]
    assert sorted(vars(direct)) == sorted(names)
    for name in names:
        schema = getattr(torch.ops.ddtree, name).default._schema
        params = list(inspect.signature(getattr(direct, name)).parameters.values())
        assert [p.name for p in params] == [a.name for a in schema.arguments], name
        for p, a in zip(params, schema.arguments):
            want = a.default_value if a.has_default_value() else inspect.Parameter.empty
            assert p.default == want and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (name, p, want)
        assert str(schema) in getattr(direct, name).__doc__


def test_direct_entry_in_eager_runs_the_launcher_not_the_dispatcher(spec, monkeypatch):
    """An eager call of a direct entry goes to the op's implementation without the dispatcher: on CPU tensors
    (standing for device 0's) the launcher runs its checks and reaches the launch, where the op itself has no CPU
    kernel to dispatch to; and a bad argument is the launcher's ArgumentError, as through the op on a GPU."""
    from conftest import LaunchReached
    from ddtree_gen.errors import ArgumentError
    _stand_in_device0(spec, monkeypatch)
    direct = ddtree_gen.torch_ops.direct
    lens, nodes, prefix = _commit_args(spec)
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="CPU"):   # the dispatcher: no kernel for CPU tensors
        torch.ops.ddtree.kv_commit_stacked(spec.name, lens, nodes, prefix, _kv(spec, 3, 4), table)
    with pytest.raises(LaunchReached):
        direct.kv_commit_stacked(spec.name, lens, nodes, prefix, _kv(spec, 3, 4), table)
    with pytest.raises(LaunchReached):   # by keyword, as the op binds them
        direct.kv_commit_stacked(spec=spec.name, accept_lens=lens, accepted_nodes=nodes, prefix_lens=prefix,
                                 kv_cache=_kv(spec, 3, 4), block_table=table)
    with pytest.raises(ArgumentError, match=r"^kv_cache: 3 dimensions"):
        direct.kv_commit_stacked(spec.name, lens, nodes, prefix, _kv(spec, 4), table)
    with pytest.raises(LaunchReached):   # the list form: a list argument, its first tensor argument a tensor
        direct.kv_commit(spec.name, lens, nodes, prefix, [_kv(spec, 4)] * 2, table)
    n = spec.max_tree_size
    logits = torch.zeros(2, spec.max_depth, 1000, dtype=torch.bfloat16)
    with pytest.raises(LaunchReached):
        direct.draft_topk(spec.name, logits, n - 1)   # the schema's default temperature
    with pytest.raises(ArgumentError, match="temperature"):
        direct.draft_topk(spec.name, logits, n - 1, temperature=0.0)


def test_direct_entry_under_a_dispatch_mode_is_the_op(spec):
    """Under FakeTensorMode (a dispatch mode: also make_fx, export, functionalization) a direct entry calls the op,
    so its fake runs: fake outputs of the op's shapes, nothing launched (no kernel set is loaded here)."""
    direct = ddtree_gen.torch_ops.direct
    n, w, b = spec.max_tree_size, spec.mask_words, 3
    with FakeTensorMode():
        ids = torch.empty(b, spec.max_depth, n - 1, dtype=torch.int32)
        vec = torch.empty(b, dtype=torch.int32)
        tree = direct.tree_build(spec.name, ids, ids.float(), vec, vec, n - 1)
        assert [tuple(t.shape) for t in tree] == [(b,)] + [(b, n)] * 5 + [(b, n, w), (b, n), (b, n)]
        assert type(tree) is tuple   # the op's tuple, not the launcher's record
        logits = torch.empty(b, spec.max_depth, 1000, dtype=torch.bfloat16)
        top = direct.draft_topk(spec.name, logits, n - 1, temperature=0.5)
        assert [tuple(t.shape) for t in top] == [(b, spec.max_depth, n - 1)] * 2


def test_direct_entry_with_a_tensor_subclass_is_the_op(spec):
    """A first tensor argument that is not a plain torch.Tensor (a subclass: here a fake tensor outside its mode's
    dispatch) takes the op, whose dispatch the subclass controls."""
    direct = ddtree_gen.torch_ops.direct
    mode = FakeTensorMode()
    with mode:
        vec = torch.empty(2, dtype=torch.int32)
        ids = torch.empty(2, spec.max_depth, spec.max_tree_size - 1, dtype=torch.int32)
    assert type(ids) is not torch.Tensor
    tree = direct.tree_build(spec.name, ids, ids.float(), vec, vec, 8)   # the fake tensors run the op's fake
    assert type(tree[0]) is type(ids) and tuple(tree[1].shape) == (2, spec.max_tree_size)

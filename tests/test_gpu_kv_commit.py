"""The walk once, the commit of every layer in one launch (tree_accept without a cache, then
kv_commit), bit-exact against the numpy reference on every layer's whole cache (moved entries and
untouched ones), for the sequence and the stacked layouts, in a CUDA graph too; an fp8 spec's caches are
e4m3 bytes (R+P bytes per entry), also passed as torch.float8_e4m3fn tensors."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ddtree_gen import inputs, reference
from ddtree_gen.types import TreeAcceptOutput
from conftest import cuda_torch
from verify_cases import fresh_seed, kv_np_dtype, kv_torch, random_cache_bits

pytestmark = pytest.mark.gpu
LAYERS = 5


def _tree(spec, rng, b):
    n = spec.max_tree_size
    first = np.full((b, n), -1, np.int32)
    nxt = np.full((b, n), -1, np.int32)
    for i in range(b):
        parents = np.concatenate([[-1], [rng.integers(0, j) for j in range(1, n)]])
        for j in range(n - 1, 0, -1):
            nxt[i, j] = first[i, parents[j]]
            first[i, parents[j]] = j
    tokens = rng.integers(0, 3, (b, n)).astype(np.int32)
    return SimpleNamespace(num_nodes=np.full(b, n, np.int32), tokens=tokens, first_child=first, next_sibling=nxt)


def _cache_case(spec, rng, b):
    """Pages from a random permutation (so a request's positions sit on scattered pages), prefixes
    that put the tree across page boundaries."""
    n, page = spec.max_tree_size, spec.page_size
    prefix = rng.integers(0, 3 * page, b).astype(np.int32)
    table, num_pages = inputs.block_table(rng, prefix.astype(int) + n, page, extra_pages=4, spare_columns=1,
                                          unused=-1)
    caches = [random_cache_bits(rng, spec, (num_pages, page, spec.kv_lora_rank + spec.qk_rope_head_dim))
              for _ in range(LAYERS)]
    return prefix, table, caches


def _random_paths(spec, rng, b, prefix, table, caches, full_first=False):
    """Random accepted paths (accept_lens, accepted_nodes: the root, then sorted distinct nodes; full_first: request 0
    at full depth) and every layer's cache after the reference's commit of them."""
    d, n = spec.max_depth, spec.max_tree_size
    lens = rng.integers(0, d + 1, b).astype(np.int32)
    if full_first:
        lens[0] = d
    nodes = np.full((b, d + 1), -1, np.int32)
    nodes[:, 0] = 0
    for i in range(b):
        nodes[i, 1:lens[i] + 1] = np.sort(rng.choice(np.arange(1, n), lens[i], replace=False))
    want = [c.copy() for c in caches]
    reference.kv_commit(SimpleNamespace(accept_lens=lens, accepted_nodes=nodes), prefix, want, table)
    return lens, nodes, want


@pytest.mark.parametrize("b", [1, 7])
def test_walk_then_commit_every_layer(spec, kset, b):
    import cupy
    rng = np.random.default_rng(fresh_seed())
    tree = _tree(spec, rng, b)
    target = rng.integers(0, 3, (b, spec.max_tree_size)).astype(np.int32)
    prefix, table, caches = _cache_case(spec, rng, b)
    want = [c.copy() for c in caches]
    for c in want:
        ref = reference.tree_accept(tree, target, prefix, c, table, spec.max_depth)
    dev = {k: cupy.asarray(getattr(tree, k)) for k in ("num_nodes", "tokens", "first_child", "next_sibling")}
    out = TreeAcceptOutput(*(cupy.full(np.shape(r), -7, np.int32) for r in ref))   # poisoned
    acc = kset.tree_accept(SimpleNamespace(**dev), cupy.asarray(target), cupy.asarray(prefix), out=out)
    for got, r in zip(acc, ref):
        assert np.array_equal(cupy.asnumpy(got), r)
    seq = [cupy.asarray(c) for c in caches]
    kset.kv_commit(acc, cupy.asarray(prefix), seq, cupy.asarray(table))
    stacked = cupy.asarray(np.stack(caches))
    kset.kv_commit(acc, cupy.asarray(prefix), stacked, cupy.asarray(table))
    for k in range(LAYERS):
        assert np.array_equal(cupy.asnumpy(seq[k]), want[k]), f"layer {k} (sequence)"
        assert np.array_equal(cupy.asnumpy(stacked[k]), want[k]), f"layer {k} (stacked)"


@pytest.mark.parametrize("accept", ["none", "full", "random"])
def test_commit_of_given_paths(spec, kset, accept):
    """accept_len 0, full depth with every move a real one (path[k] = k + 16: sources and
    destinations on different slots, often pages), and random lengths and paths, in a CUDA graph."""
    import cupy
    rng = np.random.default_rng(fresh_seed())
    b, d, n = 6, spec.max_depth, spec.max_tree_size
    prefix, table, caches = _cache_case(spec, rng, b)
    nodes = np.full((b, d + 1), -1, np.int32)
    nodes[:, 0] = 0
    if accept == "none":
        lens = np.zeros(b, np.int32)
    elif accept == "full":
        lens = np.full(b, d, np.int32)
        nodes[:, 1:] = np.minimum(np.arange(1, d + 1) + 16, n - 1)
    else:
        lens = rng.integers(0, d + 1, b).astype(np.int32)
        for i in range(b):
            nodes[i, 1:lens[i] + 1] = np.sort(rng.choice(np.arange(1, n), lens[i], replace=False))
    accepted = SimpleNamespace(accept_lens=lens, accepted_nodes=nodes)
    want = [c.copy() for c in caches]
    reference.kv_commit(accepted, prefix, want, table)
    dev = SimpleNamespace(accept_lens=cupy.asarray(lens), accepted_nodes=cupy.asarray(nodes))
    seq = [cupy.asarray(c) for c in caches]
    p, t = cupy.asarray(prefix), cupy.asarray(table)
    cupy.cuda.get_current_stream().synchronize()   # the copies above land before the non-blocking stream runs
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kset.kv_commit(dev, p, [cupy.asarray(c) for c in caches], t)   # prepares outside the capture
        stream.begin_capture()
        kset.kv_commit(dev, p, seq, t)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    for k in range(LAYERS):
        assert np.array_equal(cupy.asnumpy(seq[k]), want[k]), f"layer {k}"
    if accept == "full":
        assert all(not np.array_equal(w, c) for w, c in zip(want, caches))   # the moves were real


def test_commit_torch_tensors(spec, kset):
    """The layer caches as the torch tensors an engine holds (torch.bfloat16, or torch.float8_e4m3fn for an
    fp8 spec), in a list and stacked: the same bytes as the reference."""
    torch = cuda_torch()
    rng = np.random.default_rng(fresh_seed())
    b = 5
    prefix, table, caches = _cache_case(spec, rng, b)
    lens, nodes, want = _random_paths(spec, rng, b, prefix, table, caches)
    tt = lambda a: torch.from_numpy(a).cuda()   # noqa: E731
    acc = SimpleNamespace(accept_lens=tt(lens), accepted_nodes=tt(nodes))
    layers = [kv_torch(spec, c) for c in caches]
    stacked = kv_torch(spec, np.stack(caches))
    kset.kv_commit(acc, tt(prefix), layers, tt(table))
    kset.kv_commit(acc, tt(prefix), stacked, tt(table))
    torch.cuda.synchronize()
    host = lambda t: t.view(torch.uint8).cpu().numpy().view(kv_np_dtype(spec))   # noqa: E731
    for k in range(LAYERS):
        assert np.array_equal(host(layers[k]), want[k]), f"layer {k} (list)"
        assert np.array_equal(host(stacked[k]), want[k]), f"layer {k} (stacked)"


def test_commit_torch_ops_list_and_stacked(spec):
    """torch.ops.ddtree.kv_commit (a list of layers) and kv_commit_stacked (one [layers, num_pages, page_size,
    R+P] tensor) on random caches: every layer's whole cache (the moved entries and the untouched ones) bit-exact
    against the numpy reference, eagerly and replayed from a CUDA graph (the stacked op)."""
    torch = cuda_torch()
    import ddtree_gen.torch_ops  # noqa: F401
    ops = torch.ops.ddtree
    rng = np.random.default_rng(fresh_seed())
    b = 6
    prefix, table, caches = _cache_case(spec, rng, b)
    # one request at full depth: moves across the tree
    lens, nodes, want = _random_paths(spec, rng, b, prefix, table, caches, full_first=True)
    assert any(not np.array_equal(w, c) for w, c in zip(want, caches))   # the reference moved entries
    tt = lambda a: torch.from_numpy(a).cuda()   # noqa: E731
    args = (tt(lens), tt(nodes), tt(prefix))
    host = lambda t: t.view(torch.uint8).cpu().numpy().view(kv_np_dtype(spec))   # noqa: E731
    layers = [kv_torch(spec, c) for c in caches]
    stacked = kv_torch(spec, np.stack(caches))
    ops.kv_commit(spec.name, *args, layers, tt(table))
    assert ops.kv_commit_stacked(spec.name, *args, stacked, tt(table)) is None
    torch.cuda.synchronize()
    for k in range(LAYERS):
        assert np.array_equal(host(layers[k]), want[k]), f"layer {k} (kv_commit, list)"
        assert np.array_equal(host(stacked[k]), want[k]), f"layer {k} (kv_commit_stacked)"
    # in a CUDA graph: captured on a fresh copy of the caches, replayed once
    graphed = kv_torch(spec, np.stack(caches))
    t = tt(table)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.kv_commit_stacked(spec.name, *args, kv_torch(spec, np.stack(caches)), t)   # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.kv_commit_stacked(spec.name, *args, graphed, t)
    graphed.copy_(kv_torch(spec, np.stack(caches)))   # the capture ran nothing: restore anyway, then replay
    g.replay()
    torch.cuda.synchronize()
    for k in range(LAYERS):
        assert np.array_equal(host(graphed[k]), want[k]), f"layer {k} (kv_commit_stacked, CUDA graph)"

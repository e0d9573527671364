"""The engine boundary on the GPU: any device, any thread, torch custom ops, CUDA graphs.

Multi-GPU tests skip with a reason below 2 GPUs. Every check compares with the numpy reference
on fresh random inputs, into outputs poisoned before the launch.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import need

from ddtree_gen import bf16, inputs, reference
from ddtree_gen.errors import ArgumentError
from verify_cases import fresh_seed, kv_torch, make_inputs, random_bf16_normal, random_e4m3_normal, random_kv_scale

pytestmark = pytest.mark.gpu
SPEC = "kimi-k2.6-tp8"
SPEC_FP8 = "kimi-k2.6-tp8-fp8"   # the same with an fp8 (e4m3) KV cache: torch.float8_e4m3fn and kv_scale


def _torch():
    return need("torch")


def _need_gpus(n):
    torch = _torch()
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")
    return torch


@pytest.fixture
def ks():
    import ddtree_gen
    return ddtree_gen.load(SPEC)


# ------------------------------------------------------------------------ inputs and checks

def build_inputs(spec, rng, b=4):
    d, k = spec.max_depth, spec.max_tree_size - 1
    ids = rng.integers(0, 150000, size=(b, d, k), dtype=np.int32)
    lps = np.ascontiguousarray(-np.sort(rng.exponential(1.0, size=(b, d, k)).astype(np.float32), axis=-1))
    return ids, lps, rng.integers(0, 150000, size=b, dtype=np.int32), rng.integers(0, 5000, size=b, dtype=np.int32)


def run_build(ks, torch, device, host, budget):
    """tree_build on torch inputs of `device` into poisoned outputs; returns the outputs on the host."""
    x = [torch.from_numpy(a).to(device) for a in host]
    out = ks.tree_build(*x, budget)
    assert all(o.device == torch.device(device) for o in out), [o.device for o in out]
    return [o.cpu().numpy() for o in out]


def check_build(got, host, spec, budget):
    want = reference.tree_build(*host, budget, max_tree_size=spec.max_tree_size)
    for g, w, name in zip(got, want, want._fields):
        if g.dtype.kind == "f":
            assert np.array_equal(g.view(np.uint32), np.asarray(w, np.float32).view(np.uint32)), name
        else:
            assert np.array_equal(g, w), name


def verify_case(spec, seed):
    rng = np.random.default_rng(seed)
    return make_inputs(spec, rng, [300, 7], [spec.max_tree_size, 20], ["random", "chain"], seed=seed,
                       bf16=random_bf16_normal)


def run_verify(ks, torch, device, x, stream=None):
    def t(a, bits=False):
        ta = torch.from_numpy(np.ascontiguousarray(a)).to(device)
        return ta.view(torch.bfloat16) if bits else ta
    args = (t(x.q_nope, True), t(x.q_pe, True), t(x.kv_cache, True), t(x.block_table), t(x.prefix_lens),
            t(x.q_lens), t(x.tree_mask.view(np.int32)).view(torch.uint32))
    b, nq, h, r = x.q_nope.shape
    out = torch.full((b, nq, h, r), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((b, nq, h), float("nan"), dtype=torch.float32, device=device)
    res = ks.tree_verify(*args, 0.07, out, lse)
    assert res.out.device == torch.device(device)
    return res


def check_verify(res, x):
    want = reference.tree_verify(x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.prefix_lens, x.q_lens, x.tree_mask,
                                 0.07)
    out = bf16.from_bits(res.out.view(__import__("torch").uint16).cpu().numpy()).astype(np.float64)
    lse = res.lse.cpu().numpy()
    for b, q in enumerate(x.q_lens):
        o, w = out[b, :q], want.out[b, :q]
        assert not np.isnan(o).any() and not np.isnan(lse[b, :q]).any()
        assert np.linalg.norm(o - w) <= 5e-3 * np.linalg.norm(w)
        assert np.abs(lse[b, :q] - want.lse[b, :q]).max() <= 1e-3
        assert np.isnan(out[b, q:]).all() and np.isnan(lse[b, q:]).all()   # rows >= q_len untouched


# ------------------------------------------------------------------------------ devices

def test_load_before_set_device(ks):
    """A kernel set loaded while cuda:0 is current runs on cuda:1 after set_device(1)."""
    torch = _need_gpus(2)
    rng = np.random.default_rng(fresh_seed())
    host = build_inputs(ks.spec, rng)
    torch.cuda.set_device(1)
    try:
        check_build(run_build(ks, torch, "cuda:1", host, 40), host, ks.spec, 40)
    finally:
        torch.cuda.set_device(0)


def test_tma_map_of_a_cache_on_1(ks):
    """The TMA kernel (the seesaw tree_verify of a bf16 spec with 64-key pages) on a cache that lives on cuda:1,
    while cuda:0 is current: the launch passes the tensor map encoded for that cache's own pointer (memoized per
    pointer, so a cache on another device never reuses cuda:0's), and the result holds against the reference."""
    torch = _need_gpus(2)
    from ddtree_gen.launch import runtime
    from ddtree_gen.ops.tree_verify.wgmma import uses_tma
    assert uses_tma(ks.spec)
    seed = fresh_seed()
    x = verify_case(ks.spec, seed)
    check_verify(run_verify(ks, torch, "cuda:0", x), x)
    before = set(runtime._TENSOR_MAPS)
    res = run_verify(ks, torch, "cuda:1", x)
    check_verify(res, x)
    new = [key for key in runtime._TENSOR_MAPS if key not in before]
    assert new, "no tensor map was encoded for the cache on cuda:1"
    for ptr, _ in new:   # the cuda:1 cache's pointer: a cuda:1 address
        attrs = __import__("cupy").cuda.runtime.pointerGetAttributes(ptr)
        assert attrs.device == 1, (hex(ptr), attrs.device)
    assert torch.cuda.current_device() == 0


def test_set_used_on_0_then_inputs_on_1(ks):
    """One kernel set, used on cuda:0 first, then with inputs on cuda:1 while cuda:0 is current."""
    torch = _need_gpus(2)
    seed = fresh_seed()
    x = verify_case(ks.spec, seed)
    check_verify(run_verify(ks, torch, "cuda:0", x), x)
    assert torch.cuda.current_device() == 0
    check_verify(run_verify(ks, torch, "cuda:1", x), x)
    assert torch.cuda.current_device() == 0   # the launch switched devices for itself only
    host = build_inputs(ks.spec, np.random.default_rng(seed))
    check_build(run_build(ks, torch, "cuda:1", host, 64), host, ks.spec, 64)


def test_two_threads_drive_two_gpus(ks):
    torch = _need_gpus(2)
    seed = fresh_seed()
    x = verify_case(ks.spec, seed)
    errors, results = [], {}

    def work(dev):
        try:
            torch.cuda.set_device(dev)
            for i in range(20):
                results[(dev, i)] = run_verify(ks, torch, f"cuda:{dev}", x)
            torch.cuda.synchronize(dev)
        except Exception as e:   # reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for res in results.values():
        check_verify(res, x)


def test_two_threads_two_streams_one_gpu(ks):
    torch = _need_gpus(1)
    x = verify_case(ks.spec, fresh_seed())
    errors, results = [], []

    def work():
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(20):
                    results.append(run_verify(ks, torch, "cuda:0", x))
            s.synchronize()
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 40
    for res in results:
        check_verify(res, x)


def test_inputs_on_two_devices_are_refused(ks):
    torch = _need_gpus(2)
    host = build_inputs(ks.spec, np.random.default_rng(0))
    x = [torch.from_numpy(a).to("cuda:0") for a in host]
    x[2] = x[2].to("cuda:1")
    with pytest.raises(ArgumentError, match="root_tokens: on device 1, but topk_ids is on device 0"):
        ks.tree_build(*x, 10)


def test_cupy_inputs_on_device_1(ks):
    _need_gpus(2)
    import cupy
    host = build_inputs(ks.spec, np.random.default_rng(fresh_seed()))
    with cupy.cuda.Device(1):
        x = [cupy.asarray(a) for a in host]
    out = ks.tree_build(*x, 30)
    assert all(o.device.id == 1 for o in out)
    check_build([cupy.asnumpy(o) for o in out], host, ks.spec, 30)


# ------------------------------------------------------------------------------ torch ops

def _step_inputs(spec, torch, rng):
    """One step's inputs as torch tensors; the cache is torch.bfloat16, or torch.float8_e4m3fn (with a kv_scale)
    for an fp8 spec."""
    b, n, h, r, p = 2, spec.max_tree_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    ids, lps, roots, _ = build_inputs(spec, rng, b)
    prefix = np.array([100, 37], np.int32)
    bt, num_pages = inputs.block_table(rng, prefix + n, spec.page_size, permute=False)   # contiguous pages
    dev = "cuda"
    t = lambda a: torch.from_numpy(a).to(dev)   # noqa: E731
    bits = lambda shape: torch.from_numpy(random_bf16_normal(rng, shape)).to(dev).view(torch.bfloat16)  # noqa: E731
    kv_shape = (num_pages, spec.page_size, r + p)
    kv = kv_torch(spec, random_e4m3_normal(rng, kv_shape) if spec.kv_fp8 else random_bf16_normal(rng, kv_shape), dev)
    return dict(spec=spec.name, ids=t(ids), lps=t(lps), roots=t(roots), prefix=t(prefix), table=t(bt),
                kv=kv, q_nope=bits((b, n, h, r)), q_pe=bits((b, n, h, p)),
                target=t(rng.integers(0, 150000, size=(b, n), dtype=np.int32)),
                kv_scale=random_kv_scale(rng) if spec.kv_fp8 else None)


def _entries(entry):
    """The namespace a step calls: torch.ops.ddtree ("op"), or the ops' direct entries ("direct")."""
    import torch

    import ddtree_gen.torch_ops
    return ddtree_gen.torch_ops.direct if entry == "direct" else torch.ops.ddtree


def _step(x, kv, kv_layers, entry="op"):
    """tree_build -> tree_verify -> tree_accept through torch.ops.ddtree (what an engine compiles), or through the
    ops' direct entries (entry="direct"); then the engine path for many layers: the walk once and kv_commit of
    `kv_layers` (copies of kv)."""
    import torch
    ops = _entries(entry)
    spec = x["spec"]
    tree = ops.tree_build(spec, x["ids"], x["lps"], x["roots"], x["prefix"], 64)
    q_lens = torch.full_like(x["prefix"], x["q_nope"].shape[1])
    out, lse = ops.tree_verify(spec, x["q_nope"], x["q_pe"], kv, x["table"], x["prefix"], q_lens, tree[6], 0.07, "auto",
                               x["kv_scale"])
    # the target "chooses" the drafted tokens of the first children where it can: a non-trivial walk
    target = torch.where(tree[7] >= 0, torch.gather(tree[1], 1, tree[7].clamp(min=0).long()), x["target"])
    acc = ops.tree_accept(spec, tree[0], tree[1], tree[7], tree[8], target, x["prefix"], kv, x["table"])
    walk = ops.tree_walk(spec, tree[0], tree[1], tree[7], tree[8], target, x["prefix"])
    ops.kv_commit(spec, walk[0], walk[1], x["prefix"], kv_layers, x["table"])
    return (*tree, out, lse, *acc, *walk)


def _load(name):
    import ddtree_gen
    return ddtree_gen.load(name)


@pytest.mark.parametrize("entry", ["op", "direct"])
@pytest.mark.parametrize("spec_name", [SPEC, SPEC_FP8])
def test_torch_compile_fullgraph_matches_eager(spec_name, entry):
    """The step compiled (fullgraph) equals the step run eagerly through the ops; with entry="direct" both the
    compiled and the eager step call the direct entries (eager: the implementations without the dispatcher)."""
    torch = _need_gpus(1)
    import ddtree_gen.torch_ops  # noqa: F401
    x = _step_inputs(_load(spec_name).spec, torch, np.random.default_rng(fresh_seed()))
    kv_eager, kv_compiled = x["kv"].clone(), x["kv"].clone()
    layers_eager, layers_compiled = [x["kv"].clone() for _ in range(2)], [x["kv"].clone() for _ in range(2)]
    want = _step(x, kv_eager, layers_eager, entry)
    torch._dynamo.reset()
    got = torch.compile(_step, fullgraph=True)(x, kv_compiled, layers_compiled, entry)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8) if g.dtype.is_floating_point else g,
                           w.view(torch.uint8) if w.dtype.is_floating_point else w)
    assert torch.equal(kv_compiled.view(torch.uint8), kv_eager.view(torch.uint8))   # the same entries moved
    for a, b in zip(layers_compiled + layers_eager, [kv_eager] * 4):   # walk + kv_commit == tree_accept's commit
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(want[-8:-4], want[-4:]):
        assert torch.equal(a, b)   # the walk's outputs are tree_accept's
    assert int(want[-8].max()) > 0   # some request accepted drafts: the commit really ran


def captured_step(torch, step, kv0, kv, layers):
    """`step(kv, layers)` warmed up on a side stream (on copies of kv0), captured in a CUDA graph on kv and layers,
    then replayed once the caches are kv0 again and its outputs poisoned (-1, NaN); its outputs, as the replay left
    them."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(kv0.clone(), [kv0.clone() for _ in layers])   # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = step(kv, layers)
    for cache in (kv, *layers):
        cache.copy_(kv0)
    for o in got:
        o.fill_(-1) if not o.dtype.is_floating_point else o.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("entry", ["op", "direct"])
@pytest.mark.parametrize("spec_name", [SPEC, SPEC_FP8])
def test_torch_ops_capture_in_a_cuda_graph(spec_name, entry):
    torch = _need_gpus(1)
    import ddtree_gen.torch_ops  # noqa: F401
    x = _step_inputs(_load(spec_name).spec, torch, np.random.default_rng(fresh_seed()))
    kv_eager, kv_graph = x["kv"].clone(), x["kv"].clone()
    layers_graph = [x["kv"].clone() for _ in range(3)]
    want = _step(x, kv_eager, [x["kv"].clone()])   # eager through the ops: the reference of both entries
    got = captured_step(torch, lambda kv, layers: _step(x, kv, layers, entry), x["kv"], kv_graph, layers_graph)
    for a, w in zip(got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                           w.view(torch.uint8) if w.dtype.is_floating_point else w)
    assert torch.equal(kv_graph.view(torch.uint8), kv_eager.view(torch.uint8))
    for layer in layers_graph:
        assert torch.equal(layer.view(torch.uint8), kv_eager.view(torch.uint8))


@pytest.mark.parametrize("spec_name", [SPEC, SPEC_FP8])
def test_direct_entries_give_the_ops_results(spec_name):
    """Each direct entry, called eagerly, gives the op's outputs bit for bit and moves the same cache entries:
    the whole step through torch_ops.direct against the same step through torch.ops.ddtree, on fresh inputs, the
    outputs given back as the op's fields in the op's order."""
    torch = _need_gpus(1)
    x = _step_inputs(_load(spec_name).spec, torch, np.random.default_rng(fresh_seed()))
    kv_op, kv_direct = x["kv"].clone(), x["kv"].clone()
    layers_op, layers_direct = [x["kv"].clone() for _ in range(2)], [x["kv"].clone() for _ in range(2)]
    want = _step(x, kv_op, layers_op)
    # the same step's outputs once more, poisoned and freed: the caching allocator hands these blocks to the direct
    # step's outputs (same sizes, same stream), so an output the direct step left unwritten would not match
    scratch = _step(x, x["kv"].clone(), [x["kv"].clone() for _ in range(2)])
    for o in scratch:
        o.fill_(-1) if not o.dtype.is_floating_point else o.fill_(float("nan"))
    ptrs = {o.data_ptr() for o in scratch}
    del scratch, o
    got = _step(x, kv_direct, layers_direct, "direct")
    assert ptrs & {o.data_ptr() for o in got}   # some outputs did start poisoned
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device
        assert torch.equal(g.view(torch.uint8) if g.dtype.is_floating_point else g,
                           w.view(torch.uint8) if w.dtype.is_floating_point else w)
    for a, b in zip([kv_direct, *layers_direct], [kv_op, *layers_op]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not torch.equal(kv_direct.view(torch.uint8), x["kv"].view(torch.uint8))   # the commit moved entries
    ops = _entries("direct")
    d = x["q_nope"].shape[1]
    logits = torch.randn(x["q_nope"].shape[0], 3, 5000, device=x["q_nope"].device).to(torch.bfloat16)
    a = ops.draft_topk(x["spec"], logits, d - 1, 0.7)
    b = torch.ops.ddtree.draft_topk(x["spec"], logits, d - 1, 0.7)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_profiler_shows_our_kernels(ks):
    torch = _need_gpus(1)
    import ddtree_gen.torch_ops  # noqa: F401
    x = _step_inputs(ks.spec, torch, np.random.default_rng(0))
    _step(x, x["kv"].clone(), [x["kv"].clone()])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(x, x["kv"].clone(), [x["kv"].clone()])
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    for want in ("ddtree::tree_build", "ddtree::tree_verify", "ddtree::tree_accept", "ddtree::kv_commit",
                 "ddtree_tree_build", "ddtree_tree_accept", "ddtree_kv_commit"):
        assert any(want in n for n in names), (want, sorted(n for n in names if "ddtree" in n))
    assert any(n.startswith("ddtree_tree_verify") for n in names), sorted(n for n in names if "ddtree" in n)

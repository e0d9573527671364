"""`ddtree-gen bench launch`: the host cost of one call, as an engine that runs eagerly pays it.

For every launcher on a tiny problem (B = 1, prefix 64; kimi-k2.6-tp8 unless --spec; kv_commit of 61
layers, as a list of caches and as one stacked array (torch ops kv_commit and kv_commit_stacked); draft_topk, where the kernel set has it, of B = 1, D' = D, k = 64, V = 163840 bf16 logits), with
torch and with CuPy inputs, through the torch custom op ("torch op") and through its direct entry ("direct":
ddtree_gen.torch_ops.direct, the op's arguments, no dispatcher in an eager call):
  * eager: wall time per call of many back-to-back calls (the host is the bottleneck there);
  * host: wall time per call of HOST_CALLS calls issued without waiting for the GPU (the host's own time, also
    where the GPU is the slower side: then eager > host);
  * out=: eager with the outputs given (torch inputs; no allocation in the call);
  * GPU: the same call replayed from a CUDA graph (no host work);
  * host overhead = eager - GPU.
Reference points from the same process: torch.add and a CuPy elementwise add on 16 floats.
"""
from __future__ import annotations

import time

import numpy as np

from ..inputs import tree_build_inputs, verify_inputs
from .specs import LAYERS
from .timing import graph_time_ms

CALLS = 2000          # back-to-back eager calls per measurement
GRAPH_CALLS = 50      # calls captured in one graph
HOST_CALLS = 200      # calls issued before one synchronisation (far fewer than the launch queue holds)
KV_COMMIT = f"kv_commit, {LAYERS} layers"
KV_STACKED = f"kv_commit, {LAYERS} stacked"   # the layers as one [layers, num_pages, page_size, R+P] array
VOCAB = 163840        # draft_topk's vocabulary (Kimi K2)


def _eager_us(fn, sync, calls=CALLS, runs=3) -> float:
    """Wall time per call: best of `runs` runs of `calls` back-to-back calls, each run ended by a sync."""
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _host_us(fn, sync, calls=HOST_CALLS) -> float:
    """Wall time per call of `calls` calls, the clock stopped before the synchronisation."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(10):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    sync()
    return best


def _graph_us_torch(fn) -> float:
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return float(np.median(times))


def _graph_us_cupy(fn) -> float:
    return graph_time_ms(fn, per_graph=GRAPH_CALLS, reps=10) * 1e3


def tiny_inputs(spec, kind: str, seed: int = 0) -> dict:
    """Inputs of every launcher on a tiny problem, as torch tensors or CuPy arrays."""
    import cupy
    rng = np.random.default_rng(seed)
    x = verify_inputs(spec, 1, [64], spec.max_tree_size, seed)
    ids, lps, roots, prefix = (cupy.asarray(a) for a in tree_build_inputs(spec, 1, rng))
    n = spec.max_tree_size
    target = cupy.asarray(rng.integers(0, 4, (1, n)).astype(np.int32))
    # the drafter's logits of draft_topk (bf16 bits): B = 1, D' = D, Kimi K2's vocabulary
    logits = cupy.asarray(rng.standard_normal((1, spec.max_depth, VOCAB), dtype=np.float32)).view(cupy.uint32)
    logits = (logits >> 16).astype(cupy.uint16)
    out = dict(verify=x, build=(ids, lps, roots, prefix), target=target, logits=logits)
    if kind == "torch":
        import torch
        conv = {"uint16": torch.bfloat16}

        def t(a):
            ta = torch.utils.dlpack.from_dlpack(a)
            return ta.view(conv[a.dtype.name]) if a.dtype.name in conv else ta
        out = dict(verify={k: (t(v) if hasattr(v, "dtype") else v) for k, v in x.items()},
                   build=tuple(t(a) for a in out["build"]), target=t(target), logits=t(logits))
    return out


def _calls(ks, spec, kind: str):
    """(name -> call allocating its outputs, name -> the same call into given out= buffers, state):
    the first for the eager figures, the second for graph capture (no allocation in a capture)."""
    x = tiny_inputs(spec, kind)
    v = x["verify"]
    ids, lps, roots, prefix = x["build"]
    budget = spec.max_tree_size - 1
    tree = ks.tree_build(ids, lps, roots, prefix, budget)
    res = ks.tree_verify(**v)
    tail = ks.tree_verify_tail(**v)
    merged = ks.merge_states(res.out, res.lse, tail.out, tail.lse)
    # the accept moves cache entries at prefix_len + j: the verify inputs' cache has room for the tree
    accept_args = (tree, x["target"], v["prefix_lens"], v["kv_cache"], v["block_table"])
    acc = ks.tree_accept(*accept_args)
    tree2 = ks.tree_build(ids, lps, roots, prefix, budget)
    res2, tail2 = ks.tree_verify(**v), ks.tree_verify_tail(**v)
    # kv_commit of LAYERS layers: the walk's result, every layer's cache the verify inputs' cache's shape
    walk = ks.tree_accept(tree, x["target"], v["prefix_lens"])
    caches = [_like(v["kv_cache"]) for _ in range(LAYERS)]
    commit = (walk, v["prefix_lens"], caches, v["block_table"])
    stacked = (walk, v["prefix_lens"], _stack(caches), v["block_table"])
    eager = {
        "tree_build": lambda: ks.tree_build(ids, lps, roots, prefix, budget),
        "tree_verify (auto)": lambda: ks.tree_verify(**v),
        "tree_verify_tail": lambda: ks.tree_verify_tail(**v),
        "merge_states": lambda: ks.merge_states(res.out, res.lse, tail.out, tail.lse),
        "tree_accept": lambda: ks.tree_accept(*accept_args),
        KV_COMMIT: lambda: ks.kv_commit(*commit),
        KV_STACKED: lambda: ks.kv_commit(*stacked),
    }
    given = {
        "tree_build": lambda: ks.tree_build(ids, lps, roots, prefix, budget, out=tree2),
        "tree_verify (auto)": lambda: ks.tree_verify(**v, out=res2.out, lse=res2.lse),
        "tree_verify_tail": lambda: ks.tree_verify_tail(**v, out=tail2.out, lse=tail2.lse),
        "merge_states": lambda: ks.merge_states(res.out, res.lse, tail.out, tail.lse, out=merged.out,
                                                lse=merged.lse),
        "tree_accept": lambda: ks.tree_accept(*accept_args, out=acc),
        KV_COMMIT: lambda: ks.kv_commit(*commit),
        KV_STACKED: lambda: ks.kv_commit(*stacked),
    }
    if "draft_topk" in ks.kernels:   # the drafter's top-k (issue 23): B = 1, D' = D, k = 64, Kimi's vocabulary
        from ..kernels import draft_topk
        logits = x["logits"]
        k = min(64, spec.max_tree_size - 1)
        topk = ks.draft_topk(logits, k)
        need = draft_topk.workspace_elems(*logits.shape, k)
        ws = _empty_like_kind(logits, max(need, 1), kind)
        eager["draft_topk"] = lambda: ks.draft_topk(logits, k)
        given["draft_topk"] = lambda: ks.draft_topk(logits, k, out=topk, workspace=ws if need else None)
    return eager, given, (x, tree, res, tail, walk, caches, stacked[2])


def _like(a):
    """A new array of a's shape and dtype, of a's kind, holding a copy."""
    return a.clone() if hasattr(a, "clone") else a.copy()


def _stack(arrays):
    """The arrays stacked along a new leading dimension (a copy), of their kind."""
    if hasattr(arrays[0], "clone"):
        import torch
        return torch.stack(arrays)
    import cupy
    return cupy.stack(arrays)


def _empty_like_kind(like, n: int, kind: str):
    """n int32 elements of like's kind."""
    if kind == "torch":
        import torch
        return torch.empty(n, dtype=torch.int32, device=like.device)
    import cupy
    return cupy.empty(n, dtype=cupy.int32)


def _op_calls(spec_name: str, x, tree, res, tail, walk, caches, stacked, direct: bool = False) -> dict:
    """name -> the call through torch.ops.ddtree, or (direct) through the ops' direct entries (torch_ops.direct:
    the same arguments, the implementation without the dispatcher in eager calls)."""
    import torch

    from .. import torch_ops  # (registers torch.ops.ddtree)
    ops = torch_ops.direct if direct else torch.ops.ddtree
    v = x["verify"]
    ids, lps, roots, prefix = x["build"]
    budget = len(tree.tokens[0]) - 1
    args = (v["q_nope"], v["q_pe"], v["kv_cache"], v["block_table"], v["prefix_lens"], v["q_lens"], v["tree_mask"],
            v["softmax_scale"])
    calls = {
        "tree_build": lambda: ops.tree_build(spec_name, ids, lps, roots, prefix, budget),
        "tree_verify (auto)": lambda: ops.tree_verify(spec_name, *args, "auto"),
        "tree_verify_tail": lambda: ops.tree_verify_tail(spec_name, *args, "auto"),
        "merge_states": lambda: ops.merge_states(spec_name, res.out, res.lse, tail.out, tail.lse),
        "tree_accept": lambda: ops.tree_accept(spec_name, tree.num_nodes, tree.tokens, tree.first_child,
                                               tree.next_sibling, x["target"], v["prefix_lens"], v["kv_cache"],
                                               v["block_table"]),
        KV_COMMIT: lambda: ops.kv_commit(spec_name, walk.accept_lens, walk.accepted_nodes, v["prefix_lens"], caches,
                                         v["block_table"]),
        KV_STACKED: lambda: ops.kv_commit_stacked(spec_name, walk.accept_lens, walk.accepted_nodes, v["prefix_lens"],
                                                  stacked, v["block_table"]),
    }
    if hasattr(ops, "draft_topk") and "logits" in x:
        k = min(64, len(tree.tokens[0]) - 1)
        calls["draft_topk"] = lambda: ops.draft_topk(spec_name, x["logits"], k)
    return calls


def measure(spec_name: str) -> list[tuple]:
    """Rows (call, inputs, eager us, host us, eager with out= us (torch inputs, else nan), GPU us) of every
    launcher and the reference ops."""
    import cupy
    import torch

    from ..spec import find_spec
    from ..kernel_set import load
    spec = find_spec(spec_name)
    ks = load(spec)
    rows = []
    tsync, csync = torch.cuda.synchronize, cupy.cuda.runtime.deviceSynchronize
    torch_calls, torch_given, state = _calls(ks, spec, "torch")
    cupy_calls, cupy_given, _ = _calls(ks, spec, "cupy")
    op_calls = _op_calls(spec.name, *state)
    direct_calls = _op_calls(spec.name, *state, direct=True)
    nan = float("nan")
    for name in torch_calls:
        gpu = _graph_us_torch(torch_given[name])
        rows.append((name, "torch", _eager_us(torch_calls[name], tsync), _host_us(torch_calls[name], tsync),
                     _eager_us(torch_given[name], tsync), gpu))
        if name in op_calls:
            rows.append((name, "torch op", _eager_us(op_calls[name], tsync), _host_us(op_calls[name], tsync), nan,
                         gpu))
            rows.append((name, "direct", _eager_us(direct_calls[name], tsync), _host_us(direct_calls[name], tsync),
                         nan, gpu))
        rows.append((name, "cupy", _eager_us(cupy_calls[name], csync), _host_us(cupy_calls[name], csync), nan,
                     _graph_us_cupy(cupy_given[name])))
    a, b, c = (torch.ones(16, device="cuda") for _ in range(3))
    rows.append(("torch.add, 16 floats", "torch", _eager_us(lambda: torch.add(a, b), tsync),
                 _host_us(lambda: torch.add(a, b), tsync), nan, _graph_us_torch(lambda: torch.add(a, b, out=c))))
    ca, cb, cc = (cupy.ones(16, dtype=cupy.float32) for _ in range(3))
    rows.append(("cupy elementwise add, 16 floats", "cupy", _eager_us(lambda: ca + cb, csync),
                 _host_us(lambda: ca + cb, csync), nan, _graph_us_cupy(lambda: cupy.add(ca, cb, out=cc))))
    return rows


def table(rows) -> str:
    lines = [f"{'call':<34} {'inputs':<9} {'eager us':>9} {'host us':>8} {'out= us':>8} {'GPU us':>8} "
             f"{'host overhead us':>17}"]
    for name, kind, eager, host, given, gpu in rows:
        lines.append(f"{name:<34} {kind:<9} {eager:9.1f} {host:8.1f} {given:8.1f} {gpu:8.1f} "
                     f"{max(0.0, eager - gpu):17.1f}")
    return "\n".join(lines)


def run(args) -> None:
    spec = (args.spec or ["kimi-k2.6-tp8"])[0]
    text = table(measure(spec))
    print(f"launch cost, spec {spec}, B = 1, prefix 64, Nq = N (eager: {CALLS} back-to-back calls; "
          f"GPU: CUDA-graph replay)")
    print(text)
    if getattr(args, "out", None):
        from pathlib import Path
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_launch.txt").write_text(text + "\n")

"""`ddtree-gen bench launch`: the host cost of one call, as an engine that runs eagerly pays it.

For every launcher on a tiny problem (B = 1, prefix 64; kimi-k2.6-tp8 unless --spec; tree_accept with its commit
and as the walk alone; kv_commit of 61 layers, as a list of caches and as one stacked array (torch ops kv_commit
and kv_commit_stacked); draft_topk, where the kernel set has it, of B = 1, D' = D, k = 64, V = 163840 bf16
logits), with torch and with CuPy inputs, through the torch custom op ("torch op") and through its direct entry ("direct":
ddtree_gen.torch_ops.direct, the op's arguments, no dispatcher in an eager call):
  * eager: wall time per call of many back-to-back calls (the host is the bottleneck there);
  * host: wall time per call of HOST_CALLS calls issued without waiting for the GPU (the host's own time, also
    where the GPU is the slower side: then eager > host);
  * out=: eager with the outputs given (torch inputs; no allocation in the call);
  * GPU: the same call replayed from a CUDA graph (no host work);
  * host overhead = eager - GPU.
Reference points from the same process: torch.add and a CuPy elementwise add on 16 floats.

The call table (call_table, on tiny_inputs) and the host timings (eager_us, host_us, per_call_us, stage_times)
are the ones of scripts/profile_launch.py (the same calls on the CPU stand-in of bench/stand_in.py) and of the
probes scripts/probe_launch_gpu.py, probe_launch_queue.py and probe_op_dispatch.py.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

import numpy as np

from .. import inputs
from ..launch.hostcode import stages
from .specs import LAYERS
from .timing import graph_time_ms, torch_graph_time_ms

CALLS = 2000          # back-to-back eager calls per measurement
GRAPH_CALLS = 50      # calls captured in one graph
HOST_CALLS = 200      # calls issued before one synchronisation (far fewer than the launch queue holds)
KV_COMMIT = f"kv_commit, {LAYERS} layers"
KV_STACKED = f"kv_commit, {LAYERS} stacked"   # the layers as one [layers, num_pages, page_size, R+P] array
VOCAB = 163840        # draft_topk's vocabulary (Kimi K2)


def eager_us(fn, sync, calls=CALLS, runs=3) -> float:
    """Wall time per call (us): best of `runs` runs of `calls` back-to-back calls, each run ended by a sync (the
    eager column)."""
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


def host_us(fn, sync, calls=HOST_CALLS) -> float:
    """Wall time per call (us) of `calls` calls, the clock stopped before the synchronisation (the host column)."""
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
    return torch_graph_time_ms(fn, per_graph=GRAPH_CALLS, reps=10) * 1e3


def _graph_us_cupy(fn) -> float:
    return graph_time_ms(fn, per_graph=GRAPH_CALLS, reps=10) * 1e3


def tiny_inputs(spec, kind: str, seed: int = 0) -> dict:
    """The inputs of every launcher on the tiny problem (B = 1, prefix 64, Nq = N; draft_topk's logits B = 1, D' = D,
    VOCAB bf16), drawn on the host (numpy, seeded) and given as `kind`: "cupy" (CuPy arrays, bf16 as uint16 bits),
    "torch" (CUDA tensors) or "cpu" (torch CPU tensors, for the stand-in kernel set of bench/stand_in.py).
    {"verify": tree_verify's keyword arguments, "build": tree_build's four arrays, "target": [1, N] target tokens,
    "logits": the drafter's logits}; the cache has room for the tree (tree_accept moves entries at prefix + j)."""
    rng = np.random.default_rng(seed)
    n = spec.max_tree_size
    host = inputs.tree_verify(spec, rng, [64], [n], "random", nq=n).host(softmax_scale=192 ** -0.5)
    if host["kv_scale"] is None:
        del host["kv_scale"]
    build = inputs.tree_build_inputs(spec, 1, rng)
    target = rng.integers(0, 4, (1, n)).astype(np.int32)
    # the drafter's logits of draft_topk: the top 16 bits of float32 normals (bf16 bits)
    logits = (rng.standard_normal((1, spec.max_depth, VOCAB), dtype=np.float32).view(np.uint32) >> 16).astype(
        np.uint16)
    if kind == "cupy":
        import cupy
        conv = cupy.asarray
    elif kind in ("torch", "cpu"):
        import torch
        device = "cuda" if kind == "torch" else "cpu"

        def conv(a):
            t = torch.from_numpy(np.ascontiguousarray(a))
            return (t.view(torch.bfloat16) if a.dtype == np.uint16 else t).to(device)
    else:
        raise ValueError(f"kind {kind!r}: one of cupy, torch, cpu")

    def arr(a):
        return conv(a) if isinstance(a, np.ndarray) else a
    return dict(verify={k: arr(v) for k, v in host.items()}, build=tuple(arr(a) for a in build), target=arr(target),
                logits=arr(logits))


class Call(NamedTuple):
    """One row of the call table: the same call four ways."""
    plain: Callable             # the launcher, its outputs allocated (the eager figures)
    given: Callable             # the launcher into given outputs, out= (no allocation: graph capture)
    op: Callable | None         # through torch.ops.ddtree (None: no torch op of that form, or ops=False)
    direct: Callable | None     # through the op's direct entry, torch_ops.direct: the op's arguments, no dispatcher


def call_table(ks, spec, x: dict, *, ops: bool = False) -> dict[str, Call]:
    """name -> Call: every launcher of kernel set `ks` on tiny_inputs `x` (the one table of `bench launch`,
    scripts/profile_launch.py, probe_launch_gpu.py, probe_launch_queue.py and probe_op_dispatch.py). Rows:
    tree_build, tree_verify (auto), tree_verify_tail, merge_states, tree_accept (walk + commit), tree_walk (the walk
    alone), kv_commit of LAYERS layers as a list (KV_COMMIT: the op kv_commit) and stacked in one array (KV_STACKED:
    kv_commit_stacked), and draft_topk where the kernel set has it. ops=True (torch inputs) also fills the op and
    direct forms (importing ddtree_gen.torch_ops registers torch.ops.ddtree)."""
    v = x["verify"]
    ids, lps, roots, prefix = x["build"]
    target, prefix_lens, cache, table = x["target"], v["prefix_lens"], v["kv_cache"], v["block_table"]
    budget = spec.max_tree_size - 1
    tree, tree2 = (ks.tree_build(ids, lps, roots, prefix, budget) for _ in range(2))
    res, res2 = (ks.tree_verify(**v) for _ in range(2))
    tail, tail2 = (ks.tree_verify_tail(**v) for _ in range(2))
    merged = ks.merge_states(res.out, res.lse, tail.out, tail.lse)
    accept_args = (tree, target, prefix_lens, cache, table)
    acc = ks.tree_accept(*accept_args)
    walk, walk2 = (ks.tree_accept(tree, target, prefix_lens) for _ in range(2))
    # kv_commit of LAYERS layers: the walk's result, every layer's cache the verify inputs' cache's shape
    caches = [_like(cache) for _ in range(LAYERS)]
    stacked = _stack(caches)   # the layers as one [layers, num_pages, page_size, R+P] array
    rows = {
        "tree_build": (lambda: ks.tree_build(ids, lps, roots, prefix, budget),
                       lambda: ks.tree_build(ids, lps, roots, prefix, budget, out=tree2)),
        "tree_verify (auto)": (lambda: ks.tree_verify(**v), lambda: ks.tree_verify(**v, out=res2.out, lse=res2.lse)),
        "tree_verify_tail": (lambda: ks.tree_verify_tail(**v),
                             lambda: ks.tree_verify_tail(**v, out=tail2.out, lse=tail2.lse)),
        "merge_states": (lambda: ks.merge_states(res.out, res.lse, tail.out, tail.lse),
                         lambda: ks.merge_states(res.out, res.lse, tail.out, tail.lse, out=merged.out,
                                                 lse=merged.lse)),
        "tree_accept": (lambda: ks.tree_accept(*accept_args), lambda: ks.tree_accept(*accept_args, out=acc)),
        "tree_walk": (lambda: ks.tree_accept(tree, target, prefix_lens),
                      lambda: ks.tree_accept(tree, target, prefix_lens, out=walk2)),
        KV_COMMIT: (lambda: ks.kv_commit(walk, prefix_lens, caches, table),) * 2,
        KV_STACKED: (lambda: ks.kv_commit(walk, prefix_lens, stacked, table),) * 2,
    }
    logits, k = x["logits"], min(64, budget)
    if "draft_topk" in ks.kernels:   # the drafter's top-k (issue 23): B = 1, D' = D, k = 64
        from ..ops.draft_topk import launch as draft_topk
        topk = ks.draft_topk(logits, k)
        need = draft_topk.workspace_elems(*logits.shape, k)
        ws = _int32_like(logits, need) if need else None
        rows["draft_topk"] = (lambda: ks.draft_topk(logits, k), lambda: ks.draft_topk(logits, k, out=topk,
                                                                                     workspace=ws))
    through = {}
    if ops:
        import torch

        from .. import torch_ops  # (registers torch.ops.ddtree)
        s = spec.name
        vargs = (v["q_nope"], v["q_pe"], cache, table, prefix_lens, v["q_lens"], v["tree_mask"], v["softmax_scale"])
        extra = (v["kv_scale"],) if "kv_scale" in v else ()
        tree_args = (tree.num_nodes, tree.tokens, tree.first_child, tree.next_sibling, target, prefix_lens)
        commit = (walk.accept_lens, walk.accepted_nodes, prefix_lens)
        for form, o in (("op", torch.ops.ddtree), ("direct", torch_ops.direct)):
            through[form] = {
                "tree_build": lambda o=o: o.tree_build(s, ids, lps, roots, prefix, budget),
                "tree_verify (auto)": lambda o=o: o.tree_verify(s, *vargs, "auto", *extra),
                "tree_verify_tail": lambda o=o: o.tree_verify_tail(s, *vargs, "auto", *extra),
                "merge_states": lambda o=o: o.merge_states(s, res.out, res.lse, tail.out, tail.lse),
                "tree_accept": lambda o=o: o.tree_accept(s, *tree_args, cache, table),
                "tree_walk": lambda o=o: o.tree_walk(s, *tree_args),
                KV_COMMIT: lambda o=o: o.kv_commit(s, *commit, caches, table),
                KV_STACKED: lambda o=o: o.kv_commit_stacked(s, *commit, stacked, table),
            }
            if "draft_topk" in rows and hasattr(o, "draft_topk"):
                through[form]["draft_topk"] = lambda o=o: o.draft_topk(s, logits, k)
    return {name: Call(plain, given, through.get("op", {}).get(name), through.get("direct", {}).get(name))
            for name, (plain, given) in rows.items()}


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


def _int32_like(like, n: int):
    """n int32 elements of like's kind and device."""
    if hasattr(like, "clone"):
        import torch
        return torch.empty(n, dtype=torch.int32, device=like.device)
    import cupy
    return cupy.empty(n, dtype=cupy.int32)


def per_call_us(fn, n: int, *, clock=time.thread_time, sync=None) -> float:
    """Host time per call (us): best of 5 runs of n calls after 50 warm-up calls, timed by `clock` (default this
    thread's CPU time: a shared machine's load does not count; time.perf_counter: wall time); `sync`, where
    given, is called before each run (a GPU's queue drained first)."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        if sync is not None:
            sync()
        t0 = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t0) / n * 1e6)
    return best


def _compiled_calls(ks, fn) -> list:
    """(compiled function, its arrays, its pointers) of each compiled function one cached call of fn runs."""
    from ..launch.runtime import Prepared
    fn()
    seen = []
    preps = [p for p in ks.prepared_calls.values() if isinstance(p, Prepared) and p.run is not None]
    reals = {id(p): p.run for p in preps}
    for p in preps:
        p.run = (lambda real: lambda arrays, ptrs: seen.append((real, arrays, list(ptrs))) or real(arrays, ptrs))(
            reals[id(p)])
    try:
        fn()
    finally:
        for p in preps:
            p.run = reals[id(p)]
    return seen


def stage_times(ks, fn, n: int, **timing) -> list:
    """The time of each stage of one cached call, [(label, us)]: the whole call, the compiled function's stages
    (hostcode.compile_runner marks them in its source: checks, outputs, launch, result), each timed as the source
    cut after it (hostcode.stages), then the launcher, its signature and the cache lookup (the call minus its compiled function).
    Works on any kernel set (the stand-in of bench/stand_in.py, or a real one); `timing`: per_call_us' clock and
    sync."""
    seen = _compiled_calls(ks, fn)
    total = per_call_us(fn, n, **timing)
    rows = [("the call", total)]
    inner = 0.0
    for real, arrays, ptrs in seen:
        last = 0.0
        for stage, part in stages(real):
            t = (per_call_us(lambda: part(arrays, list(ptrs)), n, **timing)
                 - per_call_us(lambda: list(ptrs), n, **timing))
            rows.append((f"{stage:<8} ({real.__code__.co_filename.strip('<>')[11:]:<34})", t - last))
            last = t
        inner += last
    rows.append(("launcher, signature, cache lookup", total - inner))
    return rows


STAGES = ("launcher, signature, lookup", "checks", "outputs", "launch", "result")


def stage_split(rows) -> dict:
    """stage_times' rows after the whole call's -> {stage: us} (STAGES), summed over a call's compiled functions."""
    out = dict.fromkeys(STAGES, 0.0)
    for label, us in rows:
        word = label.split()[0]
        if label.startswith("launcher"):
            out[STAGES[0]] += us
        elif word in out:
            out[word] += us
    return out


def compiled_sources(ks, fn) -> list[str]:
    """The source of each compiled function (hostcode.compile_runner) one cached call of fn runs."""
    return [real.source for real, _, _ in _compiled_calls(ks, fn)]


def measure(spec_name: str) -> list[tuple]:
    """Rows (call, inputs, eager us, host us, eager with out= us (torch inputs, else nan), GPU us) of every
    launcher and the reference ops."""
    import cupy
    import torch

    from ..kernel_set import load
    from ..spec import find_spec
    spec = find_spec(spec_name)
    ks = load(spec)
    rows = []
    tsync, csync = torch.cuda.synchronize, cupy.cuda.runtime.deviceSynchronize
    torch_calls = call_table(ks, spec, tiny_inputs(spec, "torch"), ops=True)
    cupy_calls = call_table(ks, spec, tiny_inputs(spec, "cupy"))
    nan = float("nan")
    for name, c in torch_calls.items():
        gpu = _graph_us_torch(c.given)
        rows.append((name, "torch", eager_us(c.plain, tsync), host_us(c.plain, tsync), eager_us(c.given, tsync), gpu))
        for form, fn in (("torch op", c.op), ("direct", c.direct)):
            if fn is not None:
                rows.append((name, form, eager_us(fn, tsync), host_us(fn, tsync), nan, gpu))
        cc = cupy_calls[name]
        rows.append((name, "cupy", eager_us(cc.plain, csync), host_us(cc.plain, csync), nan, _graph_us_cupy(cc.given)))
    a, b, c = (torch.ones(16, device="cuda") for _ in range(3))
    rows.append(("torch.add, 16 floats", "torch", eager_us(lambda: torch.add(a, b), tsync),
                 host_us(lambda: torch.add(a, b), tsync), nan, _graph_us_torch(lambda: torch.add(a, b, out=c))))
    ca, cb, cc = (cupy.ones(16, dtype=cupy.float32) for _ in range(3))
    rows.append(("cupy elementwise add, 16 floats", "cupy", eager_us(lambda: ca + cb, csync),
                 host_us(lambda: ca + cb, csync), nan, _graph_us_cupy(lambda: cupy.add(ca, cb, out=cc))))
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

"""`ddtree-gen bench`: our kernels next to their peers, side by side in one process on the GPU.

Times are CUDA-event medians after warm-up (host wall-clock medians for CPU peers). Each
benchmark prints a table last; --out DIR also writes it (and a plot where there is one).
"""
from __future__ import annotations

import dataclasses
import heapq
import statistics
import time
from pathlib import Path

import numpy as np

from . import reference
from .trees import ancestor_mask, tree_parents


def gpu_time_ms(fn, *, warmup=5, reps=30) -> float:
    """Median milliseconds of fn() on the current stream, by CUDA events around each call."""
    import cupy
    for _ in range(warmup):
        fn()
    stream = cupy.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def graph_time_ms(fn, *, per_graph=20, warmup=3, reps=20) -> float:
    """Median milliseconds of one fn() when per_graph calls are replayed from a CUDA graph.

    This is the GPU time an engine sees when it captures its step: no Python launch overhead.
    """
    import cupy
    # the capture stream does not wait for the legacy default stream: work queued there (inputs being made,
    # a slow peer's launch) must be done before fn's first call on it
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # warm up outside the capture (module load, allocations)
        stream.synchronize()
        stream.begin_capture()
        for _ in range(per_graph):
            fn()
        graph = stream.end_capture()
        ms = gpu_time_ms(lambda: graph.launch(stream), warmup=warmup, reps=reps)
    return ms / per_graph


def checked_graph_time_ms(fn, what: str, min_ms: float) -> float:
    """graph_time_ms(fn), refused when it is faster than `min_ms`, the call's FLOPs at the matmul peak measured
    in the same run: no kernel beats that, so such a time is a failed measurement (bench kv-dtype once printed
    0.004 ms for a 0.67 ms call, bench tree_verify 0.006 ms for a 0.87 ms one, before graph_time_ms waited for
    the legacy stream). It is measured again once; a second impossible time is an error, not a table row."""
    ms = graph_time_ms(fn, per_graph=5, reps=10)
    if ms < min_ms:
        again = graph_time_ms(fn, per_graph=5, reps=10)
        print(f"WARNING: {what}: CUDA-graph replay {ms:.4f} ms is faster than its FLOPs at the measured peak "
              f"({min_ms:.4f} ms); measured again: {again:.4f} ms")
        if again < min_ms:
            raise RuntimeError(f"{what}: {again:.4f} ms twice below the peak's {min_ms:.4f} ms: not a measurement")
        ms = again
    return ms


def cpu_time_ms(fn, *, warmup=1, reps=5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measured_peak_tflops() -> float:
    """Dense bf16 matmul rate measured now on this GPU (torch, random data, 8192^3)."""
    import torch
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = gpu_time_ms(lambda: torch.matmul(a, b), warmup=3, reps=10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def print_table(title: str, header: list[str], rows: list[list], out: str | None, name: str) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    lines = [title, "  ".join(str(h).rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.txt").write_text(text + "\n")
    return text


# ---------------------------------------------------------------- tree_build

def tree_build_inputs(spec, b: int, rng, depth: int | None = None, k: int | None = None):
    d = depth or spec.max_depth
    k = k or spec.max_tree_size - 1
    ids = rng.integers(0, 150000, size=(b, d, k), dtype=np.int32)
    lps = -np.sort(rng.exponential(1.0, size=(b, d, k)).astype(np.float32), axis=-1)
    roots = rng.integers(0, 150000, size=b, dtype=np.int32)
    prefix = rng.integers(0, 100000, size=b, dtype=np.int32)
    return ids, np.ascontiguousarray(lps), roots, prefix


def cpu_heap_builder(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget):
    """The CPU peer an engine would run today: a per-request heapq best-first builder in plain
    Python (lists, tuples, ints as bit masks), same algorithm and outputs as tree_build, with
    Python-float scores (the cost, not the rounding, is what this peer is for)."""
    ids, lps = topk_ids.tolist(), topk_logprobs.tolist()
    out = []
    for b in range(len(ids)):
        lp, tok_table = lps[b], ids[b]
        dmax, kmax = len(lp), len(lp[0])
        tokens, parents, depths, scores, masks = [int(root_tokens[b])], [-1], [0], [0.0], [1]
        heap = [(-lp[0][0], 0, 0, 1, 0)] if budget >= 1 else []
        created = 1
        while heap and len(tokens) <= budget:
            neg, _, parent, depth, rank = heapq.heappop(heap)
            i = len(tokens)
            tokens.append(tok_table[depth - 1][rank])
            parents.append(parent)
            depths.append(depth)
            scores.append(-neg)
            masks.append(masks[parent] | (1 << i))
            if rank + 1 < kmax:
                heapq.heappush(heap, (-(scores[parent] + lp[depth - 1][rank + 1]), created, parent, depth, rank + 1))
                created += 1
            if depth < dmax:
                heapq.heappush(heap, (neg - lp[depth][0], created, i, depth + 1, 0))
                created += 1
        out.append((tokens, parents, depths, scores, masks, int(prefix_lens[b])))
    return out


def bench_tree_build(args) -> None:
    import cupy
    from .spec import find_spec
    from .kernel_set import load
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec, kernels=["tree_build"])
    budget = spec.max_tree_size - 1
    rows = []
    rng = np.random.default_rng(0)
    for b in (1, 8, 64):
        host = tree_build_inputs(spec, b, rng)
        dev = [cupy.asarray(x) for x in host]
        out = ks.tree_build(*dev, budget)
        ref = reference.tree_build(*host, budget, max_tree_size=spec.max_tree_size)
        same = all(np.array_equal(cupy.asnumpy(g).view(np.uint32) if g.dtype == np.float32 else cupy.asnumpy(g),
                                  r.view(np.uint32) if r.dtype == np.float32 else r)
                   for g, r in zip(out, ref))
        step = lambda: ks.tree_build(*dev, budget, out=out)  # noqa: E731
        gpu = graph_time_ms(step)
        eager = gpu_time_ms(step, warmup=10, reps=100)
        cpu = cpu_time_ms(lambda: cpu_heap_builder(*host, budget))
        nodes_match = [len(t[0]) for t in cpu_heap_builder(*host, budget)] == ref.num_nodes.tolist()
        rows.append([b, budget, spec.max_depth, f"{gpu * 1e3:.1f}", f"{eager * 1e3:.1f}", f"{cpu * 1e3:.0f}",
                     f"{cpu / gpu:.0f}x", "yes" if same else "NO"])
        assert nodes_match, "the CPU heap peer built trees of other sizes"
    print_table(f"tree_build on {spec.name} (N={spec.max_tree_size}, K'={spec.max_tree_size - 1}, "
                f"D'={spec.max_depth}); gpu: CUDA-graph replay, event median per step; eager: one Python "
                f"launch per step incl. argument checks; cpu: heapq builder, median",
                ["B", "budget", "depth", "gpu us", "eager us", "cpu heap us", "speedup", "bit-exact"], rows, args.out,
                "bench_tree_build")


# ---------------------------------------------------------------- tree_verify

SPEC_BY_HEADS = {8: "kimi-k2.6-tp8", 16: "deepseek-v3-tp8", 64: "kimi-k2.6", 128: "deepseek-v3"}
# the shapes of the FlashMLA comparison (issue "tree_verify at FlashMLA speed"), and one of mixed lengths
VERIFY_CONFIGS = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (1, 16, 4096), (64, 16, 2048), (1, 64, 4096),
                  (8, 64, 4096), (8, 128, 4096), (8, 64, 16384), (64, 8, 8192), (8, 64, "mixed")]


def verify_inputs(spec, b: int, lens, nq: int, seed: int = 0):
    """Random bf16 inputs on the GPU (cupy uint16 bits), a random-permutation block table, random trees.
    An fp8 spec's cache is the e4m3 bytes (cupy uint8, converted by torch) of the same normal samples,
    with kv_scale 1; the same seed gives the same q, table, masks and cache values for both kv_dtypes."""
    import cupy
    from .bf16 import to_bits
    rng = np.random.default_rng(seed)
    h, r, p, page = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size
    lens = np.asarray(lens, np.int32)
    per = -(-(lens + nq) // page)
    max_pages = int(per.max())
    num_pages = int(per.sum())
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((b, max_pages), np.int32)
    k = 0
    for i in range(b):
        table[i, :per[i]] = perm[k:k + per[i]]
        k += per[i]
    # random trees: parent of node j uniformly among 0..j-1 (root 0)
    mask = np.stack([ancestor_mask(tree_parents("random", nq, rng), spec.mask_words) for _ in range(b)])
    g = cupy.random.default_rng(seed)

    def bf(shape):
        return cupy.asarray(to_bits(cupy.asnumpy(g.standard_normal(shape, dtype=cupy.float32))))

    def e4m3(shape):   # normal samples -> e4m3 bytes (round to nearest even; |x| < 448 here)
        import torch
        x = torch.utils.dlpack.from_dlpack(g.standard_normal(shape, dtype=cupy.float32))
        return cupy.from_dlpack(x.to(torch.float8_e4m3fn).view(torch.uint8).contiguous())

    q_nope, q_pe = bf((b, nq, h, r)), bf((b, nq, h, p))
    kv_shape = (num_pages, page, r + p)
    out = dict(q_nope=q_nope, q_pe=q_pe, kv_cache=e4m3(kv_shape) if spec.kv_fp8 else bf(kv_shape),
               block_table=cupy.asarray(table), prefix_lens=cupy.asarray(lens),
               q_lens=cupy.full(b, nq, dtype=cupy.int32), tree_mask=cupy.asarray(mask),
               softmax_scale=192 ** -0.5)
    if spec.kv_fp8:
        out["kv_scale"] = 1.0
    return out


def verify_flops(spec, lens, nq: int) -> float:
    """The contract's FLOP count of one tree_verify call (docs/contract.md section 13), summed over requests."""
    return float(sum(2 * spec.num_heads * nq * (int(li) + nq) * (2 * spec.kv_lora_rank + spec.qk_rope_head_dim)
                     for li in lens))


def torch_peers(x):
    """torch eager (bf16 einsum + fp32 masked softmax) and SDPA with a boolean mask, on the same data,
    with each request's keys gathered contiguously beforehand (not timed: favours the peers)."""
    import torch
    dl = torch.utils.dlpack.from_dlpack
    kv = dl(x["kv_cache"]).view(torch.bfloat16)
    table = dl(x["block_table"]).long()
    lens = dl(x["prefix_lens"]).long()
    q = torch.cat([dl(x["q_nope"]).view(torch.bfloat16), dl(x["q_pe"]).view(torch.bfloat16)], -1)
    b, nq, h, _ = q.shape
    r = x["q_nope"].shape[-1]
    page = kv.shape[1]
    t = int(lens.max()) + nq
    pos = torch.arange(t, device=q.device)
    keys = kv[table[:, pos // page], pos % page]                     # [B, T, R+P]
    words = dl(x["tree_mask"]).view(torch.int32).long() & 0xFFFFFFFF  # [B, Nq, W]
    j = pos[None, :] - lens[:, None]                                  # tail index per key
    jj = j.clamp(min=0, max=words.shape[-1] * 32 - 1)
    word = torch.gather(words, 2, (jj // 32)[:, None, :].expand(b, nq, t))
    tail_vis = ((word >> (jj % 32)[:, None, :]) & 1).bool() & (j >= 0)[:, None, :] & (j < nq)[:, None, :]
    vis = (j < 0)[:, None, :] | tail_vis                              # [B, Nq, T]
    vis &= (pos[None, :] < (lens + nq)[:, None])[:, None, :]
    scale = x["softmax_scale"]

    def eager():
        s = torch.einsum("bqhd,btd->bqht", q, keys).float() * scale
        s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        return torch.einsum("bqht,btd->bqhd", p.to(torch.bfloat16), keys[..., :r])

    qs = q.transpose(1, 2)                                            # [B, H, Nq, R+P]
    ks_ = keys[:, None].expand(b, h, t, keys.shape[-1])
    vs = keys[:, None, :, :r].expand(b, h, t, r)
    am = vis[:, None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, ks_, vs, attn_mask=am, scale=scale)

    return {"torch eager": eager, "torch SDPA": sdpa}


def flashmla_peers(ks, x):
    """FlashMLA's dense decode on the same inputs, when `flash_mla` is importable (../shared/peers: not a
    dependency): "FlashMLA dense" (cache_seqlens = L + Nq, no tree mask: our FLOPs without the mask) and
    "split: FlashMLA + tail + merge" (FlashMLA over the prefix, our tree_verify_tail, merge_states: the split
    path an engine can run today, with FlashMLA's [B, H, Nq] lse transposed for merge_states). {} without it.
    Returns {name: fn}; fn() returns (out, lse) in our layouts."""
    try:
        import flash_mla
    except ImportError as e:
        print(f"FlashMLA peers skipped: flash_mla is not importable ({e}); put ../shared/peers' package on PYTHONPATH")
        return {}
    import torch
    dl = torch.utils.dlpack.from_dlpack
    qn, qp = dl(x["q_nope"]).view(torch.bfloat16), dl(x["q_pe"]).view(torch.bfloat16)
    q = torch.cat([qn, qp], -1).contiguous()                              # [B, Nq, H, R+P]: made once, not timed
    b, nq, h, r = qn.shape
    cache = dl(x["kv_cache"]).view(torch.bfloat16)
    kv = cache.view(cache.shape[0], cache.shape[1], 1, cache.shape[2])    # [num_pages, page, 1, R+P]
    table, lens = dl(x["block_table"]), dl(x["prefix_lens"])
    dense_lens = (lens + nq).to(torch.int32)
    scale = x["softmax_scale"]
    meta_dense, splits_dense = flash_mla.get_mla_metadata()
    meta_pre, splits_pre = flash_mla.get_mla_metadata()
    tail = ks.tree_verify_tail(**x)
    merged = ks.merge_states(tail.out, tail.lse, tail.out, tail.lse)       # output buffers of the split path

    import cupy

    def on_our_stream():   # FlashMLA launches on torch's current stream: make it CuPy's (the one being timed)
        return torch.cuda.stream(torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr))

    def dense():
        with on_our_stream():
            o, lse = flash_mla.flash_mla_with_kvcache(q, kv, table, dense_lens, r, meta_dense, splits_dense,
                                                      softmax_scale=scale, causal=False)
            return o, lse.transpose(1, 2)

    def split():
        with on_our_stream():
            po, plse = flash_mla.flash_mla_with_kvcache(q, kv, table, lens, r, meta_pre, splits_pre,
                                                        softmax_scale=scale, causal=False)
            t = ks.tree_verify_tail(**x, out=tail.out, lse=tail.lse)
            return ks.merge_states(po, plse.transpose(1, 2).contiguous(), t.out, t.lse, out=merged.out,
                                   lse=merged.lse)

    return {"FlashMLA dense (no mask)": dense, "split: FlashMLA + tail + merge": split}


def bench_tree_verify(args) -> None:
    from .spec import find_spec
    from .kernel_set import load
    peak = measured_peak_tflops()
    nq = 65
    rows, plot = [], []
    for b, h, l in VERIFY_CONFIGS:
        if args.spec and SPEC_BY_HEADS[h] not in args.spec:
            continue
        spec = find_spec(SPEC_BY_HEADS[h])
        ks = load(spec)
        rng = np.random.default_rng(1)
        lens = rng.integers(64, 16384, size=b) if l == "mixed" else np.full(b, l)
        x = verify_inputs(spec, b, lens, nq)
        flops = verify_flops(spec, lens, nq)
        impls = {}
        for impl in ("wgmma", "mma", "simple"):
            why = ks.unavailable(f"tree_verify_{impl}", x["q_nope"].device.id) if impl != "simple" else None
            if why:   # e.g. wgmma when forced to the sm_80 PTX builds
                print(f"skipped impl={impl}: {why}")
                continue
            out = ks.tree_verify(**x, impl=impl)
            impls[f"ours ({impl})"] = lambda impl=impl, out=out: ks.tree_verify(**x, out=out.out, lse=out.lse,
                                                                                impl=impl)
        times = {}
        for name, fn in impls.items():
            times[name] = checked_graph_time_ms(fn, f"{name} at B={b} H={h} L={l}", flops / (peak * 1e12) * 1e3)
        for name, fn in flashmla_peers(ks, x).items():
            times[name] = checked_graph_time_ms(fn, f"{name} at B={b} H={h} L={l}", flops / (peak * 1e12) * 1e3)
        for name, fn in torch_peers(x).items():
            try:
                times[name] = gpu_time_ms(fn, warmup=2, reps=5)
            except Exception as e:  # out of memory or unsupported: show, don't hide
                print(f"{name} failed at B={b} H={h} L={l}: {type(e).__name__}: {str(e)[:100]}")
        ours = min((t, n) for n, t in times.items() if n.startswith("ours"))
        fmla = times.get("FlashMLA dense (no mask)")
        for name, ms in times.items():
            tf = flops / (ms * 1e-3) / 1e12
            rows.append([f"B={b} H={h} L={l}", name, f"{ms:.3f}", f"{tf:.1f}", f"{100 * tf / peak:.1f}%",
                         f"{ms / ours[0]:.2f}x" if not name.startswith("ours") else
                         ("best" if name == ours[1] else f"{ms / ours[0]:.2f}x"),
                         f"{ms / fmla:.2f}" if fmla else "-"])
            plot.append((f"B={b}\nH={h}\nL={l}", name, tf))
    print_table(f"tree_verify, Nq={nq}; FLOPs = 2*H*Nq*(L+Nq)*(2R+P) summed over requests; "
                f"measured bf16 matmul peak in this run: {peak:.0f} TFLOP/s; ours and FlashMLA: CUDA-graph replay "
                f"medians; torch peers: eager medians; vs ours: time / our best time; vs FlashMLA: time / FlashMLA "
                f"dense's (its FLOPs without the tree mask)",
                ["config", "impl", "ms", "TFLOP/s", "% peak", "vs ours", "vs FlashMLA"], rows, args.out,
                "bench_tree_verify")
    if args.out:
        _plot(plot, peak, Path(args.out) / "bench_tree_verify.png")


def _plot(points, peak, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    configs = list(dict.fromkeys(c for c, _, _ in points))
    impls = list(dict.fromkeys(i for _, i, _ in points))
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        xs = [configs.index(c) + k * width for c, i, _ in points if i == impl]
        ys = [t for _, i, t in points if i == impl]
        ax.bar(xs, ys, width, label=impl)
    ax.axhline(peak, color="k", linestyle="--", label=f"measured bf16 peak {peak:.0f}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], configs, fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_yscale("log")
    ax.set_title("tree_verify on H200, Nq = 65")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---------------------------------------------------------------- kv dtype: fp8 vs bf16

KV_DTYPE_CONFIGS = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (8, 16, 4096), (8, 64, 4096), (8, 128, 4096)]
KV_DTYPE_KERNELS = ("tree_verify", "tree_verify_wgmma", "tree_verify_mma", "tree_verify_mma_combine")


def spec_variant(base, heads: int, kv_dtype: str):
    """`base` with num_heads = heads and kv_dtype: the shipped spec with exactly those values if there is one
    (its builds may be cached already), else an unshipped variant named <base>-h<H>[-fp8] (built into the
    binary cache only, never into generated/)."""
    from .spec import all_specs
    want = dataclasses.replace(base, num_heads=heads, kv_dtype=kv_dtype)
    for s in all_specs():
        if dataclasses.replace(s, name=want.name) == want:
            return s
    stem = base.name[:-4] if base.name.endswith("-fp8") else base.name
    name = stem + (f"-h{heads}" if heads != base.num_heads else "") + ("-fp8" if kv_dtype == "fp8_e4m3" else "")
    return dataclasses.replace(want, name=name)


def _auto_impl(ks, device: int) -> str:
    """The implementation tree_verify(impl="auto") takes on `device` (kernels/tree_verify.py's rule)."""
    for kind in ("wgmma", "mma"):
        if all(k in ks.kernels and ks.unavailable(k, device) is None
               for k in (f"tree_verify_{kind}", "tree_verify_mma_combine")):
            return kind
    return "simple"


def bench_kv_dtype(args) -> None:
    """tree_verify (impl="auto") of a spec with a bf16 and with an fp8 (e4m3) KV cache on the same shapes, in one
    process: H comes from the config (variants of the spec with other H are built as needed), the fp8 cache holds
    the e4m3 bytes of the bf16 cache's samples. A table: config, impl, bf16 ms, fp8 ms, bf16/fp8 speed ratio,
    TFLOP/s and % of the measured bf16 matmul peak of each."""
    from .spec import find_spec
    from .kernel_set import load
    base = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    peak = measured_peak_tflops()
    nq = 65
    rows = []
    for b, h, l in KV_DTYPE_CONFIGS:
        lens = np.full(b, l)
        flops, times, impls = None, {}, {}
        for kv_dtype in ("bf16", "fp8_e4m3"):
            spec = spec_variant(base, h, kv_dtype)
            t0 = time.perf_counter()
            ks = load(spec, kernels=list(KV_DTYPE_KERNELS))
            x = verify_inputs(spec, b, lens, nq)
            impls[kv_dtype] = _auto_impl(ks, x["q_nope"].device.id)
            res = ks.tree_verify(**x)
            fn = lambda ks=ks, x=x, res=res: ks.tree_verify(**x, out=res.out, lse=res.lse)  # noqa: E731
            flops = verify_flops(spec, lens, nq)
            times[kv_dtype] = checked_graph_time_ms(fn, f"{kv_dtype} at B={b} H={h} L={l}", flops / (peak * 1e12) * 1e3)
            print(f"B={b} H={h} L={l} {spec.name} ({kv_dtype}, impl={impls[kv_dtype]}): {times[kv_dtype]:.3f} ms "
                  f"(load + inputs + timing {time.perf_counter() - t0:.1f} s)", flush=True)
        cells = []
        for kv_dtype in ("bf16", "fp8_e4m3"):
            tf = flops / (times[kv_dtype] * 1e-3) / 1e12
            cells += [f"{tf:.1f}", f"{100 * tf / peak:.1f}%"]
        rows.append([f"B={b} H={h} L={l}", f"{impls['bf16']}/{impls['fp8_e4m3']}", f"{times['bf16']:.3f}",
                     f"{times['fp8_e4m3']:.3f}", f"{times['bf16'] / times['fp8_e4m3']:.2f}x", *cells])
    print_table(f"tree_verify (impl auto) of {base.name}: bf16 vs fp8 (e4m3) KV cache, Nq={nq}; CUDA-graph replay "
                f"medians; FLOPs = 2*H*Nq*(L+Nq)*(2R+P) summed over requests; measured bf16 matmul peak in this run: "
                f"{peak:.0f} TFLOP/s; speedup = bf16 ms / fp8 ms",
                ["config", "impl bf16/fp8", "bf16 ms", "fp8 ms", "speedup", "bf16 TFLOP/s", "bf16 % peak",
                 "fp8 TFLOP/s", "fp8 % peak"], rows, args.out, "bench_kv_dtype")


# ---------------------------------------------------------------- draft_topk

def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate measured now: bytes read plus bytes written per second, in GB/s."""
    import cupy
    src = cupy.empty(nbytes // 4, np.float32)
    src.fill(1.0)
    dst = cupy.empty_like(src)
    ms = graph_time_ms(lambda: cupy.copyto(dst, src), per_graph=5, reps=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _torch_graph_time_ms(fn, *, per_graph=10, reps=20) -> float:
    """Median milliseconds of one fn() (torch ops) replayed from a torch CUDA graph of per_graph calls."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    torch.cuda.synchronize()
    return gpu_time_ms(g.replay, warmup=3, reps=reps) / per_graph


def bench_draft_topk(args) -> None:
    """draft_topk next to torch.topk + logsumexp (what engines run today) on the same bf16 logits, B = 1, 8, 64,
    D' = 15, k = 64, V = 129280 (DeepSeek-V3) and 163840 (Kimi K2): CUDA-graph replay medians of both, and the
    bandwidth floor (the logits read once at the device-to-device copy rate measured in this run)."""
    import cupy
    import torch
    from .spec import find_spec
    from .kernel_set import load
    from .kernels.draft_topk import workspace_elems
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec, kernels=["draft_topk"])
    k, dp = min(64, spec.max_tree_size - 1), min(15, spec.max_depth)
    gbs = copy_bandwidth_gbs()
    rows = []
    rng = np.random.default_rng(0)
    for v in (129280, 163840):
        for b in (1, 8, 64):
            t = (torch.randn(b, dp, v, device="cuda") * 3).to(torch.bfloat16)
            x = cupy.asarray(t.view(torch.int16)).view(np.uint16)          # the same bytes, CuPy bf16 bits
            out = ks.draft_topk(x, k)
            ws = cupy.empty(max(1, workspace_elems(b, dp, v, k)), np.int32)
            ours = graph_time_ms(lambda: ks.draft_topk(x, k, out=out, workspace=ws), per_graph=10) * 1e3

            def peer():
                vals, idx = torch.topk(t, k, dim=-1)
                return idx, vals.float() - torch.logsumexp(t.float(), dim=-1, keepdim=True)
            theirs = _torch_graph_time_ms(peer) * 1e3
            # checks: against the numpy reference on two rows (ids bit-exact, log-probs within the bar)
            pick = rng.integers(0, b * dp, 2)
            host = cupy.asnumpy(x).reshape(b * dp, v)[pick][None]
            want = reference.draft_topk(host, k)
            got_ids = cupy.asnumpy(out.topk_ids).reshape(b * dp, k)[pick][None]
            got_lps = cupy.asnumpy(out.topk_logprobs).reshape(b * dp, k)[pick][None].astype(np.float64)
            ok = (np.array_equal(got_ids, want.topk_ids) and
                  np.all(np.abs(got_lps - want.topk_logprobs) <= 1e-5 + 2.0**-22 * np.abs(want.topk_logprobs)))
            nbytes = b * dp * v * 2
            floor = nbytes / (gbs * 1e9) * 1e6
            rows.append([v, b, b * dp, f"{nbytes / 1e6:.1f}", f"{floor:.1f}", f"{ours:.1f}", f"{100 * floor / ours:.0f}%",
                         f"{theirs:.1f}", f"{100 * floor / theirs:.0f}%", f"{theirs / ours:.1f}x", "yes" if ok else "NO"])
            del t, x, out, ws
    print_table(f"draft_topk on {spec.name} (k={k}, D'={dp}, bf16 logits); GPU times: CUDA-graph replay medians per "
                f"call; floor: the logits read once at the device copy rate measured now ({gbs:.0f} GB/s, read + "
                f"write); torch: torch.topk + logsumexp (fp32) on the same logits; checked: two rows against "
                f"reference.draft_topk",
                ["V", "B", "rows", "MB", "floor us", "ours us", "% floor", "torch us", "torch % floor", "speedup",
                 "checked"], rows, args.out, "bench_draft_topk")

#!/usr/bin/env python
"""The host (Python) time of one cached eager call, per launcher and per torch op, without a GPU.

When: after changing the launch path (runtime.run_call, arrays, the launchers, torch_ops), to see what a
call costs on the host before a GPU run of `ddtree-gen bench launch` (which measures the same calls on
the GPU, with the driver and CUDA allocations).
How: a real KernelSet of the spec (its plans, constants and launchers) whose binaries are stand-ins, on a
stand-in device 0 (compute capability 9.0, so impl="auto" picks wgmma as on an H200), with the driver's
cuLaunchKernel, stream and device calls replaced by no-ops that count the launches. The arrays are torch
CPU tensors passed as if they lived on device 0 (their fast signature says device 0; outputs are allocated
on the CPU), so the torch path is the engine's path minus the driver and the CUDA caching allocator; the
torch ops are the registered CUDA implementations, registered for the CPU key here. The tiny problem of
`bench launch`: B = 1, prefix 64, Nq = N; kv_commit with 61 layers.
Run: PYTHONPATH=. python scripts/profile_launch.py [--spec kimi-k2.6-tp8] [--calls 5000] [--clock cpu|wall]
                                                   [--profile CALL] [--stages CALL] [--source CALL]
It prints one row per call: host us per call (best of 5 runs of --calls calls), launches per call.
--profile CALL prints a cProfile of that call (cumulative, top 25); --stages CALL the time of each stage
of the cached call (the launcher, signature and lookup; its compiled function's checks, outputs, launch,
result); --source CALL that compiled function. Times are this thread's CPU time (--clock wall: wall time).
Needs torch (CPU build) and no GPU; a GPU is not touched.
"""
from __future__ import annotations

import argparse
import cProfile
import operator
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

LAYERS = 61


class _Built:
    """An artifacts.Built stand-in: KernelSet reads .binary, .arch and .variant (its plan)."""

    def __init__(self, v):
        self.binary, self.arch, self.variant = b"", v.target, v


def stand_in_kset(spec, patch=setattr, patch_item=operator.setitem):
    """A real KernelSet of `spec` with stand-in binaries, on a stand-in Hopper device 0 whose launches are
    counted, not run. Returns (kset, launches: a list of (function, grid, block, shared memory, stream, the
    parameter buffer's address) per cuLaunchKernel call). `patch` / `patch_item` make the replacements
    (setattr / setitem here; a test passes monkeypatch.setattr / monkeypatch.setitem, which undo them)."""
    import torch

    from ddtree_gen import arrays, callplan, runtime
    from ddtree_gen.kernel_set import KernelSet
    from ddtree_gen.plans import all_kernels
    from ddtree_gen.plans.variant import variant

    info = runtime.DeviceInfo("stand-in H200", (9, 0), 232448)
    patch(runtime, "device_info", lambda device: info)
    patch(runtime, "sm_count", lambda device: 132)
    launches = []

    def launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        launches.append((fn, (gx, gy, gz), (bx, by, bz), smem, stream, params))

    runtime._cuda()   # the real entry points first (a torch or CuPy import), then the stand-ins over them
    for key, value in (("launch", launch), ("get_device", lambda: 0), ("set_device", lambda d: None),
                       ("cupy_stream", lambda d: type("S", (), {"ptr": 0})()), ("torch_stream", lambda d: 0)):
        patch_item(runtime._CUDA, key, value)

    def fake_load(self, name, device):
        arch, why = self.choose(name, device)
        if arch is None:
            raise runtime.ArgumentError(why)
        b = self._kernels[name][arch]
        return None, 0x1000 + len(name), b.threads, b.dynamic_smem

    patch(runtime.DeviceModules, "_load", fake_load)

    def encode(out, *args):   # cuTensorMapEncodeTiled: 16 words of zeros
        return 0

    patch(callplan, "_encode_tiled", lambda: encode)
    _torch_cpu_as_device0(torch, arrays, runtime, patch, patch_item)
    built = {k.name: {a: _Built(variant(k, spec, a)) for a in k.archs_for(spec)} for k in all_kernels() if k.archs_for(spec)}
    return KernelSet(spec, built), launches


def _torch_cpu_as_device0(torch, arrays, runtime, patch, patch_item):
    """torch CPU tensors stand for CUDA tensors of device 0: their view (the checks) and fast view (the
    signature) say device 0 (runtime.HOST_DEVICE), and new outputs are CPU tensors."""
    real_view = arrays.view

    def view(x, name):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            dt = arrays._TORCH_DTYPES.get(str(x.dtype), str(x.dtype))
            return (arrays.DevArray(x, x.data_ptr(), tuple(x.shape), dt, "torch", runtime.HOST_DEVICE),
                    x.is_contiguous())
        return real_view(x, name)
    patch(arrays, "view", view)

    def torch_fast(x):   # arrays._torch_fast with the device index of a CUDA tensor
        return x.data_ptr(), (x.dtype, x.shape, x.stride(), runtime.HOST_DEVICE)
    patch_item(arrays._FAST, torch.Tensor, torch_fast)
    if hasattr(arrays, "TORCH_TENSOR"):
        arrays.TORCH_TENSOR[0] = torch.Tensor   # (what the first torch array sets)
    cpu = torch.device("cpu")
    patch(arrays, "torch_device", lambda device: cpu)
    patch(runtime, "HOST_DEVICE", 0)   # run_call's inline view of a torch tensor: a CPU tensor stands for device 0
    for name, dt in (("bf16", torch.bfloat16), ("int32", torch.int32), ("float32", torch.float32),
                     ("uint32", torch.uint32), ("uint8", torch.uint8)):
        for device in (0, 1):
            patch_item(arrays._TORCH_NEW, (name, device), (torch.empty, {"dtype": dt, "device": cpu}))


def inputs(spec):
    """The tiny problem's torch CPU inputs (B = 1, prefix 64, Nq = N)."""
    import torch
    g = torch.Generator().manual_seed(0)
    b, n, h, r, p, page = 1, spec.max_tree_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, \
        spec.page_size
    d, w = spec.max_depth, spec.mask_words
    pages = -(-(64 + n) // page)
    kv_dtype = torch.float8_e4m3fn if spec.kv_fp8 else torch.bfloat16

    def kv():
        return torch.zeros((pages, page, r + p), dtype=kv_dtype)
    v = dict(q_nope=torch.randn((b, n, h, r), generator=g).bfloat16(),
             q_pe=torch.randn((b, n, h, p), generator=g).bfloat16(), kv_cache=kv(),
             block_table=torch.arange(pages, dtype=torch.int32).reshape(1, pages),
             prefix_lens=torch.full((b,), 64, dtype=torch.int32), q_lens=torch.full((b,), n, dtype=torch.int32),
             tree_mask=torch.ones((b, n, w), dtype=torch.uint32), softmax_scale=192 ** -0.5)
    if spec.kv_fp8:
        v["kv_scale"] = 1.0
    ids = torch.randint(0, 150000, (b, d, n - 1), dtype=torch.int32, generator=g)
    lps = -torch.sort(torch.rand((b, d, n - 1), generator=g), dim=-1).values
    build = (ids, lps, torch.randint(0, 150000, (b,), dtype=torch.int32, generator=g), v["prefix_lens"].clone())
    caches = [kv() for _ in range(LAYERS)]
    target = torch.zeros((b, n), dtype=torch.int32)
    return v, build, caches, target


def calls(ks, spec):
    """name -> (plain call, torch-op call or None, the op's direct entry or None): the calls of `bench launch`, and
    kv_commit of 61 layers (a list: the op kv_commit; stacked: kv_commit_stacked). The direct entries
    (torch_ops.direct) take the same arguments as the ops."""
    import torch

    from ddtree_gen import registry, torch_ops
    v, (ids, lps, roots, prefix), caches, target = inputs(spec)
    budget = spec.max_tree_size - 1
    tree = ks.tree_build(ids, lps, roots, prefix, budget)
    res, tail = ks.tree_verify(**v), ks.tree_verify_tail(**v)
    acc_args = (tree, target, v["prefix_lens"], v["kv_cache"], v["block_table"])
    acc = ks.tree_accept(tree, target, v["prefix_lens"])
    stacked = torch.stack(caches)   # the layers as one [layers, num_pages, page_size, R+P] tensor
    # the torch ops: their CUDA implementations, registered for the CPU key, on this kernel set
    torch_ops._kset = lambda name: ks
    lib = torch.library.Library("ddtree", "IMPL")
    for _, op in registry.torch_ops():
        lib.impl(op.name, torch_ops.implementation(op.name), "CPU")
    calls.lib = lib   # kept alive
    s = spec.name
    vargs = (v["q_nope"], v["q_pe"], v["kv_cache"], v["block_table"], v["prefix_lens"], v["q_lens"], v["tree_mask"],
             v["softmax_scale"])
    extra = (v["kv_scale"],) if spec.kv_fp8 else ()
    logits = k = None
    if "draft_topk" in ks.kernels:
        logits = torch.randn((1, spec.max_depth, 129280), generator=torch.Generator().manual_seed(1)).bfloat16()
        k = min(64, spec.max_tree_size - 1)

    def op_calls(ops):   # row -> the call through `ops` (torch.ops.ddtree, or torch_ops.direct)
        out = {
            "tree_build": lambda: ops.tree_build(s, ids, lps, roots, prefix, budget),
            "tree_verify (auto)": lambda: ops.tree_verify(s, *vargs, "auto", *extra),
            "tree_verify_tail": lambda: ops.tree_verify_tail(s, *vargs, "auto", *extra),
            "merge_states": lambda: ops.merge_states(s, res.out, res.lse, tail.out, tail.lse),
            "tree_accept": lambda: ops.tree_accept(s, tree.num_nodes, tree.tokens, tree.first_child,
                                                   tree.next_sibling, target, v["prefix_lens"], v["kv_cache"],
                                                   v["block_table"]),
            "tree_walk": lambda: ops.tree_walk(s, tree.num_nodes, tree.tokens, tree.first_child, tree.next_sibling,
                                               target, v["prefix_lens"]),
            f"kv_commit, {LAYERS} stacked": lambda: ops.kv_commit_stacked(s, acc.accept_lens, acc.accepted_nodes,
                                                                          v["prefix_lens"], stacked,
                                                                          v["block_table"]),
            f"kv_commit, {LAYERS} layers": lambda: ops.kv_commit(s, acc.accept_lens, acc.accepted_nodes,
                                                                 v["prefix_lens"], caches, v["block_table"]),
        }
        if logits is not None and hasattr(ops, "draft_topk"):
            out["draft_topk"] = lambda: ops.draft_topk(s, logits, k)
        return out

    plain = {
        "tree_build": lambda: ks.tree_build(ids, lps, roots, prefix, budget),
        "tree_verify (auto)": lambda: ks.tree_verify(**v),
        "tree_verify_tail": lambda: ks.tree_verify_tail(**v),
        "merge_states": lambda: ks.merge_states(res.out, res.lse, tail.out, tail.lse),
        "tree_accept": lambda: ks.tree_accept(*acc_args),
        "tree_walk": lambda: ks.tree_accept(tree, target, v["prefix_lens"]),
        f"kv_commit, {LAYERS} stacked": lambda: ks.kv_commit(acc, v["prefix_lens"], stacked, v["block_table"]),
        f"kv_commit, {LAYERS} layers": lambda: ks.kv_commit(acc, v["prefix_lens"], caches, v["block_table"]),
    }
    if logits is not None:
        plain["draft_topk"] = lambda: ks.draft_topk(logits, k)
    ops, direct = op_calls(torch.ops.ddtree), op_calls(torch_ops.direct)
    out = {name: (fn, ops.get(name), direct.get(name)) for name, fn in plain.items()}
    a, b = torch.ones(16), torch.ones(16)
    out["torch.add, 16 floats (CPU)"] = (lambda: torch.add(a, b), None, None)
    return out


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
CLOCK = [time.thread_time]   # --clock: this thread's CPU time (default: a shared machine's load does not count), or wall
SYNC = [None]   # called before each timed run where set (scripts/probe_launch_gpu.py: the GPU's queue drained first)


def per_call_us(fn, n: int) -> float:
    clock, sync = CLOCK[0], SYNC[0]
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


def stages(ks, fn, n: int) -> None:
    """Print stage_times(ks, fn, n)."""
    for label, us in stage_times(ks, fn, n):
        print(f"  {label:<45} {us:6.1f} us")


def stage_times(ks, fn, n: int) -> list:
    """The time of each stage of one cached call, [(label, us)]: the whole call, the compiled function's stages
    (callplan.compile_runner marks them in its source: checks, outputs, launch, result), each timed as the source
    cut after it, then the launcher, its signature and the cache lookup (the call minus its compiled function).
    Works on any kernel set (this script's stand-in, or a real one: scripts/probe_launch_gpu.py)."""
    from ddtree_gen.runtime import Prepared
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
    total = per_call_us(fn, n)
    rows = [("the call", total)]
    inner = 0.0
    for real, arrays, ptrs in seen:
        lines = real.source.rstrip("\n").split("\n")
        cuts = [k for k, line in enumerate(lines) if line.startswith("    # ")] + [len(lines)]
        last = 0.0
        for k, cut in zip(cuts, cuts[1:]):
            src = "\n".join(lines[:cut] + ["    return None"]) + "\n"
            ns = dict(real.__globals__)
            exec(src, ns)
            part = ns["run"]
            t = per_call_us(lambda: part(arrays, list(ptrs)), n) - per_call_us(lambda: list(ptrs), n)
            rows.append((f"{lines[k].strip()[2:]:<8} ({real.__code__.co_filename.strip('<>')[11:]:<34})", t - last))
            last = t
        inner += last
    rows.append(("launcher, signature, cache lookup", total - inner))
    return rows


def source(ks, fn) -> None:
    """The compiled function(s) of one cached call (callplan.compile_runner)."""
    from ddtree_gen.runtime import Prepared
    fn()
    before = {id(p) for p in ks.prepared_calls.values() if isinstance(p, Prepared)}
    for p in ks.prepared_calls.values():
        if isinstance(p, Prepared) and p.run is not None and id(p) in before:
            seen = []
            real = p.run
            p.run = lambda arrays, ptrs, real=real: seen.append(1) or real(arrays, ptrs)
            fn()
            p.run = real
            if seen:
                print(real.source)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="CPU only: stand-in binaries and a counting stand-in for cuLaunchKernel.")
    ap.add_argument("--spec", default="kimi-k2.6-tp8", help="spec name (default kimi-k2.6-tp8)")
    ap.add_argument("--calls", type=int, default=5000, help="calls per timing run (best of 5)")
    ap.add_argument("--profile", metavar="CALL", help="cProfile this call's plain launcher (a row name, or its "
                                                      "prefix), 'op:CALL' its torch op, 'direct:CALL' the op's "
                                                      "direct entry")
    ap.add_argument("--stages", metavar="CALL", help="time each stage of this call (its compiled function's "
                                                     "checks, outputs, launch, result; the rest before it)")
    ap.add_argument("--source", metavar="CALL", help="print this call's compiled function (callplan.compile_runner)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: this thread's CPU time (default; on a shared machine, others' load does not count); "
                         "wall: wall time")
    args = ap.parse_args(argv)
    CLOCK[0] = CLOCKS[args.clock]
    try:
        import torch  # noqa: F401
    except ImportError:
        print("profile_launch.py needs torch (its CPU build is enough): pip install torch")
        return 2
    from ddtree_gen.spec import find_spec
    spec = find_spec(args.spec)
    ks, launches = stand_in_kset(spec)
    table = calls(ks, spec)
    if args.profile or args.stages or args.source:
        want = args.profile or args.stages or args.source
        form, _, rest = want.partition(":")
        form, want = (form, rest) if rest and form in ("op", "direct") else ("plain", want)
        name = next((k for k in table if k.startswith(want)), None)
        if name is None:
            ap.error(f"no call named {want!r}: {', '.join(table)}")
        fn = table[name][("plain", "op", "direct").index(form)]
        if fn is None:
            ap.error(f"{name!r} has no {form} form")
        if args.stages:
            print(f"stages of {name} ({form}), {args.calls} calls")
            stages(ks, fn, args.calls)
            return 0
        if args.source:
            source(ks, fn)
            return 0
        for _ in range(50):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        return 0
    print(f"host time per cached eager call, spec {spec.name}, B = 1, prefix 64, Nq = N, torch CPU tensors "
          f"standing for CUDA ones, no driver (best of 5 x {args.calls} calls; this machine's CPU, {args.clock} time)")
    print(f"{'call':<30} {'plain us':>9} {'torch op us':>12} {'op - plain':>11} {'direct us':>10} "
          f"{'direct - plain':>15} {'launches':>9}")
    for name, (plain, op, direct) in table.items():
        before = len(launches)
        plain()
        n_launch = len(launches) - before
        p = per_call_us(plain, args.calls)
        o = per_call_us(op, args.calls) if op is not None else float("nan")
        d = per_call_us(direct, args.calls) if direct is not None else float("nan")
        launches.clear()
        print(f"{name:<30} {p:9.1f} {o:12.1f} {o - p:11.1f} {d:10.1f} {d - p:15.1f} {n_launch:9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

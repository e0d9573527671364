"""`ddtree-gen bench arch`: the two build targets of one spec side by side, in one process on one GPU.

Two kernel sets of the same spec: the default one (each kernel picks its build per device,
archs.select: the sm_90a cubins on an H100 / H200; $DDTREE_GEN_ARCH is ignored here) and one forced
to the sm_80 PTX (load(spec, arch="sm_80"): the compute_80 PTX the driver JIT-compiles, what an
A100 or a B200 runs). The same inputs go to both:

* tree_build, B = 64, the spec's budget and depth;
* tree_verify impl="auto" (sm_90a: wgmma; sm_80: mma.sync) and impl="mma" (the mma.sync kernel family
  of both builds; not for an fp8 spec, which has none) at B = 1 and 8 with the spec's H, and B = 8 with
  H = 64 (the spec with 64 heads, as bench kv-dtype builds it), L = 4096, Nq = the spec's N;
* tree_accept + kv_commit (the walk once, the commit of 61 layers), B = 64, 4 accepted drafts.

A table: kernel, shape, what each set ran (implementation and target), both times (CUDA-graph replay
medians), sm_80 ms / default ms, % of the measured bf16 matmul peak (tree_verify), and whether the
outputs agree, so that a wrong forced build cannot look fast: the discrete kernels bit-exact (tree_build
also against the numpy reference); attention per (request, row, head) the relative norm of the
difference and the largest |lse difference|, held to twice the contract's bar (docs/contract.md
section 10: two outputs each within 5e-3 / 1e-3 of the reference differ by at most 1e-2 / 2e-3).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .. import reference
from ..errors import DdtreeError
from ..inputs import accept_tree, block_table, cache_shape, tree_build_inputs, verify_inputs
from ..ops.tree_verify.launch import auto_impl, why_not
from .specs import LAYERS, VERIFY_KERNELS, spec_variant
from .timing import checked_graph_time_ms, graph_time_ms, measured_peak_tflops, print_table, verify_flops

FORCED = "sm_80"
KERNELS = ("tree_build", "tree_accept", "kv_commit", *VERIFY_KERNELS)
BUILD_B = 64
ACCEPT_B, ACCEPTED = 64, 4
VERIFY_L = 4096
VERIFY_SHAPES = ((1, None), (8, None), (8, 64))   # (B, H); None: the spec's H
VERIFY_IMPLS = ("auto", "mma")
REL_BAR, LSE_BAR = 2 * 5e-3, 2 * 1e-3           # twice the contract's bar: the difference of two conforming outputs


def verify_shapes(spec) -> list[tuple[int, int]]:
    """(B, H) of the tree_verify rows for `spec`, without repeats (a spec with H = 64 has two)."""
    return list(dict.fromkeys((b, h or spec.num_heads) for b, h in VERIFY_SHAPES))


def ran(ks, kernel: str, device: int, impl: str | None = None) -> str:
    """What kernel set `ks` runs on `device`: "<target>" for a kernel, "<impl> (<target>)" for tree_verify with
    `impl` ("auto": the implementation auto takes there, as bench kv-dtype reports it)."""
    if impl is None:
        return str(ks.arch_for(kernel, device))
    kind = auto_impl(ks, device) if impl == "auto" else impl
    name = "tree_verify" if kind == "simple" else f"tree_verify_{kind}"
    return f"{kind} ({ks.arch_for(name, device)})"


def _gpu() -> tuple[int, object]:
    """The current device and its runtime.device_info; DdtreeError, saying why, where there is no usable GPU."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
        device = cupy.cuda.Device().id
    except Exception as e:   # no CuPy, no driver, no device
        raise DdtreeError(f"bench arch runs on a GPU (an H100 / H200 to compare the sm_90a cubins with the sm_80 "
                          f"PTX); none is usable here: {type(e).__name__}: {e}") from None
    if count == 0:
        raise DdtreeError("bench arch runs on a GPU (an H100 / H200); CUDA sees none")
    from ..launch.runtime import device_info
    return device, device_info(device)


def _same_bits(a, b) -> bool:
    import cupy
    a, b = cupy.asnumpy(a), cupy.asnumpy(b)   # numpy arrays pass through
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _differ(names, xs, ys) -> list[str]:
    return [n for n, x, y in zip(names, xs, ys) if not _same_bits(x, y)]


def _agree_bits(differ: list[str]) -> str:
    return "bit-exact" if not differ else "DIFFER: " + ",".join(differ)


def attention_difference(a, b) -> tuple[float, float, bool]:
    """(largest per (request, row, head) ||out_a - out_b|| / ||out_a||, largest |lse_a - lse_b|, NaN anywhere)
    of two AttentionOutputs (bf16 bits on the GPU); equal infinities count as no difference."""
    import cupy

    def f32(bits):
        return (bits.astype(cupy.uint32) << 16).view(cupy.float32)

    oa, ob = f32(a.out), f32(b.out)
    rel = cupy.linalg.norm(oa - ob, axis=-1) / cupy.maximum(cupy.linalg.norm(oa, axis=-1), 1e-30)
    la, lb = a.lse, b.lse
    dl = cupy.where(la == lb, 0.0, cupy.abs(la - lb))
    nan = bool(cupy.isnan(oa).any() | cupy.isnan(ob).any() | cupy.isnan(la).any() | cupy.isnan(lb).any())
    return float(rel.max()), float(dl.max()), nan


def _agree_attention(a, b) -> str:
    rel, dl, nan = attention_difference(a, b)
    ok = not nan and rel <= REL_BAR and dl <= LSE_BAR
    return f"rel {rel:.1e} lse {dl:.1e} " + ("ok" if ok else "OVER BAR" + (" (NaN)" if nan else ""))


def _ratio(base_ms: float, forced_ms: float) -> str:
    return f"{forced_ms / base_ms:.2f}x"


def run(args) -> None:
    """The table of the module docstring, per spec of --spec (default kimi-k2.6-tp8)."""
    from ..spec import find_spec
    from ..kernel_set import load
    specs = [find_spec(n) for n in (args.spec or ["kimi-k2.6-tp8"])]
    for spec in specs:
        if FORCED not in spec.archs:
            raise DdtreeError(f"bench arch: spec {spec.name!r} is not built for {FORCED} (its targets: "
                              f"{', '.join(spec.archs)}): there is nothing to compare")
    device, info = _gpu()
    base_name = "sm_90a" if tuple(info.cc) == (9, 0) else "default"
    print(f"bench arch on {info.describe(device)}: the default kernel set (the build each kernel picks here) next "
          f"to the set forced to {FORCED} (PTX JIT-compiled by the driver)", flush=True)
    if base_name == "default":
        print(f"note: not an H100 / H200: the default set runs the {FORCED} PTX too (sm_90a cubins run on compute "
              f"capability 9.0 only)", flush=True)
    peak = measured_peak_tflops()
    for spec in specs:
        rows = _rows(spec, load, device, peak)
        print_table(f"bench arch, {spec.name} on {info.name}: {base_name} = the default kernel set, {FORCED} = "
                    f"load(spec, arch='{FORCED}'); CUDA-graph replay medians; ratio = {FORCED} ms / {base_name} ms "
                    f"(> 1: the PTX build is slower); % peak of the bf16 matmul measured in this run ({peak:.0f} "
                    f"TFLOP/s); outputs: discrete kernels bit-exact ({base_name} vs {FORCED}, tree_build also vs the "
                    f"reference), attention: largest per-(request, row, head) relative difference and |lse "
                    f"difference|, bar {REL_BAR:.0e} / {LSE_BAR:.0e} (twice the contract's)",
                    ["kernel", "shape", f"ran {base_name}", f"ran {FORCED}", f"{base_name} ms", f"{FORCED} ms",
                     "ratio", f"{base_name} % peak", f"{FORCED} % peak", "outputs"],
                    rows, args.out, "bench_arch" if len(specs) == 1 else f"bench_arch_{spec.name}")
        wrong = [f"{r[0]} {r[1]}" for r in rows if not r[-1].endswith(("bit-exact", " ok"))]
        if wrong:
            print(f"WARNING: the {FORCED} and the {base_name} outputs disagree (their times do not compare) in: "
                  + "; ".join(wrong), flush=True)


def _sets(load, spec, kernels):
    """(default set, forced set) of `spec`'s `kernels`: "auto" ignores $DDTREE_GEN_ARCH."""
    return load(spec, kernels=list(kernels), arch="auto"), load(spec, kernels=list(kernels), arch=FORCED)


def _rows(spec, load, device, peak) -> list[list]:
    sets = _sets(load, spec, KERNELS)
    rows = [_tree_build_row(spec, sets, device)]
    nq = spec.max_tree_size
    for b, h in verify_shapes(spec):
        vspec = spec if h == spec.num_heads else spec_variant(spec, h, spec.kv_dtype)
        vsets = sets if vspec is spec else _sets(load, vspec, VERIFY_KERNELS)
        rows += _verify_rows(vspec, vsets, device, b, nq, peak, variant=vspec is not spec)
    rows.append(_accept_row(spec, sets, device))
    return rows


def _tree_build_row(spec, sets, device) -> list:
    import cupy
    budget = spec.max_tree_size - 1
    host = tree_build_inputs(spec, BUILD_B, np.random.default_rng(0))
    dev = [cupy.asarray(x) for x in host]
    ref = reference.tree_build(*host, budget, max_tree_size=spec.max_tree_size)
    outs, times = [], []
    for ks in sets:
        out = ks.tree_build(*dev, budget)
        outs.append([cupy.asnumpy(x) for x in out])
        times.append(graph_time_ms(lambda ks=ks, out=out: ks.tree_build(*dev, budget, out=out)))
    names = list(ref._fields)
    differ = _differ(names, *outs) + [f"{n} vs ref" for n in _differ(names, outs[0], list(ref))]
    shape = f"B={BUILD_B} budget={budget} D={spec.max_depth}"
    _progress("tree_build", shape, sets, times)
    return ["tree_build", shape, *(ran(ks, "tree_build", device) for ks in sets), *(f"{t:.4f}" for t in times),
            _ratio(*times), "-", "-", _agree_bits(differ)]


def _verify_rows(spec, sets, device, b, nq, peak, variant=False) -> list[list]:
    lens = np.full(b, VERIFY_L)
    x = verify_inputs(spec, b, lens, nq)
    flops = verify_flops(spec, lens, nq)
    shape = f"B={b} H={spec.num_heads} L={VERIFY_L} Nq={nq}" + (f" ({spec.name})" if variant else "")
    rows = []
    for impl in VERIFY_IMPLS:
        why = [why_not(ks, impl, device) for ks in sets]
        if any(why):
            print(f"skipped tree_verify impl={impl} at {shape} on {spec.name}: {next(w for w in why if w)}",
                  flush=True)
            continue
        outs, times = [], []
        for ks in sets:
            res = ks.tree_verify(**x, impl=impl)
            outs.append(res)
            fn = lambda ks=ks, res=res: ks.tree_verify(**x, out=res.out, lse=res.lse, impl=impl)  # noqa: E731
            times.append(checked_graph_time_ms(fn, f"tree_verify {impl} at {shape}", flops / (peak * 1e12) * 1e3))
        agree = _agree_attention(*outs)   # after the timed replays: they rewrote the same outputs
        _progress(f"tree_verify {impl}", shape, sets, times)
        pct = [f"{100 * flops / (t * 1e-3) / 1e12 / peak:.1f}%" for t in times]
        rows.append([f"tree_verify {impl}", shape, *(ran(ks, "tree_verify", device, impl) for ks in sets),
                     *(f"{t:.4f}" for t in times), _ratio(*times), *pct, agree])
    return rows


def _accept_row(spec, sets, device) -> list:
    import cupy
    b = ACCEPT_B
    tree_np, target_of, full = accept_tree(spec, b)
    accepted = min(ACCEPTED, full)
    tree = SimpleNamespace(**{k: cupy.asarray(v) for k, v in tree_np.items()})
    prefix = cupy.asarray(np.full(b, 512, np.int32))
    table_np, num_pages = block_table(None, [512 + spec.max_tree_size] * b, spec.page_size, permute=False)
    table = cupy.asarray(table_np)
    target = cupy.asarray(target_of(accepted))
    dtype, top = (cupy.uint8, 256) if spec.kv_fp8 else (cupy.uint16, 65536)
    shape = cache_shape(spec, num_pages)
    layer = (cupy.random.default_rng(0).random(shape, dtype=cupy.float32) * top).astype(dtype)   # random bytes
    accs, caches, times = [], [], []
    for ks in sets:
        kv = [layer.copy() for _ in range(LAYERS)]
        acc = ks.tree_accept(tree, target, prefix)
        ks.kv_commit(acc, prefix, kv, table)   # once for the check; the timed replays repeat the same moves
        if int(acc.accept_lens.max()) != accepted:
            raise DdtreeError(f"bench arch: tree_accept accepted {int(acc.accept_lens.max())} drafts, "
                              f"the tree was made for {accepted}")

        def step(ks=ks, acc=acc, kv=kv):
            ks.tree_accept(tree, target, prefix, out=acc)
            ks.kv_commit(acc, prefix, kv, table)
        times.append(graph_time_ms(step, per_graph=5))
        accs.append(acc)
        caches.append(kv)
    differ = _differ(list(accs[0]._fields), *accs)
    differ += [f"cache of layer {i}" for i, (p, q) in enumerate(zip(*caches)) if not bool(cupy.array_equal(p, q))]
    del layer, caches
    label = f"B={b} layers={LAYERS} accepted={accepted}"
    _progress("tree_accept + kv_commit", label, sets, times)
    return ["tree_accept + kv_commit", label,
            *("/".join(dict.fromkeys(ran(ks, k, device) for k in ("tree_accept", "kv_commit"))) for ks in sets),
            *(f"{t:.4f}" for t in times), _ratio(*times), "-", "-", _agree_bits(differ[:4])]


def _progress(kernel, shape, sets, times) -> None:
    print(f"{kernel} {shape}: " + ", ".join(f"{'default' if ks.forced_arch is None else ks.forced_arch} "
                                            f"{t:.4f} ms" for ks, t in zip(sets, times)), flush=True)

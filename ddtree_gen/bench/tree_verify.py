"""`ddtree-gen bench tree_verify`: our kernel (each implementation) next to its peers, side by side in one
process: FlashMLA's dense decode and the split path (when flash_mla is importable), torch eager and SDPA.
TFLOP/s and % of the bf16 matmul peak measured in the same run; --out DIR also writes a plot.

--sweep: the default call against FlashMLA on shapes drawn from served traffic (bench/shapes.py). --pages 1,16,64:
one logical cache laid out in pages of each size (inputs.relayout; the specs made in code, specs.page_variant),
the build each takes, its time and the ratio to page 64, and whether the layouts' outputs agree. Both given: both
run, and a short summary of the two is printed last."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..inputs import relayout, verify_inputs
from .peers import flashmla_peers, torch_peers
from .specs import SPEC_BY_HEADS, VERIFY_KERNELS, page_variant

# what --sweep loads of a spec: ours (VERIFY_KERNELS) and the split path's tail and merge (flashmla_peers); not the
# whole set (a fresh machine compiles what it loads)
SWEEP_KERNELS = VERIFY_KERNELS + ("tree_verify_tail", "tree_verify_tail_mma", "tree_verify_tail_wgmma",
                                  "merge_states")
from .timing import checked_graph_time_ms, gpu_time_ms, measured_peak_tflops, print_table, verify_flops

# the shapes of the FlashMLA comparison (issue "tree_verify at FlashMLA speed"), and one of mixed lengths
VERIFY_CONFIGS = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (1, 16, 4096), (64, 16, 2048), (1, 64, 4096),
                  (8, 64, 4096), (8, 128, 4096), (8, 64, 16384), (64, 8, 8192), (8, 64, "mixed")]

# --pages: the base specs (H = 8 and a larger H; --spec replaces them), the fixed shapes of issue "Every page size an
# engine uses" (B, prefix lengths; Nq = PAGE_NQ as there), then PAGE_DRAWN shapes of the sweep's draw per spec
PAGE_BASES = ("kimi-k2.6-tp8", "kimi-k2.6")
PAGE_SHAPES = [(4096,), (65536,), (4096,) * 8, (30000, 2000, 9000, 500, 12000, 4000, 700, 60000)]
PAGE_NQ = 65
PAGE_DRAWN = 2
BAR_REL, BAR_LSE = 5e-3, 1e-3   # docs/contract.md section 10, per (request, row, head)


def run(args) -> None:
    on_sweep, pages = getattr(args, "sweep", False), getattr(args, "pages", None)
    if on_sweep or pages:
        # every spec either mode runs, compiled first in one pool (a fresh machine's binary cache is empty)
        _build_together((_sweep_builds(args) if on_sweep else []) + (_page_builds(args) if pages else []))
        done = [f(args) for f, on in ((sweep, on_sweep), (page_sizes, pages)) if on]
        if len(done) > 1:   # one command for both: the two verdicts side by side, last
            print_table("summary", ["what", "result"], [row for rows in done for row in rows], None, "")
        return
    from ..spec import find_spec
    from ..kernel_set import load
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


def sweep(args) -> list:
    """`bench tree_verify --sweep`: per drawn shape (bench/shapes.draw(seed, count)), ours (the default call: impl auto,
    its own schedule) next to FlashMLA's dense decode and the split path in the same process: time, % of the peak
    measured in the run, ours / FlashMLA, the schedule ours ran; then the worst and the median ratio."""
    import statistics
    from ..kernel_set import load
    from ..spec import find_spec
    from . import shapes
    from ..launch.runtime import sm_count
    draw = _sweep_draw(args)
    peak = measured_peak_tflops()
    rows, ratios = [], []
    for shp in draw:
        spec = find_spec(SPEC_BY_HEADS[shp.h])
        ks = load(spec, kernels=list(SWEEP_KERNELS))
        lens = np.asarray(shp.lens)
        x = verify_inputs(spec, shp.b, lens, shp.nq, seed=args.seed)
        flops = shapes.flops(shp.h, shp.nq, shp.lens, spec.kv_lora_rank, spec.qk_rope_head_dim)
        floor_ms = flops / (peak * 1e12) * 1e3
        plan = ks.tree_verify_schedule(shp.b, shp.nq, x["block_table"].shape[1], device=x["q_nope"].device.id)
        out = ks.tree_verify(**x)
        times = {"ours": checked_graph_time_ms(lambda out=out: ks.tree_verify(**x, out=out.out, lse=out.lse),
                                               f"ours at {shp.label()}", floor_ms)}
        for name, fn in flashmla_peers(ks, x).items():
            times["FlashMLA" if name.startswith("FlashMLA") else "split"] = checked_graph_time_ms(
                fn, f"{name} at {shp.label()}", floor_ms)
        fm = times.get("FlashMLA")
        pct = {k: 100 * floor_ms / t for k, t in times.items()}
        if fm:
            ratios.append((times["ours"] / fm, shp.label()))
        rows.append([shp.label(), f"{plan.kernel}: {plan.grid} x{plan.pieces} ({plan.blocks} blocks)",
                     *(f"{1e3 * times[k]:.1f}" if k in times else "-" for k in ("ours", "FlashMLA", "split")),
                     f"{pct['ours']:.0f}%", f"{pct['FlashMLA']:.0f}%" if fm else "-",
                     f"{times['ours'] / fm:.2f}" if fm else "-"])
    print_table(f"tree_verify --sweep (seed {args.seed}, {len(draw)} shapes drawn from {', '.join(shapes.CLASSES)}; "
                f"{sm_count(0)} SMs); CUDA-graph replay medians in us; % of the bf16 matmul peak measured in this run "
                f"({peak:.0f} TFLOP/s) for the contract's FLOPs; ours = the default call (impl auto), its schedule "
                f"ks.tree_verify_schedule's (the build: grid x pieces)",
                ["shape", "ours: build: schedule", "ours us", "FlashMLA us", "split us", "ours %", "FlashMLA %",
                 "ours / FlashMLA"], rows, args.out, f"bench_tree_verify_sweep_seed{args.seed}")
    if ratios:
        worst = max(ratios)
        line = (f"worst {worst[0]:.2f} ({worst[1]}), median {statistics.median(r for r, _ in ratios):.2f}, at most "
                f"1.05 on {sum(r <= 1.05 for r, _ in ratios)} of {len(ratios)}")
        print(f"ours / FlashMLA over {len(ratios)} shapes: {line}")
    else:
        line = "FlashMLA not importable: no ratios"
        print("FlashMLA not importable: no ratios (docs/benchmarks.md: FlashMLA's package on PYTHONPATH)")
    return [[f"--sweep seed {args.seed}: ours / FlashMLA", line]]


def _sweep_draw(args) -> list:
    """--sweep's shapes: shapes.draw(--seed, --count) over the head counts of --spec (default: every shipped one)."""
    from . import shapes
    if args.count < 1:
        raise SystemExit("error: --count must be at least 1")
    return shapes.draw(args.seed, args.count, heads=tuple(h for h in shapes.HEADS
                                                          if not args.spec or SPEC_BY_HEADS[h] in args.spec))


def _sweep_builds(args) -> list:
    """(spec, kernels) the sweep loads: the shipped spec of each drawn H, with the kernels of ours and of the split
    path (SWEEP_KERNELS)."""
    from ..spec import find_spec
    return [(find_spec(SPEC_BY_HEADS[h]), SWEEP_KERNELS) for h in sorted({s.h for s in _sweep_draw(args)})]


def _page_bases(args) -> list:
    from ..spec import find_spec
    return [find_spec(n) for n in (args.spec or PAGE_BASES)]


def _page_builds(args) -> list:
    """(spec, kernels) --pages loads: each base spec at each page size (specs.page_variant), VERIFY_KERNELS."""
    return [(page_variant(base, p), VERIFY_KERNELS) for base in _page_bases(args) for p in args.pages]


def page_shapes(base, seed: int) -> list:
    """The --pages shapes of a base spec: PAGE_SHAPES at Nq = PAGE_NQ, then PAGE_DRAWN shapes of the sweep's draw
    (shapes.draw(seed, ..., heads=(H,)): the same classes, lengths and Nq for every base)."""
    from . import shapes
    fixed = [shapes.Shape("fixed", len(lens), base.num_heads, PAGE_NQ, lens) for lens in PAGE_SHAPES]
    return fixed + shapes.draw(seed, PAGE_DRAWN, heads=(base.num_heads,))


def _agreement(a, b) -> tuple[float, float]:
    """(the worst row's ||a.out - b.out|| / ||b.out||, the largest |a.lse - b.lse|) of two tree_verify outputs of the
    same inputs (every row written: q_len = Nq), on the GPU; a NaN anywhere gives inf."""
    import cupy

    def f32(bits):   # bf16 bits -> float32
        return (bits.astype(cupy.uint32) << 16).view(cupy.float32)
    oa, ob = f32(a.out), f32(b.out)
    rel = cupy.linalg.norm(oa - ob, axis=-1) / cupy.maximum(cupy.linalg.norm(ob, axis=-1), 1e-30)
    dl = cupy.abs(a.lse - b.lse)
    bad = bool(cupy.isnan(oa).any() or cupy.isnan(a.lse).any() or cupy.isnan(rel).any() or cupy.isnan(dl).any())
    return (float("inf"), float("inf")) if bad else (float(rel.max()), float(dl.max()))


def _build_together(builds) -> None:
    """The kernels of every (spec, kernels) pair compiled in one pool, timed (NVRTC runs without the GIL; load()
    compiles one spec at a time, whose few variants leave most CPUs idle), so that load() then reads them from the
    binary cache; a cached variant costs a lookup."""
    import time
    from ..build import artifacts
    vs = list(dict.fromkeys(v for spec, kernels in builds
                            for v in artifacts.variants(spec, artifacts.select_kernels(list(kernels)))))
    if not vs:
        return
    t0 = time.perf_counter()
    results = artifacts.build_variants(vs)
    for r in results:
        if isinstance(r, Exception):
            raise r
    compiled = [r for r in results if r.status == "compiled"]
    print(f"bench tree_verify: {len(compiled)} of {len(vs)} variants of {len({spec for spec, _ in builds})} specs "
          f"compiled with NVRTC in {time.perf_counter() - t0:.1f} s (wall; {sum(r.seconds for r in compiled):.1f} s "
          f"of compiles), the rest read from the binary cache", flush=True)
    for name in dict.fromkeys(r.variant.spec.name for r in compiled):   # what each spec cost (a page variant's)
        mine = [r for r in compiled if r.variant.spec.name == name]
        print(f"  {name}: {len(mine)} variants, {sum(r.seconds for r in mine):.1f} s of compiles, the longest "
              f"{max(r.seconds for r in mine):.1f} s", flush=True)


def page_sizes(args) -> list:
    """`bench tree_verify --pages P1,P2,...`: per base spec (PAGE_BASES, or --spec) and shape (page_shapes), one
    logical cache (verify_inputs on the base spec's pages) laid out in pages of each size (inputs.relayout: a random
    page permutation), each run by its spec's kernel set (specs.page_variant: made in code, compiled into the binary
    cache at first use, timed): the build ks.tree_verify_schedule and which_kernel report, the CUDA-graph replay
    median, % of the peak measured in this run, the ratio to page 64 (else the first size listed) and whether the
    outputs agree with that layout's within the contract's bar (docs/contract.md section 10: they are the same
    logical inputs). Layouts that disagree are an error after the table."""
    import statistics
    from ..kernel_set import load
    from ..ops.tree_verify.which import which_kernel
    from . import shapes
    pages = list(args.pages)
    base_page = 64 if 64 in pages else pages[0]
    pages = [base_page] + [p for p in pages if p != base_page]   # the base first: the others compare with it
    peak = measured_peak_tflops()
    rows, ratios, over, sets = [], {p: [] for p in pages}, [], {}
    for base in _page_bases(args):
        for p in pages:
            sets[(base.name, p)] = load(page_variant(base, p), kernels=list(VERIFY_KERNELS))
        for shp in page_shapes(base, args.seed):
            lens = np.asarray(shp.lens)
            x = verify_inputs(base, shp.b, lens, shp.nq, seed=args.seed)
            floor_ms = shapes.flops(shp.h, shp.nq, lens, base.kv_lora_rank, base.qk_rope_head_dim) / (peak * 1e9)
            outs, times = {}, {}
            rng = np.random.default_rng(args.seed)
            for p in pages:
                ks = sets[(base.name, p)]
                kv, table = relayout(x["kv_cache"], x["block_table"], lens + shp.nq, p, rng)
                xp = dict(x, kv_cache=kv, block_table=table)
                dev = kv.device.id
                plan = ks.tree_verify_schedule(shp.b, shp.nq, table.shape[1], device=dev)
                sched = which_kernel(ks, shp.b, shp.nq, table.shape[1], device=dev).schedule
                outs[p] = out = ks.tree_verify(**xp)
                times[p] = checked_graph_time_ms(lambda xp=xp, out=out, ks=ks: ks.tree_verify(
                    **xp, out=out.out, lse=out.lse), f"page {p} at {shp.label()}", floor_ms)
                rel, dlse = _agreement(out, outs[base_page])
                ok = rel <= BAR_REL and dlse <= BAR_LSE
                if not ok:
                    over.append(f"page {p} at {shp.label()}: rel {rel:.2e}, lse {dlse:.2e}")
                ratio = times[p] / times[base_page]
                ratios[p].append(ratio)
                rows.append([shp.label(), p, f"{plan.kernel} {sched or ''}: {plan.grid} x{plan.pieces}",
                             f"{1e3 * times[p]:.1f}", f"{100 * floor_ms / times[p]:.0f}%", f"{ratio:.2f}",
                             "-" if p == base_page else f"{rel:.1e} / {dlse:.1e} {'ok' if ok else 'OVER'}"])
    print_table(f"tree_verify --pages {','.join(map(str, args.pages))} (seed {args.seed}): one logical cache per "
                f"shape laid out in pages of each size (a random page permutation each); impl auto; CUDA-graph replay "
                f"medians in us; % of the bf16 matmul peak measured in this run ({peak:.0f} TFLOP/s); build: "
                f"ks.tree_verify_schedule's kernel, which_kernel's schedule, grid x pieces; vs page {base_page}: "
                f"time ratio, and the outputs' worst row rel / |lse| difference against page {base_page}'s (bar "
                f"{BAR_REL:g} / {BAR_LSE:g})",
                ["shape", "page", "build: schedule", "us", "% peak", f"/ page {base_page}", "agrees"], rows,
                args.out, f"bench_tree_verify_pages_seed{args.seed}")
    summary = [[f"--pages: page {p} / page {base_page}", f"median {statistics.median(ratios[p]):.2f}, worst "
                f"{max(ratios[p]):.2f} over {len(ratios[p])} shapes"] for p in pages if p != base_page]
    for line in summary:
        print(": ".join(line))
    if over:
        raise RuntimeError("layouts of one logical cache disagree beyond the contract's bar:\n" + "\n".join(over))
    return summary


def _plot(points, peak, path) -> None:
    """A log-scale bar chart: one group of bars per config, one bar per implementation. The legend sits to the
    right of the axes (inside them it covered the first groups of bars)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    configs = list(dict.fromkeys(c for c, _, _ in points))
    impls = list(dict.fromkeys(i for _, i, _ in points))
    fig, ax = plt.subplots(figsize=(13, 5))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        xs = [configs.index(c) + k * width for c, i, _ in points if i == impl]
        ys = [t for _, i, t in points if i == impl]
        ax.bar(xs, ys, width, label=impl)
    ax.axhline(peak, color="k", linestyle="--", label=f"measured bf16 peak {peak:.0f}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], configs, fontsize=8)
    ax.set_xlim(-0.5, len(configs) - 0.1)
    ax.set_ylabel("TFLOP/s")
    ax.set_yscale("log")
    ax.set_title("tree_verify on H200, Nq = 65")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def replot(table_path, path) -> None:
    """Redraw the chart from the table a run wrote (bench_tree_verify.txt: no GPU needed), e.g.
    python -c "from ddtree_gen.bench.tree_verify import replot; replot('docs/bench/bench_tree_verify.txt',
    'docs/bench/bench_tree_verify.png')" """
    import re
    lines = Path(table_path).read_text().splitlines()
    peak = float(re.search(r"peak in this run: ([0-9.]+) TFLOP/s", lines[0]).group(1))
    points = []
    for line in lines[2:]:
        m = re.match(r"\s*(B=\S+) (H=\S+) (L=\S+)\s+(.+?)\s+[0-9.]+\s+([0-9.]+)\s+[0-9.]+%", line)
        if m:
            points.append((f"{m[1]}\n{m[2]}\n{m[3]}", m[4], float(m[5])))
    if not points:
        raise ValueError(f"{table_path}: no rows of a tree_verify table")
    _plot(points, peak, path)



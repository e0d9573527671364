"""`ddtree-gen bench tree_verify`: our kernel (each implementation) next to its peers, side by side in one
process: FlashMLA's dense decode and the split path (when flash_mla is importable), torch eager and SDPA.
TFLOP/s and % of the bf16 matmul peak measured in the same run; --out DIR also writes a plot."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..inputs import verify_inputs
from .peers import flashmla_peers, torch_peers
from .specs import SPEC_BY_HEADS
from .timing import checked_graph_time_ms, gpu_time_ms, measured_peak_tflops, print_table, verify_flops

# the shapes of the FlashMLA comparison (issue "tree_verify at FlashMLA speed"), and one of mixed lengths
VERIFY_CONFIGS = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (1, 16, 4096), (64, 16, 2048), (1, 64, 4096),
                  (8, 64, 4096), (8, 128, 4096), (8, 64, 16384), (64, 8, 8192), (8, 64, "mixed")]



def run(args) -> None:
    if getattr(args, "sweep", False):
        return sweep(args)
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


def sweep(args) -> None:
    """`bench tree_verify --sweep`: per drawn shape (bench/shapes.draw(seed, count)), ours (the default call: impl auto,
    its own schedule) next to FlashMLA's dense decode and the split path in the same process: time, % of the peak
    measured in the run, ours / FlashMLA, the schedule ours ran; then the worst and the median ratio."""
    import statistics
    from ..kernel_set import load
    from ..spec import find_spec
    from . import shapes
    from ..launch.runtime import sm_count
    if args.count < 1:
        raise SystemExit("error: --count must be at least 1")
    peak = measured_peak_tflops()
    draw = shapes.draw(args.seed, args.count, heads=tuple(h for h in shapes.HEADS
                                                          if not args.spec or SPEC_BY_HEADS[h] in args.spec))
    rows, ratios, sets = [], [], {}
    for shp in draw:
        spec = find_spec(SPEC_BY_HEADS[shp.h])
        ks = sets.setdefault(spec.name, load(spec))
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
            ratios.append(times["ours"] / fm)
        rows.append([shp.label(), f"{plan.grid} x{plan.pieces} ({plan.blocks} blocks)",
                     *(f"{1e3 * times[k]:.1f}" if k in times else "-" for k in ("ours", "FlashMLA", "split")),
                     f"{pct['ours']:.0f}%", f"{pct['FlashMLA']:.0f}%" if fm else "-",
                     f"{times['ours'] / fm:.2f}" if fm else "-"])
    print_table(f"tree_verify --sweep (seed {args.seed}, {len(draw)} shapes drawn from {', '.join(shapes.CLASSES)}; "
                f"{sm_count(0)} SMs); CUDA-graph replay medians in us; % of the bf16 matmul peak measured in this run "
                f"({peak:.0f} TFLOP/s) for the contract's FLOPs; ours = the default call (impl auto)",
                ["shape", "ours: schedule", "ours us", "FlashMLA us", "split us", "ours %", "FlashMLA %",
                 "ours / FlashMLA"], rows, args.out, f"bench_tree_verify_sweep_seed{args.seed}")
    if ratios:
        print(f"ours / FlashMLA over {len(ratios)} shapes: worst {max(ratios):.2f}, median "
              f"{statistics.median(ratios):.2f}, at most 1.05 on {sum(r <= 1.05 for r in ratios)}")
    else:
        print("FlashMLA not importable: no ratios (docs/benchmarks.md: FlashMLA's package on PYTHONPATH)")


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



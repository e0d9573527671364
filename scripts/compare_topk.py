#!/usr/bin/env python
"""draft_topk's schedules side by side, in one process on the same logits: "chunks" (one block per chunk) and "rows"
(one block per row, its warps streaming with a shared threshold, where the rows fill the GPU; else its copy of the
chunks schedule; ops/draft_topk/plan.SCHEDULES). Per shape: the ids of all compared bit for bit, the log-probs of the
rows columns within 2e-5 + 2^-21 |x| of chunks' (their sums add in another order), and rows of each against
reference.draft_topk (ids exact, log-probs within 1e-5 + 2^-22 |ref|), then CUDA-graph replay medians of both and
% of the floor: the logits read once at the device-to-device copy rate measured in the same run.
When: on a GPU after a change to templates/draft_topk.cu.j2 (docs/perf/journal-kernels.md, "draft_topk (issue 23 part 1)").
--rows-per-sm N ...: the rows build again with ops/draft_topk/launch.ROWS_PER_SM = N and ROWS_MIN_CHUNKS = 0 (it streams a
row per block where the rows are at least N x SMs, whatever V, else runs the chunks schedule; 0: streaming on every
shape), one column each.
--knobs NAME:KNOB=VALUE,... ...: the rows build with other build options, one column each (e.g. mb3:min_blocks=3).
Run: PYTHONPATH=. python3 scripts/compare_topk.py [--spec kimi-k2.6-tp8] [--shapes B,D',V,dtype ...] [--rows 4]
     [--rows-per-sm 0 3] [--knobs mb3:min_blocks=3]
"""
from __future__ import annotations

import argparse

import numpy as np

# (B, D', V, dtype): the bench's shapes (DeepSeek-V3's and Kimi K2's vocabularies), B = 1 and 8, and float32 rows
SHAPES = [(64, 15, 129280, "bf16"), (64, 15, 163840, "bf16"), (8, 15, 129280, "bf16"), (1, 15, 129280, "bf16"),
          (1, 15, 163840, "bf16"), (8, 15, 129280, "float32"), (2, 4, 262144, "float32")]


def make_logits(rng, b, dp, v, dtype):
    """Random logits (scale 3) as the kernel's input (uint16 bf16 bits or float32) on the host, with a few
    rows of the edge cases: ties at the top, NaN / -inf, an all -inf row, a constant row."""
    from ddtree_gen import bf16
    x = rng.standard_normal((b, dp, v)) * 3
    flat = x.reshape(-1, v)
    if flat.shape[0] >= 4:
        flat[1] = np.round(flat[1])                     # a few values: ties everywhere
        flat[2, rng.random(v) < 0.2] = np.nan           # NaN as -inf
        flat[2, rng.random(v) < 0.2] = -np.inf
        flat[3] = -np.inf                               # all -inf: ids 0..k-1
    if flat.shape[0] >= 5:
        flat[4] = 0.0                                   # constant: the ties overflow the candidate list
    return bf16.to_bits(x) if dtype == "bf16" else x.astype(np.float32)


def check_rows(ids, lps, host, rows, k, t) -> str | None:
    """None if rows `rows` match reference.draft_topk, else what differs."""
    from ddtree_gen import reference
    v = host.shape[-1]
    want = reference.draft_topk(host.reshape(-1, v)[rows][None], k, t)
    got_ids, got_lps = ids.reshape(-1, k)[rows][None], lps.reshape(-1, k)[rows][None].astype(np.float64)
    if not np.array_equal(got_ids, want.topk_ids):
        return f"ids differ at {tuple(np.argwhere(got_ids != want.topk_ids)[0])}"
    w = want.topk_logprobs
    neg = np.isneginf(w) | (w < -float(np.finfo(np.float32).max))
    if np.isnan(got_lps).any() or not np.array_equal(np.isneginf(got_lps), neg):
        return "NaN or misplaced -inf log-probs"
    err = np.abs(got_lps[~neg] - w[~neg])
    if err.size and not np.all(err <= 1e-5 + 2.0**-22 * np.abs(w[~neg])):
        return f"log-prob error {err.max():.3g}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="kimi-k2.6-tp8", help="the spec whose builds are compared (k = min(64, N-1))")
    ap.add_argument("--shapes", nargs="*", help="B,D',V,dtype quadruples (dtype bf16 or float32; default: "
                    + " ".join(f"{b},{d},{v},{t}" for b, d, v, t in SHAPES) + ")")
    ap.add_argument("--rows", type=int, default=4, help="rows per shape checked against the numpy reference")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--knobs", nargs="*", default=[], metavar="NAME:KNOB=VALUE,...",
                    help="extra columns: the rows build with these build options, e.g. mb3:min_blocks=3 "
                         "(integers as integers)")
    ap.add_argument("--rows-per-sm", type=float, nargs="*", default=[],
                    help="extra columns: the rows build with ops/draft_topk/launch.ROWS_PER_SM set to each (0: always streaming)")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True)
    import cupy
    from ddtree_gen.bench.timing import copy_bandwidth_gbs, graph_time_ms
    from ddtree_gen.kernel_set import load, variant_set
    from ddtree_gen.ops.draft_topk.launch import workspace_elems
    from ddtree_gen.ops.draft_topk import launch as launcher
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.draft_topk.plan import SCHEDULES
    from ddtree_gen.build.variant import default_config, variant
    from ddtree_gen.reference import DraftTopkOutput
    from ddtree_gen.spec import find_spec

    spec = find_spec(args.spec)
    kdef = by_name("draft_topk")
    default = default_config(kdef, spec)["schedule"]
    sets = {s: load(spec, kernels=["draft_topk"]) if s == default else variant_set([variant(kdef, spec, schedule=s)])
            for s in SCHEDULES}
    for s, ks in sets.items():
        assert ks.constants("draft_topk")["ROWS"] == int(s == "rows"), s
    default_switch, default_chunks = launcher.ROWS_PER_SM, launcher.ROWS_MIN_CHUNKS
    for spec_text in args.knobs:   # name:knob=value,...: a rows variant of its own
        name, _, kv = spec_text.partition(":")
        knobs = {key: int(val) if val.lstrip("-").isdigit() else val
                 for key, val in (item.split("=", 1) for item in kv.split(",") if item)}
        sets[name] = variant_set([variant(kdef, spec, **{"schedule": "rows", **knobs})])
    runs = [(s, s, None) for s in SCHEDULES] + [(f"rows r{w:g}", "rows", w) for w in args.rows_per_sm] + \
        [(n, n, None) for n in (t.partition(":")[0] for t in args.knobs)]
    names = [n for n, _, _ in runs]
    k = min(64, spec.max_tree_size - 1)
    t = args.temperature
    shapes = ([(int(b), int(d), int(v), dt) for b, d, v, dt in (q.split(",") for q in args.shapes)]
              if args.shapes else SHAPES)
    gbs = copy_bandwidth_gbs()
    rng = np.random.default_rng(0)
    print(f"draft_topk schedules on {spec.name}, k = {k}, T = {t}; device copy rate {gbs:.0f} GB/s (read + write); "
          f"floor = the logits' bytes at that rate; times: CUDA-graph replay medians per call")
    header = ["B", "D'", "V", "dtype", "MB", "floor us"] + [f"{n} us" for n in names] + \
             [f"{n} %floor" for n in names] + ["rows/chunks", "same", "vs reference"]
    table, failed = [], False
    for b, dp, v, dtype in shapes:
        dp = min(dp, spec.max_depth)
        host = make_logits(rng, b, dp, v, dtype)
        x = cupy.asarray(host)
        ws = cupy.empty(max(1, workspace_elems(b, dp, v, k, dtype)), np.int32)
        outs, times = {}, {}
        for name, s, waves in runs:
            ks = sets[s]
            launcher.ROWS_PER_SM = default_switch if waves is None else waves
            launcher.ROWS_MIN_CHUNKS = default_chunks if waves is None else 0   # a given switch: any row length
            ks.prepared_calls.clear()   # the parts are chosen when a call's signature is first prepared
            out = DraftTopkOutput(cupy.full((b, dp, k), 0x7BADBEEF, np.int32), cupy.full((b, dp, k), np.nan, np.float32))
            ks.draft_topk(x, k, t, out=out, workspace=ws)
            cupy.cuda.Device().synchronize()
            outs[name] = (cupy.asnumpy(out.topk_ids), cupy.asnumpy(out.topk_logprobs))
            times[name] = graph_time_ms(lambda ks=ks, out=out: ks.draft_topk(x, k, t, out=out, workspace=ws),
                                        per_graph=10) * 1e3
        launcher.ROWS_PER_SM = default_switch
        (ia, la) = outs["chunks"]
        same = all(np.array_equal(ia, i) for i, _ in outs.values())
        for n in names:
            if n.startswith("rows"):
                lr = outs[n][1]
                fin = np.isfinite(la)
                same &= np.array_equal(fin, np.isfinite(lr)) and np.array_equal(la[~fin], lr[~fin], equal_nan=True)
                same &= bool(np.all(np.abs(lr[fin] - la[fin]) <= 2e-5 + 2.0**-21 * np.abs(la[fin])))
        rows = sorted(set(range(min(5, b * dp))) | set(rng.choice(b * dp, min(args.rows, b * dp), replace=False).tolist()))
        bad = [f"{s}: {why}" for s, (i, lp) in outs.items() if (why := check_rows(i, lp, host, rows, k, t))]
        failed |= (not same) or bool(bad)
        nbytes = host.nbytes
        floor = nbytes / (gbs * 1e9) * 1e6
        table.append([b, dp, v, dtype, f"{nbytes / 1e6:.1f}", f"{floor:.1f}"] +
                     [f"{times[n]:.1f}" for n in names] + [f"{100 * floor / times[n]:.0f}%" for n in names] +
                     [f"{times['rows'] / times['chunks']:.3f}", "yes" if same else "NO",
                      "ok" if not bad else "; ".join(bad)])
        del x, ws
    widths = [max(len(str(r[i])) for r in [header] + table) for i in range(len(header))]
    for r in [header] + table:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    if failed:
        raise SystemExit("error: a schedule's outputs differ from the other's or from the reference (table above)")


if __name__ == "__main__":
    main()

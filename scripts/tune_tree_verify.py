#!/usr/bin/env python
"""Tune tree_verify_mma on this GPU: build every candidate configuration of each spec, validate it
against the float64 reference, time it (CUDA events, median), print a table, write the choice.
When: on the GPU after changing templates/tree_verify_mma.cu.j2, the configuration candidates or
the split policy of the plan, or on a new GPU model; then rebuild (the wgmma kernels use the same
split table).

    python scripts/tune_tree_verify.py                        # every spec, L = 4096, write the JSON
    python scripts/tune_tree_verify.py kimi-k2.6-tp8 --L 4096 16384 --no-write

Per spec: for each configuration (BN, STAGES) whose shared memory fits, compile it (ptxas must
report no spill and no stack, or it is dropped), run a validation matrix against
ddtree_gen.reference.tree_verify / tree_verify_tail (full and tail kernels, split-KV off and on,
prefixes 0 .. 4096, random trees; the numerical bar of docs/contract.md); a configuration that fails is
never timed nor chosen. Then every batch size of the sweep is timed with every useful split count.
The configuration with the smallest geometric mean of (best time per batch) wins; its best split
count per shape class (B x row tiles rounded up to a power of two) goes to the tuning file
(ddtree_gen/ops/tree_verify/tree_verify_tuning.json), which the plan reads: a fresh build on a machine
without a GPU then compiles the same configuration and the launcher picks the same split counts.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ddtree_gen import archs, bf16, inputs, reference
from ddtree_gen.build import artifacts
from ddtree_gen.bench.timing import call_time_ms
from ddtree_gen.kernel_set import variant_set
from ddtree_gen.ops import by_name
from ddtree_gen.ops.tree_verify import split as split_kv
from ddtree_gen.ops.tree_verify import mma as mod
from ddtree_gen.build.variant import variant
from ddtree_gen.build.resources import compare
from ddtree_gen.spec import all_specs, find_spec

OUT_TOL, LSE_TOL = 5e-3, 1e-3
PEAK_TFLOPS = 760.0
SPLIT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_BATCHES = {8: (1, 2, 4, 8, 16, 32, 64), 16: (1, 2, 4, 8, 16, 32), 64: (1, 2, 4, 8, 16), 128: (1, 2, 4, 8)}


# ------------------------------------------------------------------------------ inputs

def host_inputs(spec, rng, prefix, qlens, nq):
    """A small host batch with random ancestor trees (validation): the input factory's, with bf16 normal values,
    3 spare pages and one spare block-table column of -1."""
    inp = inputs.tree_verify(spec, rng, prefix, qlens, "random", nq=nq, extra_pages=3, spare_columns=1, unused=-1,
                             values=inputs.bf16_normal)
    return {k: v for k, v in inp.host().items() if k != "kv_scale"}   # the mma.sync kernels: bf16 caches only


# -------------------------------------------------------------------------- validation

def validate(vs, spec, seed=0) -> list[str]:
    """Problems of one configuration against the float64 reference (empty: it passes)."""
    import cupy
    rng = np.random.default_rng(seed)
    nq = spec.max_tree_size
    cases = [([0], [1]), ([0, 70, 63, 5], [nq, 33, 2, 1]), ([4096, 4097], [nq, 17]), ([129], [nq])]
    problems = []
    for prefix, qlens in cases:
        qlens = [min(q, nq) for q in qlens]
        host = host_inputs(spec, rng, prefix, qlens, nq)
        heads = np.unique([0, spec.num_heads - 1])
        sub = {**host, "q_nope": host["q_nope"][:, :, heads], "q_pe": host["q_pe"][:, :, heads]}
        for name, ref_fn in (("tree_verify_mma", reference.tree_verify),
                             ("tree_verify_tail_mma", reference.tree_verify_tail)):
            for scale in (192 ** -0.5, 1.0):
                ref = ref_fn(**sub, softmax_scale=scale)
                for splits in (1, 5):
                    out = cupy.full(host["q_nope"].shape, 0xFFFF, np.uint16)
                    lse = cupy.full(host["q_nope"].shape[:3], np.nan, np.float32)
                    getattr(vs, name)(**{k: cupy.asarray(v) for k, v in host.items()}, softmax_scale=scale,
                                      out=out, lse=lse, num_splits=splits)
                    o, lh = cupy.asnumpy(out), cupy.asnumpy(lse)
                    tag = f"{name} prefix={prefix} q={qlens} scale={scale:.3g} splits={splits}"
                    for b, q in enumerate(qlens):
                        if not (o[b, q:] == 0xFFFF).all() or not np.isnan(lh[b, q:]).all():
                            problems.append(f"{tag}: rows >= q_len written (request {b})")
                        got = bf16.from_bits(o[b, :q][:, heads]).astype(np.float64)
                        gl = lh[b, :q][:, heads].astype(np.float64)
                        if np.isnan(got).any() or np.isnan(gl).any():
                            problems.append(f"{tag}: NaN / unwritten rows (request {b})")
                            continue
                        empty = np.isneginf(ref.lse[b, :q])
                        if not ((o[b, :q][:, heads][empty] == 0).all() and np.isneginf(gl[empty]).all()):
                            problems.append(f"{tag}: empty rows not 0 / -inf (request {b})")
                        full = ~empty
                        rel = (np.linalg.norm(got - ref.out[b, :q], axis=-1)
                               / np.maximum(np.linalg.norm(ref.out[b, :q], axis=-1), 1e-30))[full]
                        dl = np.abs(gl - np.where(empty, 0, ref.lse[b, :q]))[full]
                        if rel.size and rel.max() > OUT_TOL:
                            problems.append(f"{tag}: request {b}: rel out error {rel.max():.3g}")
                        if dl.size and dl.max() > LSE_TOL:
                            problems.append(f"{tag}: request {b}: lse error {dl.max():.3g}")
    return problems


# ------------------------------------------------------------------------------ timing

def sweep(vs, spec, batches, lengths, nq, sms):
    """{(B, L): {splits: ms}} for one configuration."""
    import cupy
    bn = vs.variants["tree_verify_mma"].config["BN"]
    rows = {}
    for L in lengths:
        for b in batches:
            dev = inputs.chain_verify_inputs(spec, b, L, nq)
            out = cupy.empty(dev["q_nope"].shape[:3] + (spec.kv_lora_rank,), np.uint16)
            lse = cupy.empty(dev["q_nope"].shape[:3], np.float32)
            base = b * -(-nq * spec.num_heads // split_kv.BM)
            useful = max(1, -(-(L + nq) // (2 * bn)))
            choices = [s for s in SPLIT_CHOICES if s <= useful and (s == 1 or base < 2 * sms)]
            ws = cupy.empty(max(1, split_kv.workspace_elems(spec, b, nq, max(choices))), np.float32)
            times = {}
            for s in choices:
                def call(s=s):
                    vs.tree_verify_mma(**dev, softmax_scale=192 ** -0.5, out=out, lse=lse, workspace=ws,
                                       num_splits=s)
                times[s] = call_time_ms(call)
            rows[(b, L)] = times
            dev = out = lse = ws = None   # free this batch before the next one is made
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


# ------------------------------------------------------------------------------- main

def config_set(spec, cfg):
    """A kernel set of the mma.sync pair built with `cfg` (the variants tree_verify_mma.bn<BN>.s<STAGES> and its
    tail) for the forced target ($DDTREE_GEN_ARCH) or else sm_90a, with the default combine kernel."""
    target = archs.forced() or archs.PRIMARY
    pair = [variant(by_name(k), spec, target, **cfg) for k in ("tree_verify_mma", "tree_verify_tail_mma")]
    return variant_set(pair, also=[split_kv.COMBINE])


def tune_spec(spec, args, sms) -> dict | None:
    nq = spec.max_tree_size
    batches = args.batches or DEFAULT_BATCHES.get(spec.num_heads, (1, 2, 4, 8, 16))
    results = {}
    print(f"\n=== {spec.name}: H={spec.num_heads} R={spec.kv_lora_rank} P={spec.qk_rope_head_dim} Nq={nq} "
          f"L={list(args.L)} B={list(batches)} SMs={sms}", flush=True)
    for cfg in mod.candidates(spec):
        t0 = time.time()
        vs = config_set(spec, cfg)
        bad = []
        for name, (plan, rep) in vs.reports.items():
            bad += [f"{name}: {p}" for p in compare(plan, rep)]
            print(f"  {cfg}: {name}: {rep.registers} regs, {rep.spill_stores + rep.spill_loads} B spill, "
                  f"{rep.stack} B stack, {plan.value(plan.dynamic_smem)} B dynamic smem", flush=True)
        if bad:
            print(f"  {cfg}: DROPPED (ptxas vs model): {bad}", flush=True)
            continue
        problems = validate(vs, spec, seed=args.seed)
        if problems:
            print(f"  {cfg}: DROPPED, {len(problems)} validation failure(s), first: {problems[:3]}", flush=True)
            continue
        print(f"  {cfg}: validated in {time.time() - t0:.0f}s; timing ...", flush=True)
        results[json.dumps(cfg, sort_keys=True)] = (cfg, sweep(vs, spec, batches, args.L, nq, sms))
    if not results:
        print(f"  {spec.name}: no configuration passed; nothing chosen", flush=True)
        return None

    # table
    print(f"\n{'config':<26} {'B':>4} {'L':>6} {'best S':>6} {'ms':>9} {'TFLOP/s':>8} {'% 760':>6}   ms by split")
    score = {}
    for key, (cfg, rows) in results.items():
        logs = []
        for (b, L), times in rows.items():
            s_best = min(times, key=times.get)
            ms = times[s_best]
            fl = mod.predict(spec, b, L, nq)["flops"]
            tf = fl / (ms * 1e-3) / 1e12
            logs.append(math.log(ms))
            splits_txt = " ".join(f"{s}:{t:.3f}" for s, t in times.items())
            print(f"{key:<26} {b:>4} {L:>6} {s_best:>6} {ms:>9.4f} {tf:>8.1f} {100 * tf / PEAK_TFLOPS:>5.1f}%   "
                  f"{splits_txt}")
        score[key] = statistics.fmean(logs)
    best_key = min(score, key=score.get)
    cfg, rows = results[best_key]
    # best split per shape class (summed over the lengths and batches in the class)
    per_class: dict[str, dict[int, float]] = {}
    for (b, L), times in rows.items():
        cls = split_kv.shape_class(b * -(-nq * spec.num_heads // split_kv.BM))
        acc = per_class.setdefault(cls, {})
        for s, t in times.items():
            acc[s] = acc.get(s, 0.0) + t / min(times.values())
    splits = {cls: min(acc, key=acc.get) for cls, acc in sorted(per_class.items(), key=lambda kv: int(kv[0]))}
    print(f"chosen for {spec.name}: {cfg}, splits by shape class {splits}", flush=True)
    measured = {f"B={b},L={L}": {str(s): round(t, 5) for s, t in times.items()} for (b, L), times in rows.items()}
    return {"config": cfg, "splits": splits, "measured_ms": measured,
            "device": args.device_name, "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="*", help="spec names (default: every spec)")
    p.add_argument("--L", type=int, nargs="+", default=[4096], help="prefix lengths to time (default 4096)")
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: by head count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(split_kv.TUNING_FILE), help="tuning file to update")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True)
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    args.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    specs = [find_spec(n) for n in args.specs] if args.specs else all_specs()
    chosen = {}
    for spec in specs:
        entry = tune_spec(spec, args, sms)
        if entry:
            chosen[spec.name] = entry
    if args.no_write or not chosen:
        return 0 if chosen else 1
    path = Path(args.out)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    specs = data.setdefault("specs", {})
    for name, entry in chosen.items():   # the wgmma table (scripts/sweep_splits.py) is kept
        specs[name] = {**entry, **({"wgmma": specs[name]["wgmma"]} if "wgmma" in specs.get(name, {}) else {})}
    data["about"] = ("written by scripts/tune_tree_verify.py; read by ddtree_gen/ops/tree_verify/split.py "
                     "(config: compiled BN/STAGES; splits: key chunks by shape class = B x row tiles rounded up "
                     "to a power of two)")
    artifacts.atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {path}; rebuild with `python -m ddtree_gen build` to compile the chosen configurations")
    return 0


if __name__ == "__main__":
    sys.exit(main())

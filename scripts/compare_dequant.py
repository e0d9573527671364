#!/usr/bin/env python
"""kv_dequant's build options side by side against torch moving the same bytes, and tree_verify(fp8_path="dequant")
end to end with each of them, in one process on the same inputs (docs/perf/journal-fp8.md "The pre-pass at the copy rate").

Per shape (B, H, L; Nq = 65, the shapes of `ddtree-gen bench kv-dtype`), on the fp8 spec of that H:
* kv_dequant alone, per build option (ops/kv_dequant/plan.CANDIDATES by default: the default build first): CUDA-graph
  replay median per call, its rate (bytes read + written: 3 per e4m3 byte of the converted pages), % of torch's rate
  on the same bytes; its workspace pages and block table must be bit-identical to the default build's (every byte of
  both outputs, poisoned alike before the run).
* the copy-rate references, the same run: a bf16 -> bf16 `copy_` moving the same total bytes (the copy rate: "% copy",
  the bar) and torch's e4m3 -> bf16 `copy_` of as many bytes as the pages converted (into a preallocated bf16 tensor:
  read 1, write 2 bytes per element; torch's cast kernel, ~1 TB/s on the H200: "% cast"); torch CUDA-graph replay
  medians.
* end to end: tree_verify on the bf16 spec of that H (impl="wgmma") and on the fp8 one with fp8_path="dequant" (its
  kv_workspace given), per option; fp8 speed = bf16 ms / dequant ms; its out and lse must be the default build's bits.
Exit status 1 when a build's outputs differ from the default's (the table says where).
When: on an H100 / H200 after a change to templates/kv_dequant.cu.j2 or its build options.
Run: PYTHONPATH=. python3 scripts/compare_dequant.py [--spec kimi-k2.6-tp8-fp8] [--shapes B,H,L ...]
     [--options KNOB=VALUE,... ...] [--no-e2e] [--out DIR]
"""
from __future__ import annotations

import argparse

import numpy as np

from ddtree_gen.bench.compare import parse_shape

# (B, H, L): `ddtree-gen bench kv-dtype`'s shapes (ddtree_gen.bench.kv_dtype.KV_DTYPE_CONFIGS)
SHAPES = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (64, 16, 2048), (8, 64, 4096), (8, 128, 4096), (8, 64, 16384)]
NQ = 65
POISON_KV, POISON_TABLE = 0xABCD, 0x5EEDBEEF


def parse_knobs(text: str) -> dict:
    """"parts=1,store=pair" -> the knobs of a kv_dequant build ("default": none), each checked against
    ops/kv_dequant/plan.KNOBS and the build's plan (a retired knob: the plan's message, where its figures are; argparse
    type)."""
    from ddtree_gen.errors import BuildError, SpecError
    from ddtree_gen.ops.kv_dequant.plan import KNOBS, RETIRED, plan
    from ddtree_gen.spec import find_spec
    if text.strip() == "default":
        return {}
    knobs = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(f"option {text!r}: expected KNOB=VALUE[,KNOB=VALUE...] or 'default' "
                                             f"(knobs: {', '.join(KNOBS)})")
        if key not in KNOBS and key not in RETIRED:
            raise argparse.ArgumentTypeError(f"option {text!r}: no knob {key!r} (knobs: {', '.join(KNOBS)})")
        knobs[key] = int(value) if isinstance(KNOBS.get(key), int) and value.lstrip("-").isdigit() else value
    try:
        plan(find_spec("kimi-k2.6-tp8-fp8"), {**KNOBS, **knobs})   # (a retired knob: the plan says where its figures are)
    except (BuildError, SpecError) as e:
        raise argparse.ArgumentTypeError(f"option {text!r}: {e}") from None
    return {k: v for k, v in knobs.items() if v != KNOBS[k]}


def option_label(knobs: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(knobs.items())) or "default"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--spec", default="kimi-k2.6-tp8-fp8",
                    help="the fp8 spec whose H the shapes replace (its bf16 twin for the bf16 times)")
    ap.add_argument("--shapes", nargs="+", type=parse_shape, metavar="B,H,L",
                    help="default: " + " ".join(f"{b},{h},{l}" for b, h, l in SHAPES))
    ap.add_argument("--options", nargs="+", type=parse_knobs, metavar="KNOB=VALUE,...",
                    help="kv_dequant builds to compare ('default' or knobs off it, e.g. parts=1,store=pair: the "
                         "first kernel); default: ops/kv_dequant/plan.CANDIDATES. The default build is always compared "
                         "first")
    ap.add_argument("--no-e2e", action="store_true", help="kv_dequant and the torch references only (no tree_verify)")
    ap.add_argument("--out", help="also write the table to DIR/compare_dequant.txt")
    return ap


def _options(given) -> list:
    from ddtree_gen.ops.kv_dequant.plan import CANDIDATES
    out = [{}]
    for knobs in (given if given is not None else CANDIDATES):
        if knobs not in out:
            out.append(dict(knobs))
    return out


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True, torch=True)
    import cupy
    import torch
    from ddtree_gen.bench.specs import spec_variant
    from ddtree_gen.bench.timing import graph_time_ms, print_table, torch_graph_time_ms
    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load, variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.kv_dequant.plan import workspace_elems
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.ops.tree_verify.wgmma import DEQUANT
    from ddtree_gen.build.variant import variant
    from ddtree_gen.reference import KvDequantOutput
    from ddtree_gen.spec import find_spec

    base = find_spec(args.spec)
    if not base.kv_fp8:
        raise SystemExit(f"error: --spec {base.name!r} has kv_dtype {base.kv_dtype!r}: give an fp8 spec "
                         f"(kimi-k2.6-tp8-fp8, deepseek-v3-fp8)")
    options = _options(args.options)
    labels = [option_label(k) for k in options]
    shapes = args.shapes or SHAPES
    kdef = by_name("kv_dequant")
    table, failed = [], []
    names = ", ".join(f"{lab} ({variant(kdef, base, **k).name})" for lab, k in zip(labels, options))
    print(f"kv_dequant builds: {names}", flush=True)
    for b, h, l in shapes:
        fp8 = spec_variant(base, h, "fp8_e4m3")
        bf16 = spec_variant(base, h, "bf16")
        lens = np.full(b, l)
        e2e = not args.no_e2e
        sets = []
        for knobs in options:
            kernels = [DEQUANT, COMBINE] if e2e else []
            if knobs:
                sets.append(variant_set([variant(kdef, fp8, **knobs)], also=kernels))
            else:
                sets.append(load(fp8, kernels=["kv_dequant", *kernels]))
        x = verify_inputs(fp8, b, lens, NQ)
        kv, bt, pl, ql = x["kv_cache"], x["block_table"], x["prefix_lens"], x["q_lens"]
        max_pages = bt.shape[1]
        page, row = kv.shape[1:]
        outs = [KvDequantOutput(cupy.empty((b * max_pages, page, row), np.uint16),
                                cupy.empty((b, max_pages), np.int32)) for _ in range(2)]
        ref = None
        dq_us, same_ws = [], []
        for i, ks in enumerate(sets):   # bits first (poisoned outputs), then the time
            o = outs[0 if i == 0 else 1]
            o.kv_cache.fill(POISON_KV)
            o.block_table.fill(np.int32(POISON_TABLE))
            ks.kv_dequant(kv, bt, pl, ql, out=o)
            cupy.cuda.Device().synchronize()
            if i == 0:
                ref = o
                converted = int((o.block_table >= 0).sum())
            else:
                same = bool(cupy.array_equal(o.kv_cache, ref.kv_cache)) and bool(cupy.array_equal(o.block_table,
                                                                                                  ref.block_table))
                same_ws.append("yes" if same else "NO")
                if not same:
                    failed.append(f"B={b} H={h} L={l} {labels[i]}: workspace differs from the default build's")
            dq_us.append(graph_time_ms(lambda ks=ks, o=o: ks.kv_dequant(kv, bt, pl, ql, out=o), per_graph=10) * 1e3)
        same_ws.insert(0, "-")
        del outs, ref, o
        nbytes = converted * page * row * 3                       # e4m3 read + bf16 written
        # torch on the same bytes: as many e4m3 bytes as the converted pages hold (random bytes, NaN ones included)
        # cast into a bf16 tensor, and a bf16 copy moving as many bytes in all
        elems = converted * page * row
        src = torch.randint(0, 256, (elems,), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        dst = torch.empty(elems, dtype=torch.bfloat16, device="cuda")
        cast_us = torch_graph_time_ms(lambda d=dst, s=src: d.copy_(s)) * 1e3
        del src, dst
        a = torch.zeros(nbytes // 4, dtype=torch.bfloat16, device="cuda")
        c = torch.empty_like(a)
        copy_us = torch_graph_time_ms(lambda d=c, s=a: d.copy_(s)) * 1e3
        del a, c
        rate = lambda us: nbytes / (us * 1e-6) / 1e9   # noqa: E731  (GB/s)
        bf16_ms, e2e_ms, same_out = None, [None] * len(sets), ["-"] * len(sets)
        if e2e:
            kvw = cupy.empty(workspace_elems(fp8, b, max_pages), np.uint16)
            first = None
            for i, ks in enumerate(sets):
                res = ks.tree_verify(**x, impl="wgmma", fp8_path="dequant", kv_workspace=kvw)
                got = (cupy.asnumpy(res.out).view(np.uint16), cupy.asnumpy(res.lse).view(np.uint32))
                if first is None:
                    first = got
                else:
                    same = all(np.array_equal(g, f) for g, f in zip(got, first))
                    same_out[i] = "yes" if same else "NO"
                    if not same:
                        failed.append(f"B={b} H={h} L={l} {labels[i]}: tree_verify's out / lse differ from the "
                                      f"default build's")
                e2e_ms[i] = graph_time_ms(lambda ks=ks, res=res: ks.tree_verify(
                    **x, out=res.out, lse=res.lse, impl="wgmma", fp8_path="dequant", kv_workspace=kvw), per_graph=10)
                del res
            del kvw, x
            xb = verify_inputs(bf16, b, lens, NQ)
            ksb = load(bf16, kernels=["tree_verify_wgmma", COMBINE])
            rb = ksb.tree_verify(**xb, impl="wgmma")
            bf16_ms = graph_time_ms(lambda: ksb.tree_verify(**xb, out=rb.out, lse=rb.lse, impl="wgmma"), per_graph=10)
            del xb, rb
        print(f"B={b} H={h} L={l}: {converted} pages, {nbytes / 1e6:.1f} MB moved; torch cast {cast_us:.1f} us "
              f"({rate(cast_us):.0f} GB/s), bf16 copy {copy_us:.1f} us ({rate(copy_us):.0f} GB/s)"
              + (f", bf16 tree_verify {bf16_ms:.3f} ms" if bf16_ms else ""), flush=True)
        for i, lab in enumerate(labels):
            table.append([f"{b},{h},{l}", lab, f"{nbytes / 1e6:.1f}", f"{cast_us:.1f}", f"{copy_us:.1f}",
                          f"{dq_us[i]:.1f}", f"{rate(dq_us[i]):.0f}", f"{100 * copy_us / dq_us[i]:.0f}%",
                          f"{100 * cast_us / dq_us[i]:.0f}%", f"{dq_us[i] / dq_us[0]:.2f}", same_ws[i],
                          f"{bf16_ms:.3f}" if bf16_ms else "-", f"{e2e_ms[i]:.3f}" if e2e_ms[i] else "-",
                          f"{bf16_ms / e2e_ms[i]:.2f}x" if e2e_ms[i] else "-",
                          f"{1e3 * (e2e_ms[i] - bf16_ms) :.1f}" if e2e_ms[i] else "-", same_out[i]])
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    print_table(f"kv_dequant builds on {base.name} (H from the shape), Nq = {NQ}; CUDA-graph replay medians per call; "
                f"MB = bytes moved (e4m3 read + bf16 written); cast / copy = torch moving the same bytes (e4m3 -> "
                f"bf16 copy_, bf16 copy_); % = torch's time / kv_dequant's (its rate as % of torch's); vs default = "
                f"kv_dequant time / the default build's; fp8 speed = bf16 ms / dequant ms; dq - bf16 = the dequant "
                f"path's extra us over bf16; same = bit-identical to the default build (workspace; out and lse)",
                ["B,H,L", "build", "MB", "cast us", "copy us", "kv_dequant us", "GB/s", "% copy", "% cast",
                 "vs default", "same ws", "bf16 ms", "dequant ms", "fp8 speed", "dq - bf16 us", "same out"],
                table, args.out, "compare_dequant")
    if failed:
        raise SystemExit("error: " + "; ".join(failed))


if __name__ == "__main__":
    main()

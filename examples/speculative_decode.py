#!/usr/bin/env python3
"""DDTree speculative decoding on the GPU with the generated kernels, on a tiny random MLA model.

    python examples/speculative_decode.py --spec kimi-k2.6-tp8 --batch 8 --new-tokens 128 --graph

Runs the device loop of ddtree_gen.model (rollout drafter -> draft top-k -> kset.tree_build -> a target pass
with kset.tree_verify in every layer -> kset.tree_accept on every layer's cache), checks that
it reproduces plain decoding on the same GPU model, and prints tokens per step and the time of
each generated kernel (CUDA events around every call, median over steps). With --graph, one
step is captured in a CUDA graph and replayed; the replayed run must give the same tokens. With
--noise 0 (an exact drafter) the draft top-k is kset.draft_topk on the drafter's logits; with noise
(the default 0.5) it is the model's own top-k of the noisy scores (draft_topk takes no noise).

Exit status 0 when the kernels are right: speculative decoding gives the plain tokens, except that a
request may part from them at a near-tie. Each divergence (request b, token i: plain chose a, speculative c)
is decided in float64 on the reference path (ddtree_gen.model.near_tie): the numpy float64 model recomputes
the scores at token i from the same inputs (weights, prompt, the tokens before i), and the divergence is a
near-tie only if its float64 margin s[a] - s[c] is within the bound that the contract's attention bar
(5e-3 relative per row and head, section 10) puts on that margin: Z = 5 standard deviations of the margin's
first-order change when each of the token's attention outputs errs by the bar in a direction not aimed at it.
Every divergence is printed with its float64 margin and bound; one outside the bound is a bug and exits 1,
and so does a graph replay that differs from the eager run at all.

--control mask|scale runs the speculative decoder with a planted bug in its tree passes (mask: tree row 1,
the root's first child, does not see the root; scale: softmax_scale x 1.1) and must exit 1: a check that the
criterion tells a bug from a near-tie. --cpu runs the same loop without a GPU (the float32 numpy emulation
of the GPU model, the numpy references as the kernel set; slow: use small sizes).
Needs a CUDA GPU (exit 2, saying what is missing, without one), unless --cpu.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_gen import DdtreeError, load, needs  # noqa: E402
from ddtree_gen import model as M  # noqa: E402
from ddtree_gen.model import near_tie as NT  # noqa: E402  (the float64 near-tie rule)
from ddtree_gen.model import tensor_parallel as TP  # noqa: E402  (judge_tokens)
from ddtree_gen.spec import find_spec  # noqa: E402

CONTROL_SCALE = 1.1   # --control scale: the tree passes' softmax_scale times this


class Control:
    """A kernel set with a planted bug in tree_verify's tree passes (q rows > 1; the one-token passes and
    the prefill are left alone): "mask" clears tree row 1's bit of the root (node 1, the root's first
    child, no longer sees the root); "scale" multiplies softmax_scale by CONTROL_SCALE."""

    def __init__(self, kernels, kind: str):
        self._k, self.kind = kernels, kind

    def __getattr__(self, name):
        return getattr(self._k, name)

    def tree_verify(self, q_nope, q_pe, kv, table, prefix, q_lens, mask, scale, **kw):
        if mask.shape[1] > 1:
            if self.kind == "mask":
                mask = mask.copy()                         # the decoder's own mask is left as it is
                mask[:, 1, 0] &= np.uint32(0xFFFFFFFE)     # row 1 (node 1), bit 0 (the root): cleared
            else:
                scale = scale * CONTROL_SCALE
        return self._k.tree_verify(q_nope, q_pe, kv, table, prefix, q_lens, mask, scale, **kw)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="kimi-k2.6-tp8", help="spec name in specs/ or a .toml path")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=100, help="prompt lengths are 1 .. this, mixed")
    p.add_argument("--budget", type=int, default=None, help="tree nodes besides the root (default N-1)")
    p.add_argument("--draft-depth", type=int, default=None, help="D' (default the spec's max_depth)")
    p.add_argument("--noise", type=float, default=0.5, help="drafter noise (0: exact, top-k by kset.draft_topk; large: useless)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: Gumbel-max sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--graph", action="store_true", help="also capture a step in a CUDA graph and replay it")
    p.add_argument("--control", choices=("mask", "scale"), default=None,
                   help="plant a bug in the speculative tree passes (mask: node 1 does not see the root; scale: "
                        f"softmax_scale x {CONTROL_SCALE:g}); the example must then exit 1")
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: the float32 numpy emulation of the GPU model with the numpy references as the "
                        "kernel set (slow: use small sizes; no --graph, no kernel times)")
    p.add_argument("--numpy-check", action="store_true",
                   help="also decode plain with the float64 numpy model and report the agreement")
    return p.parse_args(argv)


def timed_run(dec: M.DeviceDecoder):
    """Eager loop with CUDA events around each step and each generated-kernel call."""
    import cupy
    per_kernel = defaultdict(list)   # name -> per-step total ms
    calls = {}
    step_ms = []
    steps = 0
    while not dec.done():
        dec.timer = []
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(dec.stream)
        dec.step()
        end.record(dec.stream)
        end.synchronize()
        step_ms.append(cupy.cuda.get_elapsed_time(start, end))
        totals = defaultdict(float)
        counts = defaultdict(int)
        for name, a, b in dec.timer:
            totals[name] += cupy.cuda.get_elapsed_time(a, b)
            counts[name] += 1
        for name, t in totals.items():
            per_kernel[name].append(t)
            calls[name] = counts[name]
        steps += 1
    dec.timer = None
    return dec.result(steps), step_ms, per_kernel, calls


def graph_run(dec: M.DeviceDecoder):
    """First step eager (warm-up), then a captured step replayed until done; replay times by events."""
    import cupy
    step = dec.capture_step()
    steps, replay_ms = 1, []
    while not dec.done():
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(dec.stream)
        step.replay()
        end.record(dec.stream)
        end.synchronize()
        replay_ms.append(cupy.cuda.get_elapsed_time(start, end))
        steps += 1
    return dec.result(steps), replay_ms


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.cpu and args.graph:
            raise DdtreeError("--graph: CUDA graphs need the GPU (leave out --cpu)")
        if not args.cpu:
            needs.require("examples/speculative_decode.py", gpu=True)
        spec = find_spec(args.spec)
    except DdtreeError as e:
        print(f"error: {e}", file=sys.stderr)
        return needs.EXIT_MISSING
    kset = M.ReferenceKernels(spec) if args.cpu else load(spec)
    cfg = M.ModelConfig.from_spec(spec)
    weights = M.init_weights(cfg)
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(1, args.max_prompt + 1, size=args.batch)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in lens]
    sampling = M.Sampling(args.temperature, args.seed)
    drafter = M.Drafter(noise=args.noise, depth=args.draft_depth)
    ops = M.NumpyOps() if args.cpu else M.CupyOps()

    def decoder(speculative):
        dec = M.DeviceDecoder(cfg, spec, prompts, args.new_tokens, ops=ops, kernels=kset, weights=weights,
                              speculative=speculative, sampling=sampling, drafter=drafter, budget=args.budget)
        if speculative and args.control:   # after the prefill: only the steps' tree passes carry the bug
            dec.kernels = Control(kset, args.control)
        return dec

    print(f"spec {spec.name}: H={spec.num_heads} R={spec.kv_lora_rank} P={spec.qk_rope_head_dim} "
          f"page={spec.page_size} N={spec.max_tree_size} D={spec.max_depth}; batch {args.batch}, "
          f"prompts {int(lens.min())}..{int(lens.max())} tokens, {args.new_tokens} new tokens, "
          f"{'greedy' if sampling.greedy else f'T={args.temperature}'}"
          f"{'; CPU emulation' if args.cpu else ''}"
          f"{f'; CONTROL {args.control}: a planted bug, must FAIL' if args.control else ''}")
    if args.cpu:
        plain, gen = decoder(False).run(), decoder(True).run()
    else:
        plain, plain_ms, plain_kernels, _ = timed_run(decoder(False))
        gen, step_ms, per_kernel, calls = timed_run(decoder(True))
    agree = float((gen.tokens == plain.tokens).mean())
    print(f"speculative: {gen.steps} steps, mean accepted length {gen.mean_accept:.2f}, "
          f"tokens/step {gen.tokens_per_step:.2f}; plain: {plain.steps} steps")
    model64 = M.NumpyMLA(cfg, weights)   # the reference path (float64), for the divergences only

    def judge(b, i, a, c):
        return NT.judge(model64, spec, prompts[b] + plain.tokens[b, :i].tolist(), a, c, request=b, token=i,
                        sampling=sampling)

    cmp = TP.judge_tokens(plain.tokens, gen.tokens, judge)
    if cmp.identical:
        print(f"lossless: speculative == plain tokens for all {len(gen.tokens)} requests")
    else:
        parted = len(cmp.near_ties) + len(cmp.violations)
        print(f"speculative vs plain tokens: {len(gen.tokens) - parted} of {len(gen.tokens)} requests "
              f"identical (token agreement {agree:.4f}); first divergence per request, decided in float64 "
              f"(near-tie: |s[plain] - s[speculative]| <= {NT.Z:g} sigma of the attention bar {NT.BAR:g}):")
        for check in cmp.near_ties + cmp.violations:
            print(f"  {'near-tie ' if check.near_tie else 'VIOLATION'} {check}")
        print("  each divergence is a near-tie: rounding within the bar, not a kernel error" if cmp.ok else
              "  FAILED: a request diverges where the float64 margin is outside the bar's bound")
    if not args.cpu:
        print(f"step time (median): speculative {statistics.median(step_ms):.3f} ms, "
              f"plain {statistics.median(plain_ms):.3f} ms")
        print("per generated-kernel time per speculative step (median over steps):")
        for name in sorted(per_kernel):
            med = statistics.median(per_kernel[name])
            print(f"  {name:24s} {med:9.4f} ms  ({calls[name]} calls, {med / calls[name]:.4f} ms per call)")
        print(f"  plain step tree_verify (q_len 1): "
              f"{statistics.median(plain_kernels['tree_verify (q_len 1)']):.4f} ms")
    status = 0 if cmp.ok else 1
    if args.graph:
        ggen, replay_ms = graph_run(decoder(True))
        gsame = np.array_equal(ggen.tokens, gen.tokens)
        print(f"CUDA graph: {ggen.steps} steps, replay median {statistics.median(replay_ms):.3f} ms per step "
              f"(eager {statistics.median(step_ms):.3f} ms); same tokens as eager: {gsame}")
        status |= 0 if gsame else 1
    if args.numpy_check:
        ref = M.generate_numpy(model64, spec, prompts, args.new_tokens, speculative=False, sampling=sampling)
        print(f"agreement with numpy float64 plain decoding: {float((plain.tokens == ref.tokens).mean()):.4f}")
    print("PASS" if status == 0 else "FAILED", f"(exit {status})")
    return status


if __name__ == "__main__":
    sys.exit(main())

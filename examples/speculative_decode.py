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
request may part from them at a near-tie, a token whose plain top-2 logit margin is below --near-tie
(default 5e-3, as tests/test_gpu_e2e.py): the tree pass and the one-token pass sum attention in different
tile orders, so a bf16 ulp can flip such a token. Every divergence is printed with its margin; one at a
larger margin is a bug and exits 1, and so does a graph replay that differs from the eager run at all.
Needs a CUDA GPU (exit 2, saying so, without one).
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
from ddtree_gen.model import tensor_parallel as TP  # noqa: E402  (compare_tokens: the near-tie rule)
from ddtree_gen.spec import find_spec  # noqa: E402

NEAR_TIE = 5e-3   # top-2 logit margin below which a bf16 rounding difference may flip a token


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
    p.add_argument("--near-tie", type=float, default=NEAR_TIE,
                   help=f"top-2 margin below which speculative and plain tokens may part (default {NEAR_TIE:g})")
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
        needs.require("examples/speculative_decode.py", gpu=True)
        spec = find_spec(args.spec)
    except DdtreeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kset = load(spec)
    cfg = M.ModelConfig.from_spec(spec)
    weights = M.init_weights(cfg)
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(1, args.max_prompt + 1, size=args.batch)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in lens]
    sampling = M.Sampling(args.temperature, args.seed)
    drafter = M.Drafter(noise=args.noise, depth=args.draft_depth)
    ops = M.CupyOps()

    def decoder(speculative):
        return M.DeviceDecoder(cfg, spec, prompts, args.new_tokens, ops=ops, kernels=kset, weights=weights,
                               speculative=speculative, sampling=sampling, drafter=drafter, budget=args.budget)

    print(f"spec {spec.name}: H={spec.num_heads} R={spec.kv_lora_rank} P={spec.qk_rope_head_dim} "
          f"page={spec.page_size} N={spec.max_tree_size} D={spec.max_depth}; batch {args.batch}, "
          f"prompts {int(lens.min())}..{int(lens.max())} tokens, {args.new_tokens} new tokens, "
          f"{'greedy' if sampling.greedy else f'T={args.temperature}'}")
    plain, plain_ms, plain_kernels, _ = timed_run(decoder(False))
    spec_dec = decoder(True)
    gen, step_ms, per_kernel, calls = timed_run(spec_dec)
    agree = float((gen.tokens == plain.tokens).mean())
    print(f"speculative: {gen.steps} steps, mean accepted length {gen.mean_accept:.2f}, "
          f"tokens/step {gen.tokens_per_step:.2f}; plain: {plain.steps} steps")
    margins = {}

    def margin(b, i):   # the plain run's top-2 margins, computed only if some request diverges
        if "m" not in margins:
            margins["m"] = decoder(False).run(keep_margins=True).margins
        return margins["m"][b, i]

    cmp = TP.compare_tokens(plain.tokens, gen.tokens, margin, args.near_tie)
    if cmp.identical:
        print(f"lossless: speculative == plain GPU tokens for all {len(gen.tokens)} requests")
    else:
        parted = len(cmp.near_ties) + len(cmp.violations)
        print(f"speculative vs plain GPU tokens: {len(gen.tokens) - parted} of {len(gen.tokens)} requests "
              f"identical (token agreement {agree:.4f}); {cmp.describe()}; near-tie bound: plain top-2 "
              f"margin < {args.near_tie:g}")
        print("  a near-tie divergence is bf16 rounding (the tree pass and the one-token pass sum in different "
              "orders), not a kernel error" if cmp.ok else
              "  FAILED: a request diverges where the plain top-2 margin is not a near-tie")
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
        ref = M.generate_numpy(M.NumpyMLA(cfg, weights), spec, prompts, args.new_tokens, speculative=False,
                               sampling=sampling)
        print(f"agreement with numpy float64 plain decoding: {float((plain.tokens == ref.tokens).mean()):.4f}")
    return status


if __name__ == "__main__":
    sys.exit(main())

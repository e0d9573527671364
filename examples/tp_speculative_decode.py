#!/usr/bin/env python3
"""DDTree speculative decoding with tensor parallelism over GPUs (torch.distributed, NCCL).

    python examples/tp_speculative_decode.py --tp 2                       # spawns 2 processes
    torchrun --nproc-per-node 2 examples/tp_speculative_decode.py         # or let torchrun start them

The tiny random MLA model of ddtree_gen.model (the GPU device loop of examples/speculative_decode.py:
float32 CuPy, kset.tree_build / kset.tree_verify / kset.tree_accept) runs with its attention heads
split over T = --tp ranks, one process per GPU:

* The full model has the heads of --spec (default deepseek-v3-tp8: H = 16, R = 512, P = 64, page
  64, N = 65, D = 15). Its weights are generated on every rank with the same seed, then sliced:
  rank r keeps heads [r H/T, (r+1) H/T) of wq_b (column-parallel), W_UK (w_uk_t), W_UV (w_uv)
  and the matching rows of o_proj (wo, row-parallel); everything else is replicated (embedding,
  norms, wq_a, wkv_a, the MLP, lm_head). Each rank runs the kernel set of a spec with H/T heads
  and the same R, P, page size, N, D (T = 2: kimi-k2.6-tp8, H = 8, whose other fields equal
  deepseek-v3-tp8's). See ddtree_gen/model/tensor_parallel.py.
* MLA's latent KV row (wkv_a, kv_norm, RoPE) is shared by all heads, so every rank computes and
  keeps the full latent cache; nothing of the cache is exchanged.
* The only sum over heads is o_proj: after it, every layer all-reduces the [tokens, hidden]
  partial (torch.distributed.all_reduce, SUM, on the decoder's CUDA stream, no host sync) and
  then adds the residual. Every rank then holds the same hidden state and logits, so tree_build
  (replicated: same inputs), the target tokens and tree_accept (on each rank's own cache) agree
  on every rank without further communication.

What "equal" means. Each rank checks, under the float64 near-tie rule of examples/speculative_decode.py
(ddtree_gen.model.near_tie):
  1. TP speculative == TP plain (speculative decoding is lossless under TP);
  2. TP speculative == TP=1 plain, and TP plain == TP=1 plain, where TP=1 is the unsharded model
     (the same weights and prompts, the --spec kernel set) run on the rank's own GPU.
TP=1 sums the H * Dv products of o_proj in one dot product; TP=T sums T partial dot products and
the all-reduce adds them: the same function, different float32 summation order. The difference
(float32 rounding, ~1e-7 relative) can move a later bf16 rounding (a cache row, a query, the
attention output) by one ulp, which, as between plain and speculative decoding on one GPU (the
attention kernel's tile split differs between a 1-token and a tree pass), can change a token
only where its two best scores nearly tie. So, per request, the token sequences must be identical,
except that they may part at a token that the float64 reference path calls a near-tie: the unsharded
float64 numpy model recomputes the scores there (greedy: logits; sampled: logits / T + Gumbel noise)
from the same prompt and tokens, and their margin between the two runs' tokens must be within the
bound that the contract's attention bar puts on it (near_tie.judge); after that token the
continuations differ and are not compared; any other divergence is a failure. Within one TP run the ranks must agree
bit for bit (tokens, steps, accepted counts): the all-reduce hands every rank the same sum (NCCL
reduces each element once and broadcasts it; with 2 ranks a + b = b + a anyway) and everything
else is replicated and deterministic. Were that not so, the ranks could build different trees
and their collectives would stop matching.

The report: per rank its device and heads, "tokens equal" (yes / yes (near-tie ...) / NO) for
each check, accepted draft tokens per step and the wall time of the TP and TP=1 runs (eager
loop, host check between steps; the first runs, which load modules and set up NCCL, are a
warm-up and not timed). Exit status 0 when every check passes.

--cpu runs the same distributed path without a GPU (gloo backend, the float32 numpy emulation of
the GPU model, the numpy references as the kernel set; use small sizes). Tests: tests/test_tp.py.
NCCL_NVLS_ENABLE defaults to 0 here (NVLink multicast is of no use at these sizes).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_gen import DdtreeError, load, needs  # noqa: E402
from ddtree_gen import model as M  # noqa: E402
from ddtree_gen.model import near_tie as NT  # noqa: E402
from ddtree_gen.model import tensor_parallel as TP  # noqa: E402
from ddtree_gen.spec import find_spec  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=None,
                   help="ranks (GPUs), spawned here; under torchrun: WORLD_SIZE (default 2)")
    p.add_argument("--spec", default="deepseek-v3-tp8", help="the full model's spec (all H heads)")
    p.add_argument("--rank-spec", default=None, help="each rank's spec (default: one in specs/ with H/T heads)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=100, help="prompt lengths are 1 .. this, mixed")
    p.add_argument("--budget", type=int, default=None, help="tree nodes besides the root (default N-1)")
    p.add_argument("--draft-depth", type=int, default=None, help="D' (default the spec's max_depth)")
    p.add_argument("--noise", type=float, default=0.5, help="drafter noise (0: exact; large: useless)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: Gumbel-max sampling")
    p.add_argument("--seed", type=int, default=0, help="prompts and sampling noise (weights: the config's seed)")
    p.add_argument("--no-tp1", action="store_true", help="skip the TP=1 reference runs")
    p.add_argument("--report", default=None, help="also write the report as JSON to this path")
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: gloo backend, the float32 numpy emulation of the GPU model and the numpy "
                        "references as the kernel set (checks the distributed plumbing; slow: use small sizes)")
    return p.parse_args(argv)


def make_prompts(seed: int, batch: int, max_prompt: int, vocab: int) -> list[list[int]]:
    """The same prompts on every rank (1 .. max_prompt tokens, mixed)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_prompt + 1, size=batch)
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lens]


class CupyTorchAllReduce:
    """DeviceDecoder's all_reduce for CuPy arrays: torch.distributed.all_reduce (SUM) in place,
    ordered on the current CuPy stream (torch's current stream is set to the same CUDA stream
    for the call, so NCCL waits for the o_proj partial and the next kernels wait for the sum;
    no host synchronisation). The array is shared with torch through DLPack, not copied."""

    def __init__(self, group=None):
        self.group = group
        self.calls = 0
        self._streams = {}

    def __call__(self, x):
        import cupy
        import torch
        import torch.distributed as dist
        stream = cupy.cuda.get_current_stream()
        dev = x.device.id
        ts = self._streams.get((dev, stream.ptr))
        if ts is None:
            ts = (torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", dev)) if stream.ptr
                  else torch.cuda.default_stream(dev))
            self._streams[(dev, stream.ptr)] = ts
        with torch.cuda.stream(ts):
            t = torch.from_dlpack(x)
            if t.data_ptr() != x.data.ptr:
                raise RuntimeError("DLPack exchange copied the array: the in-place all-reduce would be lost")
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        self.calls += 1
        return x


class NumpyTorchAllReduce(CupyTorchAllReduce):
    """The same for the numpy emulation (--cpu, gloo): all_reduce of the array's memory in place."""

    def __call__(self, x):
        import torch
        import torch.distributed as dist
        dist.all_reduce(torch.from_numpy(x), op=dist.ReduceOp.SUM, group=self.group)
        self.calls += 1
        return x


def _timed(dec: M.DeviceDecoder, **kwargs):
    """(Generation, wall seconds) of dec.run(); the stream is idle before and after."""
    sync = dec.stream.synchronize if dec.stream is not None else (lambda: None)
    sync()
    t0 = time.perf_counter()
    gen = dec.run(**kwargs)
    sync()
    return gen, time.perf_counter() - t0


def _check(comp: TP.Comparison) -> dict:
    return {"ok": comp.ok, "identical": comp.identical, "detail": comp.describe()}


def _stats(gen: M.Generation, seconds: float) -> dict:
    return {"steps": gen.steps, "accepted": gen.accepted, "mean_accept": gen.mean_accept,
            "tokens_per_step": gen.tokens_per_step, "seconds": seconds}


def rank_main(rank: int, local_rank: int, world: int, args) -> dict:
    """One rank's work (the process group is up); every rank returns the same gathered report."""
    import torch
    import torch.distributed as dist
    full = find_spec(args.spec)
    spec_r = find_spec(args.rank_spec) if args.rank_spec else TP.rank_spec(full, world)
    cfg = M.ModelConfig.from_spec(full)                     # the full model (all heads)
    weights = M.init_weights(cfg)                           # same seed on every rank ...
    cfg_r = TP.shard_config(cfg, world)
    w_r = TP.shard_weights(weights, cfg, rank, world)       # ... then this rank's heads
    if (cfg_r.num_heads, cfg_r.kv_lora_rank, cfg_r.qk_rope_head_dim, cfg_r.page_size, full.max_tree_size,
            full.max_depth) != (spec_r.num_heads, spec_r.kv_lora_rank, spec_r.qk_rope_head_dim, spec_r.page_size,
                                spec_r.max_tree_size, spec_r.max_depth):
        raise ValueError(f"rank spec {spec_r.name}: needs H={cfg_r.num_heads} and the other fields of {full.name}")
    lo, hi = TP.head_range(cfg.num_heads, rank, world)
    prompts = make_prompts(args.seed, args.batch, args.max_prompt, cfg.vocab_size)
    sampling = M.Sampling(args.temperature, args.seed)
    drafter = M.Drafter(noise=args.noise, depth=args.draft_depth)
    if args.cpu:
        ops, kernels, reduce = M.NumpyOps(), M.ReferenceKernels, NumpyTorchAllReduce()
        device = "cpu (numpy emulation)"
    else:
        ops, kernels, reduce = M.CupyOps(), load, CupyTorchAllReduce()   # CuPy: this rank's GPU
        device = f"cuda:{local_rank} {torch.cuda.get_device_name(local_rank)}"
    kset_r = kernels(spec_r)
    common = dict(ops=ops, sampling=sampling, drafter=drafter, budget=args.budget)

    def tp_dec(speculative, new_tokens=args.new_tokens):
        return M.DeviceDecoder(cfg_r, spec_r, prompts, new_tokens, kernels=kset_r, weights=w_r,
                               speculative=speculative, all_reduce=reduce, **common)

    barrier = dist.barrier if args.cpu else (lambda: dist.barrier(device_ids=[local_rank]))
    model64 = M.NumpyMLA(cfg, weights)   # the unsharded float64 reference path, for divergences only

    def judged(ref_tokens, tokens):
        def judge(b, i, a, c):
            return NT.judge(model64, full, prompts[b] + list(ref_tokens[b, :i]), a, c, request=b, token=i,
                            sampling=sampling)
        return _check(TP.judge_tokens(ref_tokens, tokens, judge))

    # warm-up (module loads, NCCL communicator), then the timed TP runs, then plain again (determinism)
    tp_dec(True, 4).run()
    tp_dec(False, 4).run()
    barrier()
    plain, t_plain = _timed(tp_dec(False))
    barrier()
    spec_gen, t_spec = _timed(tp_dec(True))
    barrier()
    again = tp_dec(False).run()
    out = {"rank": rank, "device": device,
           "heads": [lo, hi], "rank_spec": spec_r.name, "all_reduces": reduce.calls,
           "tp_plain": _stats(plain, t_plain), "tp_spec": _stats(spec_gen, t_spec),
           "tokens": {"tp_plain": plain.tokens.tolist(), "tp_spec": spec_gen.tokens.tolist()},
           "checks": {"TP plain deterministic": _check(TP.compare_tokens(plain.tokens, again.tokens, None, 0.0)),
                      "TP spec == TP plain": judged(plain.tokens, spec_gen.tokens)}}
    if not args.no_tp1 and world > 1:
        # the unsharded model on this rank's GPU, no communication
        kset_1 = kernels(full)

        def dec1(speculative, new_tokens=args.new_tokens):
            return M.DeviceDecoder(cfg, full, prompts, new_tokens, kernels=kset_1, weights=weights,
                                   speculative=speculative, **common)
        dec1(True, 4).run()
        dec1(False, 4).run()
        plain1, t_plain1 = _timed(dec1(False))
        spec1, t_spec1 = _timed(dec1(True))
        out["tp1_plain"], out["tp1_spec"] = _stats(plain1, t_plain1), _stats(spec1, t_spec1)
        out["checks"].update({
            "TP spec == TP=1 plain": judged(plain1.tokens, spec_gen.tokens),
            "TP plain == TP=1 plain": judged(plain1.tokens, plain.tokens),
            "TP=1 spec == TP=1 plain": judged(plain1.tokens, spec1.tokens)})
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    first = gathered[0]
    agree = all(g["tokens"] == first["tokens"] and
                all(g[k]["steps"] == first[k]["steps"] and g[k]["accepted"] == first[k]["accepted"]
                    for k in ("tp_plain", "tp_spec")) for g in gathered)
    ok = agree and all(c["ok"] for g in gathered for c in g["checks"].values())
    lens = [len(p) for p in prompts]
    return {"tp": world, "backend": dist.get_backend(), "spec": full.name, "rank_spec": spec_r.name,
            "num_heads": cfg.num_heads, "batch": args.batch, "new_tokens": args.new_tokens,
            "prompt_lens": [min(lens), max(lens)],
            "sampling": "greedy" if sampling.greedy else f"T={args.temperature}",
            "near_tie": f"float64 margin within {NT.Z:g} sigma of the attention bar {NT.BAR:g}",
            "ranks": gathered, "ranks_agree": agree, "ok": ok}


def format_report(rep: dict) -> str:
    def yes(c):
        return ("yes" if c["identical"] else f"yes ({c['detail']})") if c["ok"] else f"NO ({c['detail']})"
    lines = [f"tensor parallel TP={rep['tp']} (torch.distributed, {rep['backend']}): model {rep['spec']} "
             f"H={rep['num_heads']}, each rank runs spec {rep['rank_spec']} ({rep['num_heads'] // rep['tp']} heads); "
             f"batch {rep['batch']}, "
             f"prompts {rep['prompt_lens'][0]}..{rep['prompt_lens'][1]} tokens, {rep['new_tokens']} new tokens, "
             f"{rep['sampling']}"]
    for g in rep["ranks"]:
        s, p = g["tp_spec"], g["tp_plain"]
        lines.append(f"rank {g['rank']}  {g['device']}  heads {g['heads'][0]}..{g['heads'][1] - 1}  "
                     f"({g['all_reduces']} all-reduces)")
        lines.append(f"  TP={rep['tp']}: speculative {s['steps']} steps, {s['mean_accept']:.2f} accepted tokens/step "
                     f"({s['tokens_per_step']:.2f} tokens/step), {s['seconds']:.3f} s; plain {p['steps']} steps, "
                     f"{p['seconds']:.3f} s")
        if "tp1_spec" in g:
            s1, p1 = g["tp1_spec"], g["tp1_plain"]
            lines.append(f"  TP=1 (same device): speculative {s1['steps']} steps, {s1['mean_accept']:.2f} accepted "
                         f"tokens/step, {s1['seconds']:.3f} s; plain {p1['steps']} steps, {p1['seconds']:.3f} s")
        for name, c in g["checks"].items():
            lines.append(f"  tokens equal, {name}: {yes(c)}")
    lines.append(f"ranks agree bit for bit (tokens, steps, accepted): {'yes' if rep['ranks_agree'] else 'NO'}")
    lines.append(f"result: {'PASS' if rep['ok'] else 'FAIL'}  (equal = identical, or parted only at a near-tie: "
                 f"{rep['near_tie']})")
    return "\n".join(lines)


def worker(local_rank: int, args, world: int, init_method: str, report_path: str | None, rank: int | None = None):
    """One process: its GPU, the process group, rank_main; rank 0 prints (and writes) the report."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # no NVLink multicast: not needed for these sizes
    import torch
    import torch.distributed as dist
    rank = local_rank if rank is None else rank
    if not args.cpu:
        import cupy
        torch.cuda.set_device(local_rank)
        cupy.cuda.Device(local_rank).use()
    dist.init_process_group("gloo" if args.cpu else "nccl", init_method=init_method, rank=rank, world_size=world)
    try:
        rep = rank_main(rank, local_rank, world, args)
        if rank == 0:
            print(format_report(rep), flush=True)
            for path in (report_path, args.report):
                if path:
                    Path(path).write_text(json.dumps(rep))
        return rep
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    """Run the example; returns the report (under torchrun every process returns it)."""
    args = parse_args(argv)
    try:   # torch.distributed always; GPUs unless --cpu (their count is checked below)
        needs.require("examples/tp_speculative_decode.py" + (" --cpu" if args.cpu else ""), gpu=not args.cpu,
                      torch=True)
    except DdtreeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(needs.EXIT_MISSING) from None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:       # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        if args.tp not in (None, world):
            raise SystemExit(f"--tp {args.tp} but torchrun started WORLD_SIZE={world} processes")
        return worker(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), args, world, "env://", None,
                      rank=int(os.environ["RANK"]))
    import torch
    import torch.multiprocessing as mp
    world = args.tp or 2
    if not args.cpu and torch.cuda.device_count() < world:
        print(f"error: --tp {world}: needs {world} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        raise SystemExit(needs.EXIT_MISSING)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        mp.spawn(worker, args=(args, world, f"tcp://127.0.0.1:{_free_port()}", path), nprocs=world, join=True)
        return json.loads(Path(path).read_text())


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)

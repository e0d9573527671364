#!/usr/bin/env python3
"""Greedy DDTree speculative decoding of a transformers DeepseekV3ForCausalLM (DeepSeek-V3 / Kimi K2 architecture)
through ddtree-gen, checked against transformers' own greedy generate().

    python examples/hf_ddtree.py                       # a tiny random model; CPU: the numpy references, float32
    python examples/hf_ddtree.py --model /path/to/ckpt # a local checkpoint (nothing is downloaded)
    python examples/hf_ddtree.py --flip-mask-bit       # the control: one tree-mask bit flipped each step -> exit 1

One step, as an engine runs it (ddtree_gen.hf.TreeTarget): the drafter gives one distribution per depth
(draft_topk, then tree_build grows the tree under --budget); the target runs once over the tree's nodes, every layer
writing the nodes' latent + k_pe into its paged cache and attending through tree_verify (norms, MLP, MoE, lm_head: the
model's own modules); tree_accept walks the tree with the target's greedy tokens and kv_commit moves the accepted KV.
On a GPU draft_topk, tree_build, tree_verify, tree_accept and kv_commit are the kernels of the model's spec (built
on first use; bf16 model and cache); on the CPU their numpy references (float32 model and cache, float64 attention).

The drafter is the target itself with its last layers skipped (--draft-layers of them kept, then its final norm and
lm_head), run greedily for --depth tokens on the accepted sequence; depth d's distribution is its logits at step d, the
same for every parent (DDTree's drafter shape). Any drafter gives the target's greedy tokens (verification is exact);
a better one accepts more per step.

The check: the tokens must be generate()'s (greedy, --new-tokens of them). In the float32 reference mode (CPU) they
must be identical. On the GPU (bf16) the first difference is accepted only if it is a near tie: a float64 copy of the
model recomputes, from the same hidden state (the common prefix's last position), the logits of the two candidates,
and their margin is at most --near-tie times the largest |logit|; the example says so and compares no further (the
two sequences part there). Exit status 0 when correct, 1 otherwise, 2 when a --model path cannot be read or the
machine lacks what the run needs (torch and transformers: `pip install -e ".[hf]"`; a CUDA GPU for --device cuda),
said in one line.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddtree_gen  # noqa: E402
from ddtree_gen import needs, reference  # noqa: E402

NEEDED = ("torch", "transformers")   # the [hf] extra; --help works without them, main() refuses in one line
try:
    import torch
    from ddtree_gen import hf
except ModuleNotFoundError as e:
    if e.name not in NEEDED:
        raise
    torch = hf = None

GPU_KERNELS = ["tree_build", "draft_topk", "tree_verify", "tree_verify_wgmma", "tree_verify_mma",
               "tree_verify_mma_combine", "tree_accept", "kv_commit"]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a local DeepseekV3ForCausalLM checkpoint folder (default: a tiny random model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="cuda: the kernels, bf16; cpu: the references, float32 (default: cuda if present)")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--depth", type=int, default=6, help="draft depth D' (<= 15)")
    p.add_argument("--topk", type=int, default=3, help="tokens kept per depth")
    p.add_argument("--budget", type=int, default=20, help="tree nodes below the root (<= 64)")
    p.add_argument("--draft-layers", type=int, default=1, help="layers the drafter keeps")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--near-tie", type=float, default=1e-2,
                   help="GPU: a difference is a near tie if the float64 margin is <= this x max |logit|")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flip-mask-bit", action="store_true",
                   help="control: the root sees node 1, its first child (one mask bit flipped each step): must exit 1")
    return p.parse_args(argv)


def load_model(args, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.model:
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, torch_dtype=dtype,
                                                         attn_implementation="eager")
        except (OSError, ValueError) as e:
            print(f"hf_ddtree: cannot load {args.model}: {e}")
            sys.exit(2)
        return model.eval().to(device)
    # the kernels' tensor-core builds need R a multiple of 128 and R + P within the wgmma tiles: R = 512, P = 64 on
    # the GPU (Kimi K2's latent); the CPU reference takes any shape
    cfg = hf.tiny_config(kv_lora_rank=512, qk_rope_head_dim=64) if device == "cuda" else hf.tiny_config()
    return hf.tiny_model(cfg, seed=args.seed, dtype=dtype).to(device)


def draft_logits(model, seq, depth, layers):
    """The layer-skip drafter: the model's first `layers` layers, greedy for `depth` tokens after `seq`; [1, depth, V]
    float32 logits, depth d's row the distribution at step d."""
    kept = model.config.num_hidden_layers
    model.config.num_hidden_layers = min(layers, kept)
    try:
        ids = torch.tensor([seq], device=model.device)
        rows = []
        with torch.no_grad():
            for _ in range(depth):
                lg = model(input_ids=ids, use_cache=False).logits[0, -1].float()
                rows.append(lg)
                ids = torch.cat([ids, lg.argmax().view(1, 1)], 1)
    finally:
        model.config.num_hidden_layers = kept
    return torch.stack(rows)[None].contiguous()


def greedy_reference(model, prompt, n):
    """transformers' own greedy generate() of n tokens (no stop token)."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id, cfg.pad_token_id = None, 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), generation_config=cfg, do_sample=False,
                             max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def near_tie(model, seq, a, b):
    """(margin, max |logit|) of candidates a and b from a float64 copy of the model at the last position of seq."""
    # on the CPU: CUDA's grouped matmuls of the MoE layers take no float64
    m64 = copy.deepcopy(model).to("cpu", torch.float64)
    if hasattr(m64, "set_experts_implementation"):   # (transformers 5.x) the grouped matmuls take no float64 either
        m64.set_experts_implementation("eager")
    with torch.no_grad():
        lg = m64(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
    return abs(float(lg[a] - lg[b])), float(lg.abs().max())


def _installed(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):   # (a module set to None in sys.modules: not importable)
        return False


def refusal(device: str) -> str | None:
    """What this machine lacks for the run (one line), else None: torch and transformers always, a CUDA GPU
    for --device cuda."""
    missing = [n for n in NEEDED if not _installed(n)]
    if missing:
        return (f"examples/hf_ddtree.py needs torch and transformers: {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed (pip install -e \".[hf]\")")
    if device == "cuda" and (torch is None or not torch.cuda.is_available()):
        return (f"examples/hf_ddtree.py --device cuda needs a CUDA GPU: "
                f"{needs.gpu_problem() or 'torch sees no CUDA device (a CPU build of torch?)'}")
    return None


def main(argv=None) -> int:
    args = parse(argv)
    why = refusal(args.device)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return needs.EXIT_MISSING
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_model(args, device)
    cfg = model.config
    gpu = device == "cuda"
    n_max, d_max = 65, 15
    if not (1 <= args.depth <= d_max and 1 <= args.budget <= n_max - 1 and 1 <= args.topk <= n_max - 1):
        print(f"hf_ddtree: need 1 <= depth <= {d_max}, 1 <= budget, topk <= {n_max - 1}")
        return 2
    ks = None
    if gpu:
        spec = hf.spec_for(cfg, page_size=args.page_size, max_tree_size=n_max, max_depth=d_max)
        t0 = time.time()
        ks = ddtree_gen.load(spec, kernels=GPU_KERNELS)
        print(f"spec {spec.name}: H={spec.num_heads} R={spec.kv_lora_rank} P={spec.qk_rope_head_dim} "
              f"(loaded in {time.time() - t0:.1f} s)")
    target = hf.TreeTarget(model, kernels=ks)
    a0 = target.adapters[0]
    print(f"model: {cfg.num_hidden_layers} layers, H={a0.heads}, R={a0.R}, P={a0.P}, rope "
          f"{hf.rope_parameters(cfg).get('rope_type', 'default')}{' interleaved' if a0.rope_interleave else ''}, "
          f"softmax scale {a0.softmax_scale:.6f} (plain {(a0.Dn + a0.P) ** -0.5:.6f}); "
          f"{'GPU kernels, bf16' if gpu else 'CPU references, float32'}; drafter: the first {args.draft_layers} "
          f"layer(s) of the model")

    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(2, cfg.vocab_size, args.prompt_len).tolist()
    expected = greedy_reference(model, prompt, args.new_tokens)

    page = args.page_size
    pages = -(-(args.prompt_len + args.new_tokens + n_max + 1) // page) + 1
    caches = target.new_caches(pages, page, "float32")
    table_np = rng.permutation(pages)[None].astype(np.int32)          # scattered pages, as a paged engine's
    table = torch.from_numpy(table_np).to(device) if gpu else table_np
    as_dev = (lambda a: torch.tensor(a, dtype=torch.int32, device=device)) if gpu else \
        (lambda a: np.asarray(a, np.int32))
    target.prefill(np.asarray([prompt[:-1]]), caches, table)
    prefix = as_dev([len(prompt) - 1])
    out = []
    steps = 0
    while len(out) < args.new_tokens:
        seq = prompt + out
        logits = draft_logits(model, seq, args.depth, args.draft_layers)
        if gpu:
            top = ks.draft_topk(logits, args.topk)
            tree = ks.tree_build(top.topk_ids, top.topk_logprobs, as_dev([seq[-1]]), prefix, args.budget)
        else:
            top = reference.draft_topk(logits.numpy(), args.topk)
            tree = reference.tree_build(top.topk_ids, top.topk_logprobs, as_dev([seq[-1]]), prefix, args.budget,
                                        max_tree_size=n_max)
        if args.flip_mask_bit and int(tree.num_nodes[0]) > 1:   # the control: the root sees node 1 (bit 1 of row 0)
            (tree.tree_mask.view(torch.int32) if gpu else tree.tree_mask)[0, 0, 0] ^= 2
        lg = target.forward(tree.tokens, tree.positions, caches, table, prefix, tree.num_nodes, tree.tree_mask)
        acc = target.accept(tree, lg, caches, table, prefix)
        k = int(acc.accept_lens[0])
        new = [int(t) for t in acc.out_tokens[0, :k + 1]]
        out += new
        prefix = acc.new_prefix_lens
        steps += 1
        print(f"step {steps:2d}: {int(tree.num_nodes[0]):2d} nodes, accepted {k} + bonus -> {new}")
    out = out[:args.new_tokens]
    print(f"{len(out)} tokens in {steps} steps: {len(out) / steps:.2f} tokens per step, "
          f"acceptance {(len(out) - steps) / steps:.2f} draft tokens per step")

    diff = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), None)
    if diff is None:
        print(f"OK: identical to transformers' greedy generate() ({len(out)} tokens)")
        return 0
    print(f"position {diff}: ours {out[diff]}, generate() {expected[diff]}")
    if not gpu:
        print("FAIL: the float32 reference mode must give generate()'s tokens exactly")
        return 1
    margin, scale = near_tie(model, prompt + expected[:diff], out[diff], expected[diff])
    if margin <= args.near_tie * scale:
        print(f"OK: a near tie (float64 margin {margin:.3g} <= {args.near_tie} x max |logit| {scale:.3g}); "
              f"identical before it ({diff} tokens), not compared after")
        return 0
    print(f"FAIL: not a near tie (float64 margin {margin:.3g} > {args.near_tie} x max |logit| {scale:.3g})")
    return 1


if __name__ == "__main__":
    sys.exit(main())

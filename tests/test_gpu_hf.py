"""ddtree_gen.hf through the kernels (GPU): TreeTarget with a kernel set of the model's spec (bf16, and fp8 e4m3 with
kv_scale) against transformers' own DeepseekV3 forward under the 4-D tree mask, as tests/test_hf_cpu.py does on the
CPU with the references: each layer's attention output within 2e-2 relative (bf16 cache), the same top-1 token at
every node outside near ties; the mask packer on the device; which_kernel on the device; examples/hf_ddtree.py on the
GPU (exit 0, and 1 with its control). Tiny random models with R = 512, P = 64 (the tensor-core kernels' shapes)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import need

pytestmark = pytest.mark.gpu
torch, _ = need("torch", "transformers")

import ddtree_gen  # noqa: E402
from ddtree_gen import hf, inputs  # noqa: E402
from ddtree_gen.trees import pack_tree_mask, tree_parents  # noqa: E402

KERNELS = ["tree_verify", "tree_verify_wgmma", "tree_verify_mma", "tree_verify_mma_combine", "tree_accept",
           "kv_commit", "kv_dequant"]
KV_SCALE = 1 / 16      # |latent| <~ 10 after kv_a_layernorm (norm weights <= 2): e4m3 values within 448


def _kset(cfg, kv_dtype):
    spec = hf.spec_for(cfg, kv_dtype=kv_dtype)
    names = [k for k in KERNELS if not (kv_dtype == "bf16" and k == "kv_dequant")
             and not (kv_dtype != "bf16" and k == "tree_verify_mma")]
    return ddtree_gen.load(spec, kernels=names)


CASES = [
    pytest.param(8, True, 32, True, 2, 1000, "random", 65, "bf16", id="h8-yarn-qlora-inter-2l-L1000-n65-bf16"),
    pytest.param(16, False, None, False, 1, 300, "binary", 33, "bf16", id="h16-plain-noqlora-half-1l-L300-n33-bf16"),
    pytest.param(8, True, 32, True, 2, 1000, "random", 65, "fp8_e4m3", id="h8-yarn-qlora-inter-2l-L1000-n65-fp8"),
    pytest.param(16, {"factor": 32.0, "mscale": 0.707}, None, True, 2, 517, "star", 1, "fp8_e4m3",
                 id="h16-yarn32-noqlora-inter-2l-L517-n1-fp8"),
]


@pytest.mark.parametrize("h,yarn,q_lora,inter,layers,prefix,kind,nodes,kv_dtype", CASES)
def test_kernels_match_transformers(h, yarn, q_lora, inter, layers, prefix, kind, nodes, kv_dtype):
    kw = dict(num_attention_heads=h, num_key_value_heads=h, q_lora_rank=q_lora, rope_interleave=inter,
              num_hidden_layers=layers, yarn=bool(yarn), kv_lora_rank=512, qk_rope_head_dim=64)
    if isinstance(yarn, dict):
        kw["rope"] = yarn
    cfg = hf.tiny_config(**kw)
    model = hf.tiny_model(cfg).to("cuda")
    rng = np.random.default_rng(0)
    parents = tree_parents(kind, nodes, rng)
    ids = rng.integers(0, cfg.vocab_size, prefix + nodes)
    pos = torch.from_numpy(np.concatenate([np.arange(prefix), prefix + hf.tree_depths(parents)]))[None].cuda()
    seen = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out: seen.append(out[0][0, prefix:].float().cpu()))
             for layer in model.model.layers]
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids)[None].cuda(), attention_mask=hf.additive_tree_mask(
            prefix, parents).cuda(), position_ids=pos).logits[0, prefix:].float().cpu()
    for hk in hooks:
        hk.remove()

    ks = _kset(cfg, kv_dtype)
    target = hf.TreeTarget(model, kernels=ks, kv_scale=KV_SCALE if kv_dtype != "bf16" else None)
    table, pages = inputs.block_table(np.random.default_rng(1), [prefix + nodes], 64, extra_pages=1)   # scattered
    caches = target.new_caches(pages, 64)
    table = torch.from_numpy(table).cuda()
    target.prefill(ids[None, :prefix], caches, table)
    tree = hf.tree_record(parents[None], ids[None, prefix:], [prefix], ks.spec.mask_words)
    tree_t = type(tree)(*[torch.from_numpy(np.ascontiguousarray(f)).cuda() for f in tree])
    logits, attns = target.verify(tree_t, caches, table, torch.tensor([prefix], dtype=torch.int32).cuda(),
                                  return_attention=True)
    # e4m3 rounds the latent and k_pe to 2^-4 relative (~6 % an element): measured on the H200 8.7e-2 and 9.3e-2 at
    # the second layer (the first layer's error carried in), against 1.5e-3..7e-3 for bf16
    tol = 2e-2 if kv_dtype == "bf16" else 0.15
    for i, (a, w) in enumerate(zip(attns, seen)):
        rel = float((a[0, :nodes].float().cpu() - w).norm() / w.norm())
        assert rel <= tol, f"layer {i}: attention output off by {rel:.2e} ({kv_dtype} cache)"
    if kv_dtype != "bf16":   # the top-1 bar is the bf16 cache's: e4m3's ~6 % moved 9 of 65 nodes' top-1 on the H200
        return
    ours = logits[0, :nodes].cpu()
    top = want.topk(2, -1)
    near = (top.values[:, 0] - top.values[:, 1]) <= 2e-2 * float(want.abs().max())
    same = ours.argmax(-1) == top.indices[:, 0]
    assert bool((same | near).all()), f"{int((~same).sum())} nodes' top-1 differ outside a near tie"


def test_pack_tree_mask_on_the_device():
    rng = np.random.default_rng(0)
    parents = np.stack([tree_parents(k, 65, rng) for k in ("chain", "star", "binary", "random")])
    t = pack_tree_mask(torch.from_numpy(parents).cuda(), 3)
    assert t.is_cuda and t.dtype == torch.uint32
    assert np.array_equal(t.view(torch.int32).cpu().numpy().view(np.uint32), pack_tree_mask(parents, 3))


def test_which_kernel_on_the_device():
    from ddtree_gen.ops.tree_verify.which import which_kernel
    cfg = hf.tiny_config(kv_lora_rank=512, qk_rope_head_dim=64)
    ks = _kset(cfg, "bf16")
    c = which_kernel(ks, 1, 65, 17, device=torch.cuda.current_device())
    major = torch.cuda.get_device_capability()[0]
    assert c.impl == ("wgmma" if major == 9 else "mma" if major >= 8 else "simple"), c
    assert c.schedule == ("seesaw" if c.impl == "wgmma" else None)


@pytest.mark.parametrize("flip", [False, True], ids=["plain", "flip-mask-bit"])
def test_example_hf_ddtree_on_the_gpu(flip):
    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(repo / "examples" / "hf_ddtree.py"), "--device", "cuda",
                        *(["--flip-mask-bit"] if flip else [])], capture_output=True, text=True, timeout=600,
                       cwd=repo, env=dict(os.environ))
    assert r.returncode == (1 if flip else 0), r.stdout[-3000:] + r.stderr[-3000:]
    assert ("FAIL" if flip else "OK:") in r.stdout

"""The FlashMLA pairing recipe of docs/engine.md ("Pairing with FlashMLA") on the GPU: FlashMLA's dense decode
over the prefix (cache_seqlens = prefix_lens), our tree_verify_tail over the tree, merge_states of the two
(FlashMLA's [B, H, Nq] natural-log lse transposed to [B, Nq, H]), held to the bar of tree_verify against the
float64 reference. FlashMLA is a peer, not a dependency: the test skips, saying why and how to get FlashMLA
(ddtree_gen.needs.FLASHMLA_HINT: github.com/deepseek-ai/FlashMLA, built with `python setup.py install`; or
$DDTREE_GEN_FLASHMLA / PYTHONPATH naming a folder with its built package), where flash_mla or torch with CUDA is missing, and for specs FlashMLA's kernel
cannot read (an fp8 cache, pages other than 64 tokens, R + P other than 512 + 64)."""
from __future__ import annotations

import numpy as np
import pytest

from test_gpu_tree_verify import SCALES, check_against, heads_to_check, reference_for
from conftest import cuda_torch
from verify_cases import fresh_seed, kv_torch, make_inputs

pytestmark = pytest.mark.gpu


def test_flashmla_prefix_plus_tail(spec):
    if spec.kv_fp8 or spec.page_size != 64 or (spec.kv_lora_rank, spec.qk_rope_head_dim) != (512, 64):
        pytest.skip(f"spec {spec.name!r}: FlashMLA's dense decode reads bf16 caches of 64-token pages, R + P = 512 + 64")
    torch = cuda_torch()
    from ddtree_gen.needs import import_flash_mla
    try:
        flash_mla = import_flash_mla()
    except ImportError as e:
        pytest.skip(str(e))
    import ddtree_gen
    ks = ddtree_gen.load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n = spec.max_tree_size
    inp = make_inputs(spec, rng, [1, 70, 1000, 4100], [n, 33, 2, n], ["random", "binary", "chain", "star"], seed=seed)
    scale = SCALES["mla"]

    def t(x):
        if x.dtype == np.uint16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
        if x.dtype == np.uint32:
            return torch.from_numpy(x.view(np.int32)).view(torch.uint32).cuda()
        return torch.from_numpy(x).cuda()

    q_nope, q_pe = t(inp.q_nope), t(inp.q_pe)
    kv = kv_torch(spec, inp.kv_cache)                                   # [num_pages, 64, R+P] bf16
    table, prefix_lens, q_lens, mask = t(inp.block_table), t(inp.prefix_lens), t(inp.q_lens), t(inp.tree_mask)
    # the recipe: FlashMLA over the prefix, our tail over the tree, one merge
    q = torch.cat([q_nope, q_pe], -1)                                   # [B, Nq, H, R+P]
    meta, splits = flash_mla.get_mla_metadata()
    o_pre, lse_pre = flash_mla.flash_mla_with_kvcache(q, kv.view(kv.shape[0], kv.shape[1], 1, kv.shape[2]), table,
                                                      prefix_lens, spec.kv_lora_rank, meta, splits,
                                                      softmax_scale=scale, causal=False)
    tail = ks.tree_verify_tail(q_nope, q_pe, kv, table, prefix_lens, q_lens, mask, scale)
    res = ks.merge_states(o_pre, lse_pre.transpose(1, 2).contiguous(), tail.out, tail.lse)
    torch.cuda.synchronize()
    out_bits = res.out.view(torch.int16).cpu().numpy().view(np.uint16)
    lse = res.lse.cpu().numpy()
    heads = heads_to_check(spec.num_heads, rng, 4)
    ref = reference_for("tree_verify", inp, scale, heads)
    check_against(out_bits, lse, ref, inp.q_lens, heads, f"FlashMLA prefix + tail + merge {spec.name} seed={seed}")

"""The specs and shapes the benches share: the shipped spec of each head count, spec variants of other head
counts or kv_dtypes or page sizes (built into the binary cache only), the tree_verify kernels and the layer count."""
from __future__ import annotations

import dataclasses

SPEC_BY_HEADS = {8: "kimi-k2.6-tp8", 16: "deepseek-v3-tp8", 64: "kimi-k2.6", 128: "deepseek-v3"}
# (tree_verify_wgmma with each of its builds: the parts grid, an fp8 spec's dequantize path)
VERIFY_KERNELS = ("tree_verify", "tree_verify_wgmma", "tree_verify_mma", "tree_verify_mma_combine")
LAYERS = 61   # MLA layers of DeepSeek-V3 / Kimi K2: kv_commit's caches, tree_verify's launches per step


def spec_variant(base, heads: int, kv_dtype: str):
    """`base` with num_heads = heads and kv_dtype: the shipped spec with exactly those values if there is one
    (its builds may be cached already), else an unshipped variant named <base>-h<H>[-fp8] (built into the
    binary cache only, never into generated/)."""
    from ..spec import all_specs
    want = dataclasses.replace(base, num_heads=heads, kv_dtype=kv_dtype)
    for s in all_specs():
        if dataclasses.replace(s, name=want.name) == want:
            return s
    stem = base.name[:-4] if base.name.endswith("-fp8") else base.name
    name = stem + (f"-h{heads}" if heads != base.num_heads else "") + ("-fp8" if kv_dtype == "fp8_e4m3" else "")
    return dataclasses.replace(want, name=name)




def page_variant(base, page_size: int):
    """`base` with its cache in pages of `page_size` tokens (an engine's own layout: bench tree_verify --pages):
    `base` itself at its own page size (the shipped spec: its builds are in generated/), else a spec made in code
    (ddtree_gen.make_spec, its checks: a SpecError naming page_size) named <base>-page<N>, every other field
    base's."""
    if page_size == base.page_size:
        return base
    from ..spec import make_spec
    return make_spec(f"{base.name}-page{page_size}", base.num_heads, base.kv_lora_rank, base.qk_rope_head_dim,
                     page_size=page_size, max_tree_size=base.max_tree_size, max_depth=base.max_depth,
                     kv_dtype=base.kv_dtype, archs=base.archs)

"""A Hugging Face transformers DeepSeek-V3 / Kimi-K2 model (`DeepseekV3ForCausalLM`, `DeepseekV3Attention`) through
ddtree-gen: its MLA attention mapped onto tree_verify's inputs, and tree verification of the whole model.

    from ddtree_gen import hf
    mla = hf.MlaAdapter.from_module(model.model.layers[0].self_attn, rotary=model.model.rotary_emb, tp_size=8, tp_rank=0)
    spec = mla.spec(page_size=64)                 # H per rank, R = kv_lora_rank, P = qk_rope_head_dim
    q_nope, q_pe = mla.queries(x, position_ids)   # x: the layer's input_layernorm output; q_nope absorbed [.., H, R]
    ckv, kpe = mla.latents(x, position_ids)       # the latent after kv_a_layernorm, k_pe after rope
    hf.write_kv(kv_cache, block_table, cache_positions, ckv, kpe)   # into the paged cache (contract section 7)
    out = reference.tree_verify(q_nope, q_pe, kv_cache, ..., softmax_scale=mla.softmax_scale).out
    y = mla.output(out)                           # out @ W_UV per head, then o_proj (the rank's columns)

What the model computes (transformers' modeling_deepseek_v3.py, the same in 5.17 and 5.24), and what is whose here:

* the softmax scale is `qk_head_dim ** -0.5` (qk_head_dim = qk_nope_head_dim + qk_rope_head_dim), times
  `yarn_mscale(factor, mscale_all_dim) ** 2` when the rope parameters' type is not "default" and they set
  `mscale_all_dim` (yarn: DeepSeek-V3 and Kimi K2): `softmax_scale(config)`;
* `kv_b_proj.weight` is `[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: per head the first qk_nope_head_dim
  rows are W_UK (k_nope = W_UK ckv), the next v_head_dim rows W_UV (v = W_UV ckv); the absorbed query of head h is
  `q_nope[h] @ W_UK[h]` (R values) and the attention output `o[h] @ W_UV[h].T` before o_proj;
* the cached latent is `kv_a_layernorm(kv_a_proj_with_mqa(x)[:R])`, the cached rope key `rope(kv_a_proj(x)[R:])`,
  one key shared by every head; q_pe is the rope part of each head's query after the same rope;
* rope: the model's rotary embedding (its cos / sin carry yarn's attention factor) applied as rotate-half, or, with
  `config.rope_interleave`, to the interleaved pairs (x0, x1), (x2, x3), ... with the result laid out as
  [rotated evens, rotated odds] - for q_pe and k_pe alike (a dot product of the two is what tree_verify takes, so
  any layout works that both share; the one here is transformers');
* tensor parallelism: rank r of tp_size holds heads [r H / tp, (r + 1) H / tp) (q, kv_b_proj rows, o_proj columns);
  the latent and k_pe are the same on every rank; the ranks' o_proj partial sums add up to the layer's output.

`TreeTarget` runs a whole model over a paged cache per layer: each layer's norms, MLP / MoE, the embedding, the final
norm and lm_head are the model's own modules; the attention goes through the numpy reference (`kernels=None`, any
float cache, float64 attention) or a kernel set's tree_verify on torch CUDA tensors (`kernels=ddtree_gen.load(spec)`).
Needs torch (and a transformers model to adapt); `import ddtree_gen` does not import this module.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import bf16 as _bf16
from . import fp8 as _fp8
from . import reference as _reference
from .spec import Spec, make_spec
from .trees import pack_tree_mask
from .types import TreeBuildOutput

__all__ = ["rope_parameters", "yarn_mscale", "softmax_scale", "spec_for", "MlaAdapter", "write_kv", "TreeTarget",
           "tree_record", "pad_tree", "tree_depths", "additive_tree_mask", "tiny_config", "tiny_model"]


# ---------------------------------------------------------------------------------------------------------- config

def rope_parameters(config) -> dict:
    """The config's rope parameters: `rope_parameters` (transformers 5) or `rope_scaling` (older configs), {} if
    neither."""
    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        rp = getattr(config, "rope_scaling", None)
    return dict(rp or {})


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's yarn magnitude factor: 1 for scale <= 1, else 0.1 mscale ln(scale) + 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config) -> float:
    """The softmax scale DeepseekV3Attention uses (its `scaling`): qk_head_dim^-0.5, times yarn_mscale(factor,
    mscale_all_dim)^2 when the rope type is not "default" and mscale_all_dim is set (non-zero). The scores it
    multiplies are q . k over qk_head_dim = qk_nope_head_dim + qk_rope_head_dim dims, i.e. exactly tree_verify's
    q_nope_absorbed . ckv + q_pe . kpe: tree_verify takes this value as its softmax_scale unchanged."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rp = rope_parameters(config)
    if rp.get("rope_type", rp.get("type", "default")) != "default":
        m_all = rp.get("mscale_all_dim", 0)
        if m_all:
            m = yarn_mscale(rp["factor"], m_all)
            scale = scale * m * m
    return scale


def _heads(config, tp_size: int) -> int:
    h = int(config.num_attention_heads)
    if tp_size < 1 or h % tp_size:
        raise ValueError(f"tp_size: {tp_size} does not divide num_attention_heads = {h}")
    return h // tp_size


def spec_for(config, *, tp_size: int = 1, page_size: int = 64, max_tree_size: int = 65, max_depth: int = 15,
             kv_dtype: str = "bf16", name: str | None = None, archs=None) -> Spec:
    """The spec of a DeepseekV3 config under tensor parallelism: num_heads = num_attention_heads / tp_size (the heads
    of one rank), kv_lora_rank R, qk_rope_head_dim P; page size, tree size, depth and cache dtype are the caller's.
    Built in code (ddtree_gen.make_spec); `name` defaults to one made of its values."""
    h = _heads(config, tp_size)
    r, p = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    if name is None:
        name = f"hf-h{h}-r{r}-p{p}-pg{page_size}-n{max_tree_size}-d{max_depth}" + ("-fp8" if kv_dtype != "bf16" else "")
    return make_spec(name, h, r, p, page_size=page_size, max_tree_size=max_tree_size, max_depth=max_depth,
                     kv_dtype=kv_dtype, archs=archs)


# ------------------------------------------------------------------------------------------------------------ rope

def apply_rope(x, cos, sin, interleave: bool):
    """Rope as DeepseekV3Attention applies it, on x [..., T, heads, P] with cos / sin [..., T, P] (the rotary
    embedding's, cat(freqs, freqs)): rotate-half, or with `interleave` the pairs (x0, x1), (x2, x3), ... rotated by one
    frequency each, the result laid out [rotated evens, rotated odds] (transformers' apply_rotary_pos_emb_interleave)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleave:
        c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotary_of(attn):
    """A rotary embedding for a lone attention module: its modeling file's DeepseekV3RotaryEmbedding of its config."""
    mod = sys.modules[type(attn).__module__]
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))
    return cls(config=attn.config).to(next(attn.parameters()).device)


# ------------------------------------------------------------------------------------------------------- the layer

@dataclass(frozen=True)
class MlaAdapter:
    """One DeepseekV3Attention layer (one tensor-parallel rank of it) as tree_verify's inputs and outputs.

    Fields: `attn` the module, `rotary` the rotary embedding (the model's `model.rotary_emb`), `heads` per rank,
    `head0` its first head, `R`, `P`, `Dn` (qk_nope_head_dim), `Dv` (v_head_dim), `softmax_scale`, `rope_interleave`,
    `latent_norm` (kv_a_layernorm applied to the cached latent, as the model does) and `tp_rank`. They are what the
    model computes; the tests replace some (dataclasses.replace) to show that a wrong one is caught."""
    attn: Any
    rotary: Any
    heads: int
    head0: int
    R: int
    P: int
    Dn: int
    Dv: int
    softmax_scale: float
    rope_interleave: bool
    latent_norm: bool = True
    tp_rank: int = 0
    _w: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_module(cls, attn, *, rotary=None, tp_size: int = 1, tp_rank: int = 0) -> "MlaAdapter":
        """The adapter of a transformers DeepseekV3Attention (or any module with its attributes and config).
        `rotary`: the model's rotary embedding (`model.model.rotary_emb`); None makes one from the config. The softmax
        scale is softmax_scale(config), checked against the module's own `scaling` where it has one."""
        cfg = attn.config
        h = _heads(cfg, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: {tp_rank} is outside [0, {tp_size})")
        scale = softmax_scale(cfg)
        own = getattr(attn, "scaling", None)
        if own is not None and not math.isclose(float(own), scale, rel_tol=1e-12):
            raise ValueError(f"softmax scale: the module's scaling {own} is not softmax_scale(config) = {scale}: this "
                             f"model computes its scale in a way ddtree_gen.hf does not know")
        return cls(attn, rotary if rotary is not None else _rotary_of(attn), h, tp_rank * h, int(cfg.kv_lora_rank),
                   int(cfg.qk_rope_head_dim), int(cfg.qk_nope_head_dim), int(cfg.v_head_dim), scale,
                   bool(getattr(cfg, "rope_interleave", False)), True, tp_rank)

    def spec(self, *, page_size: int = 64, max_tree_size: int = 65, max_depth: int = 15, kv_dtype: str = "bf16",
             name: str | None = None, archs=None) -> Spec:
        """This rank's spec (spec_for with its heads)."""
        tp = int(self.attn.config.num_attention_heads) // self.heads
        return spec_for(self.attn.config, tp_size=tp, page_size=page_size, max_tree_size=max_tree_size,
                        max_depth=max_depth, kv_dtype=kv_dtype, name=name, archs=archs)

    # --- weights
    def weights(self) -> tuple:
        """(W_UK [heads, Dn, R], W_UV [heads, Dv, R]) of this rank's heads, float32, from kv_b_proj.weight
        ([H (Dn + Dv), R]: per head Dn rows of W_UK, then Dv of W_UV)."""
        if "uk" not in self._w:
            w = self.attn.kv_b_proj.weight.detach().float()
            w = w.view(-1, self.Dn + self.Dv, self.R)[self.head0:self.head0 + self.heads]
            self._w["uk"], self._w["uv"] = w[:, :self.Dn].contiguous(), w[:, self.Dn:].contiguous()
        return self._w["uk"], self._w["uv"]

    def rope(self, x, position_ids):
        """cos, sin [B, T, P] of the model's rotary embedding at position_ids [B, T], in x's dtype."""
        return self.rotary(x, position_ids)

    # --- inputs of tree_verify
    def queries(self, hidden, position_ids, dtype=torch.float32) -> tuple:
        """The absorbed queries of hidden states [B, T, hidden] (the layer's input_layernorm output) at rope
        positions [B, T]: (q_nope [B, T, heads, R] = q_nope @ W_UK per head, q_pe [B, T, heads, P] after rope), in
        `dtype` (the projections run in the module's dtype, the absorption in float32)."""
        a = self.attn
        x = hidden.to(a.kv_a_proj_with_mqa.weight.dtype)
        qk = self.Dn + self.P
        rows = slice(self.head0 * qk, (self.head0 + self.heads) * qk)
        if getattr(a, "q_lora_rank", None) is None:
            lin, src = a.q_proj, x
        else:
            lin, src = a.q_b_proj, a.q_a_layernorm(a.q_a_proj(x))
        q = F.linear(src, lin.weight[rows], None if lin.bias is None else lin.bias[rows])
        q = q.view(*q.shape[:-1], self.heads, qk)
        q_nope, q_rot = q[..., :self.Dn], q[..., self.Dn:]
        cos, sin = self.rope(x, position_ids)
        q_pe = apply_rope(q_rot, cos, sin, self.rope_interleave)
        uk, _ = self.weights()
        q_abs = torch.einsum("bthd,hdr->bthr", q_nope.float(), uk.to(q_nope.device))
        return q_abs.to(dtype), q_pe.to(dtype)

    def latents(self, hidden, position_ids, dtype=torch.float32) -> tuple:
        """What the layer caches for hidden states [B, T, hidden] at rope positions [B, T]: (ckv [B, T, R] =
        kv_a_layernorm of the latent, kpe [B, T, P] = the rope key after rope), in `dtype`."""
        a = self.attn
        x = hidden.to(a.kv_a_proj_with_mqa.weight.dtype)
        c = a.kv_a_proj_with_mqa(x)
        ckv, k_rot = c[..., :self.R], c[..., self.R:]
        if self.latent_norm:
            ckv = a.kv_a_layernorm(ckv)
        cos, sin = self.rope(x, position_ids)
        kpe = apply_rope(k_rot.unsqueeze(-2), cos, sin, self.rope_interleave).squeeze(-2)
        return ckv.to(dtype), kpe.to(dtype)

    # --- the output of tree_verify
    def output(self, attn_out):
        """The layer's attention output [B, T, hidden] (this rank's partial sum under tensor parallelism, o_proj's
        bias on rank 0) from tree_verify's out [B, T, heads, R]: out @ W_UV^T per head, then o_proj."""
        a = self.attn
        _, uv = self.weights()
        o = torch.as_tensor(attn_out)
        v = torch.einsum("bthr,hvr->bthv", o.float(), uv.to(o.device))
        v = v.reshape(*v.shape[:-2], self.heads * self.Dv).to(a.o_proj.weight.dtype)
        cols = slice(self.head0 * self.Dv, (self.head0 + self.heads) * self.Dv)
        bias = a.o_proj.bias if (a.o_proj.bias is not None and self.tp_rank == 0) else None
        return F.linear(v, a.o_proj.weight[:, cols], bias)


# ---------------------------------------------------------------------------------------------------- the KV cache

def _kv_kind(kv_cache) -> str:
    """"bf16", "fp8" or "float" for a cache of numpy (uint16 bits, uint8 / float8_e4m3fn bytes, floats) or torch."""
    if isinstance(kv_cache, torch.Tensor):
        if kv_cache.dtype in (torch.bfloat16, torch.uint16):
            return "bf16"
        if kv_cache.dtype in (torch.float8_e4m3fn, torch.uint8):
            return "fp8"
        return "float"
    if kv_cache.dtype == np.uint16 or kv_cache.dtype.name == "bfloat16":
        return "bf16"
    if _fp8.is_e4m3(kv_cache.dtype):
        return "fp8"
    return "float"


def write_kv(kv_cache, block_table, positions, ckv, kpe, kv_scale=None) -> None:
    """Write latents and rope keys into one layer's paged cache (docs/contract.md section 7): the entry of token
    `positions[b, t]` of request b is `[ckv[b, t], kpe[b, t]]` (R then P values) at page
    `block_table[b, pos // page_size]`, slot `pos % page_size`; a negative position is skipped.

    kv_cache `[num_pages, page_size, R + P]`: torch (bf16, float32/64, or an fp8 cache's float8_e4m3fn / uint8 bytes,
    on any device) or numpy (uint16 bf16 bits, float32/64, uint8 / float8_e4m3fn e4m3 bytes). bf16 rounds to nearest
    even; an fp8 cache stores e4m3(value / kv_scale) (round to nearest even; kv_scale required there only).
    block_table `[B, max_pages]`, positions `[B, T]`, ckv `[B, T, R]`, kpe `[B, T, P]`, of the cache's kind."""
    kind = _kv_kind(kv_cache)
    if (kind == "fp8") != (kv_scale is not None):
        raise ValueError(f"kv_scale: {'required for' if kind == 'fp8' else 'only for'} an fp8 (e4m3) cache")
    page = kv_cache.shape[1]
    if isinstance(kv_cache, torch.Tensor):
        dev = kv_cache.device
        pos = torch.as_tensor(positions, device=dev).long()
        table = torch.as_tensor(block_table, device=dev).long()
        entry = torch.cat([torch.as_tensor(ckv, device=dev).float(), torch.as_tensor(kpe, device=dev).float()], -1)
        b_idx, t_idx = torch.nonzero(pos >= 0, as_tuple=True)
        p = pos[b_idx, t_idx]
        pages, slots = table[b_idx, p // page], p % page
        vals = entry[b_idx, t_idx]
        if kind == "fp8":   # through uint8 views: index_put of float8 is not implemented on every device
            kv_cache.view(torch.uint8)[pages, slots] = (vals / kv_scale).to(torch.float8_e4m3fn).view(torch.uint8)
        elif kv_cache.dtype == torch.uint16:
            kv_cache[pages, slots] = vals.to(torch.bfloat16).view(torch.uint16)
        else:
            kv_cache[pages, slots] = vals.to(kv_cache.dtype)
        return
    pos = np.asarray(positions).astype(np.int64)
    table = np.asarray(block_table).astype(np.int64)
    entry = np.concatenate([_np(ckv), _np(kpe)], -1)
    b_idx, t_idx = np.nonzero(pos >= 0)
    p = pos[b_idx, t_idx]
    pages, slots = table[b_idx, p // page], p % page
    vals = entry[b_idx, t_idx]
    if kind == "bf16":
        kv_cache[pages, slots] = _bf16.to_bits(vals).view(kv_cache.dtype)
    elif kind == "fp8":
        kv_cache[pages, slots] = _fp8.from_float(vals / kv_scale).view(kv_cache.dtype)
    else:
        kv_cache[pages, slots] = vals


def _np(x) -> np.ndarray:
    """float64 numpy of a torch tensor or array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, np.float64)


# ------------------------------------------------------------------------------------------------------- the trees

def tree_depths(parents):
    """Depths [..., N] of parent arrays (the root 0; padding rows, parent -1 at i > 0, get -1); numpy or torch (on
    its device)."""
    is_t = isinstance(parents, torch.Tensor)
    p = parents.long() if is_t else np.asarray(parents).astype(np.int64)
    d = (torch.full_like(p, -1) if is_t else np.full_like(p, -1))
    d[..., 0] = 0
    for i in range(1, p.shape[-1]):
        par = p[..., i]
        safe = par.clamp(0, i - 1) if is_t else np.clip(par, 0, i - 1)
        up = (torch.gather(d, -1, safe.unsqueeze(-1)).squeeze(-1) if is_t
              else np.take_along_axis(d, safe[..., None], -1)[..., 0])
        ok = (par >= 0) & (up >= 0)
        d[..., i] = torch.where(ok, up + 1, -1) if is_t else np.where(ok, up + 1, -1)
    return d


def tree_record(parents, tokens, prefix_lens, words: int | None = None, *,
                max_tree_size: int | None = None) -> TreeBuildOutput:
    """A TreeBuildOutput (numpy) of trees given as parents and tokens [B, N] (-1 padding after num_nodes; node
    numbers in an order where parents come first): what tree_accept and TreeTarget.verify read of a tree an engine
    built itself (scores 0). max_tree_size: its rows (a spec's N, as tree_build makes them; pad_tree), else N.
    TreeTarget takes a record of any N up to its spec's on every path (it pads one for the kernels' tree_accept)."""
    if max_tree_size is not None:
        n = np.asarray(parents).shape[-1]
        if max_tree_size < n:
            raise ValueError(f"max_tree_size: {max_tree_size}, fewer than the {n} rows of parents")
        return pad_tree(tree_record(parents, tokens, prefix_lens, words), max_tree_size)
    par = np.asarray(parents).astype(np.int32)
    tok = np.asarray(tokens).astype(np.int32)
    bsz, n = par.shape
    depths = tree_depths(par).astype(np.int32)
    live = depths >= 0
    num_nodes = np.array([int(np.argmin(np.append(live[b], False))) for b in range(bsz)], np.int32)
    first_child = np.full((bsz, n), -1, np.int32)
    next_sibling = np.full((bsz, n), -1, np.int32)
    for b in range(bsz):
        last = {}
        for i in range(1, int(num_nodes[b])):
            q = int(par[b, i])
            if q in last:
                next_sibling[b, last[q]] = i
            else:
                first_child[b, q] = i
            last[q] = i
    idx = np.arange(n)
    live = idx < num_nodes[:, None]
    prefix = np.asarray(prefix_lens).astype(np.int32).reshape(bsz, 1)
    return TreeBuildOutput(num_nodes, np.where(live, tok, -1).astype(np.int32), np.where(live, par, -1).astype(np.int32),
                           np.where(live, depths, -1).astype(np.int32),
                           np.where(live, prefix + depths, -1).astype(np.int32),
                           np.where(live, 0.0, -np.inf).astype(np.float32),
                           pack_tree_mask(par, words, num_nodes), first_child, next_sibling)


# what tree_build writes in a padding row, per field (num_nodes has no rows)
_PAD = {"scores": -np.inf, "tree_mask": 0}


def _pad_rows(x, n: int, value):
    """x [B, N', ...] (numpy or torch) with rows N'..n-1 of `value` appended along dimension 1."""
    rows = x.shape[1]
    if rows >= n:
        return x
    if isinstance(x, torch.Tensor):
        base = x.view(torch.int32) if x.dtype == torch.uint32 else x   # (torch.cat has no uint32 kernel)
        fill = torch.full((x.shape[0], n - rows, *x.shape[2:]), value, dtype=base.dtype, device=x.device)
        out = torch.cat([base, fill], 1)
        return out.view(torch.uint32) if x.dtype == torch.uint32 else out
    x = np.asarray(x)
    return np.concatenate([x, np.full((x.shape[0], n - rows, *x.shape[2:]), value, x.dtype)], 1)


def pad_tree(tree, n: int) -> TreeBuildOutput:
    """`tree` (tree_record's or tree_build's record, numpy or torch, or anything with its fields) with n rows: the
    rows after its own are padding as tree_build writes it (-1; scores -inf, mask words 0), num_nodes unchanged. The
    kernels' tree_accept takes trees of the spec's N rows only; a record with more rows than n is returned as it is
    (the launcher's check names it). Fields the record lacks are None."""
    fields = []
    for name in TreeBuildOutput._fields:
        x = getattr(tree, name, None)
        fields.append(x if x is None or name == "num_nodes" else _pad_rows(x, n, _PAD.get(name, -1)))
    return TreeBuildOutput(*fields)


def additive_tree_mask(prefix_len: int, parents, dtype=torch.float32):
    """transformers' view of one tree step: the 4-D additive mask [1, 1, L + n, L + n] of a causal prefix of L tokens
    followed by the n tree nodes of `parents` (each sees the prefix, its ancestors and itself), 0 where visible and
    dtype's lowest value elsewhere; with position ids [0..L) then L + depth it makes the model's own forward compute
    exactly what TreeTarget.verify computes for the tree rows."""
    par = np.asarray(parents)
    n = par.shape[0]
    t = prefix_len + n
    vis = np.tril(np.ones((t, t), bool))
    vis[prefix_len:, prefix_len:] = False
    anc = pack_tree_mask(par)
    j = np.arange(n)
    vis[prefix_len:, prefix_len:] = (anc[:, j // 32] >> (j % 32).astype(np.uint32)) & 1 == 1
    m = torch.zeros((1, 1, t, t), dtype=dtype)
    m[0, 0][torch.from_numpy(~vis)] = torch.finfo(dtype).min
    return m


def tiny_config(**overrides):
    """A small random DeepseekV3Config (transformers; 2 layers, the second MoE; H = 8, R = 64, P = 16, yarn rope with
    interleaved weights, eager attention): the tests' and examples/hf_ddtree.py's default. Keywords override fields;
    `yarn=False` gives the default rope."""
    from transformers import DeepseekV3Config
    yarn = overrides.pop("yarn", True)
    rp = ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 128,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0} if yarn
          else {"rope_type": "default", "rope_theta": 10000.0})
    rp.update(overrides.pop("rope", {}))
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=4,
              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=64,
              q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
              max_position_embeddings=int(rp.get("factor", 1.0) * rp.get("original_max_position_embeddings", 4096)),
              rope_parameters=rp, rope_interleave=True, attn_implementation="eager", tie_word_embeddings=False,
              initializer_range=0.1)
    kw.update(overrides)
    cfg = DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(config=None, seed: int = 0, dtype=torch.float32):
    """A random DeepseekV3ForCausalLM of `config` (tiny_config() by default), in eval mode: weights of std
    config.initializer_range, every RMSNorm weight uniform in [0.5, 2] (so that a missing or misplaced norm shows)."""
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config if config is not None else tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 2.0)
    return model.to(dtype)


# --------------------------------------------------------------------------------------------------- whole models

class TreeTarget:
    """A transformers DeepseekV3ForCausalLM run over paged caches (one per layer) as a DDTree engine's target.

    `kernels`: None, the numpy reference (ddtree_gen.reference.tree_verify, float64 attention; caches numpy: float32
    or float64, uint16 bf16 bits, or e4m3 bytes with `kv_scale`); or a kernel set (`ddtree_gen.load(spec)`, the spec
    of this model: `self.spec(...)`), whose tree_verify runs on torch CUDA tensors (caches torch bf16, or an fp8
    spec's float8_e4m3fn with `kv_scale`). The model's own modules compute everything else, in its dtype and on its
    device. `kv_scale` is one scale for every layer's fp8 cache. `fp8_path` / `impl` go to the kernel's tree_verify.

    The methods follow docs/contract.md: `forward` writes row j's KV at cache position prefix_len + j before the
    layer's attention; `verify` gives the logits of every tree node; `accept` walks the tree with the target's greedy
    tokens and commits the accepted KV in every layer (tree_accept's walk + kv_commit)."""

    def __init__(self, model, *, kernels=None, kv_scale=None, impl: str = "auto", fp8_path=None):
        self.model = model
        inner = model.model
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        self.adapters = [MlaAdapter.from_module(layer.self_attn, rotary=inner.rotary_emb) for layer in self.layers]
        self.kernels = kernels
        self.kv_scale = kv_scale
        self.impl, self.fp8_path = impl, fp8_path
        self.config = model.config
        if kernels is not None:
            s, a = kernels.spec, self.adapters[0]
            if (s.num_heads, s.kv_lora_rank, s.qk_rope_head_dim) != (a.heads, a.R, a.P):
                raise ValueError(f"kernels: spec {s.name!r} has H, R, P = {s.num_heads}, {s.kv_lora_rank}, "
                                 f"{s.qk_rope_head_dim}; the model {a.heads}, {a.R}, {a.P}")

    def spec(self, **kw) -> Spec:
        """The model's spec (spec_for of its config; page size, tree size, depth, kv_dtype: keywords)."""
        return spec_for(self.config, **kw)

    @property
    def device(self):
        return self.model.lm_head.weight.device

    def new_caches(self, num_pages: int, page_size: int, dtype="float32"):
        """One zero cache [num_pages, page_size, R + P] per layer: numpy "float32" / "float64" / "bf16" (uint16 bits) /
        "fp8" (uint8 bytes) for the reference; with kernels, torch on the model's device, bf16 or (an fp8 spec)
        float8_e4m3fn (dtype ignored: the spec's)."""
        a = self.adapters[0]
        shape = (num_pages, page_size, a.R + a.P)
        if self.kernels is not None:
            t = torch.float8_e4m3fn if self.kernels.spec.kv_fp8 else torch.bfloat16
            return [torch.zeros(shape, dtype=t, device=self.device) for _ in self.layers]
        np_dtype = {"float32": np.float32, "float64": np.float64, "bf16": np.uint16, "fp8": np.uint8}[dtype]
        return [np.zeros(shape, np_dtype) for _ in self.layers]

    def _attend(self, mla, q_nope, q_pe, cache, block_table, prefix_lens, q_lens, tree_mask):
        if self.kernels is None:
            kw = {} if self.kv_scale is None else {"kv_scale": self.kv_scale}
            res = _reference.tree_verify(_np(q_nope), _np(q_pe), cache, np.asarray(block_table),
                                         np.asarray(prefix_lens), np.asarray(q_lens), np.asarray(tree_mask),
                                         mla.softmax_scale, **kw)
            out = np.nan_to_num(res.out)
            return torch.from_numpy(out).to(self.device, torch.float32)
        kw = {"impl": self.impl}
        if self.kernels.spec.kv_fp8:
            kw.update(kv_scale=self.kv_scale, fp8_path=self.fp8_path)
        res = self.kernels.tree_verify(q_nope.to(torch.bfloat16).contiguous(), q_pe.to(torch.bfloat16).contiguous(),
                                       cache, block_table, prefix_lens, q_lens, tree_mask, mla.softmax_scale, **kw)
        return res.out

    def _table(self, x, dtype):
        """x on the compute side: numpy for the reference, an int32 / uint32 torch tensor on the device with kernels."""
        if self.kernels is None:
            return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        if isinstance(x, np.ndarray) and x.dtype == np.uint32:
            x = x.view(np.int32)
        t = torch.as_tensor(x, device=self.device)
        if dtype == "uint32":
            return t.to(torch.int32).view(torch.uint32) if t.dtype != torch.uint32 else t
        return t.to(torch.int32)

    @torch.no_grad()
    def forward(self, tokens, rope_positions, caches, block_table, prefix_lens, q_lens, tree_mask, *,
                return_attention: bool = False):
        """Logits [B, Nq, V] (float32) of rows `tokens` [B, Nq] (negative: padding, embedded as 0) at rope positions
        [B, Nq]: every layer writes row j's latent and rope key at cache position prefix_len + j (j < q_len), then
        attends through tree_verify with `tree_mask` [B, Nq, W] (the spec's W with kernels). Rows j >= q_len are
        padding (their logits are not defined). return_attention: also each layer's attention output [B, Nq, hidden]."""
        dev = self.device
        tok = torch.as_tensor(np.asarray(tokens) if not isinstance(tokens, torch.Tensor) else tokens, device=dev).long()
        pos = torch.as_tensor(np.asarray(rope_positions) if not isinstance(rope_positions, torch.Tensor)
                              else rope_positions, device=dev).long().clamp(min=0)
        bsz, nq = tok.shape
        pl_np = _host(prefix_lens).astype(np.int64)
        ql_np = _host(q_lens).astype(np.int64)
        rows = np.arange(nq)
        cache_pos = np.where(rows < ql_np[:, None], pl_np[:, None] + rows, -1)
        table, pl, ql = (self._table(block_table, "int32"), self._table(prefix_lens, "int32"),
                         self._table(q_lens, "int32"))
        mask = self._table(tree_mask, "uint32")
        live = torch.as_tensor(cache_pos >= 0, device=dev)[:, :, None, None]
        inner = self.model.model
        h = inner.embed_tokens(tok.clamp(min=0))
        attns = []
        for layer, mla, cache in zip(self.layers, self.adapters, caches):
            x = layer.input_layernorm(h)
            ckv, kpe = mla.latents(x, pos)
            wpos = cache_pos if self.kernels is None else torch.as_tensor(cache_pos, device=dev)
            wtab = table if self.kernels is None else table.long()
            write_kv(cache, wtab, wpos, ckv, kpe, kv_scale=self.kv_scale)
            q_nope, q_pe = mla.queries(x, pos, dtype=torch.float32 if self.kernels is None else torch.bfloat16)
            out = self._attend(mla, q_nope, q_pe, cache, table, pl, ql, mask)
            out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))   # rows >= q_len: 0
            a = mla.output(out).to(h.dtype)
            attns.append(a)
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(inner.norm(h)).float()
        return (logits, attns) if return_attention else logits

    def verify(self, tree, caches, block_table, prefix_lens, *, return_attention: bool = False):
        """Logits [B, N, V] of every node of the trees (a TreeBuildOutput, tree_record's or tree_build's, or anything
        with num_nodes, tokens, parents: [B], [B, N], [B, N]): rope position prefix_len + depth, mask from the parents
        (pack_tree_mask with the spec's W), node j's KV written at prefix_len + j of every layer's cache."""
        parents = tree.parents
        words = self.kernels.spec.mask_words if self.kernels is not None else None
        depths = tree_depths(parents)
        if isinstance(parents, torch.Tensor):
            pl = torch.as_tensor(prefix_lens, device=parents.device).long()
            mask = pack_tree_mask(parents, words, tree.num_nodes)
            pos = (pl[:, None] + depths.clamp(min=0))
        else:
            pl = _host(prefix_lens).astype(np.int64)
            mask = pack_tree_mask(np.asarray(parents), words, _host(tree.num_nodes))
            pos = pl[:, None] + np.maximum(depths, 0)
        return self.forward(tree.tokens, pos, caches, block_table, prefix_lens, tree.num_nodes, mask,
                            return_attention=return_attention)

    def prefill(self, tokens, caches, block_table, prefix_lens=None, chunk: int | None = None):
        """Write the KV of `tokens` [B, T] (one length for the batch) at cache positions prefix_lens + t (default 0)
        in chunks of at most `chunk` rows (default: the spec's N with kernels, 128 on the reference), each a chain
        (lower-triangular mask) over the cache; returns the logits [B, V] of the last token."""
        tok = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens).astype(np.int64)
        bsz, t = tok.shape
        start = np.zeros(bsz, np.int64) if prefix_lens is None else _host(prefix_lens).astype(np.int64)
        step = chunk or (self.kernels.spec.max_tree_size if self.kernels is not None else 128)
        words = self.kernels.spec.mask_words if self.kernels is not None else -(-step // 32)
        logits = None
        for c0 in range(0, t, step):
            c = min(step, t - c0)
            chain = np.tile(np.arange(-1, step - 1), (bsz, 1))
            mask = pack_tree_mask(chain, words)[:, :c] if c == step else pack_tree_mask(chain[:, :c], words)
            rows = np.zeros((bsz, c), np.int64) + np.arange(c)
            pl = (start + c0).astype(np.int32)
            logits = self.forward(tok[:, c0:c0 + c], pl[:, None] + rows, caches, block_table, pl,
                                  np.full(bsz, c, np.int32), mask)
        return logits[:, -1]

    def accept(self, tree, logits, caches, block_table, prefix_lens):
        """The engine's step end: target tokens = argmax of each node's logits, tree_accept's walk, then kv_commit of
        the accepted KV in every layer (the reference's, or the kernel set's). Returns the TreeAcceptOutput
        (accept_lens, accepted_nodes, out_tokens = accepted drafts + the bonus token, new_prefix_lens)."""
        target = logits.argmax(-1).to(torch.int32)
        if self.kernels is None:
            max_depth = int(np.max(_host(tree.depths))) if hasattr(tree, "depths") else tree.tokens.shape[1] - 1
            d = max(1, max_depth)
            rec = TreeBuildOutput(*[_host(f) if isinstance(f, torch.Tensor) else f for f in tree])
            acc = _reference.tree_accept(rec, target.cpu().numpy(), _host(prefix_lens), None, None, max_depth=d)
            _reference.kv_commit(acc, _host(prefix_lens), caches, np.asarray(block_table))
            return acc
        pl = self._table(prefix_lens, "int32")
        # a record of fewer rows than the spec's N (tree_record's of N' nodes) is padded to N as tree_build writes it:
        # the kernels' tree_accept takes [B, N] trees, the reference any N; numpy fields go to the device
        n = self.kernels.spec.max_tree_size
        padded = pad_tree(tree, n)
        rec = padded._replace(**{f: self._table(getattr(padded, f), "int32") for f in
                                 ("num_nodes", "tokens", "first_child", "next_sibling")})
        acc = self.kernels.tree_accept(rec, _pad_rows(target, n, -1).contiguous(), pl)
        self.kernels.kv_commit(acc, pl, caches, self._table(block_table, "int32"))
        return acc


def _host(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)

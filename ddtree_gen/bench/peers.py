"""The peers our kernels are timed against: what an engine runs today for the same work.

tree_build: cpu_heap_builder (plain-Python heapq). tree_verify: torch_peers (eager einsum + softmax, SDPA)
and flashmla_peers (FlashMLA's dense decode, and the split path FlashMLA + our tail + merge_states, when
`flash_mla` is importable). draft_topk: torch_topk (torch.topk + logsumexp). A whole step (bench step):
flashmla_decode, plain decoding's attention (FlashMLA at s_q = 1 in every layer).
"""
from __future__ import annotations

import heapq


def cpu_heap_builder(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget):
    """The CPU peer an engine would run today: a per-request heapq best-first builder in plain
    Python (lists, tuples, ints as bit masks), same algorithm and outputs as tree_build, with
    Python-float scores (the cost, not the rounding, is what this peer is for)."""
    ids, lps = topk_ids.tolist(), topk_logprobs.tolist()
    out = []
    for b in range(len(ids)):
        lp, tok_table = lps[b], ids[b]
        dmax, kmax = len(lp), len(lp[0])
        tokens, parents, depths, scores, masks = [int(root_tokens[b])], [-1], [0], [0.0], [1]
        heap = [(-lp[0][0], 0, 0, 1, 0)] if budget >= 1 else []
        created = 1
        while heap and len(tokens) <= budget:
            neg, _, parent, depth, rank = heapq.heappop(heap)
            i = len(tokens)
            tokens.append(tok_table[depth - 1][rank])
            parents.append(parent)
            depths.append(depth)
            scores.append(-neg)
            masks.append(masks[parent] | (1 << i))
            if rank + 1 < kmax:
                heapq.heappush(heap, (-(scores[parent] + lp[depth - 1][rank + 1]), created, parent, depth, rank + 1))
                created += 1
            if depth < dmax:
                heapq.heappush(heap, (neg - lp[depth][0], created, i, depth + 1, 0))
                created += 1
        out.append((tokens, parents, depths, scores, masks, int(prefix_lens[b])))
    return out


def torch_peers(x):
    """torch eager (bf16 einsum + fp32 masked softmax) and SDPA with a boolean mask, on the same data,
    with each request's keys gathered contiguously beforehand (not timed: favours the peers)."""
    import torch
    dl = torch.utils.dlpack.from_dlpack
    kv = dl(x["kv_cache"]).view(torch.bfloat16)
    table = dl(x["block_table"]).long()
    lens = dl(x["prefix_lens"]).long()
    q = torch.cat([dl(x["q_nope"]).view(torch.bfloat16), dl(x["q_pe"]).view(torch.bfloat16)], -1)
    b, nq, h, _ = q.shape
    r = x["q_nope"].shape[-1]
    page = kv.shape[1]
    t = int(lens.max()) + nq
    pos = torch.arange(t, device=q.device)
    keys = kv[table[:, pos // page], pos % page]                     # [B, T, R+P]
    words = dl(x["tree_mask"]).view(torch.int32).long() & 0xFFFFFFFF  # [B, Nq, W]
    j = pos[None, :] - lens[:, None]                                  # tail index per key
    jj = j.clamp(min=0, max=words.shape[-1] * 32 - 1)
    word = torch.gather(words, 2, (jj // 32)[:, None, :].expand(b, nq, t))
    tail_vis = ((word >> (jj % 32)[:, None, :]) & 1).bool() & (j >= 0)[:, None, :] & (j < nq)[:, None, :]
    vis = (j < 0)[:, None, :] | tail_vis                              # [B, Nq, T]
    vis &= (pos[None, :] < (lens + nq)[:, None])[:, None, :]
    scale = x["softmax_scale"]

    def eager():
        s = torch.einsum("bqhd,btd->bqht", q, keys).float() * scale
        s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        return torch.einsum("bqht,btd->bqhd", p.to(torch.bfloat16), keys[..., :r])

    qs = q.transpose(1, 2)                                            # [B, H, Nq, R+P]
    ks_ = keys[:, None].expand(b, h, t, keys.shape[-1])
    vs = keys[:, None, :, :r].expand(b, h, t, r)
    am = vis[:, None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, ks_, vs, attn_mask=am, scale=scale)

    return {"torch eager": eager, "torch SDPA": sdpa}


def flashmla_peers(ks, x):
    """FlashMLA's dense decode on the same inputs, when `flash_mla` is importable (needs.import_flash_mla: installed,
    or in the folder $DDTREE_GEN_FLASHMLA names; not a dependency; needs.FLASHMLA_HINT says how to get it): "FlashMLA dense" (cache_seqlens = L + Nq, no tree mask: our FLOPs without the mask) and
    "split: FlashMLA + tail + merge" (FlashMLA over the prefix, our tree_verify_tail, merge_states: the split
    path an engine can run today, with FlashMLA's [B, H, Nq] lse transposed for merge_states). {} without it.
    Returns {name: fn}; fn() returns (out, lse) in our layouts."""
    from ..needs import import_flash_mla
    try:
        flash_mla = import_flash_mla()
    except ImportError as e:
        print(f"FlashMLA peers skipped: {e}")
        return {}
    import torch
    dl = torch.utils.dlpack.from_dlpack
    qn, qp = dl(x["q_nope"]).view(torch.bfloat16), dl(x["q_pe"]).view(torch.bfloat16)
    q = torch.cat([qn, qp], -1).contiguous()                              # [B, Nq, H, R+P]: made once, not timed
    b, nq, h, r = qn.shape
    cache = dl(x["kv_cache"]).view(torch.bfloat16)
    kv = cache.view(cache.shape[0], cache.shape[1], 1, cache.shape[2])    # [num_pages, page, 1, R+P]
    table, lens = dl(x["block_table"]), dl(x["prefix_lens"])
    dense_lens = (lens + nq).to(torch.int32)
    scale = x["softmax_scale"]
    meta_dense, splits_dense = flash_mla.get_mla_metadata()
    meta_pre, splits_pre = flash_mla.get_mla_metadata()
    tail = ks.tree_verify_tail(**x)
    merged = ks.merge_states(tail.out, tail.lse, tail.out, tail.lse)       # output buffers of the split path

    import cupy

    def on_our_stream():   # FlashMLA launches on torch's current stream: make it CuPy's (the one being timed)
        return torch.cuda.stream(torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr))

    def dense():
        with on_our_stream():
            o, lse = flash_mla.flash_mla_with_kvcache(q, kv, table, dense_lens, r, meta_dense, splits_dense,
                                                      softmax_scale=scale, causal=False)
            return o, lse.transpose(1, 2)

    def split():
        with on_our_stream():
            po, plse = flash_mla.flash_mla_with_kvcache(q, kv, table, lens, r, meta_pre, splits_pre,
                                                        softmax_scale=scale, causal=False)
            t = ks.tree_verify_tail(**x, out=tail.out, lse=tail.lse)
            return ks.merge_states(po, plse.transpose(1, 2).contiguous(), t.out, t.lse, out=merged.out,
                                   lse=merged.lse)

    return {"FlashMLA dense (no mask)": dense, "split: FlashMLA + tail + merge": split}


def flashmla_decode(layers):
    """Plain decoding's attention, what a DDTree step is weighed against in `bench step`: FlashMLA's dense decode at
    s_q = 1 in every layer (`layers`: one tree_verify input dict a layer, its own cache): each request's first query
    row over its L + 1 keys (the new token written at position L), no mask. Returns (fn, None), fn() running every
    layer's call on CuPy's current stream (so a CUDA graph of it captures them), or (None, why) where flash_mla is not
    importable (needs.import_flash_mla)."""
    from ..needs import import_flash_mla
    try:
        flash_mla = import_flash_mla()
    except ImportError as e:
        return None, str(e).split(". ")[0]
    import cupy
    import torch
    dl = torch.utils.dlpack.from_dlpack
    calls = []
    meta, splits = flash_mla.get_mla_metadata()      # one shape in every layer: the scheduling is shared
    for x in layers:
        qn, qp = dl(x["q_nope"]).view(torch.bfloat16), dl(x["q_pe"]).view(torch.bfloat16)
        q = torch.cat([qn[:, :1], qp[:, :1]], -1).contiguous()              # [B, 1, H, R+P]
        cache = dl(x["kv_cache"]).view(torch.bfloat16)
        kv = cache.view(cache.shape[0], cache.shape[1], 1, cache.shape[2])  # [num_pages, page, 1, R+P]
        lens = (dl(x["prefix_lens"]) + 1).to(torch.int32)
        calls.append((q, kv, dl(x["block_table"]), lens, qn.shape[-1], x["softmax_scale"]))

    def every_layer():
        with torch.cuda.stream(torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr)):
            for q, kv, table, lens, r, scale in calls:
                flash_mla.flash_mla_with_kvcache(q, kv, table, lens, r, meta, splits, softmax_scale=scale,
                                                 causal=False)
    return every_layer, None


def torch_topk(logits, k: int):
    """draft_topk's peer (what engines run today): torch.topk + an fp32 logsumexp over the vocabulary, on
    bf16 logits [B, D', V]. Returns (ids, log-probs)."""
    import torch
    vals, idx = torch.topk(logits, k, dim=-1)
    return idx, vals.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)

"""tree_accept: walk the draft tree with the target's tokens and commit the accepted KV, one block per request."""
from __future__ import annotations

import numpy as np
import sympy

from .. import runtime as rt
from ..resources import D, N, P, PAGE, R, Plan
from ..types import TreeAcceptOutput
from . import KernelDef

ENTRY = R + P                          # bf16 per cache entry (latent, then rope)
CHUNKS = ENTRY / 8                     # 16-byte chunks per entry (R and P are multiples of 16)
NPAGES = sympy.ceiling((N - 2) / PAGE) + 1  # block-table entries covering positions [L+1, L+N-1]
I32_MAX = 2**31 - 1


def plan(spec) -> Plan:
    threads = 32 * sympy.ceiling(CHUNKS / 32)  # a thread per chunk column of an entry
    # struct TreeAcceptShared: staged source entries (D moves at most), move offsets (int64),
    # tree rows (tokens, first_child, next_sibling, target), block-table window, path, accept_len;
    # sizeof rounds up to the uint4 alignment of the staging buffer
    fields = 2 * D * ENTRY + 8 * D + 8 * D + 4 * 4 * N + 4 * NPAGES + 4 * (D + 1) + 4
    static_smem = 16 * sympy.ceiling(fields / 16)
    return Plan(kernel="tree_accept", spec=spec, threads=threads, min_blocks=4, static_smem=static_smem,
                consts={"ENTRY": ENTRY, "CHUNKS": CHUNKS, "NPAGES": NPAGES, "BATCH": sympy.Min(D, 16)})


def _to_host(a: rt.DevArray) -> np.ndarray:
    """A device array's values on the host (validate=True only; waits for the caller's stream)."""
    if a.kind == "torch":
        return a.obj.detach().cpu().numpy()
    import cupy
    return cupy.asnumpy(cupy.asarray(a.obj))


def _validate(spec, num_nodes, prefix, table, num_pages) -> None:
    """The checks of validate=True, on host copies: values the kernel would tolerate but not serve."""
    n, page = spec.max_tree_size, spec.page_size
    nn, pl, bt = _to_host(num_nodes), _to_host(prefix), _to_host(table)
    for b in range(nn.shape[0]):
        if not 1 <= nn[b] <= n:
            raise rt.ArgumentError(f"tree.num_nodes: request {b} has {int(nn[b])} nodes, outside [1, {n}]")
        hi = I32_MAX - spec.max_depth - 1
        if not 0 <= pl[b] <= hi:
            raise rt.ArgumentError(f"prefix_lens: request {b} has prefix_len {int(pl[b])}, outside [0, {hi}]")
        if nn[b] < 2:
            continue
        # the commit reads and writes positions prefix_len + 1 .. prefix_len + num_nodes - 1
        first, last = (int(pl[b]) + 1) // page, (int(pl[b]) + int(nn[b]) - 1) // page
        if last >= bt.shape[1]:
            raise rt.ArgumentError(f"block_table: request {b} needs page index {last} (positions up to "
                                   f"{int(pl[b]) + int(nn[b]) - 1}), but has {bt.shape[1]} columns")
        for idx in range(first, last + 1):
            if not 0 <= bt[b, idx] < num_pages:
                raise rt.ArgumentError(f"block_table: request {b}, page index {idx} holds {int(bt[b, idx])}, "
                                       f"outside [0, num_pages = {num_pages})")


def launch(kset, tree, target_tokens, prefix_lens, kv_cache, block_table, out=None,
           validate=False) -> TreeAcceptOutput:
    """Accept the longest matching path of each request's tree and commit its KV, on the current stream.

    `tree`: anything with num_nodes [B], tokens, first_child, next_sibling [B, N] int32 (e.g. the
    TreeBuildOutput of tree_build); target_tokens [B, N] int32; prefix_lens [B] int32; kv_cache
    [num_pages, page_size, R+P] bf16 (moved in place); block_table [B, max_pages] int32. Device values
    are not read on the host (the call can be captured in a CUDA graph) unless validate=True, which
    copies num_nodes, prefix_lens and block_table to the host and raises ArgumentError for values out
    of range. See DESIGN.md, tree_accept.
    """
    spec = kset.spec
    n, d1 = spec.max_tree_size, spec.max_depth + 1
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    fields = {}
    for name in ("num_nodes", "tokens", "first_child", "next_sibling"):
        if not hasattr(tree, name):
            raise rt.ArgumentError(f"tree: has no field {name!r} (expected the tree_build outputs)")
        fields[name] = getattr(tree, name)
    tokens = rt.device_array(fields["tokens"], "tree.tokens", dtype="int32", ndim=2)
    b = tokens.shape[0]
    if tokens.shape[1] != n:
        raise rt.ArgumentError(f"tree.tokens: N = {tokens.shape[1]} (dimension 1) must equal "
                               f"max_tree_size = {n}")
    num_nodes = rt.device_array(fields["num_nodes"], "tree.num_nodes", dtype="int32", shape=(b,))
    first = rt.device_array(fields["first_child"], "tree.first_child", dtype="int32", shape=(b, n))
    nxt = rt.device_array(fields["next_sibling"], "tree.next_sibling", dtype="int32", shape=(b, n))
    target = rt.device_array(target_tokens, "target_tokens", dtype="int32", shape=(b, n))
    prefix = rt.device_array(prefix_lens, "prefix_lens", dtype="int32", shape=(b,))
    kv = rt.device_array(kv_cache, "kv_cache", dtype="bf16", ndim=3)
    if kv.shape[1] != spec.page_size:
        raise rt.ArgumentError(f"kv_cache: page_size {kv.shape[1]} (dimension 1) must equal the spec's "
                               f"page_size = {spec.page_size}")
    if kv.shape[2] != width:
        raise rt.ArgumentError(f"kv_cache: entry width {kv.shape[2]} (dimension 2) must equal "
                               f"kv_lora_rank + qk_rope_head_dim = {width}")
    if kv.shape[0] > I32_MAX:
        raise rt.ArgumentError(f"kv_cache: {kv.shape[0]} pages, at most {I32_MAX}")
    if kv.ptr % 2:
        raise rt.ArgumentError("kv_cache: data pointer is not 2-byte aligned")
    table = rt.device_array(block_table, "block_table", dtype="int32", ndim=2)
    if table.shape[0] != b:
        raise rt.ArgumentError(f"block_table: {table.shape[0]} rows (dimension 0), expected batch size {b}")
    if table.shape[1] > I32_MAX:
        raise rt.ArgumentError(f"block_table: {table.shape[1]} columns, at most {I32_MAX}")
    rt.same_device(tokens, num_nodes, first, nxt, target, prefix, kv, table)
    shapes = {"accept_lens": ((b,), "int32"), "accepted_nodes": ((b, d1), "int32"),
              "out_tokens": ((b, d1), "int32"), "new_prefix_lens": ((b,), "int32")}
    if validate:
        _validate(spec, num_nodes, prefix, table, kv.shape[0])
    outs = rt.outputs(out, TreeAcceptOutput, shapes, like=tokens)
    if b:
        kset.launch("tree_accept", grid=(b,),
                    args=[num_nodes, tokens, first, nxt, target, prefix, kv, table,
                          rt.i32(kv.shape[0]), rt.i32(table.shape[1]), rt.i32(kv.ptr % 16 == 0), *outs],
                    like=tokens)
    return TreeAcceptOutput(*(o.obj for o in outs))


KERNELS = [KernelDef(name="tree_accept", template="tree_accept.cu.j2", entry="ddtree_tree_accept",
                     plan=plan, launch=launch)]

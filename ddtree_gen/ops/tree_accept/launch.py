"""tree_accept's launcher (walk the draft tree with the target's tokens and commit the accepted KV), its torch ops'
fakes and its declaration."""
from __future__ import annotations

import numpy as np

from ...launch import arrays as ar
from ... import reference
from ...errors import ArgumentError
from . import plan as plans
from ...build.declaration import Bundles, Declaration, TorchOp
from ...launch.runtime import IsAligned, Prepared, Step, run_call
from ...types import TreeAcceptOutput
from ...launch.checks import INT32_MAX, host_copy

_TREE = ("num_nodes", "tokens", "first_child", "next_sibling")
_INPUTS = (*(f"tree.{f}" for f in _TREE), "target_tokens", "prefix_lens", "kv_cache", "block_table")


def _output_shapes(b: int, d1: int) -> dict:
    """TreeAcceptOutput's fields: (shape, dtype) for B requests and D + 1 path columns."""
    return {"accept_lens": ((b,), "int32"), "accepted_nodes": ((b, d1), "int32"),
            "out_tokens": ((b, d1), "int32"), "new_prefix_lens": ((b,), "int32")}


def _validate(spec, num_nodes, prefix, table, num_pages) -> None:
    """The checks of validate=True, on host copies: values the kernel would tolerate but not serve
    (table None: the walk alone, no cache to check)."""
    n, page = spec.max_tree_size, spec.page_size
    nn, pl = host_copy(num_nodes), host_copy(prefix)
    bt = host_copy(table) if table is not None else None
    for b in range(nn.shape[0]):
        if not 1 <= nn[b] <= n:
            raise ArgumentError(f"tree.num_nodes: request {b} has {int(nn[b])} nodes, outside [1, {n}]")
        hi = INT32_MAX - spec.max_depth - 1
        if not 0 <= pl[b] <= hi:
            raise ArgumentError(f"prefix_lens: request {b} has prefix_len {int(pl[b])}, outside [0, {hi}]")
        if nn[b] < 2 or bt is None:
            continue
        # the commit reads and writes positions prefix_len + 1 .. prefix_len + num_nodes - 1
        first, last = (int(pl[b]) + 1) // page, (int(pl[b]) + int(nn[b]) - 1) // page
        if last >= bt.shape[1]:
            raise ArgumentError(f"block_table: request {b} needs page index {last} (positions up to "
                                f"{int(pl[b]) + int(nn[b]) - 1}), but has {bt.shape[1]} columns")
        for idx in range(first, last + 1):
            if not 0 <= bt[b, idx] < num_pages:
                raise ArgumentError(f"block_table: request {b}, page index {idx} holds {int(bt[b, idx])}, "
                                    f"outside [0, num_pages = {num_pages})")


def launch(kset, tree, target_tokens, prefix_lens, kv_cache=None, block_table=None, out=None,
           validate=False) -> TreeAcceptOutput:
    """Accept the longest matching path of each request's tree and commit its KV, on the current stream.

    `tree`: anything with num_nodes [B], tokens, first_child, next_sibling [B, N] int32 (e.g. the
    TreeBuildOutput of tree_build); target_tokens [B, N] int32; prefix_lens [B] int32; kv_cache
    [num_pages, page_size, R+P] bf16, or e4m3 bytes for an fp8 spec (uint8 / torch.float8_e4m3fn), moved
    in place; block_table [B, max_pages] int32. Device values
    are not read on the host (the call can be captured in a CUDA graph) unless validate=True, which
    copies num_nodes, prefix_lens and block_table to the host and raises ArgumentError for values out
    of range. See docs/contract.md, tree_accept.

    kv_cache=None and block_table=None: the walk alone (outputs only); kv_commit then moves the
    accepted entries of every layer in one launch (the engine path for a many-layer model).
    """
    try:
        fields = (tree.num_nodes, tree.tokens, tree.first_child, tree.next_sibling)   # _TREE
    except AttributeError:
        name = next(f for f in _TREE if not hasattr(tree, f))
        raise ArgumentError(f"tree: has no field {name!r} (expected the tree_build outputs)") from None
    given = ar.record_fields(out, TreeAcceptOutput) if out is not None else _NO_OUT
    return _run(kset, (*fields, target_tokens, prefix_lens, kv_cache, block_table, *given), out is not None,
                bool(validate))


_NO_OUT = (None,) * len(TreeAcceptOutput._fields)


def direct(kset, num_nodes, tokens, first_child, next_sibling, target_tokens, prefix_lens, kv_cache=None,
           block_table=None) -> TreeAcceptOutput:
    """launch(kset, tree, ...) with the tree's four arrays as arguments and no out= / validate (the torch ops'
    path: no record to build and read); the same checks and the same cached call signature."""
    return _run(kset, (num_nodes, tokens, first_child, next_sibling, target_tokens, prefix_lens, kv_cache,
                       block_table, *_NO_OUT), False, False)


def _run(kset, arrays, has_out, validate) -> TreeAcceptOutput:
    def prepare():
        return _prepare(kset, arrays, has_out, validate)
    return run_call(kset, prepare, arrays, (has_out,), cache=not validate)


def _prepare(kset, arrays, has_out, validate) -> Prepared:
    spec = kset.spec
    n, d1 = spec.max_tree_size, spec.max_depth + 1
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    tokens = ar.device_array(arrays[1], "tree.tokens", dtype="int32", ndim=2)
    b = tokens.shape[0]
    if tokens.shape[1] != n:
        raise ArgumentError(f"tree.tokens: N = {tokens.shape[1]} (dimension 1) must equal max_tree_size = {n}")
    num_nodes = ar.device_array(arrays[0], "tree.num_nodes", dtype="int32", shape=(b,))
    first = ar.device_array(arrays[2], "tree.first_child", dtype="int32", shape=(b, n))
    nxt = ar.device_array(arrays[3], "tree.next_sibling", dtype="int32", shape=(b, n))
    target = ar.device_array(arrays[4], "target_tokens", dtype="int32", shape=(b, n))
    prefix = ar.device_array(arrays[5], "prefix_lens", dtype="int32", shape=(b,))
    walk_only = arrays[6] is None and arrays[7] is None
    if walk_only:
        return _prepare_walk(kset, arrays, has_out, validate, tokens, num_nodes, first, nxt, target, prefix)
    if arrays[6] is None or arrays[7] is None:
        missing = "kv_cache" if arrays[6] is None else "block_table"
        raise ArgumentError(f"{missing}: required with the other (pass both for walk + commit, neither for "
                            f"the walk alone)")
    kv = ar.kv_array(arrays[6], "kv_cache", spec, ndim=3)
    if kv.shape[1] != spec.page_size:
        raise ArgumentError(f"kv_cache: page_size {kv.shape[1]} (dimension 1) must equal the spec's "
                            f"page_size = {spec.page_size}")
    if kv.shape[2] != width:
        raise ArgumentError(f"kv_cache: entry width {kv.shape[2]} (dimension 2) must equal "
                            f"kv_lora_rank + qk_rope_head_dim = {width}")
    if kv.shape[0] > INT32_MAX:
        raise ArgumentError(f"kv_cache: {kv.shape[0]} pages, at most {INT32_MAX}")
    table = ar.device_array(arrays[7], "block_table", dtype="int32", ndim=2)
    if table.shape[0] != b:
        raise ArgumentError(f"block_table: {table.shape[0]} rows (dimension 0), expected batch size {b}")
    if table.shape[1] > INT32_MAX:
        raise ArgumentError(f"block_table: {table.shape[1]} columns, at most {INT32_MAX}")
    device = ar.same_device({"tree.tokens": tokens, "tree.num_nodes": num_nodes, "tree.first_child": first,
                             "tree.next_sibling": nxt, "target_tokens": target, "prefix_lens": prefix,
                             "kv_cache": kv, "block_table": table})
    shapes = _output_shapes(b, d1)
    if validate:
        _validate(spec, num_nodes, prefix, table, kv.shape[0])
    first_out = len(_INPUTS)
    new = ar.record_outputs(arrays, first_out, shapes, has_out, "tree.tokens", tokens)
    outs = tuple(i for i, _, _ in new)
    # the kernel moves 16-byte chunks when the cache is 16-byte aligned, else single elements (bf16: 2 bytes,
    # which must then be 2-byte aligned; e4m3: bytes, any address)
    steps = (Step("tree_accept", (b,), (0, 1, 2, 3, 4, 5, 6, 7, np.int32(kv.shape[0]), np.int32(table.shape[1]),
                                        IsAligned(6, 16), *outs)),) if b else ()
    item = spec.kv_itemsize
    aligned = ((6, item, f"kv_cache: data pointer {{ptr:#x}} is not {item}-byte aligned"),) if item > 1 else ()
    return Prepared(device=device, kind=tokens.kind, steps=steps, new=new, aligned=aligned,
                    returns=(TreeAcceptOutput, tuple(range(first_out, first_out + len(TreeAcceptOutput._fields)))))


def _prepare_walk(kset, arrays, has_out, validate, tokens, num_nodes, first, nxt, target, prefix) -> Prepared:
    """The walk alone: outputs, no cache (the kernel reads neither kv_cache nor block_table)."""
    spec = kset.spec
    b, d1 = tokens.shape[0], spec.max_depth + 1
    device = ar.same_device({"tree.tokens": tokens, "tree.num_nodes": num_nodes, "tree.first_child": first,
                             "tree.next_sibling": nxt, "target_tokens": target, "prefix_lens": prefix})
    if validate:
        _validate(spec, num_nodes, prefix, None, 0)
    shapes = _output_shapes(b, d1)
    first_out = len(_INPUTS)
    new = ar.record_outputs(arrays, first_out, shapes, has_out, "tree.tokens", tokens)
    null = np.uint64(0)
    steps = (Step("tree_accept", (b,), (0, 1, 2, 3, 4, 5, null, null, np.int32(0), np.int32(0), np.int32(0),
                                        *(i for i, _, _ in new))),) if b else ()
    return Prepared(device=device, kind=tokens.kind, steps=steps, new=new,
                    returns=(TreeAcceptOutput, tuple(range(first_out, first_out + len(TreeAcceptOutput._fields)))))


def _walk_fake(spec, tokens):
    d1, b = spec.max_depth + 1, tokens.shape[0]
    return (tokens.new_empty((b,)), tokens.new_empty((b, d1)), tokens.new_empty((b, d1)), tokens.new_empty((b,)))


def torch_fake(spec, num_nodes, tokens, first_child, next_sibling, target_tokens, prefix_lens, kv_cache, block_table):
    """torch.ops.ddtree.tree_accept's fake (meta) implementation: the outputs' shapes, for torch.compile."""
    return _walk_fake(spec, tokens)


def walk_torch_fake(spec, num_nodes, tokens, first_child, next_sibling, target_tokens, prefix_lens):
    """torch.ops.ddtree.tree_walk's fake (meta) implementation."""
    return _walk_fake(spec, tokens)


DECLARATIONS = [Declaration(
    plans.KERNELS[0], launcher=launch, reference=reference.tree_accept, output=TreeAcceptOutput,
    torch_ops=(TorchOp("tree_accept(str spec, Tensor num_nodes, Tensor tokens, Tensor first_child, Tensor next_sibling, "
                       "Tensor target_tokens, Tensor prefix_lens, Tensor(a!) kv_cache, Tensor block_table) "
                       "-> (Tensor, Tensor, Tensor, Tensor)", fake=torch_fake, impl=direct),
               # the walk alone (no cache): kv_commit then moves every layer's entries
               TorchOp("tree_walk(str spec, Tensor num_nodes, Tensor tokens, Tensor first_child, Tensor next_sibling, "
                       "Tensor target_tokens, Tensor prefix_lens) -> (Tensor, Tensor, Tensor, Tensor)",
                       fake=walk_torch_fake, impl=direct)),
    sanitize=plans.sanitizer_cases,
    bundles=Bundles(plans.bundle_inputs, plans.BUNDLE_CASES, run=plans.bundle_run))]

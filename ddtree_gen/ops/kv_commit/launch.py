"""kv_commit's launcher: after the walk, move the accepted KV entries of every layer in one launch.

    acc = kset.tree_accept(tree, target_tokens, prefix_lens)          # the walk alone (no cache)
    kset.kv_commit(acc, prefix_lens, kv_caches, block_table)           # every layer, one launch

kv_caches: a sequence of per-layer caches (same shape [num_pages, page_size, R+P] bf16, or e4m3 bytes
for an fp8 spec: uint8 / torch.float8_e4m3fn; same dtype and device) or one stacked
[layers, num_pages, page_size, R+P] tensor; at most MAX_LAYERS layers, each 16-byte aligned. Per layer
the semantics are tree_accept's commit (docs/contract.md). Also its torch ops' fakes and its declaration.
"""
from __future__ import annotations

import numpy as np

from ...launch import arrays as ar
from ... import reference
from ...errors import ArgumentError
from . import plan as plans
from ...build.declaration import Bundles, Declaration, TorchOp
from .plan import MAX_LAYERS
from ...launch.runtime import ParamStruct, Prepared, Step, run_call
from ...launch.checks import INT32_MAX

_INPUTS = ("accept_lens", "accepted_nodes", "prefix_lens", "block_table")


def launch(kset, accepted, prefix_lens, kv_caches, block_table) -> None:
    """Commit the accepted path of each request (`accepted`: anything with accept_lens [B] and
    accepted_nodes [B, D+1] int32, e.g. tree_accept's output) in every layer's cache, on the current
    stream. prefix_lens [B] int32 are the lengths before the step; block_table [B, max_pages] int32.
    Device values are never read on the host (graph-capturable); any values are safe."""
    for name in ("accept_lens", "accepted_nodes"):
        if not hasattr(accepted, name):
            raise ArgumentError(f"accepted: has no field {name!r} (expected the tree_accept outputs)")
    return direct(kset, accepted.accept_lens, accepted.accepted_nodes, prefix_lens, kv_caches, block_table)


def direct(kset, accept_lens, accepted_nodes, prefix_lens, kv_caches, block_table) -> None:
    """launch() with the walk's two arrays as arguments (the torch op's path: no record to build and read)."""
    stacked = not isinstance(kv_caches, (list, tuple))
    arrays = ((accept_lens, accepted_nodes, prefix_lens, block_table, kv_caches) if stacked else
              (accept_lens, accepted_nodes, prefix_lens, block_table, *kv_caches))

    def prepare():
        return _prepare(kset, arrays, stacked)
    # the layers' signatures and pointers are read in one pass (runtime._group_signature)
    return run_call(kset, prepare, arrays, (stacked, len(arrays) - len(_INPUTS)),
                    group=None if stacked else len(_INPUTS))


def stacked(kset, accept_lens, accepted_nodes, prefix_lens, kv_cache, block_table) -> None:
    """direct() of the stacked form alone (the torch op kv_commit_stacked): kv_cache is one
    [layers, num_pages, page_size, R+P] array; a sequence of caches is refused, naming kv_cache."""
    if isinstance(kv_cache, (list, tuple)):
        raise ArgumentError(f"kv_cache: a {type(kv_cache).__name__} of {len(kv_cache)} caches, expected one "
                            f"[layers, num_pages, page_size, R+P] array (stack the layers, or pass the list to "
                            f"kv_commit)")
    arrays = (accept_lens, accepted_nodes, prefix_lens, block_table, kv_cache)

    def prepare():
        return _prepare(kset, arrays, True, "kv_cache")
    return run_call(kset, prepare, arrays, (True, 1))


def _prepare(kset, arrays, stacked, name="kv_caches") -> Prepared:
    """`name`: the stacked array's name in the messages (kv_caches of kv_commit, kv_cache of its stacked op)."""
    spec = kset.spec
    d1, width = spec.max_depth + 1, spec.kv_lora_rank + spec.qk_rope_head_dim
    lens = ar.device_array(arrays[0], "accepted.accept_lens", dtype="int32", ndim=1)
    b = lens.shape[0]
    nodes = ar.device_array(arrays[1], "accepted.accepted_nodes", dtype="int32", shape=(b, d1))
    prefix = ar.device_array(arrays[2], "prefix_lens", dtype="int32", shape=(b,))
    table = ar.device_array(arrays[3], "block_table", dtype="int32", ndim=2)
    if table.shape[0] != b:
        raise ArgumentError(f"block_table: {table.shape[0]} rows (dimension 0), expected batch size {b}")
    named = {"accepted.accept_lens": lens, "accepted.accepted_nodes": nodes, "prefix_lens": prefix,
             "block_table": table}
    first = len(_INPUTS)
    if stacked:
        kv = ar.kv_array(arrays[first], name, spec, ndim=None)
        if len(kv.shape) != 4:
            raise ArgumentError(f"{name}: {len(kv.shape)} dimensions {kv.shape}, expected 4: [layers, num_pages, "
                                f"page_size, R+P]" + (" (one layer's cache: add a leading dimension of 1)"
                                                      if len(kv.shape) == 3 else ""))
        num_layers, layer_shape = kv.shape[0], kv.shape[1:]
        layer_bytes = int(np.prod(layer_shape)) * spec.kv_itemsize
        slots = [(first, layer * layer_bytes) for layer in range(num_layers)]
        named[name] = kv
        where = name
    else:
        if not arrays[first:]:
            raise ArgumentError("kv_caches: an empty sequence; pass every layer's cache")
        caches = []
        for layer, x in enumerate(arrays[first:]):
            caches.append(ar.kv_array(x, f"kv_caches[{layer}]", spec, ndim=3))
            if caches[-1].dtype != caches[0].dtype:
                raise ArgumentError(f"kv_caches[{layer}]: dtype {caches[-1].dtype}, but kv_caches[0] has "
                                    f"{caches[0].dtype} (every layer's cache must have the same dtype)")
            if caches[-1].shape != caches[0].shape:
                raise ArgumentError(f"kv_caches[{layer}]: shape {caches[-1].shape}, but kv_caches[0] has "
                                    f"{caches[0].shape} (every layer's cache must have the same shape)")
            named[f"kv_caches[{layer}]"] = caches[-1]
        num_layers, layer_shape = len(caches), caches[0].shape
        slots = [first + layer for layer in range(num_layers)]
        where = "kv_caches[0]"
    num_pages, page, row = layer_shape
    if page != spec.page_size:
        raise ArgumentError(f"{where}: page_size {page} must equal the spec's page_size = {spec.page_size}")
    if row != width:
        raise ArgumentError(f"{where}: entry width {row} must equal kv_lora_rank + qk_rope_head_dim = {width}")
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ArgumentError(f"{name if stacked else 'kv_caches'}: {num_layers} layers, must be in "
                            f"[1, {MAX_LAYERS}]")
    if num_pages > INT32_MAX or table.shape[1] > INT32_MAX:
        raise ArgumentError(f"{where}: {num_pages} pages and block_table {table.shape[1]} columns must be < 2**31")
    device = ar.same_device(named)
    # every layer's cache is moved in 16-byte chunks: its pointer must be 16-byte aligned
    aligned = tuple((s if isinstance(s, int) else s[0], 16,
                     f"{name if stacked else f'kv_caches[{k}]'}: data pointer {{ptr:#x}} is not 16-byte aligned "
                     f"(the commit moves 16-byte chunks)") for k, s in enumerate(slots[:1] if stacked else slots))
    layers = ParamStruct((*slots, *(np.uint64(0),) * (MAX_LAYERS - num_layers)))   # struct LayerCaches, by value
    steps = (Step("kv_commit", (b, num_layers), (0, 1, 2, 3, layers, np.int32(num_pages),
                                                 np.int32(table.shape[1]))),) if b else ()
    return Prepared(device=device, kind=lens.kind, steps=steps, aligned=aligned, returns=(None, ()))


def torch_fake(spec, accept_lens, accepted_nodes, prefix_lens, kv_caches, block_table):
    """torch.ops.ddtree.kv_commit's fake (meta) implementation: no outputs."""
    return None


def stacked_torch_fake(spec, accept_lens, accepted_nodes, prefix_lens, kv_cache, block_table):
    """torch.ops.ddtree.kv_commit_stacked's fake: no outputs; a kv_cache of another rank is refused when traced, as the
    launcher refuses it."""
    if kv_cache.dim() != 4:
        raise ArgumentError(f"kv_cache: {kv_cache.dim()} dimensions {tuple(kv_cache.shape)}, expected 4: [layers, "
                            f"num_pages, page_size, R+P]")
    return None


DECLARATIONS = [Declaration(
    plans.KERNELS[0], launcher=launch, reference=reference.kv_commit,
    torch_ops=(TorchOp("kv_commit(str spec, Tensor accept_lens, Tensor accepted_nodes, Tensor prefix_lens, "
                       "Tensor(a!)[] kv_caches, Tensor block_table) -> ()", fake=torch_fake, impl=direct),
               # the layers as one [layers, num_pages, page_size, R+P] tensor: no list for the dispatcher to convert
               TorchOp("kv_commit_stacked(str spec, Tensor accept_lens, Tensor accepted_nodes, Tensor prefix_lens, "
                       "Tensor(a!) kv_cache, Tensor block_table) -> ()", fake=stacked_torch_fake, impl=stacked)),
    sanitize=plans.sanitizer_cases,
    bundles=Bundles(plans.bundle_inputs, plans.BUNDLE_CASES, run=plans.bundle_run),
    missing={"output": "none: it moves the caches in place and returns None"})]

"""tree_build's launcher (best-first DDTree draft-tree expansion, one warp per request), its torch op's fake and its
declaration."""
from __future__ import annotations

import numpy as np

from ...launch import arrays as ar
from ... import reference
from ...errors import ArgumentError
from . import plan as plans
from ...build.declaration import Bundles, Declaration, TorchOp
from ...launch.runtime import Prepared, Step, run_call
from ...types import TreeBuildOutput

_INPUTS = ("topk_ids", "topk_logprobs", "root_tokens", "prefix_lens")


def launch(kset, topk_ids, topk_logprobs, root_tokens, prefix_lens, budget, out=None) -> TreeBuildOutput:
    """Build one draft tree per request on the current stream. See docs/contract.md, tree_build."""
    given = ar.record_fields(out, TreeBuildOutput) if out is not None else (None,) * len(TreeBuildOutput._fields)
    arrays = (topk_ids, topk_logprobs, root_tokens, prefix_lens, *given)

    def prepare():
        return _prepare(kset, arrays, budget, out is not None)
    return run_call(kset, prepare, arrays, (type(budget), budget, out is not None))


def _prepare(kset, arrays, budget, has_out) -> Prepared:
    spec = kset.spec
    n, w = spec.max_tree_size, spec.mask_words
    ids = ar.device_array(arrays[0], "topk_ids", dtype="int32", ndim=3)
    b, dp, kp = ids.shape
    lps = ar.device_array(arrays[1], "topk_logprobs", dtype="float32", shape=(b, dp, kp))
    roots = ar.device_array(arrays[2], "root_tokens", dtype="int32", shape=(b,))
    prefix = ar.device_array(arrays[3], "prefix_lens", dtype="int32", shape=(b,))
    device = ar.same_device({"topk_ids": ids, "topk_logprobs": lps, "root_tokens": roots, "prefix_lens": prefix})
    if not 1 <= dp <= spec.max_depth:
        raise ArgumentError(f"topk_ids: D' = {dp} (dimension 1) must be in [1, max_depth = {spec.max_depth}]")
    if not 1 <= kp <= n - 1:
        raise ArgumentError(f"topk_ids: K' = {kp} (dimension 2) must be in [1, max_tree_size - 1 = {n - 1}]")
    budget = ar.int_arg(budget, "budget", lo=0, hi=n - 1)
    shapes = {"num_nodes": ((b,), "int32"), "tokens": ((b, n), "int32"), "parents": ((b, n), "int32"),
              "depths": ((b, n), "int32"), "positions": ((b, n), "int32"), "scores": ((b, n), "float32"),
              "tree_mask": ((b, n, w), "uint32"), "first_child": ((b, n), "int32"),
              "next_sibling": ((b, n), "int32")}
    first_out = len(_INPUTS)
    new = ar.record_outputs(arrays, first_out, shapes, has_out, "topk_ids", ids)
    outs = tuple(i for i, _, _ in new)
    steps = (Step("tree_build", (b,), (0, 1, 2, 3, np.int32(dp), np.int32(kp), np.int32(budget), *outs)),) if b else ()
    return Prepared(device=device, kind=ids.kind, steps=steps, new=new,
                    returns=(TreeBuildOutput, tuple(range(first_out, first_out + len(TreeBuildOutput._fields)))))


def torch_fake(spec, topk_ids, topk_logprobs, root_tokens, prefix_lens, budget):
    """torch.ops.ddtree.tree_build's fake (meta) implementation: the outputs' shapes, for torch.compile."""
    import torch
    n, w = spec.max_tree_size, spec.mask_words
    b = topk_ids.shape[0]
    i32 = dict(dtype=torch.int32)
    return (topk_ids.new_empty((b,), **i32), *(topk_ids.new_empty((b, n), **i32) for _ in range(4)),
            topk_ids.new_empty((b, n), dtype=torch.float32), topk_ids.new_empty((b, n, w), dtype=torch.uint32),
            topk_ids.new_empty((b, n), **i32), topk_ids.new_empty((b, n), **i32))


DECLARATIONS = [Declaration(
    plans.KERNELS[0], launcher=launch, reference=reference.tree_build, output=TreeBuildOutput,
    torch_ops=(TorchOp("tree_build(str spec, Tensor topk_ids, Tensor topk_logprobs, Tensor root_tokens, "
                       "Tensor prefix_lens, int budget) -> (" + ", ".join(["Tensor"] * 9) + ")", fake=torch_fake),),
    sanitize=plans.sanitizer_cases,
    bundles=Bundles(plans.bundle_inputs, plans.BUNDLE_CASES, run=plans.bundle_run))]

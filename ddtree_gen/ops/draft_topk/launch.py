"""draft_topk's launcher: from the drafter's logits to tree_build's top-k table (docs/contract.md section 5a).

    top = kset.draft_topk(logits, k)                           # DraftTopkOutput(topk_ids, topk_logprobs)
    tree = kset.tree_build(*top, root_tokens, prefix_lens, budget)

One entry point, launched once (a row of one chunk: V <= 16384 bf16 / 8192 float32 logits) or twice:
stage 0, one block per chunk of a row, writes each chunk's top-k and (max, sum) to a workspace; stage 1,
one block per row, merges them. The "rows" build (schedule="rows") launches stage 2 once instead, one block per
row, where there are at least ROWS_PER_SM rows an SM and a row holds at least ROWS_MIN_CHUNKS chunks (then no
workspace is used); the "chunks" build (ops/draft_topk/plan.SCHEDULES) always launches stages 0 and 1. Nothing is read on
the host (graph-capturable).
"""
from __future__ import annotations

import numpy as np

from ...launch import arrays as ar
from ... import reference
from . import plan as plans
from ...build.declaration import Bundles, Declaration, TorchOp
from ...errors import ArgumentError
from .plan import CHUNK, CMAX, MAX_VOCAB, chunks
from ...reference import DraftTopkOutput, temperature_arg
from ...launch.runtime import IsAligned, Prepared, Step, run_call, sm_count
from ...launch.checks import INT32_MAX

KERNEL = "draft_topk"
# the rows build streams a row per block (stage 2) where the rows are at least ROWS_PER_SM x SMs (198 on an H200: B >= 14
# at D' = 15), and runs the chunks schedule's stages 0 and 1 below that (fewer rows than SMs leave SMs idle; measured
# crossover, docs/perf/journal-kernels.md "The end of a row selected by the block": B = 16 streams faster, B = 8 does not)
ROWS_PER_SM = 1.5
# ... and a row of at least ROWS_MIN_CHUNKS chunks (128 KB of logits): a row of 1-3 chunks streams slower than the chunks
# schedule takes it (V = 16384 / 32768 / 49152 bf16 at B = 16: 1.23 / 1.01 / 1.02x of its time, 20011 float32 1.12x;
# 4 chunks 0.84-1.02x, 5-8 chunks 0.82-0.93x: docs/perf/journal-kernels.md "draft_topk's switch at small V")
ROWS_MIN_CHUNKS = 4
WS = 3                              # the workspace's index in the call's array list
_VEC = {"bf16": 8, "float32": 4}    # logits per 16-byte load


def workspace_elems(b: int, dp: int, v: int, k: int, dtype: str = "bf16") -> int:
    """int32 elements of the workspace of one call (0: a row of one chunk needs none): per row and chunk,
    k 8-byte candidates and a (max, sum) float pair."""
    c = chunks(v, dtype)
    return 0 if c <= 1 else 2 * b * dp * c * (k + 1)


def launch(kset, logits, k, temperature=1.0, out=None, *, workspace=None) -> DraftTopkOutput:
    """The top-k tokens of each row of `logits` [B, D', V] (bf16 or float32) by descending logit (equal
    logits lowest id first, NaN as -inf) and their log-softmax over the row, on the current stream. See
    docs/contract.md, draft_topk."""
    given = ar.record_fields(out, DraftTopkOutput) if out is not None else (None, None)
    arrays = (logits, *given, workspace)

    def prepare():
        return _prepare(kset, arrays, k, temperature, out is not None)
    return run_call(kset, prepare, arrays, (type(k), k, type(temperature), temperature, out is not None))


def _prepare(kset, arrays, k, temperature, has_out) -> Prepared:
    spec = kset.spec
    if arrays[0] is None:
        raise ArgumentError("logits: required, got None")
    dtype = ar.view(arrays[0], "logits")[0].dtype
    if dtype not in _VEC:
        raise ArgumentError(f"logits: dtype {dtype}, expected bf16 (uint16 bits on CuPy, torch.bfloat16 on torch) "
                            f"or float32")
    lg = ar.device_array(arrays[0], "logits", dtype=dtype, ndim=3)
    b, dp, v = lg.shape
    if not 1 <= dp <= spec.max_depth:
        raise ArgumentError(f"logits: D' = {dp} (dimension 1) must be in [1, max_depth = {spec.max_depth}]")
    if not 1 <= v <= MAX_VOCAB:
        raise ArgumentError(f"logits: V = {v} (dimension 2) must be in [1, {MAX_VOCAB}]")
    k = ar.int_arg(k, "k", lo=1, hi=spec.max_tree_size - 1)
    if k > v:
        raise ArgumentError(f"k: {k} is larger than the vocabulary, V = {v} (logits dimension 2)")
    _, inv_t, c = temperature_arg(temperature)
    rows, ch = b * dp, chunks(v, dtype)
    assert ch <= CMAX
    if rows * ch > INT32_MAX:
        raise ArgumentError(f"logits: {rows} rows of {ch} chunks are too many for one launch")
    shapes = {"topk_ids": ((b, dp, k), "int32"), "topk_logprobs": ((b, dp, k), "float32")}
    new = list(ar.record_outputs(arrays, 1, shapes, has_out, "logits", lg))
    named = {"logits": lg}
    # the rows build: one block per row where there are ROWS_PER_SM rows an SM and a row holds ROWS_MIN_CHUNKS chunks
    # (no workspace then), else its copy of the chunks schedule
    consts = kset.constants(KERNEL, lg.device)
    rows_path = (rows > 0 and bool(consts.get("ROWS")) and rows >= ROWS_PER_SM * sm_count(lg.device)
                 and ch >= ROWS_MIN_CHUNKS)
    need = 0 if rows_path else workspace_elems(b, dp, v, k, dtype)
    aligned = []
    # a given workspace is checked (kind, int32) also where this call does not use it (contract 5a's errors): a wrong
    # dtype is the caller's mistake whatever the launch, not one that shows up only at another batch or V
    wa = ar.device_array(arrays[WS], "workspace", dtype="int32", ndim=None) if arrays[WS] is not None else None
    if need and wa is not None:
        size = int(np.prod(wa.shape))
        if size < need:
            raise ArgumentError(f"workspace: {size} int32 elements, this call needs {need} "
                                f"(draft_topk.workspace_elems(B, D', V, k, dtype))")
        named["workspace"] = wa
        aligned.append((WS, 8, "workspace: data pointer {ptr:#x} is not 8-byte aligned"))
    elif need:
        new.append((WS, (need,), "int32"))
    device = ar.same_device(named)
    # outputs the caller gave must not overlap the logits or each other (new ones cannot)
    out_bytes = {0: lg.nbytes, 1: rows * k * 4, 2: rows * k * 4, WS: need * 4}
    names = {0: "logits", 1: "out.topk_ids", 2: "out.topk_logprobs", WS: "workspace"}
    given_ix = [i for i in (0, 1, 2, WS) if arrays[i] is not None and out_bytes[i]]
    disjoint = [(a, out_bytes[a], i, out_bytes[i], False, f"{names[i]}: overlaps {names[a]}")
                for n, i in enumerate(given_ix) for a in given_ix[:n]]
    vec = IsAligned(0, 16) if v % _VEC[dtype] == 0 else np.int32(0)
    keys, ms = ((WS, 0), (WS, rows * ch * k * 8)) if need else (np.uint64(0), np.uint64(0))
    common = (0, np.int32(v), np.int32(k), np.int32(ch), np.int32(dtype == "bf16"), vec, np.float32(inv_t),
              np.float32(c), keys, ms, 2, 1)
    steps = []
    if rows_path:
        steps.append(Step(KERNEL, (rows,), (*common, np.int32(2))))
    elif rows:
        steps.append(Step(KERNEL, (rows * ch,), (*common, np.int32(0))))
        if ch > 1:
            steps.append(Step(KERNEL, (rows,), (*common, np.int32(1))))
    return Prepared(device=device, kind=lg.kind, steps=tuple(steps), new=tuple(new), aligned=tuple(aligned),
                    disjoint=tuple(disjoint), returns=(DraftTopkOutput, (1, 2)))


def torch_fake(spec, logits, k, temperature=1.0):
    """torch.ops.ddtree.draft_topk's fake (meta) implementation: the outputs' shapes, for torch.compile."""
    import torch
    b, dp = logits.shape[:2]
    return (logits.new_empty((b, dp, k), dtype=torch.int32), logits.new_empty((b, dp, k), dtype=torch.float32))


DECLARATIONS = [Declaration(
    plans.KERNELS[0], launcher=launch, reference=reference.draft_topk, output=DraftTopkOutput,
    torch_ops=(TorchOp("draft_topk(str spec, Tensor logits, int k, float temperature=1.0) -> (Tensor, Tensor)",
                       fake=torch_fake),),
    sanitize=plans.sanitizer_cases,
    bundles=Bundles(plans.bundle_inputs, plans.BUNDLE_CASES))]


__all__ = ["launch", "workspace_elems", "CHUNK"]

"""kv_dequant's launcher: the dequantize pre-pass of an fp8 spec's tree_verify(fp8_path="dequant").

    dq = kset.kv_dequant(kv_cache, block_table, prefix_lens, q_lens)   # -> KvDequantOutput(kv_cache, block_table)

converts the e4m3 pages each request's keys t < prefix_len + q_len lie in into a bf16 cache [B * max_pages,
page_size, R + P] (request b's page j at b * max_pages + j; unscaled, exact, NaN bytes -> NaN) and writes its block
table ([B, max_pages]: that page, or -1 where tree_verify would not read the page): a bf16 paged cache that
tree_verify reads as it reads the e4m3 one (docs/contract.md 4b; reference.kv_dequant is the bit-exact oracle).
tree_verify(fp8_path="dequant") runs the same step (dequant_step) into its kv_workspace and then the bf16-cache
seesaw; this launcher is that step alone. Device values are never read on the host (graph-capturable); any values
are safe (pages outside [0, num_pages) are not read).
"""
from __future__ import annotations

import numpy as np

from ...launch import arrays as ar
from ... import reference
from . import plan as plans
from ...build.declaration import Bundles, Declaration
from ...errors import ArgumentError
from ...reference import KvDequantOutput
from ...launch.runtime import Prepared, Step, run_call
from ...launch.checks import INT32_MAX, PointerChecks, check_outputs

KERNEL = "kv_dequant"
READER = "kv_dequant kernel"     # in alignment messages
_INDEX = {name: i for i, name in enumerate(("kv_cache", "block_table", "prefix_lens", "q_lens", "out.kv_cache",
                                            "out.block_table"))}


def launch(kset, kv_cache, block_table, prefix_lens, q_lens, out=None) -> KvDequantOutput:
    """The bf16 copy of the e4m3 pages a tree_verify call of these lengths reads, and its block table, on the current
    stream (see the module docstring). out: a KvDequantOutput (or anything with its fields) to write into; pages
    not converted keep their contents there (in a new one they are uninitialised)."""
    given = ar.record_fields(out, KvDequantOutput) if out is not None else (None, None)
    arrays = (kv_cache, block_table, prefix_lens, q_lens, *given)

    def prepare():
        return _prepare(kset, arrays, out is not None)
    return run_call(kset, prepare, arrays, (out is not None,))


def check_inputs(spec, kv_cache, block_table, prefix_lens, q_lens) -> dict:
    """The pre-pass's inputs as DevArrays (the cache: the spec's e4m3 bytes, 16-byte aligned: checked by the
    caller's PointerChecks or here)."""
    if not spec.kv_fp8:
        raise ArgumentError(f"kv_cache: spec {spec.name!r} has kv_dtype {spec.kv_dtype!r}; kv_dequant converts an "
                            f"fp8 (kv_dtype 'fp8_e4m3') cache")
    kv = ar.kv_array(kv_cache, "kv_cache", spec, ndim=3)
    num_pages, page, row = kv.shape
    if page != spec.page_size:
        raise ArgumentError(f"kv_cache: page_size = {page} (dimension 1) must equal page_size = {spec.page_size} of "
                            f"spec {spec.name!r}")
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    if row != width:
        raise ArgumentError(f"kv_cache: row width {row} (dimension 2) must equal kv_lora_rank + qk_rope_head_dim "
                            f"= {width} of spec {spec.name!r}")
    bt = ar.device_array(block_table, "block_table", dtype="int32", ndim=2)
    b = bt.shape[0]
    pl = ar.device_array(prefix_lens, "prefix_lens", dtype="int32", shape=(b,))
    ql = ar.device_array(q_lens, "q_lens", dtype="int32", shape=(b,))
    if num_pages > INT32_MAX:
        raise ArgumentError(f"kv_cache: {num_pages} pages must be < 2**31")
    check_workspace_pages(spec, b, bt.shape[1])
    return {"kv_cache": kv, "block_table": bt, "prefix_lens": pl, "q_lens": ql}


def check_workspace_pages(spec, b: int, max_pages: int) -> None:
    """The workspace's B * max_pages pages (and their rows, page_size each) must have 32-bit indices."""
    if b * max_pages * spec.page_size > INT32_MAX:
        raise ArgumentError(f"block_table: {b} requests x {max_pages} pages x page_size {spec.page_size} = "
                            f"{b * max_pages * spec.page_size} workspace rows must be < 2**31 (32-bit row indices)")


def dequant_grid(consts: dict, b: int, max_pages: int) -> int:
    """Blocks of the pre-pass's launch for the build's template constants (ops/kv_dequant/plan.plan): the work units,
    B x max_pages x PARTS, one block each."""
    units = b * max_pages * int(consts.get("PARTS", 1))
    if units > INT32_MAX:
        raise ArgumentError(f"block_table: {b} requests x {max_pages} pages x {consts.get('PARTS', 1)} parts = "
                            f"{units} blocks are too many for one launch of kv_dequant")
    return units


def dequant_step(kv, table, prefix, qlens, ws_kv, ws_table, b: int, max_pages: int, num_pages: int,
                 consts: dict) -> Step:
    """The pre-pass's launch (dequant_grid: consts are the loaded build's template constants); the arguments are
    the call's array indices (or (index, byte offset) pairs) of the e4m3 cache, its block table, the lengths and the
    two outputs."""
    return Step(KERNEL, (dequant_grid(consts, b, max_pages),),
                (kv, table, prefix, qlens, ws_kv, ws_table, np.int32(num_pages), np.int32(max_pages), np.int32(b)))


def _prepare(kset, arrays, has_out) -> Prepared:
    spec = kset.spec
    inputs = check_inputs(spec, *arrays[:4])
    kv, bt = inputs["kv_cache"], inputs["block_table"]
    num_pages, page, row = kv.shape
    b, max_pages = bt.shape
    shapes = {"kv_cache": ((b * max_pages, page, row), "bf16"), "block_table": ((b, max_pages), "int32")}
    new = ar.record_outputs(arrays, 4, shapes, has_out, "kv_cache", kv)
    device = ar.same_device(inputs)
    ptrs = PointerChecks(_INDEX)
    ptrs.align(kv, "kv_cache", 16, READER)
    if has_out:
        outs = {"out.kv_cache": ar.view(arrays[4], "out.kv_cache")[0],
                "out.block_table": ar.view(arrays[5], "out.block_table")[0]}
        ptrs.align(outs["out.kv_cache"], "out.kv_cache", 16, READER, access="writes")
        check_outputs(ptrs, inputs, outs)
    consts = kset.constants(KERNEL, device)
    steps = ((dequant_step(0, 1, 2, 3, 4, 5, b, max_pages, num_pages, consts),)
             if b * max_pages else ())
    return Prepared(device=device, kind=kv.kind, steps=steps, new=new, aligned=tuple(ptrs.aligned),
                    disjoint=tuple(ptrs.disjoint), returns=(KvDequantOutput, (4, 5)))


DECLARATIONS = [Declaration(
    plans.KERNELS[0], launcher=launch, reference=reference.kv_dequant, output=KvDequantOutput,
    sanitize=plans.sanitizer_cases, bundles=Bundles(plans.bundle_inputs, plans.BUNDLE_CASES),
    missing={"torch_ops": "a step of tree_verify(fp8_path='dequant'), whose torch op takes fp8_path; not an op of "
                          "its own"})]


__all__ = ["launch", "dequant_grid", "dequant_step", "check_inputs", "check_workspace_pages"]

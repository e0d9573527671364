"""kv_dequant: the dequantize pre-pass of an fp8 spec's tree_verify(fp8_path="dequant") (docs/contract.md 4b).

Per call it converts the e4m3 pages of the cache that each request's keys t < prefix_len + q_len lie in (tree_verify's
range) into a bf16 workspace laid out as a paged bf16 cache, [B * max_pages, page_size, R + P], request b's page j at
workspace page b * max_pages + j, and writes the workspace's block table ([B, max_pages]: that page, or -1 where
tree_verify would not read the page). tree_verify_wgmma_dequant (plans/tree_verify_wgmma.py: the bf16-cache seesaw
built for the fp8 spec) then reads the workspace, with kv_scale applied in fp32 as in the fused fp8 kernel.

One block of THREADS per (request, page index); 16-byte loads of the e4m3 bytes, 16-byte stores of the bf16.
"""
from __future__ import annotations

import numpy as np
import sympy

from ..fp8 import from_float
from ..resources import P, PAGE, R, Plan
from .declaration import Bundles, Declaration
from .kernel_def import KernelDef

THREADS = 256
CHUNKS = PAGE * (R + P) / 16     # 16-byte e4m3 chunks per page (R, P multiples of 16: whole)


def plan(spec) -> Plan:
    return Plan(kernel="kv_dequant", spec=spec, threads=sympy.Integer(THREADS), min_blocks=4,
                static_smem=sympy.Integer(0), consts={"CHUNKS": CHUNKS})


def workspace_layout(spec, b: int, max_pages: int) -> tuple[int, int, int]:
    """(pages, byte offset of the block table, bf16 elements) of the workspace of a call of B requests and max_pages
    block-table columns: the pages, B * max_pages (at least one) of page_size * (R + P) bf16 each, then the block
    table's B * max_pages int32 (two bf16 slots each): B * max_pages * (page_size * (R + P) * 2 + 4) bytes."""
    pages = max(b * max_pages, 1)
    page_elems = spec.page_size * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    return pages, pages * page_elems * 2, pages * page_elems + 2 * b * max_pages


def workspace_elems(spec, b: int, max_pages: int) -> int:
    """bf16 elements of tree_verify(fp8_path="dequant")'s kv_workspace (workspace_layout)."""
    return workspace_layout(spec, b, max_pages)[2]


KERNELS = [KernelDef(name="kv_dequant", template="kv_dequant.cu.j2", entry="ddtree_kv_dequant", plan=plan,
                     kv_dtypes=("fp8_e4m3",))]


def _e4m3(rng, shape) -> np.ndarray:
    """e4m3 bytes of normal samples (no NaN), through ml_dtypes."""
    return from_float(rng.standard_normal(shape).astype(np.float32))


def bundle_inputs(spec, rng, case) -> dict:
    """The inputs of refs/<spec>/kv_dequant-<case>.kdtr, "pages": three requests of two page indices over a cache of
    four pages: one whose keys end inside its second page, one whose first entry is outside the cache (-1) and whose
    second page lies past its keys, one that tree_verify does not serve (q_len 0); every byte value (NaN included)
    in a converted page and in one that is not. (Every spec has them: the reference is defined for any shape; the
    kernel is built for the fp8 specs.)"""
    page, row = spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim
    kv = _e4m3(rng, (4, page, row))
    kv[3].reshape(-1)[:256] = np.arange(256, dtype=np.uint8)   # request 0's first page: converted
    kv[0].reshape(-1)[:256] = np.arange(256, dtype=np.uint8)   # request 2's: not converted (q_len 0)
    return {"kv_cache": kv, "block_table": np.array([[3, 1], [-1, 2], [0, 9]], np.int32),
            "prefix_lens": np.array([page + 1, 3, 5], np.int32), "q_lens": np.array([3, 2, 0], np.int32)}


def sanitizer_cases(spec, rng):
    """`ddtree-gen sanitize`: every page kind (converted, unmapped entry, past the keys, unserved request), a block
    table wider than the keys need, a page entry past the cache's end."""
    inputs = bundle_inputs(spec, rng, "pages")
    yield "pages", inputs
    page = spec.page_size
    yield "wide table, long prefix", dict(inputs, block_table=np.tile(np.arange(4, dtype=np.int32), (3, 4)),
                                          prefix_lens=np.array([5 * page, 0, 14 * page - 1], np.int32),
                                          q_lens=np.array([page, 1, 1], np.int32))
    yield "entries past the cache", dict(inputs, block_table=np.array([[4, 2**31 - 1], [3, -2**31], [1, 2]], np.int32),
                                         prefix_lens=np.array([page, 2**31 - 2, -1], np.int32),
                                         q_lens=np.array([page, 2, 1], np.int32))


DECLARATIONS = [Declaration(
    KERNELS[0], launcher="kernels.kv_dequant:launch", reference="reference:kv_dequant",
    output="reference:KvDequantOutput", sanitize="plans.kv_dequant:sanitizer_cases",
    bundles=Bundles("plans.kv_dequant:bundle_inputs", ("pages",)),
    missing={"torch_ops": "a step of tree_verify(fp8_path='dequant'), whose torch op takes fp8_path; not an op of "
                          "its own"})]

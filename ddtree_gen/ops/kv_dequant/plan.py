"""kv_dequant: the dequantize pre-pass of an fp8 spec's tree_verify(fp8_path="dequant") (docs/contract.md 4b).

Per call it converts the e4m3 pages of the cache that each request's keys t < prefix_len + q_len lie in (tree_verify's
range) into a bf16 workspace laid out as a paged bf16 cache, [B * max_pages, page_size, R + P], request b's page j at
workspace page b * max_pages + j, and writes the workspace's block table ([B, max_pages]: that page, or -1 where
tree_verify would not read the page). tree_verify_wgmma's dequantize build (ops/tree_verify/wgmma.py: the bf16-cache seesaw
built for the fp8 spec) then reads the workspace, with kv_scale applied in fp32 as in the fused fp8 kernel.

Build options (KNOBS; templates/kv_dequant.cu.j2 says how each works; every option gives the same outputs bit for
bit): `parts` (work units per page, one block each; the default 2); `store` "warp" (8-byte loads, one 16-byte store
each: contiguous warp stores; the default) or "pair" (16-byte loads, two 16-byte stores each: the first kernel,
half-sector stores); `threads` per block. docs/perf/journal-fp8.md "The pre-pass at the copy rate". Retired (RETIRED):
the "stream" schedule and the L2 hints, measured no better there.
"""
from __future__ import annotations

import numpy as np
import sympy

from ...errors import SpecError
from ...fp8 import from_float
from ...build.resources import P, PAGE, R, Plan
from ...build.kernel_def import KernelDef

THREADS = 256                    # threads per block of the default build
CHUNKS = PAGE * (R + P) / 16     # 16-byte e4m3 chunks per page (R, P multiples of 16: whole)
STORES = ("pair", "warp")
MAX_PARTS = 64
FIGURES = 'docs/perf/journal-fp8.md "The pre-pass at the copy rate"'   # where every option was measured
# the build options at their values in the default build: one block of 256 threads per half page (parts 2: B = 1's
# 66 pages fill 132 SMs), 8-byte loads and contiguous warp stores ("warp", measured 1.6x the first kernel's "pair"
# stores at B >= 8 on the H200; parts 2: 0.8x the time of one block per page at B = 1, the same elsewhere: FIGURES)
KNOBS = {"parts": 2, "store": "warp", "threads": THREADS}
# Retired build knobs (issue 44, as the seesaw's in issue 40): a config naming one is a SpecError pointing at the
# figures; their code is in git history. `schedule` "stream" (a persistent grid walking the work units, the next
# unit's loads in flight): 16.0-66.4 us against the page schedule's 16.5-64.4 on the same shapes, no better; `l2`
# "src_evict_first" / "streaming" (L2 evict-first loads, st.global.cs stores): within +-2 % of no hint.
RETIRED = {"schedule": FIGURES, "l2": FIGURES}
# the builds scripts/compare_dequant.py times side by side (knobs off the default; {}: the default build): the first
# kernel (parts 1, store "pair"), each option alone (FIGURES) and two other block sizes; the GPU tests check each bit
# for bit, with EDGE_OPTIONS (parts that do not divide a page, a block size not a power of two: the bounds tests)
CANDIDATES = ({}, {"parts": 1, "store": "pair"}, {"parts": 1}, {"store": "pair"}, {"parts": 4, "threads": 128},
              {"parts": 1, "threads": 512})
EDGE_OPTIONS = ({"parts": 5}, {"parts": 5, "store": "pair"}, {"parts": 7}, {"parts": 5, "threads": 96})


def policy(spec, arch: str = "sm_90a") -> dict:
    """The default build configuration (build/variant.default_config): one block of 256 threads per half page (two
    parts per page), warp stores (FIGURES: 92-93 % of the same-run bf16 copy rate at B >= 8, 78 % at B = 1)."""
    return dict(KNOBS)


def spell(config) -> tuple:
    """A configuration's part of the variant name: kv_dequant (the default), e.g. kv_dequant.p1.pair (the first
    kernel), kv_dequant.t128; each knob off its default adds its part."""
    parts = []
    if config["parts"] != KNOBS["parts"]:
        parts.append(f"p{config['parts']}")
    if config["store"] != KNOBS["store"]:
        parts.append(config["store"])
    if config["threads"] != KNOBS["threads"]:
        parts.append(f"t{config['threads']}")
    return tuple(parts)


def _checked(config: dict) -> dict:
    """The config's knobs checked: a SpecError naming the knob and its allowed values (a retired knob: where its
    figures are)."""
    retired = sorted(k for k in RETIRED if k in config)
    if retired:
        raise SpecError(f"kv_dequant: {retired[0]}: a retired build knob, measured no better ({RETIRED[retired[0]]}; "
                        f"its code is in git history)")
    unknown = [k for k in config if k not in KNOBS]
    if unknown:
        raise SpecError(f"kv_dequant: no build option {unknown[0]!r}, its options: {', '.join(KNOBS)}")
    config = {**KNOBS, **config}
    if config["store"] not in STORES:
        raise SpecError(f"kv_dequant: store {config['store']!r}, one of {', '.join(STORES)}")
    parts, threads = config["parts"], config["threads"]
    if not isinstance(parts, int) or isinstance(parts, bool) or not 1 <= parts <= MAX_PARTS:
        raise SpecError(f"kv_dequant: parts {parts!r}, an integer in [1, {MAX_PARTS}] (work units per page)")
    if (not isinstance(threads, int) or isinstance(threads, bool) or not 32 <= threads <= 1024 or threads % 32):
        raise SpecError(f"kv_dequant: threads {threads!r}, a multiple of 32 in [32, 1024]")
    return config


def plan(spec, config=None) -> Plan:
    config = _checked(config or policy(spec))
    # one block per work unit; min_blocks is the resource model's only (the kernel's __launch_bounds__ names none)
    consts = {"CHUNKS": CHUNKS, "PARTS": sympy.Integer(config["parts"]),
              "WARP_STORE": sympy.Integer(int(config["store"] == "warp"))}
    return Plan(kernel="kv_dequant", spec=spec, threads=sympy.Integer(config["threads"]), min_blocks=4,
                static_smem=sympy.Integer(0), consts=consts)


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
                     kv_dtypes=("fp8_e4m3",), policy=policy, spell=spell)]


def _e4m3(rng, shape) -> np.ndarray:
    """e4m3 bytes of normal samples (no NaN), through ml_dtypes."""
    return from_float(rng.standard_normal(shape).astype(np.float32))


BUNDLE_CASES = ("pages",)


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


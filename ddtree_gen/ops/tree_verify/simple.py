"""Resource plans of the CUDA-core attention kernels: tree_verify, tree_verify_tail, merge_states.

tree_verify / tree_verify_tail: one block per (request, query row, group of heads), keys streamed
through shared memory in double-buffered tiles with an online softmax, so any prefix length runs
in fixed shared memory. An fp8 spec's kernel double-buffers the tiles' e4m3 bytes and converts each
into one bf16 tile: 2 x TK x (R+P) bytes + TK x (R+P) x 2, the same total as the bf16 kernel's two
bf16 tiles. merge_states: a warp per (row, head).

Also the inputs of their sanitizer cases and bundles (sanitizer_cases, bundle_inputs; merge_states': merge_...), with
tensor_core_sanitizer_cases, the tree_verify cases with forced split-KV that every tensor-core tree_verify kernel runs.
Their declarations: ops/tree_verify/launch.py.
"""
from __future__ import annotations

import math

import numpy as np
import sympy

from ... import bf16, reference
from ...errors import SpecError
from ...inputs import bad_pages, bf16_finite, equal_block_table, kv_finite, paged_cache, reference_tree
from ...build.resources import SM90_STATIC_SMEM, H, P, R, Plan
from ...trees import ancestor_mask
from ...build.kernel_def import KernelDef

_MAX_LIVE = 180   # registers per thread the verify kernel may spend on q and accumulators

def _verify_tiles(spec):
    """(heads per warp, keys per tile) with HPW * TK = 32: the smallest HPW whose two tiles fit."""
    row = spec.kv_lora_rank + spec.qk_rope_head_dim
    for hpw in (2, 4, 8):
        tk = 32 // hpw
        if 2 * tk * row * 2 + 2 * tk * 4 <= SM90_STATIC_SMEM:
            return hpw, tk
    return 8, 4  # does not fit: Plan.check_fits refuses the spec with the formula


def verify_plan(spec, kernel="tree_verify") -> Plan:
    hpw, tk = _verify_tiles(spec)
    warps = sympy.Min(8, sympy.ceiling(H / hpw))      # up to 8 warps of hpw heads
    heads_per_block = warps * hpw
    threads = 32 * warps
    # bf16 cache: two key tiles of tk rows (R + P bf16); fp8: two tiles of e4m3 bytes and one bf16 tile;
    # + two tiles of per-key visibility flags (int)
    tiles = 2 * tk * (R + P) * 2 if not spec.kv_fp8 else 2 * tk * (R + P) + tk * (R + P) * 2
    static_smem = tiles + 2 * tk * 4
    nwarps = int(warps.subs({H: spec.num_heads}))
    # q (2 (RW + PW)) and output accumulators (2 RW) per head live in registers in every lane
    live = hpw * (4 * -(-spec.kv_lora_rank // 64) + 2 * -(-spec.qk_rope_head_dim // 64))
    if live > _MAX_LIVE:
        raise SpecError(f"spec {spec.name!r}, kernel {kernel}: kv_lora_rank = {spec.kv_lora_rank} with "
                        f"qk_rope_head_dim = {spec.qk_rope_head_dim} needs {live} query/accumulator registers per "
                        f"thread ({hpw} heads per warp); this kernel holds at most {_MAX_LIVE}")
    # up to 72 of them (R = 512, P = 64: 68) fit 128 registers: 16 warps per SM; beyond, one block
    min_blocks = max(1, 16 // nwarps) if live <= 72 else 1
    return Plan(kernel=kernel, spec=spec, threads=threads, min_blocks=min_blocks,
                static_smem=static_smem,
                consts={"WARPS": warps, "HEADS_PER_WARP": sympy.Integer(hpw), "TILE_KEYS": sympy.Integer(tk),
                        "HEADS_PER_BLOCK": heads_per_block, "HEAD_GROUPS": sympy.ceiling(H / heads_per_block),
                        "RANK_WORDS_PER_LANE": sympy.ceiling(R / 64), "ROPE_WORDS_PER_LANE": sympy.ceiling(P / 64)})


def tail_plan(spec) -> Plan:
    return verify_plan(spec, "tree_verify_tail")


MERGE_WARPS = 8


def merge_plan(spec) -> Plan:
    return Plan(kernel="merge_states", spec=spec, threads=sympy.Integer(32 * MERGE_WARPS), min_blocks=4,
                static_smem=sympy.Integer(0),
                consts={"ROWS_PER_BLOCK": sympy.Integer(MERGE_WARPS), "RANK_WORDS_PER_LANE": sympy.ceiling(R / 64)})


KERNELS = [
    KernelDef(name="tree_verify", template="tree_verify.cu.j2", entry="ddtree_tree_verify",
              plan=verify_plan, context={"tail": False}, serves=("tree_verify", "simple")),
    KernelDef(name="tree_verify_tail", template="tree_verify.cu.j2", entry="ddtree_tree_verify_tail",
              plan=tail_plan, context={"tail": True}, serves=("tree_verify_tail", "simple")),
    KernelDef(name="merge_states", template="merge_states.cu.j2", entry="ddtree_merge_states", plan=merge_plan),
]



# ---------------------------------------------------------------------------------- sanitizer cases

def sanitizer_cases(spec, rng):
    """tree_verify's and tree_verify_tail's cases: prefix_len 0, 63, 64, 65, q_len 1 and Nq, empty rows, Nq = 1,
    every mask bit set, and the out-of-range lengths and pages the kernels promise to tolerate."""
    h, r, p, n, page = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.max_tree_size, spec.page_size
    scale = 1.0 / math.sqrt(r + p)

    def inputs(prefix, qlens, nq, mask, table, num_pages):
        b = len(prefix)
        out = dict(q_nope=bf16_finite(rng, (b, nq, h, r)), q_pe=bf16_finite(rng, (b, nq, h, p)),
                   kv_cache=kv_finite(spec, rng, (num_pages, page, r + p)), block_table=table,
                   prefix_lens=np.asarray(prefix, np.int32), q_lens=np.asarray(qlens, np.int32),
                   tree_mask=mask, softmax_scale=scale)
        if spec.kv_fp8:
            out["kv_scale"] = 0.37
        return out

    prefix = [0, 63, 64]
    tree = reference_tree(spec, rng, 3, spec.max_depth, min(4, n - 1), n - 1, prefix)
    table, num_pages = equal_block_table(spec, rng, 3, 65 + n)
    yield "prefix 0/63/64, q_len 1/Nq/Nq", inputs(prefix, [1, n, n], n, tree.tree_mask, table, num_pages)

    prefix = [65, 0, 64]
    tree = reference_tree(spec, rng, 3, spec.max_depth, min(4, n - 1), n // 2, prefix)
    mask = tree.tree_mask.copy()
    mask[1, 0] = 0          # prefix 0 and no mask bit: a row with no visible key
    mask[0, 3] = 0          # an empty tail row (tree_verify_tail) with a full prefix
    yield "prefix 65/0/64, empty rows", inputs(prefix, [n, n, 1], n, mask, table, num_pages)

    small = tree.tree_mask[:, :1].copy()
    yield "Nq 1", inputs([0, 63, 65], [1, 1, 1], 1, small, table, num_pages)

    full = np.full((2, n, spec.mask_words), 0xFFFFFFFF, np.uint32)  # bits beyond q_len set too
    table2, num_pages2 = equal_block_table(spec, rng, 2, 65 + n)
    yield "all mask bits set", inputs([64, 1], [n, n - 1], n, full, table2, num_pages2)

    # values the kernels promise to tolerate without reading out of bounds (see ops/tree_verify/launch.py)
    bad_table = bad_pages(table, num_pages)
    yield "out-of-range lengths and pages", inputs([0, 64, 10**6], [0, n + 1, n], n, tree.tree_mask, bad_table,
                                                   num_pages)
    yield "negative prefix, q_len > Nq", inputs([-1, 5, 2**31 - 1], [n, 2**31 - 1, -3], n, tree.tree_mask,
                                                table, num_pages)


def tensor_core_sanitizer_cases(spec, rng):
    """The tree_verify cases with the launcher's own split choice, then forced split-KV (combine kernel): the cases of
    every tensor-core tree_verify kernel (mma.sync, wgmma)."""
    for i, (case, inputs) in enumerate(sanitizer_cases(spec, rng)):
        yield case, inputs
        if i < 2 or "out-of-range" in case:
            yield f"{case}, num_splits 3", dict(inputs, num_splits=3)
            yield f"{case}, num_splits 32", dict(inputs, num_splits=32)   # more chunks than keys


def merge_sanitizer_cases(spec, rng):
    """merge_states' cases: empty sides (-inf, +inf, NaN), both sides empty, a row count that is not a multiple of
    the block, in place."""
    r = spec.kv_lora_rank

    def sides(lead):
        o_a, o_b = bf16_finite(rng, (*lead, r)), bf16_finite(rng, (*lead, r))
        lse_a = rng.normal(5.0, 3.0, lead).astype(np.float32)
        lse_b = rng.normal(5.0, 3.0, lead).astype(np.float32)
        return o_a, lse_a, o_b, lse_b

    o_a, lse_a, o_b, lse_b = sides((3, 7, spec.num_heads))
    flat_a, flat_b = lse_a.reshape(-1), lse_b.reshape(-1)
    flat_a[0::5] = -np.inf
    flat_b[1::5] = np.inf        # FlashMLA's empty row
    flat_a[2::5] = -np.inf
    flat_b[2::5] = -np.inf       # both sides empty
    flat_a[3::7] = np.nan
    o_a.reshape(-1, r)[0::5] = 0x7FC0   # NaN in an empty side's o: must be ignored
    yield "empty sides", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    o_a, lse_a, o_b, lse_b = sides((2, 3))
    yield "rows not a multiple of the block", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    o_a, lse_a, o_b, lse_b = sides((2, 5, spec.num_heads))
    yield "in place", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out="o_a", lse="lse_a")
    o_a, lse_a, o_b, lse_b = sides((1,))
    lse_a[:] = -np.inf
    lse_b[:] = np.inf
    yield "one row, both empty", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)


# ------------------------------------------------------------------------------------------ bundles

BUNDLE_CASES = ("prefix70",)
MERGE_BUNDLE_CASES = ("empty-sides",)


def bundle_inputs(spec, rng, case):
    """tree_verify's and tree_verify_tail's bundle: one request of prefix 70 and a 3-node tree (an fp8 spec: its
    kv_scale too)."""
    h, r, p = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    nq = 3
    prefix = np.array([70], np.int32)
    q_lens = np.array([3], np.int32)
    kv, table = paged_cache(spec, rng, prefix + q_lens)
    mask = ancestor_mask([-1, 0, 0], spec.mask_words)[None]
    out = {"q_nope": bf16.to_bits(rng.standard_normal((1, nq, h, r))),
           "q_pe": bf16.to_bits(rng.standard_normal((1, nq, h, p))),
           "kv_cache": kv, "block_table": table, "prefix_lens": prefix, "q_lens": q_lens, "tree_mask": mask,
           "softmax_scale": np.array(192 ** -0.5, np.float64)}
    if spec.kv_fp8:   # a scale in [0.01, 2], exactly a float32
        out["kv_scale"] = np.array(rng.uniform(0.01, 2.0), np.float32)
    return out


def _run_attention(ref, a):
    out = ref(a["q_nope"], a["q_pe"], a["kv_cache"], a["block_table"], a["prefix_lens"], a["q_lens"], a["tree_mask"],
              float(a["softmax_scale"]), kv_scale=float(a["kv_scale"]) if "kv_scale" in a else None)
    return {"out": out.out.astype(np.float32), "lse": out.lse.astype(np.float32)}


def bundle_run(spec, a):
    """tree_verify's reference on a bundle's inputs `a` (out and lse as float32)."""
    return _run_attention(reference.tree_verify, a)


def tail_bundle_run(spec, a):
    """tree_verify_tail's reference on a bundle's inputs `a` (out and lse as float32)."""
    return _run_attention(reference.tree_verify_tail, a)


def merge_bundle_inputs(spec, rng, case):
    """merge_states' bundle: 2 rows of H heads, empty sides (-inf, +inf) and rows with both sides empty."""
    h, r = spec.num_heads, spec.kv_lora_rank
    lse_a = rng.standard_normal((1, 2, h)).astype(np.float32)
    lse_b = rng.standard_normal((1, 2, h)).astype(np.float32)
    lse_a[0, 0, ::4] = -np.inf
    lse_b[0, 0, 1::4] = np.inf
    lse_a[0, 1, ::3] = -np.inf
    lse_b[0, 1, ::3] = -np.inf   # both sides empty
    return {"o_a": bf16.to_bits(rng.standard_normal((1, 2, h, r))), "lse_a": lse_a,
            "o_b": bf16.to_bits(rng.standard_normal((1, 2, h, r))), "lse_b": lse_b}

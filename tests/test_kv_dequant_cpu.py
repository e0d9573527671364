"""kv_dequant and tree_verify(fp8_path="dequant") without a GPU: the reference against an independent oracle (and
the device conversion emulated), its edge cases, the launchers' checks and launch plans on the stand-in kernel set,
the dequantize path's build (the bf16-cache seesaw of the fused fp8 build's slab order) and its torch op argument.

The dequantize path must give the fused fp8 kernel's bits: its kernel is the bf16 twin's seesaw in the fp8 build's
slab order (tests/test_gpu_tree_verify.py test_fp8_matches_bf16_twin holds that the fused build equals that one),
with the same scale_log2 / v_scale and split count; the GPU tests (tests/test_gpu_kv_dequant.py) hold the bits.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from conftest import FakeArrays as Arrays, FakeKernelSet, need, ptr_of
from ddtree_gen import fp8, reference
from ddtree_gen.errors import ArgumentError
from ddtree_gen.ops.kv_dequant import launch as kd
from ddtree_gen.ops.tree_verify import launch as tv
from ddtree_gen.ops.tree_verify import route as verify_route
from ddtree_gen.ops.tree_verify import wgmma_launch as wg
from ddtree_gen.ops import by_name
from ddtree_gen.ops.kv_dequant import plan as kd_plans
from ddtree_gen.ops.tree_verify.wgmma import DEQUANT, DEQUANT_PARTS, PARTS_KERNEL, PARTS_MIN_B, PARTS_MIN_KEYS
from ddtree_gen.build.variant import variant
from ddtree_gen.spec import find_spec
from test_fp8_cpu import fp8x4_to_bf16x4

FP8 = find_spec("kimi-k2.6-tp8-fp8")
BF16 = find_spec("kimi-k2.6-tp8")
FP8_SPECS = ("kimi-k2.6-tp8-fp8", "deepseek-v3-fp8")
ALL_BYTES = np.arange(256, dtype=np.uint8)
KV_SCALE = 0.37


# ------------------------------------------------------------------------------- the conversion

def test_to_bf16_bits_is_the_device_conversion():
    """fp8.to_bf16_bits (the reference's table) is the kernels' conversion (common.cuh.j2, emulated in
    test_fp8_cpu.py) for every byte in every position of a word, NaN bytes included, bit for bit."""
    table = fp8.to_bf16_bits(ALL_BYTES)
    for k in range(4):
        lo, hi = fp8x4_to_bf16x4(ALL_BYTES.astype(np.uint32) << np.uint32(8 * k))
        got = np.stack([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], axis=-1).astype(np.uint16)[:, k]
        assert np.array_equal(got, table), k
    assert int(table[0x7F]) == 0x7FF0 and int(table[0xFF]) == 0xFFF0 and int(table[0x80]) == 0x8000
    finite = ~np.isin(ALL_BYTES, fp8.NAN_BYTES)
    from ddtree_gen import bf16
    assert np.array_equal(bf16.from_bits(table[finite]).astype(np.float64), fp8.to_float64(ALL_BYTES[finite]))


# ------------------------------------------------------------------------------- the reference

def oracle(kv, table, prefix, qlens):
    """kv_dequant's contract written independently of reference.kv_dequant: which (b, j) are converted, from numpy
    vector operations, and the values from ml_dtypes (finite) and the sign rule (NaN)."""
    num_pages, page, row = kv.shape
    b, max_pages = table.shape
    keys = prefix.astype(np.int64) + qlens.astype(np.int64)
    j = np.arange(max_pages)[None, :]
    converted = ((qlens >= 1) & (prefix >= 0))[:, None] & (j * page < keys[:, None]) & (table >= 0) & (table < num_pages)
    ws_table = np.where(converted, np.arange(b * max_pages).reshape(b, max_pages), -1).astype(np.int32)
    from ddtree_gen import bf16
    values = bf16.to_bits(fp8.to_float64(kv))
    values[kv == 0x7F], values[kv == 0xFF] = 0x7FF0, 0xFFF0
    ws = np.zeros((b * max_pages, page, row), np.uint16)
    for w in np.flatnonzero(converted.reshape(-1)):
        ws[w] = values[table.reshape(-1)[w]]
    return ws, ws_table, converted


def _random_case(spec, rng, b, max_pages, num_pages):
    page, row = spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim
    kv = rng.integers(0, 256, (num_pages, page, row), dtype=np.uint8)   # every byte, NaN included
    table = rng.integers(-2, num_pages + 2, (b, max_pages)).astype(np.int32)
    prefix = rng.integers(-3, max_pages * page, b).astype(np.int32)
    qlens = rng.integers(-1, 70, b).astype(np.int32)
    return kv, table, prefix, qlens


@pytest.mark.parametrize("name", FP8_SPECS)
def test_reference_against_oracle(name):
    spec = find_spec(name)
    rng = np.random.default_rng(7)
    for b, max_pages, num_pages in ((5, 4, 6), (1, 1, 1), (3, 7, 2), (4, 0, 3), (0, 3, 2)):
        kv, table, prefix, qlens = _random_case(spec, rng, b, max_pages, num_pages)
        got = reference.kv_dequant(kv, table, prefix, qlens)
        ws, ws_table, _ = oracle(kv, table, prefix, qlens)
        assert isinstance(got, reference.KvDequantOutput)
        assert got.kv_cache.dtype == np.uint16 and got.block_table.dtype == np.int32
        assert np.array_equal(got.block_table, ws_table) and np.array_equal(got.kv_cache, ws), (b, max_pages)
        via_ml = reference.kv_dequant(kv.view(fp8.ml_dtypes().float8_e4m3fn), table, prefix, qlens)
        assert np.array_equal(via_ml.kv_cache, ws)


def test_reference_edge_cases():
    """Which pages are converted: the keys' pages of a served request only, every entry outside the cache -1, the
    64-bit key count (prefix_len + q_len past 2^31), q_len 0 / prefix_len < 0 (not served), a page exactly at the
    end of the keys (not converted), the last partial one (whole)."""
    spec = FP8
    page = spec.page_size
    kv = np.full((3, page, 576), 0x38, np.uint8)   # 1.0
    kv[1] = 0x40                                    # 2.0
    table = np.array([[1, 2, 0], [0, 1, 2], [2, -1, 3], [1, 2, 0], [0, 0, 0], [2, 1, 0]], np.int32)
    prefix = np.array([page - 1, 2 * page - 1, 0, 2**31 - 2, 5, -1], np.int32)
    qlens = np.array([1, 1, page + 1, 65, 0, 3], np.int32)
    got = reference.kv_dequant(kv, table, prefix, qlens)
    m = 3
    want = [[0, -1, -1],                    # keys < page: one page
            [m, m + 1, -1],                 # keys = 2 page: two
            [2 * m, -1, -1],                # page 1 unmapped, page 2 (3 >= num_pages) past... and unmapped
            [3 * m, 3 * m + 1, 3 * m + 2],  # 2^31 + 63 keys: every column
            [-1, -1, -1], [-1, -1, -1]]     # not served
    assert got.block_table.tolist() == want
    assert (got.kv_cache[0] == 0x4000).all() and (got.kv_cache[m] == 0x3F80).all()   # 2.0, 1.0: whole pages
    assert (got.kv_cache[1] == 0).all() and (got.kv_cache[4 * m:] == 0).all()        # not converted: zero (new)


def test_reference_out_keeps_pages_not_converted():
    rng = np.random.default_rng(3)
    kv, table, prefix, qlens = _random_case(FP8, rng, 4, 3, 5)
    poison = reference.KvDequantOutput(np.full((12, FP8.page_size, 576), 0xABCD, np.uint16),
                                       np.full((4, 3), 12345, np.int32))
    got = reference.kv_dequant(kv, table, prefix, qlens, out=poison)
    assert got is poison
    ws, ws_table, converted = oracle(kv, table, prefix, qlens)
    flat = converted.reshape(-1)
    assert np.array_equal(got.block_table, ws_table)   # every entry written
    assert np.array_equal(got.kv_cache[flat], ws[flat]) and (got.kv_cache[~flat] == 0xABCD).all()


@pytest.mark.parametrize("change,words", [
    (dict(kv_cache=np.zeros((2, 64, 576), np.uint16)), "kv_cache: expected e4m3"),
    (dict(kv_cache=np.zeros((2, 64 * 576), np.uint8)), "kv_cache: expected 3 dimensions"),
    (dict(block_table=np.zeros((2, 2), np.float32)), "block_table: expected an integer"),
    (dict(prefix_lens=np.zeros(3, np.int32)), "prefix_lens / q_lens"),
    (dict(out=reference.KvDequantOutput(np.zeros((3, 64, 576), np.uint16), np.zeros((2, 2), np.int32))),
     "out.kv_cache"),
    (dict(out=reference.KvDequantOutput(np.zeros((4, 64, 576), np.uint16), np.zeros((2, 2), np.int64))),
     "out.block_table"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_reference_argument_errors(change, words):
    args = dict(kv_cache=np.zeros((2, 64, 576), np.uint8), block_table=np.zeros((2, 2), np.int32),
                prefix_lens=np.zeros(2, np.int32), q_lens=np.ones(2, np.int32))
    with pytest.raises(ArgumentError, match=words):
        reference.kv_dequant(**{**args, **change})


def test_workspace_formula():
    """kv_workspace: B * max_pages pages of page_size * (R + P) bf16 (at least one), then the table's int32."""
    for b, max_pages in ((8, 66), (1, 1), (3, 0), (0, 5)):
        pages, table_off, elems = kd_plans.workspace_layout(FP8, b, max_pages)
        assert pages == max(b * max_pages, 1) and table_off == pages * 64 * 576 * 2
        assert elems * 2 == table_off + 4 * b * max_pages == max(b * max_pages, 1) * 64 * 576 * 2 + 4 * b * max_pages
        assert kd_plans.workspace_elems(FP8, b, max_pages) == elems
    assert kd_plans.workspace_elems(FP8, 8, 66) * 2 == 8 * 66 * (64 * 576 * 2 + 4)   # 38.9 MB at B = 8, L = 4096


# ------------------------------------------------------------------------------- builds

def test_builds_of_the_dequantize_path():
    """kv_dequant and tree_verify_wgmma's dequantize build are built for the fp8 specs only; the latter is the bf16-cache
    seesaw (256 threads, no converter, KV_FP8 off) in the fused fp8 build's slab order, and its source is the bf16
    twin's seesaw of that order but for the spec's name: the same kernel. Its parts-grid build (dequant_parts) is the
    bf16 twin's parts build of that order but for the spec's name."""
    from ddtree_gen.build.render import render
    for name in ("kv_dequant", DEQUANT):
        assert by_name(name).kv_dtypes == ("fp8_e4m3",)
        assert by_name(name).builds_for(FP8) and not by_name(name).builds_for(BF16)
        assert "kv_dtype 'bf16'" in by_name(name).why_not_built(BF16)
    v = variant(by_name(DEQUANT), FP8)
    assert v.name == "tree_verify_wgmma.seesaw.tma.s-order-slab.rope-early.workspace"
    consts = v.plan().template_constants()
    assert consts["THREADS"] == 256 and consts["ROPE_EARLY"] == 1 and consts["S_LOADED_ORDER"] == 0
    assert consts["USE_TMA"] == 1 and consts["SEESAW"] == 1 and consts["PARTS"] == 0
    fused = variant(by_name("tree_verify_wgmma"), FP8).plan().template_constants()
    for k in ("RESCALE_SKIP", "MAX_SLACK", "EXP_FMA", "P_STMATRIX", "ROPE_EARLY", "BM", "BN"):
        assert consts[k] == fused[k], k
    twin = variant(by_name("tree_verify_wgmma"), BF16, schedule="seesaw", rope_early=True, s_order="slab")
    mine, theirs = render(v), render(twin)
    assert "#define FP8 0" in mine and "typedef bf16_t kv_t;" in mine
    normalize = [("kimi-k2.6-tp8-fp8", "kimi-k2.6-tp8")]
    for a, b in normalize:
        mine = mine.replace(a, b)
    assert mine == theirs
    # the parts-grid build: DEQUANT on the parts grid, the bf16 twin's parts build of the same slab order
    vp = variant(by_name(DEQUANT_PARTS), FP8)
    assert vp.name == "tree_verify_wgmma.seesaw.tma.grid-parts.s-order-slab.rope-early.workspace"
    cp = vp.plan().template_constants()
    assert cp["PARTS"] == 1 and cp["THREADS"] == 256 and cp["ROPE_EARLY"] == 1 and cp["S_LOADED_ORDER"] == 0
    twin_parts = variant(by_name(PARTS_KERNEL), BF16, rope_early=True, s_order="slab")
    mine, theirs = render(vp), render(twin_parts)
    for a, b in normalize:
        mine = mine.replace(a, b)
    assert mine == theirs
    kdq = variant(by_name("kv_dequant"), FP8).plan().template_constants()
    assert kdq["CHUNKS"] == 64 * 576 // 16 and kdq["THREADS"] == kd_plans.THREADS


# ------------------------------------------------------------------------------- launchers

B, PAGES, MAX_PAGES = 2, 10, 4


def dq_args(spec, new):
    page, row = spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim
    return dict(kv_cache=new((PAGES, page, row), np.uint8), block_table=new((B, MAX_PAGES), np.int32),
                prefix_lens=new((B,), np.int32), q_lens=new((B,), np.int32))


def test_kv_dequant_launch_plan(fake_device):
    new = Arrays()
    args = dq_args(FP8, new)
    out = reference.KvDequantOutput(new((B * MAX_PAGES, 64, 576), np.uint16), new((B, MAX_PAGES), np.int32))
    kset = FakeKernelSet(FP8, ["kv_dequant"])
    kset.launch = lambda name, **kw: kset.__dict__.setdefault("got", []).append((name, kw))
    res = kd.launch(kset, **args, out=out)
    assert res.kv_cache is out.kv_cache and res.block_table is out.block_table
    (name, kw), = kset.got
    assert name == "kv_dequant" and tuple(kw["grid"]) == (B * MAX_PAGES * kd_plans.KNOBS["parts"],)
    want = [ptr_of(args[k]) for k in ("kv_cache", "block_table", "prefix_lens", "q_lens")]
    assert list(kw["args"]) == [*want, ptr_of(out.kv_cache), ptr_of(out.block_table), PAGES, MAX_PAGES, B]
    # no out: both outputs are new (allocated by the runtime before the launch: its plan here, no GPU to allocate on)
    a = dq_args(FP8, Arrays())
    prep = kd._prepare(FakeKernelSet(FP8, ["kv_dequant"]), (*a.values(), None, None), False)
    assert prep.new == ((4, (B * MAX_PAGES, 64, 576), "bf16"), (5, (B, MAX_PAGES), "int32"))


@pytest.mark.parametrize("change,words", [
    (lambda a, new: a.update(kv_cache=new((PAGES, 64, 576), np.uint16)), "kv_cache: dtype"),
    (lambda a, new: a.update(kv_cache=new((PAGES, 32, 576), np.uint8)), "kv_cache: page_size"),
    (lambda a, new: a.update(kv_cache=new((PAGES, 64, 512), np.uint8)), "kv_cache: row width"),
    (lambda a, new: a.update(kv_cache=new((PAGES, 64, 576), np.uint8, ptr=(1 << 32) * 90 + 8)), "16-byte aligned"),
    (lambda a, new: a.update(block_table=new((B, MAX_PAGES), np.int64)), "block_table: dtype"),
    (lambda a, new: a.update(prefix_lens=new((B + 1,), np.int32)), "prefix_lens: shape"),
    (lambda a, new: a.update(q_lens=None), "q_lens: required"),
    (lambda a, new: a.update(block_table=new((2**16, 2**11), np.int32), prefix_lens=new((2**16,), np.int32),
                             q_lens=new((2**16,), np.int32)), "block_table: 65536 requests"),
    (lambda a, new: a.update(out=reference.KvDequantOutput(new((B * MAX_PAGES - 1, 64, 576), np.uint16),
                                                           new((B, MAX_PAGES), np.int32))), "out.kv_cache: shape"),
    (lambda a, new: a.update(out=reference.KvDequantOutput(new((B * MAX_PAGES, 64, 576), np.uint16),
                                                           new((B, MAX_PAGES), np.uint32))), "out.block_table: dtype"),
    (lambda a, new: a.update(out=reference.KvDequantOutput(
        new((B * MAX_PAGES, 64, 576), np.uint16, ptr=ptr_of(a["kv_cache"])), new((B, MAX_PAGES), np.int32))),
     "out.kv_cache: overlaps kv_cache"),
    (lambda a, new: a.update(out=reference.KvDequantOutput(
        new((B * MAX_PAGES, 64, 576), np.uint16, ptr=(1 << 32) * 91 + 8), new((B, MAX_PAGES), np.int32))),
     "out.kv_cache: data pointer"),
    (lambda a, new: a.update(out=(1, 2)), "out: has no field"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_kv_dequant_argument_errors(change, words, fake_device):
    new = Arrays()
    args = dq_args(FP8, new)
    change(args, new)
    kset = FakeKernelSet(FP8, ["kv_dequant"])   # a launch would raise LaunchReached, not the ArgumentError
    with pytest.raises(ArgumentError, match=words):
        kd.launch(kset, **args)


def test_kv_dequant_refuses_a_bf16_spec(fake_device):
    args = dq_args(BF16, Arrays())
    args["kv_cache"] = Arrays()((PAGES, 64, 576), np.uint16)
    with pytest.raises(ArgumentError, match="kv_dequant converts an fp8"):
        kd.launch(FakeKernelSet(BF16, ["tree_verify"]), **args)


def test_kv_dequant_empty_batch_launches_nothing(fake_device):
    new = Arrays()
    args = dict(dq_args(FP8, new), block_table=new((0, MAX_PAGES), np.int32), prefix_lens=new((0,), np.int32),
                q_lens=new((0,), np.int32))
    out = reference.KvDequantOutput(new((0, 64, 576), np.uint16), new((0, MAX_PAGES), np.int32))
    res = kd.launch(FakeKernelSet(FP8, ["kv_dequant"]), **args, out=out)   # LaunchReached would fail the test
    assert res.block_table is out.block_table


# ------------------------------------------------------------------------ tree_verify(fp8_path=...)

DEQUANT_SET = ("tree_verify", "tree_verify_tail", "merge_states", "tree_verify_wgmma", "tree_verify_tail_wgmma",
               "tree_verify_mma_combine", "kv_dequant", DEQUANT)


def verify_args(spec, new, nq=None, b=B, max_pages=MAX_PAGES):
    h, r, p, n, w = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.max_tree_size, spec.mask_words
    nq = nq or n
    args = dict(q_nope=new((b, nq, h, r), np.uint16), q_pe=new((b, nq, h, p), np.uint16),
                kv_cache=new((PAGES, spec.page_size, r + p), np.uint8 if spec.kv_fp8 else np.uint16),
                block_table=new((b, max_pages), np.int32), prefix_lens=new((b,), np.int32),
                q_lens=new((b,), np.int32), tree_mask=new((b, nq, w), np.uint32), softmax_scale=192 ** -0.5,
                out=new((b, nq, h, r), np.uint16), lse=new((b, nq, h), np.float32))
    if spec.kv_fp8:
        args["kv_scale"] = KV_SCALE
    return args


class Recording(FakeKernelSet):
    """Records every launch (name, grid, args) and runs none."""

    def __init__(self, spec, kernels=DEQUANT_SET):
        super().__init__(spec, kernels)
        self.got = []

    def launch(self, name, **kw):
        self.got.append((name, tuple(kw["grid"]), list(kw["args"])))


def _ws(spec, new, b=B, max_pages=MAX_PAGES, **kw):
    return new((kd_plans.workspace_elems(spec, b, max_pages),), np.uint16, **kw)


@pytest.mark.parametrize("name", FP8_SPECS)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_dequant_path_launch_plan(name, splits, fake_device):
    """fp8_path="dequant": kv_dequant into the kv workspace, then tree_verify_wgmma/dequant with the fused call's
    arguments but for the cache (the workspace's pages), its block table (after them), num_pages (B * max_pages)
    and the tensor map (bf16, swizzled, of the workspace); the same split count, scale_log2, v_scale; the combine
    after it as in the fused call (fp8_path="fused"). The default (fp8_path=None: fp8_default) launches the same."""
    spec = find_spec(name)
    new = Arrays()
    args = verify_args(spec, new)
    from ddtree_gen.ops.tree_verify import split as split_kv
    ws = new((split_kv.workspace_elems(spec, B, spec.max_tree_size, 32),), np.float32)
    kvw = _ws(spec, new)
    fused, dq, default = Recording(spec), Recording(spec), Recording(spec)
    tv.tree_verify(fused, **args, workspace=ws, num_splits=splits, fp8_path="fused")
    res = tv.tree_verify(dq, **args, workspace=ws, num_splits=splits, fp8_path="dequant", kv_workspace=kvw)
    tv.tree_verify(default, **args, workspace=ws, num_splits=splits, kv_workspace=kvw)
    assert default.got == dq.got
    assert res.out is args["out"] and res.lse is args["lse"]
    assert [g[0] for g in dq.got] == ["kv_dequant", DEQUANT, *[g[0] for g in fused.got[1:]]]
    assert fused.got[0][0] == "tree_verify_wgmma"
    kname, kgrid, ka = dq.got[0]
    base, table_off = ptr_of(kvw), kd_plans.workspace_layout(spec, B, MAX_PAGES)[1]
    assert kgrid == (B * MAX_PAGES * kd_plans.KNOBS["parts"],)
    assert ka == [ptr_of(args[k]) for k in ("kv_cache", "block_table", "prefix_lens", "q_lens")] + [
        base, base + table_off, PAGES, MAX_PAGES, B]
    (_, fgrid, fa), (_, dgrid, da) = fused.got[0], dq.got[1]
    assert fgrid == dgrid
    assert da[2] == base and da[3] == base + table_off and da[11] == B * MAX_PAGES
    assert fa[2] == ptr_of(args["kv_cache"]) and fa[11] == PAGES
    same = [i for i in range(18) if i not in (2, 3, 11)]
    assert [da[i] for i in same] == [fa[i] for i in same]   # q, lengths, mask, scale_log2, v_scale, splits, outputs
    assert da[8] == np.float32(KV_SCALE) and da[7] == np.float32(192 ** -0.5 * KV_SCALE * math.log2(math.e))
    (tag, ptr, tm), *rest = da[18:]
    assert tag == "tensor map" and ptr == base and rest == [0] * 15
    assert (tm.index, tm.rows, tm.cols, tm.box_rows, tm.box_cols, tm.elem_bytes, tm.swizzle) == (
        tensor_core_kvw(), B * MAX_PAGES * spec.page_size, 576, 64, 64, 2, 128)
    assert fa[18][2].elem_bytes == 1    # the fused build's map: e4m3 bytes
    assert dq.got[2:] == fused.got[1:]  # the combine, when split
    # the build asked by name is the same path
    again = Recording(spec)
    tv.tree_verify(again, **args, workspace=ws, num_splits=splits, kv_workspace=kvw, fp8_path="dequant",
                   build="dequant")
    assert again.got == dq.got


@pytest.mark.parametrize("b,kw,loaded,want", [
    (PARTS_MIN_B, {}, True, "parts"), (PARTS_MIN_B - 1, {}, True, "chunks"), (PARTS_MIN_B, {"num_splits": 3}, True,
    "chunks"), (PARTS_MIN_B, {}, False, "chunks"), (PARTS_MIN_B, {"short": True}, True, "chunks")],
    ids=["B=min", "B=min-1", "num_splits given", "not loaded", "fewer than PARTS_MIN_KEYS keys"])
def test_dequant_path_parts_grid(b, kw, loaded, want, fake_device):
    """The dequantize path takes its parts-grid build (tree_verify_wgmma/dequant_parts) by the bf16 parts rule: B >=
    PARTS_MIN_B, a block table of at least PARTS_MIN_KEYS keys, num_splits not given, the build loaded; with the
    part count of parts_for (one block per (row tile, part)), after the same kv_dequant; fp8_path=None takes the same,
    and the build's launcher by name too. Otherwise the chunks-grid build, as before."""
    from ddtree_gen.ops.tree_verify import split as split_kv
    from ddtree_gen.ops.tree_verify.wgmma import parts_for
    pages = 4096 // FP8.page_size if kw.pop("short", False) else PARTS_MIN_KEYS // FP8.page_size
    new, n = Arrays(), FP8.max_tree_size
    args = verify_args(FP8, new, b=b, max_pages=pages)
    ws = new((max(split_kv.workspace_elems(FP8, b, n, split_kv.MAX_SPLITS),
                  split_kv.parts_workspace_elems(FP8, b, n, split_kv.MAX_PARTS)),), np.float32)
    kvw = _ws(FP8, new, b, pages)
    names = DEQUANT_SET + ((DEQUANT_PARTS,) if loaded else ())
    dq, default = Recording(FP8, names), Recording(FP8, names)
    tv.tree_verify(dq, **args, workspace=ws, fp8_path="dequant", kv_workspace=kvw, **kw)
    tv.tree_verify(default, **args, workspace=ws, kv_workspace=kvw, **kw)
    assert default.got == dq.got
    row_tiles = -(-n * FP8.num_heads // split_kv.BM)
    assert dq.got[0][0] == "kv_dequant"
    if want == "parts":
        parts = parts_for(FP8, b, n, pages * FP8.page_size, 132)
        assert dq.got[1][0] == DEQUANT_PARTS and dq.got[1][1] == (parts * row_tiles,), dq.got[1][:2]
        assert dq.got[1][2][12] == parts and dq.got[-1][0] == "tree_verify_mma_combine"
        again = Recording(FP8, names)
        tv.tree_verify(again, **args, workspace=ws, kv_workspace=kvw, fp8_path="dequant", build="dequant_parts")
        assert again.got == dq.got
    else:
        assert dq.got[1][0] == DEQUANT and dq.got[1][1][0] % (b * row_tiles) == 0, dq.got[1][:2]


def test_dequant_parts_built_where_it_serves():
    """The dequantize path's parts build exists for every fp8 seesaw spec (any H), for no bf16 one."""
    from ddtree_gen.spec import all_specs
    k = by_name(DEQUANT_PARTS)
    for spec in all_specs():
        assert k.builds_for(spec) == spec.kv_fp8, spec.name


def test_dequant_path_allocates_its_workspace(fake_device):
    """Without kv_workspace the launcher allocates it (a scratch output: not returned), with the split workspace."""
    from ddtree_gen.launch.checks import check_attention_call
    from ddtree_gen.ops.tree_verify.tensor_core import INDEX_TC, TENSOR_CORE_CHECKS, prepare_attention
    a = verify_args(FP8, Arrays())
    arrays = (*(a[k] for k in ("q_nope", "q_pe", "kv_cache", "block_table", "prefix_lens", "q_lens", "tree_mask")),
              None, None, None, None)   # out, lse, workspace, kv_workspace: new (allocated before the launches)
    checked = check_attention_call(FP8, INDEX_TC, arrays, a["softmax_scale"], KV_SCALE, **TENSOR_CORE_CHECKS)
    prep = prepare_attention(FakeKernelSet(FP8, DEQUANT_SET).offer(0), DEQUANT, False, arrays, checked, False, 1)
    assert [s.kernel for s in prep.steps] == ["kv_dequant", DEQUANT]
    assert (tensor_core_kvw(), (kd_plans.workspace_elems(FP8, B, MAX_PAGES),), "bf16") in prep.new
    assert tensor_core_kvw() in prep.scratch


def tensor_core_kvw():
    from ddtree_gen.ops.tree_verify.tensor_core import KVW
    return KVW


def test_fused_path_unchanged_by_the_argument(fake_device):
    """fp8_path="fused" launches the fused kernel, with the arguments fp8_path None (the default) gives it where the
    dequantize path does not apply (here: its kernels not loaded), and the same with them loaded."""
    new = Arrays()
    args = verify_args(FP8, new)
    fused_only = tuple(k for k in DEQUANT_SET if k not in ("kv_dequant", DEQUANT))
    a, b, c, d = Recording(FP8, fused_only), Recording(FP8, fused_only), Recording(FP8), Recording(FP8, fused_only)
    tv.tree_verify(a, **args, num_splits=1)
    tv.tree_verify(b, **args, num_splits=1, fp8_path=None)
    tv.tree_verify(c, **args, num_splits=1, fp8_path="fused")
    tv.tree_verify(d, **args, num_splits=1, fp8_path="fused")
    assert a.got == b.got == c.got == d.got and a.got[0][0] == "tree_verify_wgmma"


def test_dequant_path_zero_batch_and_no_pages(fake_device):
    new = Arrays()
    args = verify_args(FP8, new)
    zero = dict(args, **{k: new((0, *args[k].__cuda_array_interface__["shape"][1:]), args[k].__cuda_array_interface__[
        "typestr"]) for k in ("q_nope", "q_pe", "block_table", "tree_mask", "out", "lse")},
        prefix_lens=new((0,), np.int32), q_lens=new((0,), np.int32))
    k0 = Recording(FP8)
    tv.tree_verify(k0, **zero, fp8_path="dequant", kv_workspace=_ws(FP8, new, b=0))
    assert k0.got == []
    nopages = dict(args, block_table=new((B, 0), np.int32))
    k1 = Recording(FP8)
    tv.tree_verify(k1, **nopages, num_splits=1, fp8_path="dequant", kv_workspace=_ws(FP8, new, max_pages=0))
    assert [g[0] for g in k1.got] == [DEQUANT]   # no page to convert: the kernel alone (it reads no key)


@pytest.mark.parametrize("change,words", [
    (dict(fp8_path="Dequant"), "fp8_path: 'Dequant', expected None"),
    (dict(fp8_path=1), "fp8_path: 1, expected None"),
    (dict(fp8_path=("dequant",)), "fp8_path: .*expected None"),
    (dict(kv_workspace="ws", impl="simple"), "kv_workspace: only the dequantize path takes it, but fp8_path=None "
                                             "takes the fused kernel here: impl='simple'"),
    (dict(kv_workspace="ws"), "kv_workspace: "),   # the default takes it (the dequantize path): its checks
    (dict(fp8_path="fused", kv_workspace="ws"), "kv_workspace: only the dequantize path"),
    (dict(fp8_path="dequant", impl="simple"), "fp8_path: 'dequant' runs on the wgmma kernels"),
    (dict(fp8_path="dequant", impl="mma"), "fp8_path: 'dequant' runs on the wgmma kernels"),
    (dict(fp8_path="dequant", impl="fast"), "impl: 'fast'"),
    (dict(fp8_path="dequant", kv_scale=None), "kv_scale: required"),
    (dict(fp8_path="dequant", softmax_scale=math.inf), "softmax_scale"),
    (dict(fp8_path="dequant", num_splits=0), "num_splits"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_fp8_path_argument_errors(change, words, fake_device):
    kset = Recording(FP8)
    with pytest.raises(ArgumentError, match=words):
        tv.tree_verify(kset, **{**verify_args(FP8, Arrays()), **change})
    assert kset.got == []


@pytest.mark.parametrize("case,words", [
    ("dtype", "kv_workspace: dtype float32, expected bf16"),
    ("small", "kv_workspace: .* bf16 elements, B = 2 requests x max_pages = 4 need"),
    ("strided", "kv_workspace: not C-contiguous"),
    ("misaligned", "kv_workspace: data pointer .* not 16-byte aligned"),
    ("overlaps-cache", "kv_workspace: overlaps kv_cache"),
    ("overlaps-out", "overlaps out"),
    ("other-device", "kv_workspace: on device 1"),
])
def test_kv_workspace_errors(case, words, fake_device):
    new = Arrays()
    args = verify_args(FP8, new)
    elems = kd_plans.workspace_elems(FP8, B, MAX_PAGES)
    kvw = {"dtype": lambda: new((elems,), np.float32),
           "small": lambda: new((elems - 1,), np.uint16),
           "strided": lambda: new((elems, 2), np.uint16, strides=(2, 2 * elems)),
           "misaligned": lambda: new((elems,), np.uint16, ptr=(1 << 32) * 77 + 2),
           "overlaps-cache": lambda: new((elems,), np.uint16, ptr=ptr_of(args["kv_cache"])),
           "overlaps-out": lambda: new((elems,), np.uint16, ptr=ptr_of(args["out"]) + 64),
           "other-device": lambda: new((elems,), np.uint16, ptr=1 << 41)}[case]()
    kset = Recording(FP8)
    with pytest.raises(ArgumentError, match=words):
        tv.tree_verify(kset, **args, num_splits=1, fp8_path="dequant", kv_workspace=kvw)
    assert kset.got == []


def test_fp8_path_refused_for_bf16(fake_device):
    kset = Recording(BF16, ("tree_verify", "tree_verify_wgmma", "tree_verify_mma_combine"))
    with pytest.raises(ArgumentError, match="kv_workspace: only the dequantize path .* kv_dtype 'bf16'"):
        tv.tree_verify(kset, **verify_args(BF16, Arrays()), kv_workspace=_ws(FP8, Arrays()))
    assert kset.got == [] and tv.fp8_default(kset, "auto", 0, B, MAX_PAGES)[0] is None
    for path in ("fused", "dequant"):
        kset = Recording(BF16, ("tree_verify", "tree_verify_tail", "merge_states", "tree_verify_wgmma",
                                "tree_verify_mma_combine"))
        with pytest.raises(ArgumentError, match="fp8_path: given .* kv_dtype 'bf16'"):
            tv.tree_verify(kset, **verify_args(BF16, Arrays()), fp8_path=path)
        assert kset.got == []
    with pytest.raises(ArgumentError, match="not built for kv_dtype 'bf16'"):   # the build by name
        wg.tree_verify(Recording(BF16, ("tree_verify_wgmma",)), **verify_args(BF16, Arrays()), build="dequant")


# ------------------------------------------------------------------------ fp8_path=None: the policy (fp8_default)

PAGE_BYTES = 64 * 576 * 2 + 4   # a workspace page and its table entry (the shipped fp8 specs)


class Unavailable(Recording):
    """A stand-in whose kernels `off` do not run on the device (as the wgmma builds on an A100)."""

    def __init__(self, spec, off, kernels=DEQUANT_SET):
        super().__init__(spec, kernels)
        self.off = off

    def unavailable(self, name, device):
        return f"{name}: not available on device {device} (test)" if name in self.off else \
            super().unavailable(name, device)


def test_fp8_default_every_rule(monkeypatch):
    """fp8_default: the dequantize path when every rule holds (impl auto / wgmma, its three kernels loaded and
    running on the device, the workspace within KV_WORKSPACE_LIMIT: 512 MiB, B x max_pages counted, or the caller's
    kv_workspace); the fused kernel, with the first failing rule as its reason, otherwise; a bf16 spec has none."""
    limit = tv.KV_WORKSPACE_LIMIT
    kernels = tv.dequant_kernels(Recording(FP8))   # the dequantize path's: the build whose record reads the workspace
    assert limit == 512 * 2**20 and kernels == ("kv_dequant", DEQUANT, "tree_verify_mma_combine")
    fits = limit // PAGE_BYTES   # 7281 pages
    assert 2 * kd_plans.workspace_elems(FP8, 1, fits) <= limit < 2 * kd_plans.workspace_elems(FP8, 1, fits + 1)
    ks = Recording(FP8)

    def path(kset=ks, impl="auto", device=0, b=1, max_pages=fits, kvw=False, name="tree_verify"):
        return tv.fp8_default(kset, impl, device, b, max_pages, kvw, name)

    for impl in ("auto", "wgmma"):   # every rule holds, the workspace exactly at the limit
        assert path(impl=impl) == ("dequant", f"the workspace is {fits * PAGE_BYTES / 2**20:.1f} MiB (B = 1 x "
                                              f"max_pages = {fits} bf16 pages), within KV_WORKSPACE_LIMIT = 512 MiB")
    for b, max_pages in ((8, 64), (32, 64), (64, 32), (8, 256), (1, 1), (0, 0), (3, 0)):   # the bench's shapes, ends
        assert path(b=b, max_pages=max_pages)[0] == "dequant", (b, max_pages)
    # 1. the launcher
    assert path(name="tree_verify_tail") == ("fused", "tree_verify_tail has no dequantize path")
    # 2. impl
    for impl in ("simple", "mma", "fast", ["auto"], None):
        p, why = path(impl=impl)
        assert p == "fused" and why == f"impl={impl!r}: the dequantize path runs on the wgmma kernels (impl 'auto' " \
                                       f"or 'wgmma')"
    # 3. loaded (each of the three; the direct launcher's fused kernel may stay)
    for missing in kernels:
        kset = Recording(FP8, tuple(k for k in DEQUANT_SET if k != missing))
        assert path(kset) == ("fused", f"{missing} not loaded in this kernel set")
    assert path(Recording(FP8, ("tree_verify",)))[1] == f"kv_dequant and {DEQUANT} and tree_verify_mma_combine " \
                                                        f"not loaded in this kernel set"
    # 4. the device: not known (the checks will say why), or one that does not run a kernel of the path
    assert path(device=None) == ("fused", "the arrays' device is not known")
    for off in kernels:
        assert path(Unavailable(FP8, (off,))) == ("fused", f"{off}: not available on device 0 (test)")
    # 5. the workspace: over the limit by one page (B x max_pages counts), unless the caller gives it
    assert path(max_pages=fits + 1) == ("fused", f"the workspace would be {(fits + 1) * PAGE_BYTES / 2**20:.1f} MiB "
                                                 f"(B = 1 x max_pages = {fits + 1} bf16 pages), over "
                                                 f"KV_WORKSPACE_LIMIT = 512 MiB")
    assert path(b=fits + 1, max_pages=1)[0] == "fused" and path(b=2, max_pages=fits // 2 + 1)[0] == "fused"
    assert path(b=64, max_pages=2048)[0] == "fused"                        # 9.0 GiB
    assert path(b=64, max_pages=2048, kvw=True) == ("dequant", "the caller's kv_workspace")
    assert path(impl="simple", kvw=True)[0] == "fused"                     # an earlier rule still decides
    monkeypatch.setattr(verify_route, "KV_WORKSPACE_LIMIT", 0)                       # the module constant, read per decision
    assert path(b=1, max_pages=1)[0] == "fused" and path(kvw=True)[0] == "dequant"
    assert path(b=0, max_pages=0)[0] == "fused"                            # one page at least (workspace_layout)
    assert path(Recording(BF16, ("tree_verify",))) == (None, "spec 'kimi-k2.6-tp8' has kv_dtype 'bf16': no fp8 path")


def _fake_allocation(monkeypatch, new):
    """The runtime's allocations as fake arrays (no GPU here): a default call may allocate its kv_workspace."""
    from ddtree_gen.launch import runtime
    monkeypatch.setattr(runtime, "allocate", lambda kind, device, shape, dtype: new(
        shape, np.uint16 if dtype == "bf16" else dtype))
    monkeypatch.setattr(runtime, "pointer_of", ptr_of)


def test_default_path_follows_the_policy(fake_device, monkeypatch):
    """fp8_path=None launches what fp8_default says, decided per call signature: the dequantize path (its workspace
    allocated per call as a scratch array, or the caller's) within the limit, the fused kernel past it (nothing
    allocated for it) and where a rule fails; tree_verify_tail stays fused; explicit choices ignore the limit."""
    new = Arrays()
    _fake_allocation(monkeypatch, new)
    args = verify_args(FP8, new)
    kvw = _ws(FP8, new)
    # the limit: exactly this call's workspace (B x MAX_PAGES pages); one more page of block table is over it
    monkeypatch.setattr(verify_route, "KV_WORKSPACE_LIMIT", 2 * kd_plans.workspace_elems(FP8, B, MAX_PAGES))
    wide = dict(args, block_table=new((B, MAX_PAGES + 1), np.int32))
    ks = Recording(FP8)
    allocated = []
    real = Arrays.__call__
    monkeypatch.setattr(Arrays, "__call__", lambda self, shape, dtype, **kw: allocated.append(tuple(shape)) or
                        real(self, shape, dtype, **kw))
    for _ in range(2):   # the second call of each signature: the cached decision
        tv.tree_verify(ks, **args, num_splits=1)
        tv.tree_verify(ks, **wide, num_splits=1)
    assert [g[0] for g in ks.got] == ["kv_dequant", DEQUANT, "tree_verify_wgmma"] * 2
    assert allocated == [(kd_plans.workspace_elems(FP8, B, MAX_PAGES),)] * 2   # per call, for the dequantize path
    dq_ws = [g[2][4] for g in ks.got if g[0] == "kv_dequant"]
    fused = Recording(FP8)
    tv.tree_verify(fused, **wide, num_splits=1, fp8_path="fused")
    assert ks.got[2] == fused.got[0]
    # the caller's kv_workspace fits any size; with it nothing is allocated
    big = _ws(FP8, new, max_pages=MAX_PAGES + 1)
    allocated.clear()
    ks = Recording(FP8)
    tv.tree_verify(ks, **wide, num_splits=1, kv_workspace=big)
    tv.tree_verify(ks, **args, num_splits=1, kv_workspace=kvw, impl="wgmma")
    assert [g[0] for g in ks.got] == ["kv_dequant", DEQUANT] * 2 and allocated == [] and dq_ws[0] != ptr_of(kvw)
    assert ks.got[0][2][4] == ptr_of(big) and ks.got[2][2][4] == ptr_of(kvw)
    # explicit choices: "dequant" past the limit, "fused" within it
    ks = Recording(FP8)
    tv.tree_verify(ks, **wide, num_splits=1, fp8_path="dequant")
    tv.tree_verify(ks, **args, num_splits=1, fp8_path="fused")
    assert [g[0] for g in ks.got] == ["kv_dequant", DEQUANT, "tree_verify_wgmma"]
    # a failing rule: the fused kernel impl picks, or the CUDA-core one; kv_workspace then refused, naming the rule
    for kset, kw, want in ((Recording(FP8), {"impl": "simple"}, "tree_verify"),
                           (Recording(FP8, tuple(k for k in DEQUANT_SET if k != "kv_dequant")), {},
                            "tree_verify_wgmma"),
                           (Unavailable(FP8, (DEQUANT,)), {}, "tree_verify_wgmma"),
                           (Unavailable(FP8, (DEQUANT, "tree_verify_wgmma")), {}, "tree_verify")):
        tv.tree_verify(kset, **args, **kw, **({} if kw else {"num_splits": 1}))
        assert [g[0] for g in kset.got] == [want], (kset, kw)
        why = tv.fp8_default(kset, kw.get("impl", "auto"), 0, B, MAX_PAGES)[1]
        with pytest.raises(ArgumentError, match=re.escape(f"kv_workspace: only the dequantize path takes it, but "
                                                          f"fp8_path=None takes the fused kernel here: {why}")):
            tv.tree_verify(kset, **args, **kw, kv_workspace=kvw)
        assert len(kset.got) == 1
    # tree_verify_tail: the fused kernel, whatever is loaded
    ks = Recording(FP8)
    tv.tree_verify_tail(ks, **args, num_splits=1)
    assert [g[0] for g in ks.got] == ["tree_verify_tail_wgmma"]


def test_default_path_plan(fake_device):
    """The default's plan within the limit is the dequantize path's (its kv_workspace a scratch output of the call,
    workspace_elems(spec, B, max_pages) bf16); a block table the checks refuse is refused with their message."""
    from ddtree_gen.ops.tree_verify.tensor_core import KVW
    a = verify_args(FP8, Arrays())
    names = ("q_nope", "q_pe", "kv_cache", "block_table", "prefix_lens", "q_lens", "tree_mask")
    arrays = (*(a[k] for k in names), None, None, None, None)
    for impl in ("auto", "wgmma"):
        prep = tv.prepare(Recording(FP8), tv.VerifyCall("tree_verify", arrays, a["softmax_scale"], KV_SCALE, False, impl,
                                                        1))
        assert [s.kernel for s in prep.steps] == ["kv_dequant", DEQUANT]
        assert (KVW, (kd_plans.workspace_elems(FP8, B, MAX_PAGES),), "bf16") in prep.new and KVW in prep.scratch
    bad = dict(a, block_table=Arrays()((B * MAX_PAGES,), np.int32))
    with pytest.raises(ArgumentError, match="block_table"):
        tv.tree_verify(Recording(FP8), **bad)


@pytest.mark.parametrize("missing", ["kv_dequant", DEQUANT])
def test_fp8_path_needs_its_kernels(missing, fake_device):
    kset = Recording(FP8, tuple(k for k in DEQUANT_SET if k != missing))
    with pytest.raises(ArgumentError, match=f"fp8_path: 'dequant' needs {missing}"):
        tv.tree_verify(kset, **verify_args(FP8, Arrays()), fp8_path="dequant")
    assert kset.got == []


def test_dequant_path_key_and_cache(fake_device):
    """A second call of the same signature is the cached one (no new checks), and a different fp8_path is another
    signature: each reaches its own kernels (the default: the dequantize path here)."""
    new = Arrays()
    args = verify_args(FP8, new)
    kvw = _ws(FP8, new)
    kset = Recording(FP8)
    for _ in range(2):
        tv.tree_verify(kset, **args, num_splits=1, fp8_path="dequant", kv_workspace=kvw)
    tv.tree_verify(kset, **args, num_splits=1, fp8_path="fused")
    tv.tree_verify(kset, **args, num_splits=1, kv_workspace=kvw)
    assert [g[0] for g in kset.got] == ["kv_dequant", DEQUANT, "kv_dequant", DEQUANT, "tree_verify_wgmma",
                                        "kv_dequant", DEQUANT]


def test_torch_op_passes_fp8_path(monkeypatch):
    """torch.ops.ddtree.tree_verify's last argument reaches the launcher as fp8_path."""
    need("torch")
    from ddtree_gen import torch_ops
    seen = {}

    class K:
        def tree_verify(self, *a, **kw):
            seen.update(kw)
            return "ok"
    monkeypatch.setattr(torch_ops, "_kset", lambda spec: K())
    op = torch_ops.implementation("tree_verify")
    assert op("kimi-k2.6-tp8-fp8", *range(8), "auto", 0.5, "dequant") == "ok"
    assert seen == {"impl": "auto", "kv_scale": 0.5, "fp8_path": "dequant"}
    op("kimi-k2.6-tp8-fp8", *range(8), "auto", 0.5)
    assert seen["fp8_path"] is None


def test_bench_kv_dtype_loads_the_dequantize_path():
    """bench kv-dtype's fp8 column of the dequantize path: kv_dequant and tree_verify_wgmma's two dequantize builds
    (a kernel loaded by name brings each of its builds) are built for every fp8 spec the bench makes (the shipped ones
    and the unshipped H variants), never for a bf16 one."""
    from ddtree_gen.bench import kv_dtype as bench
    from ddtree_gen.bench.specs import spec_variant
    from ddtree_gen.ops import builds_of
    assert set(bench.DEQUANT_KERNELS) == {"kv_dequant"} and "tree_verify_wgmma" in bench.KV_DTYPE_KERNELS
    assert {DEQUANT, DEQUANT_PARTS} <= {k.name for k in builds_of("tree_verify_wgmma")}
    for h in sorted({h for _, h, _ in bench.KV_DTYPE_CONFIGS}):
        for name in (*bench.DEQUANT_KERNELS, DEQUANT, DEQUANT_PARTS):
            assert by_name(name).builds_for(spec_variant(BF16, h, "fp8_e4m3")), (h, name)
            assert not by_name(name).builds_for(spec_variant(BF16, h, "bf16")), (h, name)


# ------------------------------------------------------------------------ kv_dequant's build options

def test_build_options_default_and_names():
    """The default build is one block of 256 threads per half page (two parts per page) with warp stores (file
    kv_dequant.cu); the first kernel stays the build parts=1, store="pair" (its body as it was); every other option is
    a build named by its knobs, rendered with its constants."""
    from ddtree_gen.build.render import render
    kdef = by_name("kv_dequant")
    v = variant(kdef, FP8)
    assert v.name == "kv_dequant" and v.is_default and v.config == kd_plans.KNOBS
    c = v.plan().template_constants()
    assert (c["PARTS"], c["WARP_STORE"], c["THREADS"]) == (2, 1, 256)
    first = variant(kdef, FP8, parts=1, store="pair")
    assert first.name == "kv_dequant.p1.pair" and first.plan().template_constants()["WARP_STORE"] == 0
    assert "the first kernel's body" not in render(variant(kdef, FP8, store="pair"))   # parts 2: the general body
    assert "the first kernel's body" in render(first) and "the first kernel's body" not in render(v)
    names = {variant(kdef, FP8, **k).name for k in kd_plans.CANDIDATES + kd_plans.EDGE_OPTIONS}
    assert len(names) == len(kd_plans.CANDIDATES) + len(kd_plans.EDGE_OPTIONS)   # distinct builds
    assert kd_plans.CANDIDATES[0] == {} and {"parts": 1, "store": "pair"} in kd_plans.CANDIDATES
    s = variant(kdef, FP8, parts=3, store="pair", threads=128)
    assert s.name == "kv_dequant.p3.pair.t128" and not s.is_default
    c = s.plan().template_constants()
    assert (c["PARTS"], c["WARP_STORE"], c["THREADS"]) == (3, 0, 128)
    text = render(s)
    assert "the first kernel's body" not in text and "#define PARTS 3" in text and "#define WARP_STORE 0" in text
    # the retired options left the template (no build renders them)
    for build in (v, first, s):
        text = render(build)
        assert not [w for w in ("STREAM", "L2_HINT", "MIN_BLOCKS", "createpolicy", "st.global.cs") if w in text]


@pytest.mark.parametrize("knobs,words", [
    (dict(store="scatter"), "store 'scatter', one of pair, warp"),
    (dict(parts=0), "parts 0, an integer in"),
    (dict(parts=2.0), "parts 2.0, an integer in"),
    (dict(threads=100), "threads 100, a multiple of 32"),
    (dict(threads=2048), "threads 2048, a multiple of 32"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_build_option_errors(knobs, words):
    from ddtree_gen.errors import SpecError
    with pytest.raises(SpecError, match=words):
        variant(by_name("kv_dequant"), FP8, **knobs).plan()


@pytest.mark.parametrize("knobs", [dict(schedule="stream"), dict(schedule="page"), dict(l2="src_evict_first"),
                                   dict(l2="streaming", parts=1)], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_retired_build_knobs_refused(knobs):
    """The stream schedule and the L2 hints are retired (measured no better): no longer knobs of the variant, and a
    config that still names one, whatever its value, is refused by the plan naming the knob and the journal section
    that holds the figures (as tree_verify_wgmma's retired knobs: tests/test_variants.py)."""
    from ddtree_gen.errors import BuildError, SpecError
    knob = next(iter(knobs))
    with pytest.raises(BuildError, match=f"no knob '{knob}'"):
        variant(by_name("kv_dequant"), FP8, **knobs)
    with pytest.raises(SpecError, match=f'kv_dequant: {knob}: a retired build knob, measured no better '
                                        f'\\(docs/perf/journal-fp8.md "The pre-pass at the copy rate"'):
        kd_plans.plan(FP8, {**kd_plans.KNOBS, **knobs})
    with pytest.raises(SpecError, match="kv_dequant: no build option 'min_blocks', its options: parts, store, threads"):
        kd_plans.plan(FP8, {**kd_plans.KNOBS, "min_blocks": 2})


def test_retired_knobs_figures_exist():
    """The section a retired knob's error names is a real heading of the journal file it names."""
    from pathlib import Path
    import re
    for where in set(kd_plans.RETIRED.values()):
        path, section = re.fullmatch(r'(\S+) "(.+)"', where).groups()
        text = (Path(__file__).resolve().parents[1] / path).read_text()
        assert re.search(rf"^#+ {re.escape(section)}\b", text, re.M), where


def test_dequant_grid():
    """One block per work unit (B x max_pages x parts), refused past 2^31 - 1 naming block_table."""
    kdef = by_name("kv_dequant")
    page = variant(kdef, FP8, parts=3).plan().template_constants()
    assert kd.dequant_grid(page, 8, 66) == 8 * 66 * 3
    assert kd.dequant_grid(variant(kdef, FP8, parts=1).plan().template_constants(), 1, 66) == 66
    assert kd.dequant_grid(variant(kdef, FP8).plan().template_constants(), 1, 66) == 132   # the default
    with pytest.raises(ArgumentError, match="block_table: 32768 requests x 32768 pages x 3 parts"):
        kd.dequant_grid(page, 2**15, 2**15)


def emulate_assignment(consts, b, max_pages):
    """The template's work assignment (templates/kv_dequant.cu.j2: units, parts, pieces; a block per unit) replayed
    in Python: per workspace page, how often each of its 16-byte output chunks is stored, and per (b, j) how often
    its table entry is written, if every page is converted."""
    vec = 8 if consts["WARP_STORE"] else 16
    pieces = consts["PAGE_BYTES"] // vec
    parts, threads = consts["PARTS"], consts["THREADS"]
    part_pieces = -(-pieces // parts)
    per_thread = -(-part_pieces // threads)
    out16 = np.zeros((b * max_pages, consts["PAGE_BYTES"] * 2 // 16), np.int64)
    table = np.zeros(b * max_pages, np.int64)
    t = np.arange(threads)
    for u in range(kd.dequant_grid(consts, b, max_pages)):   # block u: work unit u
        w, part = divmod(u, parts)
        table[w] += 1 if part == 0 else 0
        first = part * part_pieces
        end = min(first + part_pieces, pieces)
        c = (first + t[:, None] + threads * np.arange(per_thread)[None, :]).reshape(-1)
        c = c[c < end]
        if vec == 8:
            np.add.at(out16[w], c, 1)
        else:
            np.add.at(out16[w], 2 * c, 1)
            np.add.at(out16[w], 2 * c + 1, 1)
    return out16, table


@pytest.mark.parametrize("knobs", kd_plans.CANDIDATES + kd_plans.EDGE_OPTIONS,
                         ids=lambda k: ",".join(f"{a}={b}" for a, b in sorted(k.items())) or "default")
def test_work_assignment_covers_every_byte_once(knobs):
    """Every build option stores each 16-byte chunk of a converted workspace page exactly once and each table entry
    once, for a page of the shipped specs and one whose pieces the parts and threads do not divide."""
    kdef = by_name("kv_dequant")
    import dataclasses
    odd = dataclasses.replace(FP8, name="odd-fp8", page_size=3, kv_lora_rank=48, qk_rope_head_dim=16)
    for spec in (FP8, odd):
        consts = dict(variant(kdef, spec, **knobs).plan().template_constants())
        consts["PAGE_BYTES"] = spec.page_size * (spec.kv_lora_rank + spec.qk_rope_head_dim)
        for b, max_pages in ((1, 5), (3, 7)):
            out16, table = emulate_assignment(consts, b, max_pages)
            assert (out16 == 1).all(), (spec.name, b, max_pages, np.argwhere(out16 != 1)[:3])
            assert (table == 1).all(), (spec.name, b, max_pages)


def test_kv_dequant_pointer_checks_are_the_shared_helpers(fake_device):
    """The launcher's alignment and overlap checks are PointerChecks' (launch/checks.py), recorded for every later
    call of the signature: a cached call with a misaligned or overlapping out is refused with the same message."""
    new = Arrays()
    args = dq_args(FP8, new)
    kset = FakeKernelSet(FP8, ["kv_dequant"])
    kset.launch = lambda name, **kw: None
    out = reference.KvDequantOutput(new((B * MAX_PAGES, 64, 576), np.uint16), new((B, MAX_PAGES), np.int32))
    kd.launch(kset, **args, out=out)
    bad = reference.KvDequantOutput(new((B * MAX_PAGES, 64, 576), np.uint16, ptr=ptr_of(out.kv_cache) + 8),
                                    out.block_table)
    with pytest.raises(ArgumentError, match=r"out.kv_cache: data pointer 0x[0-9a-f]+ is not 16-byte aligned \(the "
                                            r"kv_dequant kernel writes it in 16-byte units\)"):
        kd.launch(kset, **args, out=bad)
    inside = reference.KvDequantOutput(out.kv_cache, new((B, MAX_PAGES), np.int32, ptr=ptr_of(out.kv_cache) + 4096))
    with pytest.raises(ArgumentError, match="out.block_table: overlaps out.kv_cache in memory"):
        kd.launch(kset, **args, out=inside)
    onto = reference.KvDequantOutput(out.kv_cache, new((B, MAX_PAGES), np.int32, ptr=ptr_of(args["q_lens"])))
    with pytest.raises(ArgumentError, match="out.block_table: overlaps q_lens in memory"):
        kd.launch(kset, **args, out=onto)
    misaligned = dict(args, kv_cache=new((PAGES, 64, 576), np.uint8, ptr=ptr_of(args["kv_cache"]) + 4))
    with pytest.raises(ArgumentError, match=r"kv_cache: data pointer 0x[0-9a-f]+ is not 16-byte aligned \(the "
                                            r"kv_dequant kernel reads it"):
        kd.launch(kset, **misaligned, out=out)


# ------------------------------------------------------------------------ scripts/compare_dequant.py

def _compare_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "compare_dequant.py"
    spec = importlib.util.spec_from_file_location("compare_dequant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def test_compare_script_parsing():
    """Its shapes are bench kv-dtype's; --shapes and --options are parsed and checked before anything needs a GPU;
    the default build is compared first, once."""
    import argparse
    from ddtree_gen.bench.kv_dtype import KV_DTYPE_CONFIGS
    mod, _ = _compare_script()
    assert mod.SHAPES == KV_DTYPE_CONFIGS
    args = mod.build_parser().parse_args(["--shapes", "8,8,4096", "1,128,64", "--options",
                                          "parts=3,store=pair", "default", "threads=256,store=warp"])
    assert args.shapes == [(8, 8, 4096), (1, 128, 64)]
    assert args.options == [{"parts": 3, "store": "pair"}, {}, {}]   # default knobs: dropped
    assert mod._options(args.options) == [{}, {"parts": 3, "store": "pair"}]
    assert mod._options(None) == [dict(k) for k in kd_plans.CANDIDATES] and kd_plans.CANDIDATES[0] == {}
    assert mod.option_label({"store": "pair", "parts": 2}) == "parts=2,store=pair" and mod.option_label({}) == "default"
    for bad, words in (("8,8", "expected B,H,L"), ("0,8,4096", "expected B,H,L"), ("a,b,c", "expected B,H,L")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            mod.parse_shape(bad)
    for bad, words in (("bogus=1", "no knob 'bogus'"), ("parts", "expected KNOB=VALUE"),
                       ("parts=0", "parts 0, an integer in"), ("store=scatter", "store 'scatter', one of pair, warp"),
                       ("schedule=stream", "schedule: a retired build knob, measured no better"),
                       ("l2=streaming", "l2: a retired build knob")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            mod.parse_knobs(bad)


def test_compare_script_without_gpu_says_so_in_one_line(tmp_path):
    import os
    import subprocess
    import sys
    from ddtree_gen import needs
    why = needs.gpu_problem()
    if why is None:
        pytest.skip("a CUDA GPU is usable here: this test is of a machine without one")
    _, path = _compare_script()
    env = dict(os.environ, PYTHONPATH=str(path.parents[1]), DDTREE_GEN_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(path), "--shapes", "1,8,4096"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == needs.EXIT_MISSING and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: scripts/compare_dequant.py needs a CUDA GPU") \
        and why in lines[0], r.stderr



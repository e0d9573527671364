"""tree_verify, tree_verify_tail and merge_states on the GPU against the float64 numpy references.

These test the CUDA-core kernels: every tree_verify / tree_verify_tail call passes impl="simple"
(test_gpu_tree_verify_mma.py tests the tensor-core kernels; test_impl_auto here checks that the
default impl="auto" gives the tensor-core kernel's results when it is loaded).

The numerical bar of DESIGN.md, checked per (request, row, head): ||out - ref|| <= 5e-3 ||ref||,
|lse - ref| <= 1e-3, no NaN, every row < q_len written, every row >= q_len byte-identical to the
poison written before launch. Fresh random data every run: the seed is in every assertion
message (set DDTREE_TEST_SEED to replay one).

The references compute in float64 with numpy einsum (about 1 GMAC/s), so long-prefix cases are
checked on a few heads (always the first and the last, the others random); the whole output
is still checked for NaN, written rows and untouched rows. make_inputs() builds a batch (also
usable for timing).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pytest

from ddtree_gen import bf16, reference
from ddtree_gen.errors import ArgumentError
from verify_cases import (VerifyInputs, bf16_nan, fresh_seed, make_inputs, random_bf16_bounded as random_bf16,
                          to_device, to_host)

pytestmark = pytest.mark.gpu

OUT_TOL, LSE_TOL = 5e-3, 1e-3
POISON_OUT = 0xFFFF                 # a bf16 NaN pattern the kernels never write
POISON_LSE = np.uint32(0x7FC00000)  # float32 NaN
SCALES = {"mla": 192 ** -0.5, "one": 1.0}
KERNELS = ("tree_verify", "tree_verify_tail", "merge_states")
MMA_KERNELS = ("tree_verify_mma", "tree_verify_tail_mma", "tree_verify_mma_combine")
WGMMA_KERNELS = ("tree_verify_wgmma", "tree_verify_tail_wgmma")


@pytest.fixture
def vset(spec):
    """The spec's compiled attention kernels only (no need to build the other families)."""
    import ddtree_gen
    return ddtree_gen.load(spec, kernels=KERNELS)


def poisoned(shape):
    """Device out / lse buffers filled with the poison patterns."""
    b, nq, h, r = shape
    out = np.full((b, nq, h, r), POISON_OUT, np.uint16)
    lse = np.full((b, nq, h), POISON_LSE, np.uint32).view(np.float32)
    return to_device(out), to_device(lse)


def run(vset, name, inp: VerifyInputs, scale, impl="simple", **replace):
    """Launch `name` (tree_verify / tree_verify_tail, the CUDA-core kernel unless `impl` says
    otherwise) into poisoned buffers; (out bits, lse) on the host."""
    out, lse = poisoned(inp.shape)
    res = getattr(vset, name)(**inp.device(**replace), softmax_scale=scale, out=out, lse=lse, impl=impl)
    assert res.out is out and res.lse is lse
    return to_host(out), to_host(lse)


def heads_to_check(h, rng, limit):
    if h <= limit:
        return np.arange(h)
    others = rng.choice(np.arange(1, h - 1), size=limit - 2, replace=False)
    return np.unique(np.concatenate([[0, h - 1], others]))


def check_rows_written(out_bits, lse, q_lens, tag, written=None):
    """Rows < q_len written (no NaN, so no poison), rows >= q_len untouched. `written[b]` False:
    the request must be left untouched entirely."""
    nq = out_bits.shape[1]
    for b, q in enumerate(q_lens):
        q = int(q) if (written is None or written[b]) else 0
        q = min(max(q, 0), nq)
        assert not bf16_nan(out_bits[b, :q]).any(), f"{tag}: NaN (unwritten?) out in request {b}, rows < q_len {q}"
        assert not np.isnan(lse[b, :q]).any(), f"{tag}: NaN (unwritten?) lse in request {b}, rows < q_len {q}"
        assert (out_bits[b, q:] == POISON_OUT).all(), f"{tag}: out of request {b} written at rows >= {q}"
        assert (lse[b, q:].view(np.uint32) == POISON_LSE).all(), f"{tag}: lse of request {b} written at rows >= {q}"


def check_against(out_bits, lse, ref, q_lens, heads, tag):
    """Per (request, row, head) bar against a float64 reference computed for `heads`."""
    worst_out, worst_lse = 0.0, 0.0
    for b, q in enumerate(q_lens):
        q = int(q)
        got_o = bf16.from_bits(out_bits[b, :q][:, heads]).astype(np.float64)    # [q, h', R]
        got_l = lse[b, :q][:, heads].astype(np.float64)
        ref_o, ref_l = ref.out[b, :q], ref.lse[b, :q]
        empty = np.isneginf(ref_l)
        if empty.any():  # no visible key: exactly 0 and -inf
            assert (out_bits[b, :q][:, heads][empty] == 0).all(), f"{tag}: empty row of request {b}: out not 0"
            assert np.isneginf(got_l[empty]).all(), f"{tag}: empty row of request {b}: lse {got_l[empty]} not -inf"
        full = ~empty
        err = np.linalg.norm(got_o - ref_o, axis=-1)[full]
        norm = np.linalg.norm(ref_o, axis=-1)[full]
        rel = err / np.maximum(norm, 1e-30)
        with np.errstate(invalid="ignore"):   # -inf - -inf in empty rows, left out by `full`
            dl = np.abs(got_l - ref_l)[full]
        if rel.size:
            k = int(np.argmax(rel))
            worst_out = max(worst_out, float(rel[k]))
            assert rel[k] <= OUT_TOL, (f"{tag}: request {b}: ||out - ref|| / ||ref|| = {rel[k]:.3g} > {OUT_TOL} at "
                                       f"(row, head) {np.argwhere(full)[k]} (heads checked {list(heads)})")
            k = int(np.argmax(dl))
            worst_lse = max(worst_lse, float(dl[k]))
            assert dl[k] <= LSE_TOL, (f"{tag}: request {b}: |lse - ref| = {dl[k]:.3g} > {LSE_TOL} at "
                                      f"(row, head) {np.argwhere(full)[k]} (got {got_l[full][k]}, "
                                      f"ref {ref_l[full][k]})")
    return worst_out, worst_lse


def verify_and_check(vset, name, inp, scale, heads, tag):
    out_bits, lse = run(vset, name, inp, scale)
    check_rows_written(out_bits, lse, inp.q_lens, tag)
    host = inp.host()
    fn = reference.tree_verify if name == "tree_verify" else reference.tree_verify_tail
    ref = fn(**{**host, "q_nope": host["q_nope"][:, :, heads], "q_pe": host["q_pe"][:, :, heads]},
             softmax_scale=scale)
    check_against(out_bits, lse, ref, inp.q_lens, heads, tag)
    return out_bits, lse


# ------------------------------------------------------------------------------- matrix

@dataclass
class Case:
    id: str
    prefix: object          # list, or callable(rng) -> list
    qlens: object
    trees: object
    scale: str
    nq: int | None = None
    heads: int = 4          # heads checked against the reference
    junk: bool = False


def _b64(rng):
    return [int(x) for x in rng.integers(0, 300, 64)]


CASES = [
    Case("b1-L0-q1", [0], [1], ["chain"], "mla"),
    Case("b1-L1-q2", [1], [2], ["chain"], "one"),
    Case("b7-small", [0, 1, 63, 64, 65, 127, 128], [65, 2, 33, 64, 65, 1, 17],
         ["random", "chain", "star", "binary", "random", "chain", "random"], "mla", junk=True),
    Case("b7-nq33", [5, 0, 200, 64, 1, 31, 33], [33, 1, 2, 33, 17, 32, 5],
         ["binary", "chain", "random", "star", "random", "random", "chain"], "one", nq=33),
    Case("b3-L4096", [4096, 4095, 4097], [65, 2, 1], ["star", "binary", "random"], "one", heads=2),
    Case("b2-L16500", [16500, 16383], [17, 2], ["random", "chain"], "mla", heads=2),
    Case("b1-L100000", [100000], [2], ["chain"], "mla", heads=2),
    Case("b64-mixed", _b64, lambda rng: [int(x) for x in rng.choice([1, 2, 33, 64, 65], 64)],
         lambda rng: list(rng.choice(["random", "chain", "star", "binary"], 64)), "one", heads=2, junk=True),
]


def build_case(spec, case: Case, seed):
    rng = np.random.default_rng(seed)
    prefix = case.prefix(rng) if callable(case.prefix) else case.prefix
    qlens = case.qlens(rng) if callable(case.qlens) else case.qlens
    trees = case.trees(rng) if callable(case.trees) else case.trees
    nq = min(case.nq or spec.max_tree_size, spec.max_tree_size)
    qlens = [min(q, nq) for q in qlens]
    inp = make_inputs(spec, rng, prefix, qlens, trees, nq=nq, junk_bits=case.junk, seed=seed)
    return inp, rng


@pytest.mark.parametrize("name", ["tree_verify", "tree_verify_tail"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matrix(vset, spec, case, name):
    seed = fresh_seed()
    inp, rng = build_case(spec, case, seed)
    heads = heads_to_check(spec.num_heads, rng, case.heads)
    tag = f"{name} {spec.name} {case.id} seed={seed}"
    verify_and_check(vset, name, inp, SCALES[case.scale], heads, tag)


def test_empty_rows(vset, spec):
    """prefix_len 0 and a mask row without bits in [0, q_len): out exactly 0, lse -inf."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [0, 0, 3], [3, 1, 2], ["chain", "chain", "chain"], seed=seed)
    inp.tree_mask[0, 0] = 0                      # row 0 sees nothing
    inp.tree_mask[0, 1] = np.uint32(1 << 3)      # only bit 3 >= q_len: still nothing
    inp.tree_mask[1, 0] = ~np.uint32(1)          # every bit but 0: nothing within q_len 1
    inp.tree_mask[2, :2] = 0                     # prefix 3: rows still see the prefix
    heads = np.arange(spec.num_heads)
    for name in ("tree_verify", "tree_verify_tail"):
        tag = f"{name} {spec.name} empty seed={seed}"
        out_bits, lse = verify_and_check(vset, name, inp, SCALES["mla"], heads, tag)
        for b, i in [(0, 0), (0, 1), (1, 0)]:
            assert (out_bits[b, i] == 0).all() and np.isneginf(lse[b, i]).all(), tag
        assert (out_bits[0, 2] != 0).any() and np.isfinite(lse[0, 2]).all(), tag   # sees itself
        if name == "tree_verify":
            assert np.isfinite(lse[2, :2]).all(), tag
        else:
            assert np.isneginf(lse[2, :2]).all() and (out_bits[2, :2] == 0).all(), tag


def test_composition_prefix_plus_tail(vset, spec):
    """tree_verify == merge_states(tree_verify with an all-zero mask (prefix only), tail)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n = spec.max_tree_size
    inp = make_inputs(spec, rng, [0, 4096, 100, 64], [n, min(33, n), 2, n - 1], ["random", "binary", "chain", "star"],
                      seed=seed)
    tag = f"{spec.name} composition seed={seed}"
    scale = SCALES["mla"]
    full_o, full_l = run(vset, "tree_verify", inp, scale)
    pre_o, pre_l = run(vset, "tree_verify", inp, scale, tree_mask=np.zeros_like(inp.tree_mask))
    tail_o, tail_l = run(vset, "tree_verify_tail", inp, scale)
    assert np.isneginf(pre_l[0, :n]).all() and (pre_o[0, :n] == 0).all(), tag  # no prefix: empty
    merged = vset.merge_states(to_device(pre_o), to_device(pre_l), to_device(tail_o), to_device(tail_l))
    m_o, m_l = to_host(merged.out), to_host(merged.lse)
    for b, q in enumerate(inp.q_lens):
        f = bf16.from_bits(full_o[b, :q]).astype(np.float64)
        m = bf16.from_bits(m_o[b, :q]).astype(np.float64)
        rel = np.linalg.norm(m - f, axis=-1) / np.linalg.norm(f, axis=-1)
        assert rel.max() <= OUT_TOL, f"{tag}: request {b}: merged vs full {rel.max():.3g}"
        assert np.abs(m_l[b, :q] - full_l[b, :q]).max() <= LSE_TOL, f"{tag}: request {b}: lse"


def test_out_none_allocates_cupy(vset, spec):
    import cupy
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [70, 0], [65, 5], ["random", "star"], seed=seed)
    res = vset.tree_verify(**inp.device(), softmax_scale=SCALES["mla"], impl="simple")
    assert isinstance(res.out, cupy.ndarray) and res.out.dtype == np.uint16 and res.out.shape == inp.shape
    assert isinstance(res.lse, cupy.ndarray) and res.lse.dtype == np.float32 and res.lse.shape == inp.shape[:3]
    out_bits, lse = run(vset, "tree_verify", inp, SCALES["mla"])
    for b, q in enumerate(inp.q_lens):  # deterministic: the same bits as into given buffers
        assert (to_host(res.out)[b, :q] == out_bits[b, :q]).all(), f"seed={seed}"
        assert (to_host(res.lse)[b, :q].view(np.uint32) == lse[b, :q].view(np.uint32)).all(), f"seed={seed}"


@pytest.mark.parametrize("name", ["tree_verify", "tree_verify_tail"])
def test_impl_auto(vset, spec, name):
    """impl="auto" (the default) is the fastest tensor-core kernel the kernel set has: the same bits
    as <name>_wgmma called directly when it is loaded, as <name>_mma when only that family is, within
    the bar of the reference; impl="wgmma" / "mma" pick that kernel; on a set without them (vset),
    auto is the CUDA-core kernel and impl="wgmma" / "mma" are refused."""
    import ddtree_gen
    full = ddtree_gen.load(spec, kernels=KERNELS + MMA_KERNELS + WGMMA_KERNELS)
    mma_only = ddtree_gen.load(spec, kernels=KERNELS + MMA_KERNELS)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [70, 0, 1000], [65, 5, 33], ["random", "star", "binary"], seed=seed)
    scale = SCALES["mla"]
    tag = f"{name} {spec.name} auto seed={seed}"
    heads = heads_to_check(spec.num_heads, rng, 4)
    host = inp.host()
    fn = reference.tree_verify if name == "tree_verify" else reference.tree_verify_tail
    ref = fn(**{**host, "q_nope": host["q_nope"][:, :, heads], "q_pe": host["q_pe"][:, :, heads]},
             softmax_scale=scale)

    def launch(fn, **kw):
        out, lse = poisoned(inp.shape)
        res = fn(**inp.device(), softmax_scale=scale, out=out, lse=lse, **kw)
        assert res.out is out and res.lse is lse
        return to_host(out), to_host(lse)

    direct = {kind: launch(getattr(full, f"{name}_{kind}")) for kind in ("wgmma", "mma")}
    for ks, kw, want in ((full, {}, "wgmma"), (full, {"impl": "auto"}, "wgmma"), (full, {"impl": "wgmma"}, "wgmma"),
                         (full, {"impl": "mma"}, "mma"), (mma_only, {}, "mma")):
        got_o, got_l = launch(getattr(ks, name), **kw)
        want_o, want_l = direct[want]
        assert (got_o == want_o).all() and (got_l.view(np.uint32) == want_l.view(np.uint32)).all(), \
            f"{tag} {kw} {ks.kernels}: not the {want} kernel's bits"
        check_rows_written(got_o, got_l, inp.q_lens, tag)
        check_against(got_o, got_l, ref, inp.q_lens, heads, tag)
    with pytest.raises(ArgumentError, match="impl: 'wgmma' needs"):
        launch(getattr(mma_only, name), impl="wgmma")
    # without the tensor-core kernels loaded: auto is the CUDA-core kernel, "wgmma" / "mma" an ArgumentError
    assert not set(MMA_KERNELS + WGMMA_KERNELS) & set(vset.kernels)
    simple = run(vset, name, inp, scale)
    auto = run(vset, name, inp, scale, impl="auto")
    assert (simple[0] == auto[0]).all() and (simple[1].view(np.uint32) == auto[1].view(np.uint32)).all(), tag
    for impl in ("wgmma", "mma"):
        with pytest.raises(ArgumentError, match="impl"):
            run(vset, name, inp, scale, impl=impl)


# ------------------------------------------------------------------- device-side values

def test_device_values_are_clamped(vset, spec):
    """Without validate=True, bad device-side lengths and pages never fault: a request with a bad
    q_len or a negative prefix_len writes nothing, a key on a page outside [0, num_pages) or past
    the block table is not visible (compared to the reference with those tree bits cleared)."""
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    nq = spec.max_tree_size
    # request 0: prefix page + 10, a bad page in the tree tail; 1: a huge page id; 2-4: bad lengths
    prefix = [page + 10, 10, 5, 5, 5]
    inp = make_inputs(spec, rng, prefix, [nq] * 5, ["random"] * 5, seed=seed)
    scale = SCALES["mla"]
    good = inp.host()
    bad_table = inp.block_table.copy()
    bad_page0 = (prefix[0] + nq - 1) // page          # last page of request 0
    bad_table[0, bad_page0] = -1
    bad_page1 = (prefix[1] + nq - 1) // page
    bad_table[1, bad_page1] = inp.kv_cache.shape[0] + 5
    q_lens = inp.q_lens.copy()
    q_lens[2], q_lens[3] = 0, nq + 1
    prefix_lens = inp.prefix_lens.copy()
    prefix_lens[4] = -3
    tag = f"{spec.name} clamped seed={seed}"
    for name in ("tree_verify", "tree_verify_tail"):
        out_bits, lse = run(vset, name, inp, scale, block_table=bad_table, q_lens=q_lens, prefix_lens=prefix_lens)
        check_rows_written(out_bits, lse, inp.q_lens, f"{name} {tag}", written=[True, True, False, False, False])
        # the reference with the hidden keys' mask bits cleared instead
        mask = inp.tree_mask.copy()
        for b, bp in [(0, bad_page0), (1, bad_page1)]:
            for j in range(nq):
                if (prefix[b] + j) // page == bp:
                    mask[b, :, j // 32] &= ~np.uint32(1 << (j % 32))
        fn = reference.tree_verify if name == "tree_verify" else reference.tree_verify_tail
        heads = heads_to_check(spec.num_heads, rng, 4)
        ref = fn(**{**good, "tree_mask": mask[:2], "q_nope": good["q_nope"][:2][:, :, heads],
                    "q_pe": good["q_pe"][:2][:, :, heads], "block_table": good["block_table"][:2],
                    "prefix_lens": good["prefix_lens"][:2], "q_lens": good["q_lens"][:2]}, softmax_scale=scale)
        check_against(out_bits[:2], lse[:2], ref, inp.q_lens[:2], heads, f"{name} {tag}")


def test_keys_past_block_table_are_not_visible(vset, spec):
    """prefix_len + q_len beyond max_pages * page_size: keys past the table are not visible."""
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    nq = spec.max_tree_size
    L = 2 * page - 20                          # tree nodes j >= 20 fall past a 2-page table
    inp = make_inputs(spec, rng, [L], [nq], ["chain"], seed=seed)
    short = np.ascontiguousarray(inp.block_table[:, :2])
    scale = SCALES["one"]
    heads = heads_to_check(spec.num_heads, rng, 4)
    for name in ("tree_verify", "tree_verify_tail"):
        tag = f"{name} {spec.name} past-table seed={seed}"
        out_bits, lse = run(vset, name, inp, scale, block_table=short)
        check_rows_written(out_bits, lse, inp.q_lens, tag)
        mask = inp.tree_mask.copy()
        for j in range(20, nq):
            mask[0, :, j // 32] &= ~np.uint32(1 << (j % 32))
        host = inp.host()
        fn = reference.tree_verify if name == "tree_verify" else reference.tree_verify_tail
        ref = fn(**{**host, "tree_mask": mask, "q_nope": host["q_nope"][:, :, heads],
                    "q_pe": host["q_pe"][:, :, heads]}, softmax_scale=scale)
        check_against(out_bits, lse, ref, inp.q_lens, heads, tag)


@pytest.mark.parametrize("name", ["tree_verify", "tree_verify_tail"])
def test_validate(vset, spec, name):
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [page + 3, 0], [5, 2], ["chain", "chain"], seed=seed)
    launch = functools.partial(getattr(vset, name), impl="simple")
    scale = SCALES["mla"]
    out, lse = poisoned(inp.shape)
    launch(**inp.device(), softmax_scale=scale, out=out, lse=lse, validate=True)   # valid: runs
    nq = inp.shape[1]

    def bad(match, **replace):
        out, lse = poisoned(inp.shape)
        with pytest.raises(ArgumentError, match=match) as e:
            launch(**inp.device(**replace), softmax_scale=scale, out=out, lse=lse, validate=True)
        assert (to_host(out) == POISON_OUT).all(), "validate must raise before launch"
        return str(e.value)

    msg = bad("q_lens", q_lens=np.array([5, 0], np.int32))
    assert "request 1" in msg and " 0" in msg, msg
    msg = bad("q_lens", q_lens=np.array([nq + 1, 2], np.int32))
    assert "request 0" in msg and str(nq + 1) in msg, msg
    msg = bad("prefix_lens", prefix_lens=np.array([page + 3, -1], np.int32))
    assert "request 1" in msg and "-1" in msg, msg
    cap = inp.block_table.shape[1] * page
    msg = bad("prefix_lens", prefix_lens=np.array([page + 3, cap - 1], np.int32))
    assert "request 1" in msg and str(cap - 1) in msg, msg
    table = inp.block_table.copy()
    table[0, 1] = inp.kv_cache.shape[0]       # the page of request 0's tree tail
    msg = bad("block_table", block_table=table)
    assert "request 0" in msg and str(inp.kv_cache.shape[0]) in msg, msg
    table = inp.block_table.copy()
    table[0, 0] = -1                          # a prefix page: only tree_verify uses it
    if name == "tree_verify":
        msg = bad("block_table", block_table=table)
        assert "request 0" in msg and "-1" in msg, msg
    else:
        out, lse = poisoned(inp.shape)
        launch(**inp.device(block_table=table), softmax_scale=scale, out=out, lse=lse, validate=True)


# ---------------------------------------------------------------------------- merge_states

def _merge_inputs(spec, rng, lead):
    r = spec.kv_lora_rank
    o_a, o_b = random_bf16(rng, lead + (r,)), random_bf16(rng, lead + (r,))
    lse_a = (rng.standard_normal(lead) * 4).astype(np.float32)
    lse_b = (rng.standard_normal(lead) * 4).astype(np.float32)
    # every combination of empty kinds on the first rows, NaN o on empty sides
    kinds = [None, -np.inf, np.inf, np.nan]
    flat_a, flat_b = lse_a.reshape(-1), lse_b.reshape(-1)
    oa2, ob2 = o_a.reshape(-1, r), o_b.reshape(-1, r)
    k = 0
    for ka in kinds:
        for kb in kinds:
            if ka is not None:
                flat_a[k] = ka
                oa2[k] = POISON_OUT
            if kb is not None:
                flat_b[k] = kb
                ob2[k] = POISON_OUT
            k += 1
    flat_a[k], flat_b[k] = 80.0, -80.0          # one side negligible
    flat_a[k + 1], flat_b[k + 1] = 3.25, 3.25   # equal weights
    return o_a, lse_a, o_b, lse_b


def _check_merge(out_bits, lse, o_a, lse_a, o_b, lse_b, tag):
    ref = reference.merge_states(o_a, lse_a, o_b, lse_b)
    got = bf16.from_bits(out_bits).astype(np.float64)
    assert not np.isnan(got).any() and not np.isnan(lse).any(), f"{tag}: NaN"
    empty = ~np.isfinite(lse_a) & ~np.isfinite(lse_b)
    assert (out_bits[empty] == 0).all() and np.isneginf(lse[empty]).all(), f"{tag}: two empty sides"
    r = got.reshape(-1, got.shape[-1])[~empty.reshape(-1)]
    w = ref.out.reshape(-1, got.shape[-1])[~empty.reshape(-1)]
    rel = np.linalg.norm(r - w, axis=-1) / np.linalg.norm(w, axis=-1)
    assert rel.max() <= OUT_TOL, f"{tag}: ||out - ref|| / ||ref|| = {rel.max():.3g}"
    dl = np.abs(lse[~empty] - ref.lse[~empty])
    assert dl.max() <= LSE_TOL, f"{tag}: |lse - ref| = {dl.max():.3g}"


@pytest.mark.parametrize("lead", [(3, 7, None), (40,)], ids=["BNqH", "rows"])
def test_merge_states(vset, spec, lead):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lead = tuple(spec.num_heads if d is None else d for d in lead)
    o_a, lse_a, o_b, lse_b = _merge_inputs(spec, rng, lead)
    tag = f"merge {spec.name} {lead} seed={seed}"
    res = vset.merge_states(to_device(o_a), to_device(lse_a), to_device(o_b), to_device(lse_b))
    _check_merge(to_host(res.out), to_host(res.lse), o_a, lse_a, o_b, lse_b, tag)
    # in place: out = o_a, lse = lse_a; then into o_b / lse_b
    for side in ("a", "b"):
        da, dla, db, dlb = (to_device(x) for x in (o_a, lse_a, o_b, lse_b))
        out, lse = (da, dla) if side == "a" else (db, dlb)
        res = vset.merge_states(da, dla, db, dlb, out=out, lse=lse)
        assert res.out is out and res.lse is lse
        _check_merge(to_host(out), to_host(lse), o_a, lse_a, o_b, lse_b, f"{tag} in-place {side}")


# ---------------------------------------------------------------------------------- torch

def test_torch_tensors(vset, spec):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [100, 0], [65, 7], ["random", "binary"], seed=seed)
    scale = SCALES["mla"]
    want_o, want_l = run(vset, "tree_verify", inp, scale)

    def t(x):
        if x.dtype == np.uint16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
        if x.dtype == np.uint32:
            return torch.from_numpy(x.view(np.int32)).view(torch.uint32).cuda()
        return torch.from_numpy(x).cuda()

    res = vset.tree_verify(**{k: t(v) for k, v in inp.host().items()}, softmax_scale=scale, impl="simple")
    assert isinstance(res.out, torch.Tensor) and res.out.dtype == torch.bfloat16
    assert isinstance(res.lse, torch.Tensor) and res.lse.dtype == torch.float32
    got_o = res.out.view(torch.int16).cpu().numpy().view(np.uint16)
    got_l = res.lse.cpu().numpy()
    for b, q in enumerate(inp.q_lens):
        assert (got_o[b, :q] == want_o[b, :q]).all(), f"seed={seed}"
        assert (got_l[b, :q].view(np.uint32) == want_l[b, :q].view(np.uint32)).all(), f"seed={seed}"
    merged = vset.merge_states(res.out, res.lse, res.out, res.lse)   # a state merged with itself
    assert isinstance(merged.out, torch.Tensor) and merged.out.dtype == torch.bfloat16
    for b, q in enumerate(inp.q_lens):
        np.testing.assert_allclose(merged.lse[b, :q].cpu().numpy(), got_l[b, :q] + math.log(2), atol=1e-5)

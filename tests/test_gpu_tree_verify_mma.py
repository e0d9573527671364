"""The tensor-core kernels on the GPU against the float64 references: tree_verify_mma /
tree_verify_tail_mma (mma.sync) and tree_verify_wgmma / tree_verify_tail_wgmma (wgmma), with split-KV
through tree_verify_mma_combine. Every test runs on both families.

The numerical bar of DESIGN.md, per (request, row, head): ||out - ref|| <= 5e-3 ||ref||,
|lse - ref| <= 1e-3, no NaN, every row < q_len written, every row >= q_len byte-identical to the
poison written before launch. Fresh random data every run (DDTREE_TEST_SEED replays one; the seed
is in every assertion message). Every case runs with split-KV off (num_splits=1), forced on
(num_splits=5: chunks of every size, empty ones included) and as the launcher picks it; the
float64 reference is computed once per case, on a few heads for long prefixes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest

from ddtree_gen import bf16, reference
from ddtree_gen.errors import ArgumentError
from verify_cases import VerifyInputs as Inputs, fresh_seed, to_device, to_host
from verify_cases import make_inputs as _make_inputs, random_bf16_normal as random_bf16

pytestmark = pytest.mark.gpu

OUT_TOL, LSE_TOL = 5e-3, 1e-3
POISON_OUT = 0xFFFF                 # a bf16 NaN pattern the kernels never write
POISON_LSE = np.uint32(0x7FC00000)  # float32 NaN
SCALES = {"mla": 192 ** -0.5, "one": 1.0}
KERNELS = ("tree_verify_mma", "tree_verify_tail_mma", "tree_verify_mma_combine", "tree_verify_wgmma",
           "tree_verify_tail_wgmma")
FAMILIES = ("mma", "wgmma")
NAMES = tuple(f"{n}_{fam}" for fam in FAMILIES for n in ("tree_verify", "tree_verify_tail"))
SPLITS = (1, 5, None)               # off, forced on, the launcher's choice


@pytest.fixture
def mset(spec):
    """The spec's compiled tensor-core attention kernels only."""
    import ddtree_gen
    return ddtree_gen.load(spec, kernels=KERNELS)


# the tensor-core tests draw q / kv as bf16 N(0, 1) samples
make_inputs = functools.partial(_make_inputs, bf16=random_bf16)


def poisoned(shape):
    b, nq, h, r = shape
    out = np.full((b, nq, h, r), POISON_OUT, np.uint16)
    lse = np.full((b, nq, h), POISON_LSE, np.uint32).view(np.float32)
    return to_device(out), to_device(lse)


def run(mset, name, inp: Inputs, scale, splits=None, **replace):
    """Launch `name` into poisoned buffers; (out bits, lse) on the host."""
    out, lse = poisoned(inp.shape)
    res = getattr(mset, name)(**inp.device(**replace), softmax_scale=scale, out=out, lse=lse, num_splits=splits)
    assert res.out is out and res.lse is lse
    return to_host(out), to_host(lse)


def heads_to_check(h, rng, limit):
    if h <= limit:
        return np.arange(h)
    others = rng.choice(np.arange(1, h - 1), size=limit - 2, replace=False)
    return np.unique(np.concatenate([[0, h - 1], others]))


def check_rows_written(out_bits, lse, q_lens, tag, written=None):
    nq = out_bits.shape[1]
    for b, q in enumerate(q_lens):
        q = int(q) if (written is None or written[b]) else 0
        q = min(max(q, 0), nq)
        got = bf16.from_bits(out_bits[b, :q])
        assert not np.isnan(got).any(), f"{tag}: NaN in out of request {b}, rows < q_len {q}"
        assert not np.isnan(lse[b, :q]).any(), f"{tag}: NaN (unwritten?) lse in request {b}, rows < q_len {q}"
        assert (out_bits[b, q:] == POISON_OUT).all(), f"{tag}: out of request {b} written at rows >= {q}"
        assert (lse[b, q:].view(np.uint32) == POISON_LSE).all(), f"{tag}: lse of request {b} written at rows >= {q}"


def check_against(out_bits, lse, ref, q_lens, heads, tag):
    for b, q in enumerate(q_lens):
        q = int(q)
        got_o = bf16.from_bits(out_bits[b, :q][:, heads]).astype(np.float64)
        got_l = lse[b, :q][:, heads].astype(np.float64)
        ref_o, ref_l = ref.out[b, :q], ref.lse[b, :q]
        empty = np.isneginf(ref_l)
        if empty.any():
            assert (out_bits[b, :q][:, heads][empty] == 0).all(), f"{tag}: empty row of request {b}: out not 0"
            assert np.isneginf(got_l[empty]).all(), f"{tag}: empty row of request {b}: lse {got_l[empty]} not -inf"
        full = ~empty
        rel = (np.linalg.norm(got_o - ref_o, axis=-1) / np.maximum(np.linalg.norm(ref_o, axis=-1), 1e-30))[full]
        dl = np.abs(got_l - np.where(empty, 0.0, ref_l))[full]
        if rel.size:
            k = int(np.argmax(rel))
            assert rel[k] <= OUT_TOL, (f"{tag}: request {b}: ||out - ref|| / ||ref|| = {rel[k]:.3g} > {OUT_TOL} at "
                                       f"(row, head) {np.argwhere(full)[k]} (heads checked {list(heads)})")
            k = int(np.argmax(dl))
            assert dl[k] <= LSE_TOL, (f"{tag}: request {b}: |lse - ref| = {dl[k]:.3g} > {LSE_TOL} at "
                                      f"(row, head) {np.argwhere(full)[k]}")


def is_tail(name):
    return name.startswith("tree_verify_tail")


def reference_for(name, inp: Inputs, scale, heads, **replace):
    host = inp.host(**replace)
    fn = reference.tree_verify_tail if is_tail(name) else reference.tree_verify
    return fn(**{**host, "q_nope": host["q_nope"][:, :, heads], "q_pe": host["q_pe"][:, :, heads]},
              softmax_scale=scale)


def verify_all_splits(mset, name, inp, scale, heads, tag, **replace):
    """Run with every split setting against one reference; returns {splits: (out bits, lse)}."""
    ref = reference_for(name, inp, scale, heads, **replace)
    results = {}
    for splits in SPLITS:
        t = f"{tag} splits={splits}"
        out_bits, lse = run(mset, name, inp, scale, splits, **replace)
        check_rows_written(out_bits, lse, inp.q_lens, t)
        check_against(out_bits, lse, ref, inp.q_lens, heads, t)
        results[splits] = (out_bits, lse)
    return results


# ------------------------------------------------------------------------------- matrix

@dataclass
class Case:
    id: str
    prefix: object          # list, or callable(rng) -> list
    qlens: object
    trees: object
    scale: str
    nq: int | None = None
    heads: int = 4
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
    Case("b3-L4096", [4096, 4095, 4097], [65, 2, 33], ["star", "binary", "random"], "one", heads=2),
    Case("b2-L16500", [16500, 16383], [33, 2], ["random", "chain"], "mla", heads=2),
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
    return make_inputs(spec, rng, prefix, qlens, trees, nq=nq, junk_bits=case.junk), rng


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matrix(mset, spec, case, name):
    seed = fresh_seed()
    inp, rng = build_case(spec, case, seed)
    heads = heads_to_check(spec.num_heads, rng, case.heads)
    results = verify_all_splits(mset, name, inp, SCALES[case.scale], heads, f"{name} {spec.name} {case.id} seed={seed}")
    # no atomics: a rerun gives the same bits
    again = run(mset, name, inp, SCALES[case.scale], 5)
    assert (again[0] == results[5][0]).all(), f"seed={seed}: out not deterministic"
    assert (again[1].view(np.uint32) == results[5][1].view(np.uint32)).all(), f"seed={seed}: lse not deterministic"


def test_empty_rows(mset, spec):
    """prefix_len 0 and mask rows without bits in [0, q_len): out exactly 0, lse -inf."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [0, 0, 3], [3, 1, 2], ["chain", "chain", "chain"])
    inp.tree_mask[0, 0] = 0
    inp.tree_mask[0, 1] = np.uint32(1 << 3)
    inp.tree_mask[1, 0] = ~np.uint32(1)
    inp.tree_mask[2, :2] = 0
    heads = np.arange(spec.num_heads)
    for name in NAMES:
        tag = f"{name} {spec.name} empty seed={seed}"
        for splits, (out_bits, lse) in verify_all_splits(mset, name, inp, SCALES["mla"], heads, tag).items():
            for b, i in [(0, 0), (0, 1), (1, 0)]:
                assert (out_bits[b, i] == 0).all() and np.isneginf(lse[b, i]).all(), f"{tag} splits={splits}"
            assert (out_bits[0, 2] != 0).any() and np.isfinite(lse[0, 2]).all(), f"{tag} splits={splits}"
            if not is_tail(name):
                assert np.isfinite(lse[2, :2]).all(), tag
            else:
                assert np.isneginf(lse[2, :2]).all() and (out_bits[2, :2] == 0).all(), tag


@pytest.mark.parametrize("fam", FAMILIES)
def test_composition_prefix_plus_tail(mset, spec, fam):
    """tree_verify_<fam> == merge_states(tree_verify_<fam> with an all-zero mask (prefix only), tail_<fam>)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [0, 4096, 100, 64], [65, 33, 2, 64], ["random", "binary", "chain", "star"])
    tag = f"{fam} {spec.name} composition seed={seed}"
    scale = SCALES["mla"]
    full_o, full_l = run(mset, f"tree_verify_{fam}", inp, scale)
    pre_o, pre_l = run(mset, f"tree_verify_{fam}", inp, scale, tree_mask=np.zeros_like(inp.tree_mask))
    tail_o, tail_l = run(mset, f"tree_verify_tail_{fam}", inp, scale)
    assert np.isneginf(pre_l[0, :65]).all() and (pre_o[0, :65] == 0).all(), tag
    for b, q in enumerate(inp.q_lens):
        m = reference.merge_states(pre_o[b, :q], pre_l[b, :q], tail_o[b, :q], tail_l[b, :q])
        f = bf16.from_bits(full_o[b, :q]).astype(np.float64)
        rel = np.linalg.norm(m.out - f, axis=-1) / np.linalg.norm(f, axis=-1)
        assert rel.max() <= 2 * OUT_TOL, f"{tag}: request {b}: merged vs full {rel.max():.3g}"
        assert np.abs(m.lse - full_l[b, :q]).max() <= LSE_TOL, f"{tag}: request {b}: lse"


@pytest.mark.parametrize("fam", FAMILIES)
def test_matches_cuda_core_kernel(spec, fam):
    """Where the CUDA-core tree_verify is built, both agree within the bar (impl="simple": kset.tree_verify
    would otherwise pick the tensor-core kernel, loaded in the same set)."""
    import ddtree_gen
    from ddtree_gen.kernels import all_kernels
    if "tree_verify" not in {k.name for k in all_kernels()}:
        pytest.skip("the CUDA-core tree_verify is not registered")
    ks = ddtree_gen.load(spec, kernels=["tree_verify", *KERNELS])
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [70, 0, 1000], [65, 5, 33], ["random", "star", "binary"])
    a_o, a_l = run(ks, f"tree_verify_{fam}", inp, SCALES["mla"])
    out, lse = poisoned(inp.shape)
    ks.tree_verify(**inp.device(), softmax_scale=SCALES["mla"], out=out, lse=lse, impl="simple")
    b_o, b_l = to_host(out), to_host(lse)
    for b, q in enumerate(inp.q_lens):
        x = bf16.from_bits(a_o[b, :q]).astype(np.float64)
        y = bf16.from_bits(b_o[b, :q]).astype(np.float64)
        rel = np.linalg.norm(x - y, axis=-1) / np.linalg.norm(y, axis=-1)
        assert rel.max() <= 2 * OUT_TOL, f"seed={seed}: request {b}: {fam} vs cuda-core {rel.max():.3g}"
        assert np.abs(a_l[b, :q] - b_l[b, :q]).max() <= 2 * LSE_TOL, f"seed={seed}: request {b}: lse"


@pytest.mark.parametrize("fam", FAMILIES)
def test_out_none_allocates_and_workspace(mset, spec, fam):
    import cupy
    launch = getattr(mset, f"tree_verify_{fam}")
    from ddtree_gen.kernels import tree_verify_mma as mod
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [700, 0], [65, 5], ["random", "star"])
    res = launch(**inp.device(), softmax_scale=SCALES["mla"], num_splits=3)
    assert isinstance(res.out, cupy.ndarray) and res.out.dtype == np.uint16 and res.out.shape == inp.shape
    assert isinstance(res.lse, cupy.ndarray) and res.lse.dtype == np.float32 and res.lse.shape == inp.shape[:3]
    b, nq = inp.shape[:2]
    ws = cupy.full(mod.workspace_elems(spec, b, nq, 3) + 16, np.nan, np.float32)   # reused scratch
    out_bits, lse = poisoned(inp.shape)
    launch(**inp.device(), softmax_scale=SCALES["mla"], out=out_bits, lse=lse, workspace=ws, num_splits=3)
    for k in range(inp.shape[0]):
        q = inp.q_lens[k]
        assert (to_host(res.out)[k, :q] == to_host(out_bits)[k, :q]).all(), f"seed={seed}"
        assert (to_host(res.lse)[k, :q].view(np.uint32) == to_host(lse)[k, :q].view(np.uint32)).all(), f"seed={seed}"
    with pytest.raises(ArgumentError, match="workspace"):
        launch(**inp.device(), softmax_scale=SCALES["mla"], workspace=ws[:10], num_splits=3)
    with pytest.raises(ArgumentError, match="16-byte aligned"):
        q = cupy.zeros(inp.q_nope.size + 4, np.uint16)[4:].reshape(inp.shape)   # 8-byte offset
        launch(**inp.device(q_nope=q), softmax_scale=SCALES["mla"])


@pytest.mark.parametrize("fam", FAMILIES)
def test_cuda_graph_capture(mset, spec, fam):
    """With out, lse and workspace given, a launch (auto split count) captures into a CUDA graph
    and replays to the eager result: nothing reads device values on the host."""
    import cupy
    launch = getattr(mset, f"tree_verify_{fam}")
    from ddtree_gen.kernels import tree_verify_mma as mod
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [3000], [65], ["random"])
    dev = inp.device()
    b, nq = inp.shape[:2]
    ws = cupy.empty(mod.workspace_elems(spec, b, nq, mod.MAX_SPLITS), np.float32)
    eager_o, eager_l = poisoned(inp.shape)
    launch(**dev, softmax_scale=SCALES["mla"], out=eager_o, lse=eager_l, workspace=ws)
    cupy.cuda.get_current_stream().synchronize()
    out, lse = poisoned(inp.shape)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        launch(**dev, softmax_scale=SCALES["mla"], out=out, lse=lse, workspace=ws)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert (to_host(out) == to_host(eager_o)).all(), f"seed={seed}"
    assert (to_host(lse).view(np.uint32) == to_host(eager_l).view(np.uint32)).all(), f"seed={seed}"


# ------------------------------------------------------------------- device-side values

def test_device_values_are_clamped(mset, spec):
    """Without validate=True: a request with a bad q_len or a negative prefix_len writes nothing; a key
    on a page outside [0, num_pages) is not visible (compared with those tree bits cleared)."""
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    nq = spec.max_tree_size
    prefix = [page + 10, 10, 5, 5, 5]
    inp = make_inputs(spec, rng, prefix, [nq] * 5, ["random"] * 5)
    scale = SCALES["mla"]
    bad_table = inp.block_table.copy()
    bad_page0 = (prefix[0] + nq - 1) // page
    bad_table[0, bad_page0] = -1
    bad_page1 = (prefix[1] + nq - 1) // page
    bad_table[1, bad_page1] = inp.kv_cache.shape[0] + 5
    q_lens = inp.q_lens.copy()
    q_lens[2], q_lens[3] = 0, nq + 1
    prefix_lens = inp.prefix_lens.copy()
    prefix_lens[4] = -3
    tag = f"{spec.name} clamped seed={seed}"
    mask = inp.tree_mask.copy()
    for b, bp in [(0, bad_page0), (1, bad_page1)]:
        for j in range(nq):
            if (prefix[b] + j) // page == bp:
                mask[b, :, j // 32] &= ~np.uint32(1 << (j % 32))
    heads = heads_to_check(spec.num_heads, rng, 4)
    good = Inputs(**{k: v[:2] if k not in ("kv_cache",) else v for k, v in inp.host(tree_mask=mask).items()})
    for name in NAMES:
        ref = reference_for(name, good, scale, heads)
        for splits in SPLITS:
            t = f"{name} {tag} splits={splits}"
            out_bits, lse = run(mset, name, inp, scale, splits, block_table=bad_table, q_lens=q_lens,
                                prefix_lens=prefix_lens)
            check_rows_written(out_bits, lse, inp.q_lens, t, written=[True, True, False, False, False])
            check_against(out_bits[:2], lse[:2], ref, inp.q_lens[:2], heads, t)


def test_keys_past_block_table_are_not_visible(mset, spec):
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    nq = spec.max_tree_size
    L = 2 * page - 20
    inp = make_inputs(spec, rng, [L], [nq], ["chain"])
    short = np.ascontiguousarray(inp.block_table[:, :2])
    mask = inp.tree_mask.copy()
    for j in range(20, nq):
        mask[0, :, j // 32] &= ~np.uint32(1 << (j % 32))
    heads = heads_to_check(spec.num_heads, rng, 4)
    for name in NAMES:
        ref = reference_for(name, inp, SCALES["one"], heads, tree_mask=mask)
        for splits in SPLITS:
            tag = f"{name} {spec.name} past-table splits={splits} seed={seed}"
            out_bits, lse = run(mset, name, inp, SCALES["one"], splits, block_table=short)
            check_rows_written(out_bits, lse, inp.q_lens, tag)
            check_against(out_bits, lse, ref, inp.q_lens, heads, tag)


@pytest.mark.parametrize("name", NAMES)
def test_validate(mset, spec, name):
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [page + 3, 0], [5, 2], ["chain", "chain"])
    launch = getattr(mset, name)
    scale = SCALES["mla"]
    out, lse = poisoned(inp.shape)
    launch(**inp.device(), softmax_scale=scale, out=out, lse=lse, validate=True)
    nq = inp.shape[1]

    def bad(match, **replace):
        out, lse = poisoned(inp.shape)
        with pytest.raises(ArgumentError, match=match) as e:
            launch(**inp.device(**replace), softmax_scale=scale, out=out, lse=lse, validate=True)
        assert (to_host(out) == POISON_OUT).all(), "validate must raise before launch"
        return str(e.value)

    msg = bad("q_lens", q_lens=np.array([5, 0], np.int32))
    assert "request 1" in msg, msg
    msg = bad("q_lens", q_lens=np.array([nq + 1, 2], np.int32))
    assert "request 0" in msg and str(nq + 1) in msg, msg
    msg = bad("prefix_lens", prefix_lens=np.array([page + 3, -1], np.int32))
    assert "request 1" in msg and "-1" in msg, msg
    table = inp.block_table.copy()
    table[0, 1] = inp.kv_cache.shape[0]
    msg = bad("block_table", block_table=table)
    assert "request 0" in msg, msg


@pytest.mark.parametrize("fam", FAMILIES)
def test_argument_errors(mset, spec, fam):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [10], [3], ["chain"])
    full, tail = getattr(mset, f"tree_verify_{fam}"), getattr(mset, f"tree_verify_tail_{fam}")
    with pytest.raises(ArgumentError, match="num_splits"):
        full(**inp.device(), softmax_scale=1.0, num_splits=0)
    with pytest.raises(ArgumentError, match="q_nope"):
        full(**inp.device(q_nope=inp.q_nope.astype(np.float32)), softmax_scale=1.0)
    with pytest.raises(ArgumentError, match="tree_mask"):
        tail(**inp.device(tree_mask=inp.tree_mask[:, :, :1].copy()), softmax_scale=1.0)

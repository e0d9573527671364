"""CPU tests of the numpy references (ddtree_gen.reference) and of the bf16 helper."""
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree_gen import bf16, inputs
from ddtree_gen import reference as ref
from ddtree_gen.errors import ArgumentError

F32 = np.float32
NINF = -np.inf


# =============================================================================== bf16

def _rne_f32_bits_reference(u):
    """Straightforward integer RNE of float32 bit patterns (uint32) to bf16 bits."""
    u = u.astype(np.int64)
    hi, lo = u >> 16, u & 0xFFFF
    up = (lo > 0x8000) | ((lo == 0x8000) & (hi & 1 == 1))
    res = hi + up
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (hi & 0x8000) | 0x7FC0, res).astype(np.uint16)


def _exact_bf16_bits(x):
    """Exact RNE of one Python float to bf16 bits, with Fractions."""
    if x != x:
        return 0xFFC0 if np.signbit(x) else 0x7FC0
    sign = 0x8000 if np.signbit(x) else 0
    if x in (float("inf"), float("-inf")):
        return sign | 0x7F80
    a = Fraction(abs(x))
    if a == 0:
        return sign
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1  # now 2**e <= a < 2**(e+1)
    quantum = Fraction(2) ** (max(e, -126) - 7)
    q, rem = divmod(a, quantum)
    q = int(q) + (1 if rem > quantum / 2 or (rem == quantum / 2 and q % 2 == 1) else 0)
    v = q * quantum
    if v >= Fraction(2) ** 128:
        return sign | 0x7F80
    return sign | int(np.array([float(v)], F32).view(np.uint32)[0] >> 16)


def test_bf16_all_patterns_round_trip():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bf16.from_bits(bits)
    assert values.dtype == F32
    np.testing.assert_array_equal(values.view(np.uint32), bits.astype(np.uint32) << 16)
    back = bf16.to_bits(values)
    nan = (bits & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    np.testing.assert_array_equal(back[nan], (bits[nan] & 0x8000) | 0x7FC0)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns
        back64 = bf16.to_bits(values.astype(np.float64))
    np.testing.assert_array_equal(back64, back)


def test_bf16_random_float32_against_integer_rne():
    rng = np.random.default_rng(1)
    u = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    u[:4096] = (u[:4096] & 0xFFFF0000) | 0x8000  # exact ties
    u[4096:8192] = (u[4096:8192] & 0xFFFF0000) | rng.choice([0x7FFF, 0x8001], 4096)
    got = bf16.to_bits(u.view(F32))
    np.testing.assert_array_equal(got, _rne_f32_bits_reference(u))


def test_bf16_matches_ml_dtypes_on_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(2)
    x = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32).view(F32)
    x = x[~np.isnan(x)]
    np.testing.assert_array_equal(bf16.to_bits(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("f32_bits, want", [
    (0x3F808000, 0x3F80), (0x3F818000, 0x3F82), (0x3F808001, 0x3F81), (0x3F807FFF, 0x3F80),
    (0x7F7F8000, 0x7F80), (0x7F7F7FFF, 0x7F7F), (0xFF7F8000, 0xFF80),
    (0x00008000, 0x0000), (0x00018000, 0x0002), (0x80008000, 0x8000), (0x00008001, 0x0001),
    (0x7F800000, 0x7F80), (0xFF800000, 0xFF80), (0x80000000, 0x8000), (0x00000000, 0x0000),
    (0x7F800001, 0x7FC0), (0xFFFFFFFF, 0xFFC0), (0x7FC00000, 0x7FC0), (0xFF812345, 0xFFC0),
], ids=lambda v: f"{v:#010x}")
def test_bf16_float32_edge_cases(f32_bits, want):
    x = np.array([f32_bits], np.uint32).view(F32)
    assert int(bf16.to_bits(x)[0]) == want


@pytest.mark.parametrize("x", [
    1 + 2**-8 + 2**-40, 1 + 2**-8 - 2**-40, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-60),
    3.3895313892515355e38, 3.39e38, 1e300, -1e300, 2.0**-133, 2.0**-134, 2.0**-134 + 2.0**-170,
    1e-300, -1e-300, 5e-324, 0.0, -0.0, float("inf"), float("-inf"), float("nan"),
    float(np.float32(2.0**-126) * 1.5), 2.0**-127 + 2.0**-134 + 2.0**-200,
], ids=repr)
def test_bf16_float64_edge_cases(x):
    assert int(bf16.to_bits(np.float64(x))) == _exact_bf16_bits(x)


def test_bf16_float64_random_against_exact():
    rng = np.random.default_rng(3)
    u = rng.integers(0, 1 << 63, size=1500, dtype=np.uint64) | (
        rng.integers(0, 2, size=1500, dtype=np.uint64) << np.uint64(63))
    x = u.view(np.float64)
    # values near bf16 ties, near overflow and in the subnormal range
    base = bf16.from_bits(rng.integers(1, 0x7F80, 1500).astype(np.uint16)).astype(np.float64)
    ulp = np.ldexp(1.0, np.maximum(np.frexp(base)[1] - 8, -133))
    near = base + ulp * (0.5 + rng.choice([-1, 1], 1500) * 2.0 ** -rng.integers(10, 45, 1500))
    x = np.concatenate([x, near, rng.uniform(-1, 1, 500) * 2.0**-126,
                        rng.uniform(3.38e38, 3.41e38, 200)])
    got = bf16.to_bits(x)
    want = np.array([_exact_bf16_bits(float(v)) for v in x], np.uint16)
    np.testing.assert_array_equal(got, want)


def test_bf16_shapes_and_dtypes():
    assert bf16.to_bits(1.0).shape == () and int(bf16.to_bits(1.0)) == 0x3F80
    assert bf16.from_bits(np.uint16(0x3F80)).shape == ()
    assert bf16.to_bits(np.ones((2, 0, 3), np.float16)).shape == (2, 0, 3)
    np.testing.assert_array_equal(bf16.to_bits([1, 2, -3]), [0x3F80, 0x4000, 0xC040])
    np.testing.assert_array_equal(bf16.round_to_bf16(np.float32(1.00390625)), F32(1.0))
    assert bf16.round_to_bf16(np.array([1.1])).dtype == F32
    with pytest.raises(ArgumentError):
        bf16.to_bits(np.zeros(2, np.uint16))
    with pytest.raises(ArgumentError):
        bf16.from_bits(np.zeros(2, np.int32))


# ========================================================================= tree_build

def _f32sum(*xs):
    s = F32(0.0)
    for x in xs:
        s = F32(s + F32(x))
    return s


def _build(ids, lp, budget, n, root=7, prefix=100):
    ids = np.asarray(ids, np.int32)[None]
    lp = np.asarray(lp, F32)[None]
    return ref.tree_build(ids, lp, np.array([root], np.int32), np.array([prefix], np.int32),
                          budget, n)


def _mask_rows(tree, b=0):
    """Row i of tree_mask as the sorted list of set bits."""
    rows = []
    for row in tree.tree_mask[b]:
        rows.append([w * 32 + k for w, word in enumerate(row) for k in range(32)
                     if (int(word) >> k) & 1])
    return rows


def _expect_tree(tree, tokens, parents, depths, scores, n, prefix=100):
    m = len(tokens)
    assert tree.num_nodes.tolist() == [m]
    pad = [-1] * (n - m)
    assert tree.tokens[0].tolist() == tokens + pad
    assert tree.parents[0].tolist() == parents + pad
    assert tree.depths[0].tolist() == depths + pad
    assert tree.positions[0].tolist() == [prefix + d for d in depths] + pad
    np.testing.assert_array_equal(tree.scores[0], np.array(scores + [NINF] * (n - m), F32))
    rows = _mask_rows(tree)
    for i in range(n):
        want = []
        j = i if i < m else -1
        while j >= 0:
            want.append(j)
            j = parents[j]
        assert rows[i] == sorted(want)
    first = [next((c for c in range(m) if parents[c] == i), -1) for i in range(m)]
    sib = [next((c for c in range(i + 1, m) if parents[c] == parents[i]), -1) if i else -1
           for i in range(m)]
    assert tree.first_child[0].tolist() == first + pad
    assert tree.next_sibling[0].tolist() == sib + pad
    for name, arr in zip(tree._fields, tree):
        want_dtype = {"scores": F32, "tree_mask": np.uint32}.get(name, np.int32)
        assert arr.dtype == want_dtype, name


IDS_2X2 = [[10, 11], [20, 21]]


def test_tree_build_2x2_by_hand():
    lp = [[-0.1, -1.0], [-0.2, -2.0]]
    tree = _build(IDS_2X2, lp, budget=6, n=7)
    # c0(-0.1) -> node1; c1 sib(-1.0), c2 child(-0.3) -> node2; c3 sib(-2.1) ->
    # c1 -> node3; c4 child(-1.2) -> node4; c5 sib(-3.0) -> c3 -> node5; c5 -> node6
    _expect_tree(tree, tokens=[7, 10, 20, 11, 20, 21, 21], parents=[-1, 0, 1, 0, 3, 1, 3],
                 depths=[0, 1, 2, 1, 2, 2, 2],
                 scores=[0, _f32sum(-0.1), _f32sum(-0.1, -0.2), _f32sum(-1.0),
                         _f32sum(-1.0, -0.2), _f32sum(-0.1, -2.0), _f32sum(-1.0, -2.0)], n=7)


@pytest.mark.parametrize("budget, n_nodes", [(0, 1), (1, 2), (3, 4), (6, 7)],
                         ids=["budget0", "budget1", "budget3", "budget6"])
def test_tree_build_budget_truncates_pop_order(budget, n_nodes):
    lp = [[-0.1, -1.0], [-0.2, -2.0]]
    full = _build(IDS_2X2, lp, budget=6, n=9)
    tree = _build(IDS_2X2, lp, budget=budget, n=9)
    assert int(tree.num_nodes[0]) == n_nodes
    _expect_tree(tree, tokens=full.tokens[0, :n_nodes].tolist(),
                 parents=full.parents[0, :n_nodes].tolist(),
                 depths=full.depths[0, :n_nodes].tolist(),
                 scores=full.scores[0, :n_nodes].tolist(), n=9)


def test_tree_build_chain_k1_runs_out_of_candidates():
    lp = [[-0.5], [-0.25], [-1.0], [-2.0]]
    tree = _build([[1], [2], [3], [4]], lp, budget=6, n=7)
    _expect_tree(tree, tokens=[7, 1, 2, 3, 4], parents=[-1, 0, 1, 2, 3], depths=[0, 1, 2, 3, 4],
                 scores=[0, _f32sum(-0.5), _f32sum(-0.5, -0.25), _f32sum(-0.5, -0.25, -1.0),
                         _f32sum(-0.5, -0.25, -1.0, -2.0)], n=7)


def test_tree_build_depth1_star_in_rank_order():
    # siblings are created one at a time, so rank order holds even for unsorted log-probs
    tree = _build([[5, 6, 7]], [[-1.0, -0.5, -2.0]], budget=3, n=4)
    _expect_tree(tree, tokens=[7, 5, 6, 7], parents=[-1, 0, 0, 0], depths=[0, 1, 1, 1],
                 scores=[0, -1.0, -0.5, -2.0], n=4)


def test_tree_build_ties_follow_creation_order():
    tree = _build(IDS_2X2, [[-1.0, -1.0], [-1.0, -1.0]], budget=6, n=7)
    # node1=c0; node2=c1 (sibling, created before c0's child c2); then c2, c3 (child of
    # node2), c4 (sibling of c2), c5 (sibling of c3): all -2
    _expect_tree(tree, tokens=[7, 10, 11, 20, 20, 21, 21], parents=[-1, 0, 0, 1, 2, 1, 2],
                 depths=[0, 1, 1, 2, 2, 2, 2], scores=[0, -1, -1, -2, -2, -2, -2], n=7)


@pytest.mark.parametrize("bad", [NINF, np.nan], ids=["-inf", "nan"])
def test_tree_build_minus_inf_and_nan_logprobs(bad):
    tree = _build(IDS_2X2, [[-0.5, bad], [-1.0, -1.0]], budget=6, n=7)
    # the -inf candidate (sibling of node1) is taken after every finite one, then its
    # own subtree (all -inf) in creation order
    _expect_tree(tree, tokens=[7, 10, 20, 21, 11, 20, 21], parents=[-1, 0, 1, 1, 0, 4, 4],
                 depths=[0, 1, 2, 2, 1, 2, 2],
                 scores=[0, -0.5, -1.5, -1.5, NINF, NINF, NINF], n=7)
    short = _build(IDS_2X2, [[-0.5, bad], [-1.0, -1.0]], budget=3, n=7)
    assert short.tokens[0, :4].tolist() == [7, 10, 20, 21]


def test_tree_build_nan_sum_counts_as_minus_inf():
    tree = _build(IDS_2X2, [[np.inf, -1.0], [NINF, -1.0]], budget=6, n=7)
    # node1 score +inf; its child inf + -inf = NaN -> -inf; its sibling child inf + -1 = inf
    _expect_tree(tree, tokens=[7, 10, 11, 20, 21, 20, 21], parents=[-1, 0, 0, 1, 1, 2, 2],
                 depths=[0, 1, 1, 2, 2, 2, 2], scores=[0, np.inf, -1, NINF, np.inf, NINF, -2],
                 n=7)


def test_tree_build_padding_mask_width_and_batch():
    rng = np.random.default_rng(4)
    b, d, k, n = 3, 5, 8, 70
    ids = rng.integers(0, 1000, (b, d, k)).astype(np.int64)
    lp = np.sort(rng.normal(-3, 1, (b, d, k)), axis=-1)[..., ::-1]
    tree = ref.tree_build(ids, lp, [1, 2, 3], [0, 5, 9], 40, n)
    assert tree.tree_mask.shape == (b, n, 3)
    assert tree.num_nodes.tolist() == [41] * 3
    assert (tree.tokens[:, 41:] == -1).all() and (tree.tree_mask[:, 41:] == 0).all()
    assert np.isneginf(tree.scores[:, 41:]).all()
    assert tree.tokens[:, 0].tolist() == [1, 2, 3]
    assert tree.positions[:, 0].tolist() == [0, 5, 9]


def _random_case(rng, special):
    b = int(rng.integers(1, 4))
    d = int(rng.integers(1, 6))
    n = int(rng.integers(2, 80))
    k = int(rng.integers(1, min(n - 1, 9) + 1))
    ids = rng.integers(-5, 50000, (b, d, k)).astype(np.int32)
    if special:
        pool = np.array([-0.5, -1.0, -1.5, -2.0, -0.25, NINF, np.nan, 0.0], F32)
        lp = rng.choice(pool, (b, d, k))
        lp = np.where(rng.random((b, d, k)) < 0.3, rng.normal(-2, 1, (b, d, k)), lp).astype(F32)
    else:  # sorted descending, as the engine delivers them
        lp = -np.sort(rng.exponential(2.0, (b, d, k)), axis=-1).astype(F32)
    budget = int(rng.integers(0, n))
    return ids, lp, rng.integers(0, 1000, b), rng.integers(0, 5000, b), budget, n


def _check_invariants(tree, ids, lp, roots, prefix, budget, n):
    b_sz, d_max, k_max = ids.shape
    total = sum(k_max ** d for d in range(1, d_max + 1))
    for b in range(b_sz):
        m = int(tree.num_nodes[b])
        assert m == 1 + min(budget, total)
        par, dep = tree.parents[b], tree.depths[b]
        assert par[0] == -1 and dep[0] == 0 and tree.tokens[b, 0] == roots[b]
        assert tree.scores[b, 0] == 0
        assert (tree.positions[b, :m] == prefix[b] + dep[:m]).all()
        for name in ("tokens", "parents", "depths", "positions", "first_child", "next_sibling"):
            assert (getattr(tree, name)[b, m:] == -1).all(), name
        assert np.isneginf(tree.scores[b, m:]).all() and (tree.tree_mask[b, m:] == 0).all()
        rows = _mask_rows(tree, b)
        for i in range(1, m):
            p = par[i]
            assert 0 <= p < i and dep[i] == dep[p] + 1
            rank = sum(1 for c in range(1, i) if par[c] == p)
            assert tree.tokens[b, i] == ids[b, dep[i] - 1, rank]
            with np.errstate(all="ignore"):
                s = F32(tree.scores[b, p] + lp[b, dep[i] - 1, rank])
            assert tree.scores[b, i] == (NINF if np.isnan(s) else s)
            assert rows[i] == sorted(rows[p] + [i])
            kids = [c for c in range(m) if par[c] == i]
            assert tree.first_child[b, i] == (kids[0] if kids else -1)
            sibs = [c for c in range(i + 1, m) if par[c] == p]
            assert tree.next_sibling[b, i] == (sibs[0] if sibs else -1)
        assert rows[0] == [0]


@pytest.mark.parametrize("seed", range(60), ids=lambda s: f"seed{s}")
def test_tree_build_invariants_random(seed):
    rng = np.random.default_rng(seed)
    args = _random_case(rng, special=seed % 2 == 1)
    tree = ref.tree_build(*args)
    _check_invariants(tree, *args)
    if seed % 2 == 0:  # sorted log-probs <= 0: best-first pops are non-increasing
        for b in range(tree.num_nodes.shape[0]):
            s = tree.scores[b, :tree.num_nodes[b]]
            assert (np.diff(s[1:]) <= 0).all()


def test_tree_build_matches_heap_on_many_random_inputs():
    rng = np.random.default_rng(5)
    for case in range(400):
        args = _random_case(rng, special=case % 3 != 0)
        a, b = ref.tree_build(*args), ref.tree_build_heap(*args)
        for name, x, y in zip(a._fields, a, b):
            assert x.dtype == y.dtype and x.shape == y.shape, (case, name)
            np.testing.assert_array_equal(x, y, err_msg=f"case {case}: {name}")


def test_tree_build_large_batch_is_fast():
    import time
    rng = np.random.default_rng(6)
    lp = np.sort(np.log(rng.dirichlet(np.ones(200), size=(64, 15)))[..., :64], -1)[..., ::-1]
    ids = rng.integers(0, 200, (64, 15, 64))
    t0 = time.perf_counter()
    tree = ref.tree_build(ids, lp, np.zeros(64, int), np.zeros(64, int), 64, 65)
    assert time.perf_counter() - t0 < 1.0
    assert (tree.num_nodes == 65).all()


_GOOD = dict(topk_ids=np.zeros((2, 3, 4), np.int32), topk_logprobs=np.zeros((2, 3, 4), F32),
             root_tokens=np.zeros(2, np.int32), prefix_lens=np.zeros(2, np.int32), budget=4,
             max_tree_size=9)


@pytest.mark.parametrize("field, value", [
    ("topk_ids", np.zeros((2, 3), np.int32)),
    ("topk_ids", np.zeros((2, 3, 4), F32)),
    ("topk_ids", np.zeros((2, 0, 4), np.int32)),
    ("topk_ids", np.zeros((2, 3, 0), np.int32)),
    ("topk_ids", np.zeros((2, 3, 9), np.int32)),
    ("topk_ids", np.full((2, 3, 4), 2**31, np.int64)),
    ("topk_logprobs", np.zeros((2, 3, 4), np.int32)),
    ("topk_logprobs", np.zeros((2, 3, 5), F32)),
    ("root_tokens", np.zeros(3, np.int32)),
    ("prefix_lens", np.zeros(1, np.int32)),
    ("prefix_lens", np.array([0, -1])),
    ("budget", -1), ("budget", 9), ("budget", 2.0), ("budget", True),
    ("max_tree_size", 1), ("max_tree_size", None),
], ids=["ids-2d", "ids-float", "ids-D0", "ids-K0", "ids-K-too-big", "ids-overflow",
        "lp-int", "lp-shape", "roots-batch", "prefix-batch", "prefix-negative",
        "budget-negative", "budget-N", "budget-float", "budget-bool", "N-1", "N-None"])
@pytest.mark.parametrize("fn", [ref.tree_build, ref.tree_build_heap], ids=["scan", "heap"])
def test_tree_build_argument_errors(fn, field, value):
    kwargs = dict(_GOOD, **{field: value})
    with pytest.raises(ArgumentError, match=field.split("_")[0]):
        fn(**kwargs)


def test_tree_build_accepts_other_dtypes():
    kwargs = dict(_GOOD, topk_ids=np.zeros((2, 3, 4), np.uint8),
                  topk_logprobs=np.zeros((2, 3, 4), np.float64), budget=np.int64(4))
    tree = ref.tree_build(**kwargs)
    assert tree.num_nodes.tolist() == [5, 5]


# ======================================================================== tree_verify

def _brute_attention(qn, qp, kv, table, prefix, qlens, mask, scale, tail):
    """One (request, row, head) at a time, keys in a Python loop."""
    bsz, nq, h, r = qn.shape
    page_size = kv.shape[1]
    out = np.full((bsz, nq, h, r), np.nan)
    lse = np.full((bsz, nq, h), np.nan)
    for b in range(bsz):
        L = int(prefix[b])
        for i in range(int(qlens[b])):
            for hh in range(h):
                scores, vals = [], []
                for t in range(L + int(qlens[b])):
                    if t < L:
                        if tail:
                            continue
                    else:
                        j = t - L
                        if not (int(mask[b, i, j // 32]) >> (j % 32)) & 1:
                            continue
                    e = kv[table[b, t // page_size], t % page_size].astype(np.float64)
                    scores.append(scale * (qn[b, i, hh] @ e[:r] + qp[b, i, hh] @ e[r:]))
                    vals.append(e[:r])
                if not scores:
                    out[b, i, hh], lse[b, i, hh] = 0.0, NINF
                    continue
                s = np.array(scores)
                mx = s.max()
                w = np.exp(s - mx)
                lse[b, i, hh] = mx + np.log(w.sum())
                out[b, i, hh] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
    return out, lse


def _verify_case(rng, prefix=(0, 7), qlens=(3, 5), nq=5, h=2, r=4, p=2, page_size=3,
                 bits=False):
    bsz = len(prefix)
    table, num_pages = inputs.block_table(rng, [16 * page_size] * bsz, page_size, extra_pages=2)   # 16 pages each
    qn = rng.normal(size=(bsz, nq, h, r))
    qp = rng.normal(size=(bsz, nq, h, p))
    kv = rng.normal(size=(num_pages, page_size, r + p))
    w = (nq + 31) // 32
    mask = np.zeros((bsz, nq, w), np.uint32)
    for b in range(bsz):  # a random tree: node i's parent is a random earlier node
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, nq)]
        for i in range(nq):
            j = i
            while j >= 0:
                mask[b, i, j // 32] |= np.uint32(1 << (j % 32))
                j = parents[j]
    if bits:
        qn, qp, kv = bf16.to_bits(qn), bf16.to_bits(qp), bf16.to_bits(kv)
    return dict(q_nope=qn, q_pe=qp, kv_cache=kv, block_table=table,
                prefix_lens=np.array(prefix, np.int32), q_lens=np.array(qlens, np.int32),
                tree_mask=mask, softmax_scale=0.37)


def _as64(x):
    return bf16.from_bits(x).astype(np.float64) if x.dtype == np.uint16 else x


def _brute(case, tail):
    c = dict(case)
    for key in ("q_nope", "q_pe", "kv_cache"):
        c[key] = _as64(c[key])
    return _brute_attention(c["q_nope"], c["q_pe"], c["kv_cache"], c["block_table"],
                            c["prefix_lens"], c["q_lens"], c["tree_mask"], c["softmax_scale"],
                            tail)


@pytest.mark.parametrize("tail", [False, True], ids=["verify", "tail"])
@pytest.mark.parametrize("prefix, qlens, page_size, bits", [
    ((0, 7), (3, 5), 3, False),
    ((5, 0, 12), (5, 1, 4), 4, False),
    ((2, 9), (5, 5), 1, True),
    ((0,), (1,), 3, False),
], ids=["prefix0", "three-requests", "page1-bf16-bits", "single-node"])
def test_tree_verify_matches_brute_force(tail, prefix, qlens, page_size, bits):
    rng = np.random.default_rng(7)
    case = _verify_case(rng, prefix=prefix, qlens=qlens, page_size=page_size, bits=bits)
    fn = ref.tree_verify_tail if tail else ref.tree_verify
    got = fn(**case)
    want_out, want_lse = _brute(case, tail)
    assert got.out.dtype == np.float64 and got.lse.dtype == np.float64
    np.testing.assert_allclose(got.out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got.lse, want_lse, rtol=1e-12, atol=1e-13)
    for b, q in enumerate(qlens):  # rows >= q_len are not written (NaN when allocated)
        assert np.isnan(got.out[b, q:]).all() and np.isnan(got.lse[b, q:]).all()
        assert not np.isnan(got.out[b, :q]).any()


def test_tree_verify_empty_row_and_untouched_rows():
    rng = np.random.default_rng(8)
    case = _verify_case(rng, prefix=(0, 4), qlens=(3, 2))
    case["tree_mask"][0, 1] = 0  # request 0 (no prefix): row 1 sees nothing
    out = np.full((2, 5, 2, 4), 123.0, F32)
    lse = np.full((2, 5, 2), 456.0, F32)
    res = ref.tree_verify(**case, out=out, lse=lse)
    assert res.out is out and res.lse is lse
    assert (out[0, 1] == 0).all() and np.isneginf(lse[0, 1]).all()
    assert (out[0, 3:] == 123.0).all() and (lse[0, 3:] == 456.0).all()
    assert (out[1, 2:] == 123.0).all() and (lse[1, 2:] == 456.0).all()
    want_out, want_lse = _brute(case, tail=False)
    np.testing.assert_allclose(out[0, :3], want_out[0, :3], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse[1, :2], want_lse[1, :2], rtol=1e-6)
    # the prefix keeps request 1's rows non-empty even with an all-zero mask row
    case["tree_mask"][1, 0] = 0
    assert np.isfinite(ref.tree_verify(**case).lse[1, 0]).all()


def test_tree_verify_bf16_out_receives_bits():
    case = _verify_case(np.random.default_rng(9))
    out = np.zeros((2, 5, 2, 4), np.uint16)
    lse = np.zeros((2, 5, 2), np.uint16)
    ref.tree_verify(**case, out=out, lse=lse)
    full = ref.tree_verify(**case)
    np.testing.assert_array_equal(out[0, :3], bf16.to_bits(full.out[0, :3]))
    np.testing.assert_array_equal(lse[1, :5], bf16.to_bits(full.lse[1, :5]))


@pytest.mark.parametrize("prefix, qlens", [((0, 7), (3, 5)), ((4, 10), (5, 1))],
                         ids=["with-empty-prefix", "both-prefixes"])
def test_tree_verify_equals_merge_of_prefix_and_tail(prefix, qlens):
    case = _verify_case(np.random.default_rng(10), prefix=prefix, qlens=qlens)
    full = ref.tree_verify(**case)
    tail = ref.tree_verify_tail(**case)
    prefix_only = ref.tree_verify(**dict(case, tree_mask=np.zeros_like(case["tree_mask"])))
    merged = ref.merge_states(prefix_only.out, prefix_only.lse, tail.out, tail.lse)
    for b, q in enumerate(qlens):
        np.testing.assert_allclose(merged.out[b, :q], full.out[b, :q], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(merged.lse[b, :q], full.lse[b, :q], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("field, value, match", [
    ("q_lens", np.array([0, 5]), "q_lens"),
    ("q_lens", np.array([3, 6]), "q_lens"),
    ("q_lens", np.array([3]), "q_lens"),
    ("prefix_lens", np.array([0, 44]), "prefix_lens"),
    ("prefix_lens", np.array([-1, 7]), "prefix_lens"),
    ("tree_mask", np.zeros((2, 5, 0), np.uint32), "tree_mask"),
    ("tree_mask", np.zeros((2, 4, 1), np.uint32), "tree_mask"),
    ("tree_mask", np.zeros((2, 5, 1), F32), "tree_mask"),
    ("block_table", np.full((2, 16), 99, np.int32), "block_table"),
    ("block_table", np.zeros((3, 16), np.int32), "block_table"),
    ("kv_cache", np.zeros((34, 3, 5)), "kv_cache"),
    ("kv_cache", np.zeros((34, 3, 6), np.int32), "kv_cache"),
    ("q_nope", np.zeros((2, 5, 2, 4), np.int32), "q_nope"),
    ("q_pe", np.zeros((2, 5, 3, 2)), "q_pe"),
    ("softmax_scale", float("nan"), "softmax_scale"),
    ("softmax_scale", None, "softmax_scale"),
    ("out", np.zeros((2, 5, 2, 3)), "out"),
    ("lse", np.zeros((2, 5, 2), np.int32), "lse"),
], ids=["qlen0", "qlen-gt-Nq", "qlens-batch", "prefix-too-long", "prefix-negative",
        "mask-W0", "mask-rows", "mask-float", "page-out-of-range", "table-batch",
        "kv-width", "kv-int", "q-int", "q_pe-heads", "scale-nan", "scale-none", "out-shape",
        "lse-dtype"])
@pytest.mark.parametrize("fn", [ref.tree_verify, ref.tree_verify_tail], ids=["verify", "tail"])
def test_tree_verify_argument_errors(fn, field, value, match):
    case = _verify_case(np.random.default_rng(11))
    case[field] = value
    with pytest.raises(ArgumentError, match=match):
        fn(**case)


def test_tree_verify_validates_before_writing():
    case = _verify_case(np.random.default_rng(12))
    case["block_table"][1, 3] = -1  # request 1 (prefix 7 + 5, page 3) uses it
    out = np.full((2, 5, 2, 4), 5.0)
    with pytest.raises(ArgumentError, match="block_table"):
        ref.tree_verify(**case, out=out)
    assert (out == 5.0).all()


# ======================================================================= merge_states

def _state(rng, shape=(2, 3, 4), r=5):
    return rng.normal(size=shape + (r,)), rng.normal(size=shape) * 3


def test_merge_states_formula():
    rng = np.random.default_rng(13)
    (oa, la), (ob, lb) = _state(rng), _state(rng)
    got = ref.merge_states(oa, la, ob, lb)
    wa, wb = np.exp(la), np.exp(lb)
    np.testing.assert_allclose(got.lse, np.log(wa + wb), rtol=1e-12)
    np.testing.assert_allclose(got.out, (wa[..., None] * oa + wb[..., None] * ob)
                               / (wa + wb)[..., None], rtol=1e-12)


@pytest.mark.parametrize("empty", [NINF, np.inf, np.nan], ids=["-inf", "+inf", "nan"])
@pytest.mark.parametrize("side", ["a", "b"])
def test_merge_states_empty_side_drops_out(empty, side):
    rng = np.random.default_rng(14)
    (oa, la), (ob, lb) = _state(rng), _state(rng)
    la = la.copy()
    la[0, 1] = empty
    oa[0, 1] = np.nan  # an empty side's output is ignored, even when poisoned
    args = (oa, la, ob, lb) if side == "a" else (ob, lb, oa, la)
    got = ref.merge_states(*args)
    np.testing.assert_array_equal(got.out[0, 1], ob[0, 1])
    np.testing.assert_array_equal(got.lse[0, 1], lb[0, 1])
    assert not np.isnan(got.out).any() and not np.isnan(got.lse).any()


@pytest.mark.parametrize("ea, eb", [(NINF, NINF), (np.inf, NINF), (np.nan, np.inf),
                                    (np.nan, np.nan)], ids=["-inf/-inf", "+inf/-inf",
                                                            "nan/+inf", "nan/nan"])
def test_merge_states_both_empty(ea, eb):
    o = np.full((1, 2, 3), np.nan)
    got = ref.merge_states(o, np.full((1, 2), ea), o, np.full((1, 2), eb))
    assert (got.out == 0).all() and np.isneginf(got.lse).all()


def test_merge_states_bf16_bits_and_out_arrays():
    rng = np.random.default_rng(15)
    (oa, la), (ob, lb) = _state(rng), _state(rng)
    bits = [bf16.to_bits(x) for x in (oa, la, ob, lb)]
    want = ref.merge_states(*[bf16.from_bits(x) for x in bits])
    out = np.zeros(oa.shape, np.uint16)
    lse = np.zeros(la.shape, F32)
    got = ref.merge_states(*bits, out=out, lse=lse)
    assert got.out is out and got.lse is lse
    np.testing.assert_array_equal(out, bf16.to_bits(want.out))
    np.testing.assert_array_equal(lse, want.lse.astype(F32))


@pytest.mark.parametrize("args", [
    (np.zeros((2, 3)), np.zeros(3), np.zeros((2, 3)), np.zeros(2)),
    (np.zeros((2, 3)), np.zeros(2), np.zeros((2, 4)), np.zeros(2)),
    (np.zeros((2, 3), np.int32), np.zeros(2), np.zeros((2, 3)), np.zeros(2)),
    (np.zeros(()), np.zeros(()), np.zeros(()), np.zeros(())),
], ids=["lse-shape", "o-shape", "int-input", "0d"])
def test_merge_states_argument_errors(args):
    with pytest.raises(ArgumentError):
        ref.merge_states(*args)


# ======================================================================== tree_accept

def _hand_tree(n=8):
    """0 -> {1, 3}; 1 -> {2, 4}; 2 -> 5; 5 -> 6. Tokens: 1:10 2:20 3:11 4:21 5:30 6:40."""
    tokens = np.full((1, n), -1, np.int32)
    tokens[0, :7] = [100, 10, 20, 11, 21, 30, 40]
    first_child = np.full((1, n), -1, np.int32)
    next_sibling = np.full((1, n), -1, np.int32)
    first_child[0, [0, 1, 2, 5]] = [1, 2, 5, 6]
    next_sibling[0, [1, 2]] = [3, 4]
    return SimpleNamespace(num_nodes=np.array([7], np.int32), tokens=tokens,
                           first_child=first_child, next_sibling=next_sibling)


def _targets(n=8, **at):
    t = np.full((1, n), 999, np.int32)
    for node, tok in at.items():
        t[0, int(node[1:])] = tok
    return t


def _kv(num_pages=6, page_size=4, width=3, dtype=np.float64):
    return (np.arange(num_pages * page_size * width) + 1000).reshape(
        num_pages, page_size, width).astype(dtype)


def _expected_kv(kv, table, prefix, path):
    """Read every source first, then write; skip positions outside the cache."""
    want = kv.copy()
    page_size, num_pages = kv.shape[1], kv.shape[0]

    def where(pos):
        pi = pos // page_size
        if pi >= table.shape[0] or not 0 <= table[pi] < num_pages:
            return None
        return int(table[pi]), pos % page_size

    moves = [(where(prefix + k), where(prefix + node)) for k, node in enumerate(path) if k]
    vals = [kv[s].copy() if s and d else None for d, s in moves]
    for (d, s), v in zip(moves, vals):
        if v is not None:
            want[d] = v
    return want


@pytest.mark.parametrize("targets, max_depth, path, out_tokens", [
    (dict(n0=10, n1=20, n2=30, n5=40, n6=77), 4, [0, 1, 2, 5, 6], [10, 20, 30, 40, 77]),
    (dict(n0=10, n1=20, n2=30, n5=40, n6=77), 3, [0, 1, 2, 5], [10, 20, 30, 40]),
    (dict(n0=10, n1=20, n2=31), 4, [0, 1, 2], [10, 20, 31, -1, -1]),
    (dict(n0=11, n3=12), 4, [0, 3], [11, 12, -1, -1, -1]),
    (dict(n0=10, n1=21, n4=5), 4, [0, 1, 4], [10, 21, 5, -1, -1]),
    (dict(n0=55), 4, [0], [55, -1, -1, -1, -1]),
    (dict(n0=10), 0, [0], [10]),
], ids=["full-chain", "max-depth-cut", "partial", "second-root-child", "sibling-choice",
        "zero-accept", "max-depth-0"])
def test_tree_accept_hand_tree(targets, max_depth, path, out_tokens):
    tree = _hand_tree()
    kv = _kv()
    table = np.array([[3, 1, 4, 0, 2]], np.int32)
    before = kv.copy()
    res = ref.tree_accept(tree, _targets(**targets), np.array([5]), kv, table, max_depth)
    k = len(path) - 1
    assert res.accept_lens.tolist() == [k]
    assert res.accepted_nodes.tolist() == [path + [-1] * (max_depth + 1 - len(path))]
    assert res.out_tokens.tolist() == [out_tokens]
    assert res.new_prefix_lens.tolist() == [5 + 1 + k]
    for arr in res:
        assert arr.dtype == np.int32
    np.testing.assert_array_equal(kv, _expected_kv(before, table[0], 5, path))
    if k:  # element-wise: position 5 + j now holds what position 5 + path[j] held
        for j in range(1, k + 1):
            dst, src = 5 + j, 5 + path[j]
            assert (kv[table[0, dst // 4], dst % 4] == before[table[0, src // 4], src % 4]).all()


def test_tree_accept_first_matching_sibling_wins():
    tree = _hand_tree()
    tree.tokens[0, 3] = 10  # nodes 1 and 3 both carry token 10
    res = ref.tree_accept(tree, _targets(n0=10), np.array([0]), _kv(), np.array([[0, 1]]), 3)
    assert res.accepted_nodes[0, :2].tolist() == [0, 1]


def test_tree_accept_in_place_overlap_reads_before_writing():
    # page 0 serves both logical pages 0 and 1: positions 1 and 5 alias.
    # path [0, 3, 5]: move 1 writes position 1 (= slot 1), move 2 reads position 5
    # (= slot 1 too) and must see its value from before move 1.
    n = 6
    tokens = np.array([[100, 1, 2, 3, 4, 5]], np.int32)
    first_child = np.array([[1, -1, -1, 5, -1, -1]], np.int32)
    next_sibling = np.array([[-1, 2, 3, -1, -1, -1]], np.int32)
    tree = SimpleNamespace(num_nodes=np.array([6]), tokens=tokens, first_child=first_child,
                           next_sibling=next_sibling)
    kv = _kv(num_pages=2, dtype=np.uint16)
    before = kv.copy()
    table = np.array([[0, 0]], np.int32)
    t = np.full((1, n), 9, np.int32)
    t[0, 0], t[0, 3] = 3, 5
    res = ref.tree_accept(tree, t, np.array([0]), kv, table, 4)
    assert res.accepted_nodes[0, :3].tolist() == [0, 3, 5]
    assert (kv[0, 1] == before[0, 3]).all()
    assert (kv[0, 2] == before[0, 1]).all()  # the old value of position 5, not the new one
    np.testing.assert_array_equal(kv, _expected_kv(before, table[0], 0, [0, 3, 5]))


@pytest.mark.parametrize("table", [[[3, 1, -1, 0]], [[3, 1]], [[3, 1, 99]]],
                         ids=["negative-entry", "beyond-max-pages", "entry-too-large"])
def test_tree_accept_skips_positions_outside_the_cache(table):
    # prefix 2, path [0, 1, 2, 5, 6]: moves 3<-3, 4<-4, 5<-7, 6<-8; position 8 (page 2)
    # is outside the cache, so only 5<-7 changes anything
    tree = _hand_tree()
    kv = _kv()
    before = kv.copy()
    table = np.array(table, np.int32)
    res = ref.tree_accept(tree, _targets(n0=10, n1=20, n2=30, n5=40), np.array([2]),
                          kv, table, 4)
    path = [0, 1, 2, 5, 6]
    assert res.accepted_nodes[0].tolist() == path
    assert res.new_prefix_lens.tolist() == [7]
    np.testing.assert_array_equal(kv, _expected_kv(before, table[0], 2, path))
    np.testing.assert_array_equal(kv[1, 1], before[1, 3])   # 5 <- 7
    np.testing.assert_array_equal(kv[1, 2], before[1, 2])   # 6 <- 8 skipped
    assert (kv != before).sum() == kv.shape[2]


def _malformed(num_nodes, first_child, next_sibling, tokens=None):
    n = len(first_child)
    tokens = tokens if tokens is not None else [100] + [10] * (n - 1)
    return SimpleNamespace(num_nodes=np.array([num_nodes]), tokens=np.array([tokens]),
                           first_child=np.array([first_child]),
                           next_sibling=np.array([next_sibling]))


@pytest.mark.parametrize("tree, path", [
    (_malformed(4, [1, 0, -1, -1], [-1, -1, -1, -1]), [0, 1]),     # child link back to root
    (_malformed(4, [1, 1, -1, -1], [-1, -1, -1, -1]), [0, 1]),     # self child link
    (_malformed(4, [2, -1, -1, -1], [-1, -1, 2, -1], [100, 7, 7, 10]), []),  # self sibling
    (_malformed(4, [2, -1, -1, -1], [-1, -1, 1, -1], [100, 10, 7, 7]), []),  # sibling back
    (_malformed(4, [9, -1, -1, -1], [-1, -1, -1, -1]), []),        # child out of range
    (_malformed(3, [3, -1, -1, -1], [-1, -1, -1, -1]), []),        # child >= num_nodes
    (_malformed(4, [1, 2, 3, 1], [-1, -1, -1, -1]), [0, 1, 2, 3]),  # last link points back
    (_malformed(0, [1, 2, 3, -1], [-1, -1, -1, -1]), []),          # num_nodes 0
    (_malformed(5, [1, 2, 3, -1], [-1, -1, -1, -1]), []),          # num_nodes > N
    (_malformed(-3, [1, 2, 3, -1], [-1, -1, -1, -1]), []),         # negative num_nodes
    (_malformed(4, [-7, -1, -1, -1], [-1, -1, -1, -1]), []),       # negative link
], ids=["child-back", "child-self", "sibling-self", "sibling-back", "child-out-of-range",
        "child-ge-num-nodes", "chain-then-back", "num-nodes-0", "num-nodes-gt-N",
        "num-nodes-negative", "negative-link"])
def test_tree_accept_malformed_trees_terminate(tree, path):
    targets = np.array([[10, 10, 10, 10]], np.int32)
    path = path or [0]
    res = ref.tree_accept(tree, targets, np.array([0]), _kv(), np.array([[0, 1]]), 6)
    assert res.accepted_nodes[0].tolist() == path + [-1] * (7 - len(path))
    assert res.accept_lens.tolist() == [len(path) - 1]
    assert res.out_tokens[0, len(path) - 1] == 10  # bonus = target_tokens[b, last]


def test_tree_accept_random_garbage_trees_terminate():
    rng = np.random.default_rng(16)
    for _ in range(300):
        b, n, d = int(rng.integers(1, 4)), int(rng.integers(1, 10)), int(rng.integers(0, 6))
        tree = SimpleNamespace(num_nodes=rng.integers(-2, n + 3, b),
                               tokens=rng.integers(0, 3, (b, n)),
                               first_child=rng.integers(-3, n + 3, (b, n)),
                               next_sibling=rng.integers(-3, n + 3, (b, n)))
        kv = _kv(num_pages=3, page_size=2)
        table = rng.integers(-1, 4, (b, 4))
        res = ref.tree_accept(tree, rng.integers(0, 3, (b, n)), rng.integers(0, 4, b), kv,
                              table, d)
        for r in range(b):
            k = int(res.accept_lens[r])
            path = res.accepted_nodes[r, :k + 1]
            assert 0 <= k <= d and path[0] == 0 and (np.diff(path) > 0).all()
            assert (res.accepted_nodes[r, k + 1:] == -1).all()
            if k:
                assert path[-1] < tree.num_nodes[r] <= n


@pytest.mark.parametrize("change, match", [
    (dict(tree=SimpleNamespace(tokens=np.zeros((1, 8)))), "num_nodes"),
    (dict(target_tokens=np.zeros((1, 7), np.int32)), "target_tokens"),
    (dict(target_tokens=np.zeros((1, 8), F32)), "target_tokens"),
    (dict(prefix_lens=np.array([-1])), "prefix_lens"),
    (dict(prefix_lens=np.array([1, 2])), "prefix_lens"),
    (dict(kv_cache=[[[0.0]]]), "kv_cache"),
    (dict(kv_cache=np.zeros((2, 3))), "kv_cache"),
    (dict(block_table=np.zeros((2, 2), np.int32)), "block_table"),
    (dict(block_table=np.zeros((1, 2), F32)), "block_table"),
    (dict(max_depth=-1), "max_depth"),
    (dict(max_depth=1.5), "max_depth"),
], ids=["tree-missing-field", "target-shape", "target-float", "prefix-negative",
        "prefix-batch", "kv-not-ndarray", "kv-2d", "table-batch", "table-float",
        "max-depth-negative", "max-depth-float"])
def test_tree_accept_argument_errors(change, match):
    args = dict(tree=_hand_tree(), target_tokens=_targets(), prefix_lens=np.array([0]),
                kv_cache=_kv(), block_table=np.array([[0, 1]], np.int32), max_depth=4)
    args.update(change)
    with pytest.raises(ArgumentError, match=match):
        ref.tree_accept(**args)


def test_tree_accept_on_tree_build_output():
    rng = np.random.default_rng(17)
    ids = rng.integers(0, 4, (2, 4, 3)).astype(np.int32)
    lp = -rng.exponential(1.0, (2, 4, 3)).astype(F32)
    tree = ref.tree_build(ids, lp, [1, 2], [3, 8], 12, 17)
    # follow the first child each time: the target agrees with the draft's best chain
    target = np.full((2, 17), -5, np.int32)
    for b in range(2):
        cur, chain = 0, [0]
        while tree.first_child[b, cur] >= 0:
            nxt = int(tree.first_child[b, cur])
            target[b, cur] = tree.tokens[b, nxt]
            chain.append(nxt)
            cur = nxt
        res = ref.tree_accept(tree, target, np.array([3, 8]), _kv(num_pages=8),
                              np.arange(8).reshape(2, 4), 4)
        assert res.accepted_nodes[b, :len(chain)].tolist() == chain[:5]

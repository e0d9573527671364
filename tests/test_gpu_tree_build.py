"""tree_build on the GPU against reference.tree_build, bit for bit (every output, padding included).

Fresh random inputs each run: the seed is in every failure message, and DDTREE_TEST_SEED=<seed>
replays it. Every output is poisoned before the launch (out= buffers filled with 0x7BADBEEF), so a
column the kernel forgets to write shows up.
"""
import os
import secrets

import numpy as np
import pytest

from ddtree_gen import reference as ref
from ddtree_gen.types import TreeBuildOutput
from conftest import cuda_torch

pytestmark = pytest.mark.gpu

POISON = 0x7BADBEEF
NINF, PINF = np.float32(-np.inf), np.float32(np.inf)


@pytest.fixture
def ks(spec):
    import ddtree_gen
    return ddtree_gen.load(spec, kernels=["tree_build"])


@pytest.fixture
def seed():
    return int(os.environ.get("DDTREE_TEST_SEED") or secrets.randbits(31))


def where(seed):
    return f"seed {seed} (DDTREE_TEST_SEED={seed} replays it)"


# ------------------------------------------------------------------------------------ inputs

def logprobs(rng, shape, kind):
    """float32 log-probs [B, D', K'] of one flavour."""
    b, dp, kp = shape
    if kind == "sorted":      # what a drafter gives: descending per depth, <= 0
        lp = -np.sort(rng.exponential(2.0, shape), axis=-1)
    elif kind == "deep":      # rank 0 close to 0: best-first goes deep before wide
        lp = -np.sort(rng.exponential(2.0, shape), axis=-1)
        lp[..., 0] = -rng.uniform(0, 0.05, (b, dp))
    elif kind == "unsorted":
        lp = rng.normal(-3.0, 2.0, shape)
    elif kind == "ties":      # few distinct values: equal scores everywhere, creation order decides
        lp = rng.choice(np.array([-0.5, -1.0, -1.5, -2.0]), shape)
    elif kind == "equal":
        lp = np.full(shape, -1.0)
    elif kind == "special":   # -inf and NaN (both count as -inf), mixed with finite values
        lp = -np.sort(rng.exponential(2.0, shape), axis=-1)
        pick = rng.random(shape)
        lp[pick < 0.15] = -np.inf
        lp[(pick >= 0.15) & (pick < 0.3)] = np.nan
    elif kind == "allbad":
        lp = rng.choice(np.array([-np.inf, np.nan]), shape)
    elif kind == "posinf":    # +inf log-probs: +inf scores, +inf + -inf = NaN -> -inf
        lp = -np.sort(rng.exponential(2.0, shape), axis=-1)
        pick = rng.random(shape)
        lp[pick < 0.1] = np.inf
        lp[(pick >= 0.1) & (pick < 0.2)] = -np.inf
        lp[(pick >= 0.2) & (pick < 0.25)] = np.nan
    elif kind == "tiny":      # subnormals and values whose float32 sums round
        lp = rng.choice(np.array([-1e-45, -3e-39, -1e-7, -1.0000001, -16777216.0, -0.0]), shape)
    else:
        raise ValueError(kind)
    with np.errstate(invalid="ignore"):
        return lp.astype(np.float32)


def make_inputs(rng, b, dp, kp, kind, prefix="random"):
    ids = rng.integers(-2**31, 2**31, (b, dp, kp), dtype=np.int64).astype(np.int32)
    lps = logprobs(rng, (b, dp, kp), kind)
    roots = rng.integers(-2**31, 2**31, b, dtype=np.int64).astype(np.int32)
    if prefix == "random":
        pl = rng.integers(0, 100001, b)
        pl[: min(b, 3)] = [0, 100000, 1][: min(b, 3)]
    else:
        pl = np.full(b, prefix)
    return ids, lps, roots, pl.astype(np.int32)


def poisoned_out(cupy, b, n, w):
    i32 = lambda *shape: cupy.full(shape, POISON, dtype=cupy.int32)  # noqa: E731
    return TreeBuildOutput(num_nodes=i32(b), tokens=i32(b, n), parents=i32(b, n), depths=i32(b, n),
                           positions=i32(b, n),
                           scores=cupy.full((b, n), POISON, dtype=cupy.uint32).view(cupy.float32),
                           tree_mask=cupy.full((b, n, w), POISON, dtype=cupy.uint32),
                           first_child=i32(b, n), next_sibling=i32(b, n))


def check_equal(got, want, what):
    """Every field of a TreeBuildOutput bit for bit; the message names field, request, column."""
    for field in TreeBuildOutput._fields:
        g, w = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        assert g.shape == w.shape, f"{what}: {field} shape {g.shape}, reference {w.shape}"
        if w.dtype == np.float32:
            g, w = g.view(np.uint32), w.view(np.uint32)
        bad = np.argwhere(g != w)
        if bad.size:
            i = tuple(bad[0])
            b = i[0]
            raise AssertionError(
                f"{what}: {field}{list(i)} = {g[i]}, reference {w[i]} ({len(bad)} differences); "
                f"request {b}: num_nodes {want.num_nodes[b]}, tokens {want.tokens[b][:8]}..., "
                f"parents {want.parents[b][:16]}...")


def run_case(ks, seed, rng, b, dp, kp, budget, kind, prefix="random"):
    import cupy
    spec = ks.spec
    n, w = spec.max_tree_size, spec.mask_words
    ids, lps, roots, pl = make_inputs(rng, b, dp, kp, kind, prefix)
    want = ref.tree_build(ids, lps, roots, pl, budget, n)
    args = [cupy.asarray(x) for x in (ids, lps, roots, pl)]
    out = poisoned_out(cupy, b, n, w)
    got = ks.tree_build(*args, budget, out=out)
    for field in TreeBuildOutput._fields:
        assert getattr(got, field) is getattr(out, field), f"out.{field} was not used as given"
    host = TreeBuildOutput(*(cupy.asnumpy(x) for x in got))
    what = f"{spec.name}: B={b} D'={dp} K'={kp} budget={budget} {kind}, {where(seed)}"
    check_equal(host, want, what)
    for x, dev in zip((ids, lps, roots, pl), args):  # the inputs are left as they were
        assert (cupy.asnumpy(dev).view(np.uint32) == x.view(np.uint32)).all(), f"{what}: an input changed"
    return host


# ------------------------------------------------------------------------------------- cases

def shape_of(spec, dp, kp):
    n, d = spec.max_tree_size, spec.max_depth
    return (d if dp == "D" else min(dp, d)), (n - 1 if kp == "N-1" else min(kp, n - 1))


# (id, batch, D', K', budget ("max" = N-1), log-prob kind)
CASES = [
    ("full-b64", 64, "D", "N-1", "max", "sorted"),
    ("full-b1", 1, "D", "N-1", "max", "sorted"),
    ("deep-b64", 64, "D", "N-1", "max", "deep"),
    ("budget0-b64", 64, "D", "N-1", 0, "sorted"),
    ("budget0-b1", 1, "D", "N-1", 0, "sorted"),
    ("budget1-b64", 64, "D", "N-1", 1, "sorted"),
    ("budget1-b1", 1, 3, 2, 1, "unsorted"),
    ("chain-k1-b64", 64, "D", 1, "max", "sorted"),     # runs out of candidates at depth D
    ("chain-k1-b1", 1, "D", 1, "max", "unsorted"),
    ("k1-d1", 64, 1, 1, "max", "sorted"),              # one node beyond the root, whatever the budget
    ("d1-star", 64, 1, "N-1", "max", "sorted"),
    ("ties", 64, "D", "N-1", "max", "ties"),
    ("equal", 64, "D", "N-1", "max", "equal"),
    ("ties-chain", 64, "D", 1, "max", "equal"),
    ("ninf-nan", 64, "D", "N-1", "max", "special"),
    ("all-ninf-nan", 64, "D", "N-1", "max", "allbad"),
    ("posinf", 64, "D", "N-1", "max", "posinf"),
    ("subnormal-rounding", 64, "D", "N-1", "max", "tiny"),
    ("unsorted", 64, "D", "N-1", "max", "unsorted"),
]


@pytest.mark.parametrize("case,b,dp,kp,budget,kind", CASES, ids=[c[0] for c in CASES])
def test_tree_build_matches_reference(ks, spec, seed, case, b, dp, kp, budget, kind):
    rng = np.random.default_rng(seed)
    dp, kp = shape_of(spec, dp, kp)
    budget = spec.max_tree_size - 1 if budget == "max" else budget
    host = run_case(ks, seed, rng, b, dp, kp, budget, kind)
    if case.startswith("chain-k1"):  # the chain reaches depth D'
        assert (host.num_nodes == min(dp, budget) + 1).all(), where(seed)
        assert (host.depths.max(axis=1) == min(dp, budget)).all(), where(seed)
    if case.startswith("full") or case.startswith("deep"):
        assert (host.num_nodes == spec.max_tree_size).all(), where(seed)


def test_tree_build_random_shapes(ks, spec, seed):
    """Random D', K', budget and log-prob flavour, several batches."""
    rng = np.random.default_rng(seed)
    kinds = ["sorted", "deep", "unsorted", "ties", "special", "posinf", "tiny"]
    for _ in range(12):
        dp = int(rng.integers(1, spec.max_depth + 1))
        kp = int(rng.integers(1, spec.max_tree_size))
        budget = int(rng.integers(0, spec.max_tree_size))
        b = int(rng.choice([1, 2, 7, 64]))
        run_case(ks, seed, rng, b, dp, kp, budget, str(rng.choice(kinds)))


@pytest.mark.parametrize("prefix", [0, 1, 100000, 2**31 - 1 - 15])
def test_tree_build_positions(ks, spec, seed, prefix):
    rng = np.random.default_rng(seed)
    run_case(ks, seed, rng, 8, spec.max_depth, spec.max_tree_size - 1, spec.max_tree_size - 1, "deep",
             prefix=min(prefix, 2**31 - 1 - spec.max_depth))


def test_tree_build_allocates_outputs(ks, spec, seed):
    """Without out=: CuPy outputs of the right shapes, equal to the reference."""
    import cupy
    rng = np.random.default_rng(seed)
    ids, lps, roots, pl = make_inputs(rng, 5, spec.max_depth, 7, "sorted")
    got = ks.tree_build(*(cupy.asarray(x) for x in (ids, lps, roots, pl)), budget=20)
    assert all(isinstance(x, cupy.ndarray) for x in got)
    want = ref.tree_build(ids, lps, roots, pl, 20, spec.max_tree_size)
    check_equal(TreeBuildOutput(*(cupy.asnumpy(x) for x in got)), want, f"{spec.name}: allocated, {where(seed)}")


def test_tree_build_empty_batch(ks, spec):
    import cupy
    d, n = spec.max_depth, spec.max_tree_size
    got = ks.tree_build(cupy.zeros((0, d, 3), cupy.int32), cupy.zeros((0, d, 3), cupy.float32),
                        cupy.zeros(0, cupy.int32), cupy.zeros(0, cupy.int32), 5)
    assert got.tokens.shape == (0, n) and got.tree_mask.shape == (0, n, spec.mask_words)


def test_tree_build_torch(ks, spec, seed):
    torch = cuda_torch()
    rng = np.random.default_rng(seed)
    b, n = 16, spec.max_tree_size
    ids, lps, roots, pl = make_inputs(rng, b, spec.max_depth, n - 1, "special")
    args = [torch.from_numpy(x).cuda() for x in (ids, lps, roots, pl)]
    got = ks.tree_build(*args, budget=n - 1)
    torch.cuda.synchronize()
    assert all(isinstance(x, torch.Tensor) and x.is_cuda for x in got)
    assert got.tokens.dtype == torch.int32 and got.scores.dtype == torch.float32
    host = TreeBuildOutput(*(torch_to_numpy(torch, x) for x in got))
    check_equal(host, ref.tree_build(ids, lps, roots, pl, n - 1, n), f"{spec.name}: torch, {where(seed)}")
    # torch out= buffers, poisoned
    out = TreeBuildOutput(*(torch.full(tuple(x.shape), POISON, dtype=torch.int32, device=x.device).view(x.dtype)
                            for x in got))
    again = ks.tree_build(*args, budget=n - 1, out=out)
    torch.cuda.synchronize()
    assert all(a.data_ptr() == o.data_ptr() for a, o in zip(again, out))
    check_equal(TreeBuildOutput(*(torch_to_numpy(torch, x) for x in again)), host,
                f"{spec.name}: torch out=, {where(seed)}")


def torch_to_numpy(torch, x):
    """A CUDA tensor's values as numpy, uint32 through its int32 bits (torch's uint32 support is thin)."""
    if x.dtype == torch.uint32:
        return x.view(torch.int32).cpu().numpy().view(np.uint32)
    return x.cpu().numpy()

"""tree_accept on the GPU against reference.tree_accept, bit for bit, the whole kv_cache included.

Trees come from the GPU tree_build; target tokens are chosen to accept nothing, part of a path, or
a full depth-D path (a random child at each step). The cache holds random bits of the spec's kv_dtype
(bf16, or e4m3 bytes for an fp8 spec: the commit moves R+P bytes per entry then); each request's
pages are a random permutation of the pool, and its tree spans a page boundary. Malformed trees
(backward links, cycles, out-of-range links, num_nodes 0 or > N) and block tables with holes must
give the reference's result. Outputs are poisoned before every launch. Fresh random inputs each
run: the seed is in every failure message, and DDTREE_TEST_SEED=<seed> replays it.
"""
import os
import secrets
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree_gen import inputs
from ddtree_gen import reference as ref
from ddtree_gen.errors import ArgumentError
from ddtree_gen.types import TreeAcceptOutput, TreeBuildOutput
from conftest import cuda_torch
from verify_cases import kv_np_dtype, kv_torch, random_cache_bits

pytestmark = pytest.mark.gpu

POISON = 0x7BADBEEF
DRAFT_VOCAB = 50000          # draft tokens are drawn below this ...
MISS = 1 << 30               # ... and target tokens that must not match anything from here up
TREE_FIELDS = ("num_nodes", "tokens", "first_child", "next_sibling")


@pytest.fixture
def ks(spec):
    import ddtree_gen
    return ddtree_gen.load(spec, kernels=["tree_build", "tree_accept"])


@pytest.fixture
def seed():
    return int(os.environ.get("DDTREE_TEST_SEED") or secrets.randbits(31))


def where(seed):
    return f"seed {seed} (DDTREE_TEST_SEED={seed} replays it)"


# ------------------------------------------------------------------------------------- trees

def build_trees(ks, rng, b, kind="deep", dp=None, kp=None, budget=None):
    """Draft trees from the GPU tree_build: (device TreeBuildOutput, host TreeBuildOutput).

    Each depth's top-k tokens are distinct, so a target token picks exactly one child."""
    import cupy
    spec = ks.spec
    n, d = spec.max_tree_size, spec.max_depth
    dp = d if dp is None else dp
    kp = n - 1 if kp is None else kp
    budget = n - 1 if budget is None else budget
    # distinct residues mod K' make a depth's K' tokens distinct
    residues = rng.permuted(np.broadcast_to(np.arange(kp), (b, dp, kp)), axis=-1)
    ids = (rng.integers(0, DRAFT_VOCAB // kp, (b, dp, kp)) * kp + residues).astype(np.int32)
    lps = -np.sort(rng.exponential(2.0, (b, dp, kp)), axis=-1)
    if kind == "deep":   # rank 0 close to 0, the others below -5: a chain to depth D' comes first
        lps[..., 0] = -rng.uniform(0, 0.02, (b, dp))
        lps[..., 1:] -= 5.0
    lps = lps.astype(np.float32)
    roots = rng.integers(0, DRAFT_VOCAB, b).astype(np.int32)
    prefix = np.zeros(b, np.int32)
    tree = ks.tree_build(*(cupy.asarray(x) for x in (ids, lps, roots, prefix)), budget)
    host = TreeBuildOutput(*(cupy.asnumpy(x) for x in tree))
    return tree, host


def children(tree, b, node):
    out, c = [], int(tree.first_child[b, node])
    while c > node and c < tree.num_nodes[b]:
        out.append(c)
        c = int(tree.next_sibling[b, c])
    return out


def plan_targets(rng, tree, want_lens, max_depth, deepest=False):
    """target_tokens [B, N] accepting a random path of want_lens[b] nodes (fewer where the tree ends):
    a random child at each step, or with deepest=True a random one among those with the tallest subtrees.

    Returns (target_tokens, planned accept lengths)."""
    b, n = tree.tokens.shape
    target = rng.integers(MISS, 2**31 - 1, (b, n)).astype(np.int32)  # matches no draft token
    planned = np.zeros(b, np.int64)
    for r in range(b):
        height = np.zeros(n, np.int64)  # parents precede their children
        for i in range(int(tree.num_nodes[r]) - 1, 0, -1):
            p = tree.parents[r, i]
            height[p] = max(height[p], height[i] + 1)
        cur = 0
        for _ in range(min(int(want_lens[r]), max_depth)):
            kids = children(tree, r, cur)
            if not kids:
                break
            if deepest:
                tallest = max(height[c] for c in kids)
                kids = [c for c in kids if height[c] == tallest]
            c = int(rng.choice(kids))
            target[r, cur] = tree.tokens[r, c]
            cur = c
            planned[r] += 1
    return target, planned


# ------------------------------------------------------------------------------------- cache

def make_cache(rng, spec, prefix, b, spare_pages=7, table_kind="permutation"):
    """(kv_cache bits [num_pages, page, R+P] (uint16 bf16 bits, uint8 e4m3 bytes), block_table [B, max_pages] int32).

    Each request's pages around its tree (positions prefix .. prefix + N - 1) are distinct pages of a
    random permutation of the pool; the other block-table entries are junk the kernel must not use."""
    page, n = spec.page_size, spec.max_tree_size
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    first = prefix.astype(np.int64) // page
    last = (prefix.astype(np.int64) + n - 1) // page
    # junk outside the windows ("any"): valid pages of other requests, negatives, too large
    table, num_pages = inputs.block_table(rng, prefix.astype(np.int64) + n, page, first_pages=first,
                                          extra_pages=spare_pages, spare_columns=int(rng.integers(0, 3)),
                                          unused="any")
    kv = random_cache_bits(rng, spec, (num_pages, page, width))
    if table_kind == "holes":       # some pages of the windows missing: those moves are skipped
        for r in range(b):
            for idx in range(int(first[r]), int(last[r]) + 1):
                u = rng.random()
                if u < 0.2:
                    table[r, idx] = -1 - int(rng.integers(0, 5))
                elif u < 0.4:
                    table[r, idx] = num_pages + int(rng.integers(0, 5))
    elif table_kind == "duplicate":  # one page for the whole window of a request
        for r in range(b):
            table[r, first[r]:last[r] + 1] = table[r, first[r]]
    elif table_kind == "narrow":     # the table ends inside the windows: page index >= max_pages
        table = np.ascontiguousarray(table[:, : int(first.min()) + 1])
    return kv, table


def random_prefixes(rng, b, page):
    """prefix_lens in [0, 100000], with 0, page boundaries and 100000 among them."""
    specials = np.array([0, 1, page - 1, page, page + 1, 2 * page - 1, 100000 - 64, 100000])
    pl = rng.integers(0, 100001, b)
    pick = rng.random(b) < 0.3
    pl[pick] = rng.choice(specials, int(pick.sum()))
    pl[: min(b, 2)] = [0, 100000][: min(b, 2)]
    return np.clip(pl, 0, 100000).astype(np.int32)


# --------------------------------------------------------------------------------- run + check

def poisoned_out(cupy, b, d1):
    return TreeAcceptOutput(*(cupy.full(shape, POISON, dtype=cupy.int32)
                              for shape in ((b,), (b, d1), (b, d1), (b,))))


def check_equal(got, want, what, kv_got=None, kv_want=None):
    for field in TreeAcceptOutput._fields:
        g, w = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{what}: {field} {g.dtype}{g.shape}, reference {w.dtype}{w.shape}"
        bad = np.argwhere(g != w)
        if bad.size:
            i = tuple(bad[0])
            r = i[0]
            raise AssertionError(f"{what}: {field}{list(i)} = {g[i]}, reference {w[i]} ({len(bad)} differences); "
                                 f"request {r}: reference path {want.accepted_nodes[r]}, "
                                 f"kernel path {got.accepted_nodes[r]}")
    if kv_want is not None:
        bad = np.argwhere(kv_got != kv_want)
        if bad.size:
            p, s, e = bad[0]
            pages = sorted({int(x) for x in bad[:, 0]})
            raise AssertionError(f"{what}: kv_cache[{p}, {s}, {e}] = {kv_got[p, s, e]:#06x}, reference "
                                 f"{kv_want[p, s, e]:#06x}; {len(bad)} values differ, in pages {pages[:10]}")


def run_accept(ks, seed, tree_dev, tree_host, target, prefix, kv, table, what, kv_dev=None):
    """Kernel vs reference on the same inputs; returns the reference output."""
    import cupy
    spec = ks.spec
    b = target.shape[0]
    kv_want = kv.copy()
    want = ref.tree_accept(tree_host, target, prefix, kv_want, table, spec.max_depth)
    if kv_dev is None:
        kv_dev = cupy.asarray(kv)
    else:
        kv_dev[...] = cupy.asarray(kv)
    target_dev, prefix_dev, table_dev = cupy.asarray(target), cupy.asarray(prefix), cupy.asarray(table)
    out = poisoned_out(cupy, b, spec.max_depth + 1)
    got = ks.tree_accept(tree_dev, target_dev, prefix_dev, kv_dev, table_dev, out=out)
    assert all(g is o for g, o in zip(got, out)), "out= buffers were not used as given"
    host = TreeAcceptOutput(*(cupy.asnumpy(x) for x in got))
    check_equal(host, want, f"{what}, {where(seed)}", cupy.asnumpy(kv_dev), kv_want)
    # the inputs are left as they were
    for name, dev, x in (("target_tokens", target_dev, target), ("prefix_lens", prefix_dev, prefix),
                         ("block_table", table_dev, table)):
        assert np.array_equal(cupy.asnumpy(dev), x), f"{what}: {name} changed, {where(seed)}"
    for name in TREE_FIELDS:
        assert np.array_equal(cupy.asnumpy(getattr(tree_dev, name)), getattr(tree_host, name)), \
            f"{what}: tree.{name} changed, {where(seed)}"
    return want


def device_tree(host):
    import cupy
    return SimpleNamespace(**{k: cupy.asarray(np.ascontiguousarray(getattr(host, k), dtype=np.int32))
                              for k in TREE_FIELDS})


# ------------------------------------------------------------------------------------- tests

# (id, batch, how many nodes to accept: "zero", "full" (depth D), "random")
PATH_CASES = [
    ("zero-b64", 64, "zero"),
    ("full-b64", 64, "full"),
    ("random-b64", 64, "random"),
    ("zero-b1", 1, "zero"),
    ("full-b1", 1, "full"),
    ("random-b1", 1, "random"),
]


@pytest.mark.parametrize("case,b,lens", PATH_CASES, ids=[c[0] for c in PATH_CASES])
def test_tree_accept_matches_reference(ks, spec, seed, case, b, lens):
    rng = np.random.default_rng(seed)
    d = spec.max_depth
    tree_dev, tree = build_trees(ks, rng, b, kind="deep")
    want_lens = {"zero": np.zeros(b), "full": np.full(b, d), "random": rng.integers(0, d + 1, b)}[lens]
    target, planned = plan_targets(rng, tree, want_lens, d, deepest=lens == "full")
    prefix = random_prefixes(rng, b, spec.page_size)
    kv, table = make_cache(rng, spec, prefix, b)
    want = run_accept(ks, seed, tree_dev, tree, target, prefix, kv, table, f"{spec.name} {case}")
    # the test accepts what it planned (distinct sibling tokens), so every case is what it says
    assert np.array_equal(want.accept_lens, planned), where(seed)
    if lens == "full":
        assert (want.accept_lens == d).all(), f"deep trees should reach depth {d}: {want.accept_lens}, {where(seed)}"


@pytest.mark.parametrize("kind", ["wide", "chain", "budget0", "budget1", "random"])
def test_tree_accept_tree_shapes(ks, spec, seed, kind):
    """Bushy trees (random sibling choice), K'=1 chains, the root alone, one node, random shapes."""
    rng = np.random.default_rng(seed)
    n, d = spec.max_tree_size, spec.max_depth
    b = 64
    for _ in range(3 if kind == "random" else 1):
        kw = {"wide": dict(kind="sorted"), "chain": dict(kp=1), "budget0": dict(budget=0),
              "budget1": dict(budget=1),
              "random": dict(kind=str(rng.choice(["sorted", "deep"])), dp=int(rng.integers(1, d + 1)),
                             kp=int(rng.integers(1, n)), budget=int(rng.integers(0, n)))}[kind]
        tree_dev, tree = build_trees(ks, rng, b, **kw)
        target, planned = plan_targets(rng, tree, rng.integers(0, d + 1, b), d)
        prefix = random_prefixes(rng, b, spec.page_size)
        kv, table = make_cache(rng, spec, prefix, b)
        want = run_accept(ks, seed, tree_dev, tree, target, prefix, kv, table, f"{spec.name} {kind} {kw}")
        assert np.array_equal(want.accept_lens, planned), where(seed)


@pytest.mark.parametrize("table_kind", ["holes", "duplicate", "narrow"])
def test_tree_accept_block_table_edge_cases(ks, spec, seed, table_kind):
    """Pages missing from the block table (negative, >= num_pages, past max_pages) are skipped;
    a page named twice in one request gives the reference's in-order result."""
    rng = np.random.default_rng(seed)
    b, d = 32, spec.max_depth
    tree_dev, tree = build_trees(ks, rng, b, kind="deep")
    target, _ = plan_targets(rng, tree, rng.integers(d // 2, d + 1, b), d)
    prefix = random_prefixes(rng, b, spec.page_size)
    if table_kind == "narrow":
        prefix[:] = rng.integers(0, 3 * spec.page_size, b)
    kv, table = make_cache(rng, spec, prefix, b, table_kind=table_kind)
    run_accept(ks, seed, tree_dev, tree, target, prefix, kv, table, f"{spec.name} table {table_kind}")


def test_tree_accept_no_pages_at_all(ks, spec, seed):
    """block_table [B, 0] and a cache of 0 pages: nothing moves, outputs as the reference."""
    rng = np.random.default_rng(seed)
    b, d = 8, spec.max_depth
    tree_dev, tree = build_trees(ks, rng, b, kind="deep")
    target, _ = plan_targets(rng, tree, np.full(b, d), d)
    prefix = random_prefixes(rng, b, spec.page_size)
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    kv = np.zeros((0, spec.page_size, width), kv_np_dtype(spec))
    table = np.zeros((b, 0), np.int32)
    run_accept(ks, seed, tree_dev, tree, target, prefix, kv, table, f"{spec.name} no pages")
    # pages exist, but the block table names none of them
    kv = random_cache_bits(rng, spec, (3, spec.page_size, width))
    run_accept(ks, seed, tree_dev, tree, target, prefix, kv, table, f"{spec.name} empty table")


def garbage_trees(rng, b, n, vocab=3):
    """Malformed trees: random links (backward, self, -1, out of range), small vocabularies, odd num_nodes."""
    nn = rng.integers(1, n + 1, b)
    odd = rng.random(b)
    nn[odd < 0.1] = 0
    nn[(odd >= 0.1) & (odd < 0.2)] = n + 1 + rng.integers(0, 3)
    nn[(odd >= 0.2) & (odd < 0.25)] = -1 - rng.integers(0, 2**31 - 2)
    nn[(odd >= 0.25) & (odd < 0.3)] = 2**31 - 1
    nn[(odd >= 0.3) & (odd < 0.4)] = n
    tokens = rng.integers(0, vocab, (b, n))
    links = lambda: np.where(rng.random((b, n)) < 0.1, rng.integers(-2**31, 2**31, (b, n)),  # noqa: E731
                             rng.integers(-3, n + 4, (b, n)))
    first_child, next_sibling = links(), links()
    # forward chains, so that some walks go deep before they hit a bad link
    for r in range(b):
        if rng.random() < 0.5:
            for i in range(n - 1):
                if rng.random() < 0.7:
                    first_child[r, i] = i + 1
                if rng.random() < 0.3:
                    next_sibling[r, i] = rng.integers(i - 2, n + 2)
    target = rng.integers(0, vocab, (b, n))
    tree = TreeBuildOutput(num_nodes=nn.astype(np.int32), tokens=tokens.astype(np.int32),
                           parents=None, depths=None, positions=None, scores=None, tree_mask=None,
                           first_child=first_child.astype(np.int32), next_sibling=next_sibling.astype(np.int32))
    return tree, target.astype(np.int32)


def cyclic_trees(b, n):
    """Hand-made cycles: a child pointing at its parent, siblings pointing back, self loops."""
    trees = []
    for r in range(b):
        tokens = np.zeros(n, np.int64)
        fc = np.full(n, -1)
        ns = np.full(n, -1)
        v = r % 4
        if v == 0:    # 0 -> 1 -> 0 ...
            fc[0], fc[1] = 1, 0
        elif v == 1:  # siblings 1 -> 2 -> 1 ...: the scan ends at the backward link
            fc[0], ns[1], ns[2] = 1, 2, 1
            tokens[1:3] = [5, 6]
        elif v == 2:  # self loops
            fc[0], fc[1], ns[1] = 1, 1, 1
        else:         # a long forward chain whose last link points at the root
            fc[: n - 1] = np.arange(1, n)
            fc[n - 1] = 0
        trees.append((tokens, fc, ns))
    tokens, fc, ns = (np.stack(x).astype(np.int32) for x in zip(*trees))
    tree = TreeBuildOutput(num_nodes=np.full(b, n, np.int32), tokens=tokens, parents=None, depths=None,
                           positions=None, scores=None, tree_mask=None, first_child=fc, next_sibling=ns)
    return tree, np.zeros((b, n), np.int32)


def test_tree_accept_malformed_trees(ks, spec, seed):
    """Garbage links and node counts terminate with the reference's result (cache commit included)."""
    rng = np.random.default_rng(seed)
    n = spec.max_tree_size
    for vocab in (1, 2, 3, 1000):
        b = 64
        tree, target = garbage_trees(rng, b, n, vocab)
        prefix = random_prefixes(rng, b, spec.page_size)
        kv, table = make_cache(rng, spec, prefix, b)
        run_accept(ks, seed, device_tree(tree), tree, target, prefix, kv, table,
                   f"{spec.name} garbage trees, vocab {vocab}")
    tree, target = cyclic_trees(8, n)
    prefix = random_prefixes(rng, 8, spec.page_size)
    kv, table = make_cache(rng, spec, prefix, 8)
    want = run_accept(ks, seed, device_tree(tree), tree, target, prefix, kv, table, f"{spec.name} cycles")
    assert want.accept_lens[3] == min(spec.max_depth, n - 1), where(seed)


def test_tree_accept_unaligned_cache(ks, spec, seed):
    """A kv_cache view that is not 16-byte aligned takes the element path (2 bytes, e4m3: 1): same result."""
    import cupy
    rng = np.random.default_rng(seed)
    b, d = 16, spec.max_depth
    tree_dev, tree = build_trees(ks, rng, b, kind="deep")
    target, _ = plan_targets(rng, tree, rng.integers(0, d + 1, b), d)
    prefix = random_prefixes(rng, b, spec.page_size)
    kv, table = make_cache(rng, spec, prefix, b)
    item = np.dtype(kv_np_dtype(spec)).itemsize
    for shift in ((1, 4, 8) if item == 2 else (1, 2, 8, 16)):  # starts 2/8/16 (e4m3: 1/2/8/16) bytes past 256-aligned
        flat = cupy.zeros(kv.size + shift, kv_np_dtype(spec))
        kv_dev = flat[shift:].reshape(kv.shape)
        assert kv_dev.flags.c_contiguous and kv_dev.data.ptr % 16 == (item * shift) % 16
        run_accept(ks, seed, tree_dev, tree, target, prefix, kv, table, f"{spec.name} kv offset {item * shift} B",
                   kv_dev=kv_dev)
        assert (flat[:shift] == 0).all(), f"bytes before the cache were written, {where(seed)}"


def test_tree_accept_repeated_steps(ks, spec, seed):
    """Accept, then accept again on a new tree at the new prefix (the decode loop), same cache."""
    import cupy
    rng = np.random.default_rng(seed)
    b, d, n = 16, spec.max_depth, spec.max_tree_size
    prefix = random_prefixes(rng, b, spec.page_size) // 2
    # every request's pages cover three steps: positions prefix .. prefix + 3 (N + 1)
    page, width = spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim
    end = prefix.astype(np.int64) + 3 * (n + 1)
    table, num_pages = inputs.block_table(rng, end + 1, page, first_pages=prefix // page, extra_pages=3, unused=-1)
    kv = random_cache_bits(rng, spec, (num_pages, page, width))
    kv_dev, kv_want = cupy.asarray(kv), kv.copy()
    table_dev = cupy.asarray(table)
    for step in range(3):
        tree_dev, tree = build_trees(ks, rng, b, kind=str(rng.choice(["deep", "sorted"])))
        target, _ = plan_targets(rng, tree, rng.integers(0, d + 1, b), d)
        want = ref.tree_accept(tree, target, prefix, kv_want, table, d)
        got = ks.tree_accept(tree_dev, cupy.asarray(target), cupy.asarray(prefix), kv_dev, table_dev,
                             out=poisoned_out(cupy, b, d + 1))
        check_equal(TreeAcceptOutput(*(cupy.asnumpy(x) for x in got)), want,
                    f"{spec.name} step {step}, {where(seed)}", cupy.asnumpy(kv_dev), kv_want)
        prefix = want.new_prefix_lens


def _full_depth_batch(ks, spec, rng, b):
    """b requests: trees of ks.tree_build, targets that accept the full depth, random prefixes, a cache and its
    block table (host arrays; the trees also on the device)."""
    d = spec.max_depth
    tree_dev, tree = build_trees(ks, rng, b)
    target, _ = plan_targets(rng, tree, np.full(b, d), d)
    prefix = random_prefixes(rng, b, spec.page_size)
    kv, table = make_cache(rng, spec, prefix, b)
    return tree_dev, tree, target, prefix, kv, table


def test_tree_accept_allocates_outputs_and_empty_batch(ks, spec, seed):
    import cupy
    rng = np.random.default_rng(seed)
    b, d, n = 4, spec.max_depth, spec.max_tree_size
    tree_dev, tree, target, prefix, kv, table = _full_depth_batch(ks, spec, rng, b)
    kv_dev, kv_want = cupy.asarray(kv), kv.copy()
    want = ref.tree_accept(tree, target, prefix, kv_want, table, d)
    got = ks.tree_accept(tree_dev, cupy.asarray(target), cupy.asarray(prefix), kv_dev, cupy.asarray(table))
    assert all(isinstance(x, cupy.ndarray) and x.dtype == cupy.int32 for x in got)
    check_equal(TreeAcceptOutput(*(cupy.asnumpy(x) for x in got)), want, f"{spec.name} allocated, {where(seed)}",
                cupy.asnumpy(kv_dev), kv_want)
    # B = 0
    z = cupy.zeros((0, n), cupy.int32)
    empty = SimpleNamespace(num_nodes=cupy.zeros(0, cupy.int32), tokens=z, first_child=z, next_sibling=z)
    got = ks.tree_accept(empty, z, cupy.zeros(0, cupy.int32), kv_dev, cupy.zeros((0, 3), cupy.int32))
    assert got.accepted_nodes.shape == (0, d + 1) and got.accept_lens.shape == (0,)


def test_tree_accept_validate(ks, spec, seed):
    """validate=True: out-of-range device values raise ArgumentError naming argument, request and value."""
    import cupy
    rng = np.random.default_rng(seed)
    b, d, n = 4, spec.max_depth, spec.max_tree_size
    tree_dev, tree, target, prefix, kv, table = _full_depth_batch(ks, spec, rng, b)
    args = lambda t=tree_dev, p=prefix, bt=table: (t, cupy.asarray(target), cupy.asarray(p),  # noqa: E731
                                                    cupy.asarray(kv), cupy.asarray(bt))
    got = ks.tree_accept(*args(), validate=True)   # a valid call passes
    want = ref.tree_accept(tree, target, prefix, kv.copy(), table, d)
    check_equal(TreeAcceptOutput(*(cupy.asnumpy(x) for x in got)), want, f"{spec.name} validate, {where(seed)}")
    bad_nn = tree.num_nodes.copy()
    bad_nn[2] = n + 1
    bad_tree = SimpleNamespace(**{k: getattr(tree_dev, k) for k in TREE_FIELDS})
    bad_tree.num_nodes = cupy.asarray(bad_nn)
    with pytest.raises(ArgumentError, match=rf"tree\.num_nodes.*request 2.*{n + 1}"):
        ks.tree_accept(*args(t=bad_tree), validate=True)
    bad_prefix = prefix.copy()
    bad_prefix[1] = -7
    with pytest.raises(ArgumentError, match=r"prefix_lens.*request 1.*-7"):
        ks.tree_accept(*args(p=bad_prefix), validate=True)
    bad_table = table.copy()
    bad_table[3, (int(prefix[3]) + 1) // spec.page_size] = kv.shape[0]
    with pytest.raises(ArgumentError, match=rf"block_table.*request 3.*{kv.shape[0]}"):
        ks.tree_accept(*args(bt=bad_table), validate=True)
    # without validate=True the same calls launch, and match the reference
    for t_host, t_dev, p, bt in ((tree._replace(num_nodes=bad_nn), bad_tree, prefix, table),
                                 (tree, tree_dev, prefix, bad_table)):
        run_accept(ks, seed, t_dev, t_host, target, p, kv, bt, f"{spec.name} unvalidated")


def test_tree_accept_negative_prefix_touches_nothing_outside(ks, spec, seed):
    """prefix_lens < 0 (refused by the reference and by validate=True): positions < 0 are skipped,
    nothing outside the arrays is touched, and the outputs still follow the walk."""
    import cupy
    rng = np.random.default_rng(seed)
    b, d, n = 8, spec.max_depth, spec.max_tree_size
    tree_dev, tree = build_trees(ks, rng, b, kind="deep")
    target, _ = plan_targets(rng, tree, np.full(b, d), d)
    prefix = -rng.integers(1, 3 * n, b).astype(np.int32)
    prefix[0] = -2**31
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    kv = random_cache_bits(rng, spec, (4, spec.page_size, width))
    table = rng.integers(0, 4, (b, 4)).astype(np.int32)
    kv_dev = cupy.asarray(kv)
    got = ks.tree_accept(tree_dev, cupy.asarray(target), cupy.asarray(prefix), kv_dev, cupy.asarray(table),
                         out=poisoned_out(cupy, b, d + 1))
    want = ref.tree_accept(tree, target, np.zeros(b, np.int32), kv.copy(), table, d)  # the walk only
    host = TreeAcceptOutput(*(cupy.asnumpy(x) for x in got))
    for field in ("accept_lens", "accepted_nodes", "out_tokens"):
        assert np.array_equal(getattr(host, field), getattr(want, field)), f"{field}, {where(seed)}"
    assert np.array_equal(host.new_prefix_lens, (prefix.astype(np.int64) + 1 + want.accept_lens).astype(np.int32))
    # the commit with the reference's rules, positions < 0 skipped
    kv_want, page = kv.copy(), spec.page_size
    for r in range(b):
        moves = []
        for k in range(1, int(want.accept_lens[r]) + 1):
            src, dst = int(prefix[r]) + int(want.accepted_nodes[r, k]), int(prefix[r]) + k
            if src >= 0 and dst >= 0:  # the table is wide enough and its pages are valid
                entry = kv_want[table[r, src // page], src % page].copy()
                moves.append(((table[r, dst // page], dst % page), entry))
        for (p, s), entry in moves:
            kv_want[p, s] = entry
    check_equal(host, host, f"{spec.name} negative prefix, {where(seed)}", cupy.asnumpy(kv_dev), kv_want)


def test_tree_accept_torch(ks, spec, seed):
    torch = cuda_torch()
    rng = np.random.default_rng(seed)
    b, d = 16, spec.max_depth
    _, tree = build_trees(ks, rng, b, kind="deep")
    target, _ = plan_targets(rng, tree, rng.integers(0, d + 1, b), d)
    prefix = random_prefixes(rng, b, spec.page_size)
    kv, table = make_cache(rng, spec, prefix, b)
    kv_want = kv.copy()
    want = ref.tree_accept(tree, target, prefix, kv_want, table, d)
    tt = lambda x: torch.from_numpy(np.ascontiguousarray(x)).cuda()  # noqa: E731
    tree_t = SimpleNamespace(**{k: tt(getattr(tree, k)) for k in TREE_FIELDS})
    kv_t = kv_torch(spec, kv)     # torch.bfloat16, or torch.float8_e4m3fn for an fp8 spec
    host_kv = lambda: kv_t.view(torch.uint8).cpu().numpy().view(kv_np_dtype(spec))  # noqa: E731
    got = ks.tree_accept(tree_t, tt(target), tt(prefix), kv_t, tt(table))
    torch.cuda.synchronize()
    assert all(isinstance(x, torch.Tensor) and x.is_cuda and x.dtype == torch.int32 for x in got)
    host = TreeAcceptOutput(*(x.cpu().numpy() for x in got))
    check_equal(host, want, f"{spec.name} torch, {where(seed)}", host_kv(), kv_want)
    # torch out=, poisoned
    out = TreeAcceptOutput(*(torch.full(tuple(x.shape), POISON, dtype=torch.int32, device=x.device) for x in got))
    kv_t.copy_(kv_torch(spec, kv))
    again = ks.tree_accept(tree_t, tt(target), tt(prefix), kv_t, tt(table), out=out)
    torch.cuda.synchronize()
    assert all(a.data_ptr() == o.data_ptr() for a, o in zip(again, out))
    check_equal(TreeAcceptOutput(*(x.cpu().numpy() for x in again)), want, f"{spec.name} torch out=, {where(seed)}",
                host_kv(), kv_want)

"""tree_verify, tree_verify_tail and merge_states on the GPU against the float64 numpy references.

One file for the three implementations of the tree_verify / tree_verify_tail launchers (IMPLS):
  * "simple": the CUDA-core kernels, called as kset.tree_verify(..., impl="simple");
  * "mma": tree_verify_mma / tree_verify_tail_mma (mma.sync), called directly;
  * "wgmma": tree_verify_wgmma / tree_verify_tail_wgmma (sm_90a warpgroup MMA), called directly;
the two tensor-core families split the keys (split-KV, merged by tree_verify_mma_combine). A test
that applies to several implementations is parametrized over them (`impl`), or, where one test
covers every kernel of a kernel set, over the kernel set (`group`: "simple" or "mma+wgmma").
test_impl_auto checks the default impl="auto" dispatch; merge_states and torch tensors are tested
on the CUDA-core kernel set. An implementation whose kernels cannot run on the device is skipped with
the kernel set's reason: the wgmma kernels under DDTREE_GEN_ARCH=sm_80 (the sm_80 PTX path on a
Hopper GPU; they have no PTX build) or on another GPU; test_impl_auto then checks that auto picks
mma.sync and that asking for wgmma is an ArgumentError naming the kernel and the device.

The numerical bar of docs/contract.md, checked per (request, row, head): ||out - ref|| <= 5e-3 ||ref||,
|lse - ref| <= 1e-3, no NaN, every row < q_len written, every row >= q_len byte-identical to the
poison written before launch. Fresh random data every run: the seed is in every assertion
message (set DDTREE_TEST_SEED to replay one). The tensor-core kernels run every check with
split-KV off (num_splits=1), forced on (num_splits=5: chunks of every size, empty ones included)
and as the launcher picks it, against one reference per case.

The references compute in float64 with numpy einsum (about 1 GMAC/s), so long-prefix cases are
checked on a few heads (always the first and the last, the others random); the whole output
is still checked for NaN, written rows and untouched rows.

The fp8 specs (kv_dtype "fp8_e4m3") run every test: their caches are e4m3 bytes of normal samples with
a random kv_scale in [0.01, 2] (verify_cases.make_inputs), held to the same bar against the reference
on the dequantized cache; their mma.sync kernels are not built (those tests skip, saying so, and
test_impl_auto checks the ArgumentErrors). test_fp8_matches_bf16_twin: with a power-of-two kv_scale the
dequantized cache is exact in bf16, and the fp8 kernels give the bits of the bf16 spec's kernels on it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pytest

from conftest import cuda_torch, skip_unless_runs
from ddtree_gen import bf16, fp8, reference
from ddtree_gen.errors import ArgumentError
from ddtree_gen.spec import all_specs
from verify_cases import (VerifyInputs, bf16_nan, fresh_seed, kv_torch, make_inputs, random_bf16_bounded,
                          random_bf16_normal, to_device, to_host)

pytestmark = pytest.mark.gpu

OUT_TOL, LSE_TOL = 5e-3, 1e-3
POISON_OUT = 0xFFFF                 # a bf16 NaN pattern the kernels never write
POISON_LSE = np.uint32(0x7FC00000)  # float32 NaN
SCALES = {"mla": 192 ** -0.5, "one": 1.0}
LAUNCHERS = ("tree_verify", "tree_verify_tail")
CUDA_CORE_KERNELS = ("tree_verify", "tree_verify_tail", "merge_states")
MMA_KERNELS = ("tree_verify_mma", "tree_verify_tail_mma", "tree_verify_mma_combine")
# (tree_verify_wgmma's parts build: built for the bf16 seesaw specs, where tree_verify_wgmma's calls at B >= 2 with the
# launcher's own split count run it: the matrix's B = 64 case)
WGMMA_KERNELS = ("tree_verify_wgmma", "tree_verify_tail_wgmma")   # (with their builds: the parts grid)
TENSOR_CORE_KERNELS = MMA_KERNELS + WGMMA_KERNELS


@dataclass(frozen=True)
class Impl:
    """One implementation of tree_verify / tree_verify_tail and how the tests drive it."""
    name: str               # "simple", "mma", "wgmma"
    kernels: tuple          # the kernel set the tests load for it (only these: no need to build the others)
    splits: tuple           # the num_splits settings every check runs with (None: the launcher's choice)
    bf16: object            # the q / kv distribution: random_bf16_bounded or random_bf16_normal
    q_align: int            # the alignment of q_nope / q_pe the launcher requires, in bytes

    def __str__(self):
        return self.name

    @property
    def split_kv(self) -> bool:
        return len(self.splits) > 1

    @property
    def own(self) -> tuple:
        """The kernels of its two launchers (tree_verify, tree_verify_tail)."""
        return LAUNCHERS if self.name == "simple" else tuple(f"{launcher}_{self.name}" for launcher in LAUNCHERS)

    def load(self, spec):
        """Its kernel set; the test is skipped (with the reason) if its kernels do not run on this device."""
        import ddtree_gen
        ks = ddtree_gen.load(spec, kernels=self.kernels)
        skip_unless_runs(ks, *self.own)
        return ks

    def launcher(self, ks, launcher: str):
        """The function that runs `launcher` ("tree_verify" / "tree_verify_tail") on this implementation."""
        if self.name == "simple":
            return functools.partial(getattr(ks, launcher), impl="simple")
        return getattr(ks, f"{launcher}_{self.name}")


TC_SPLITS = (1, 5, None)            # off, forced on (chunks of every size, empty ones too), the launcher's choice
SIMPLE = Impl("simple", CUDA_CORE_KERNELS, (None,), random_bf16_bounded, 4)
MMA = Impl("mma", TENSOR_CORE_KERNELS, TC_SPLITS, random_bf16_normal, 16)
WGMMA = Impl("wgmma", TENSOR_CORE_KERNELS, TC_SPLITS, random_bf16_normal, 16)
IMPLS = (SIMPLE, MMA, WGMMA)
TENSOR_CORE = (MMA, WGMMA)
GROUPS = ((SIMPLE,), TENSOR_CORE)   # the implementations of one loaded kernel set
GROUP_IDS = ["+".join(map(str, g)) for g in GROUPS]


def load_group(spec, group):
    """The kernel set of `group` and those of its implementations whose kernels run on this device
    (mma.sync without wgmma under DDTREE_GEN_ARCH=sm_80); skipped if none does."""
    import cupy
    import ddtree_gen
    ks = ddtree_gen.load(spec, kernels=group[0].kernels)
    device = cupy.cuda.Device().id
    runs = tuple(impl for impl in group if all(ks.unavailable(k, device) is None for k in impl.own))
    if not runs:
        skip_unless_runs(ks, *group[0].own)
    return ks, runs


def poisoned(shape):
    """Device out / lse buffers filled with the poison patterns."""
    b, nq, h, r = shape
    out = np.full((b, nq, h, r), POISON_OUT, np.uint16)
    lse = np.full((b, nq, h), POISON_LSE, np.uint32).view(np.float32)
    return to_device(out), to_device(lse)


def run(ks, impl: Impl, launcher, inp: VerifyInputs, scale, splits=None, workspace=None, **replace):
    """Launch `launcher` of `impl` into poisoned buffers; (out bits, lse) on the host."""
    out, lse = poisoned(inp.shape)
    res = impl.launcher(ks, launcher)(**inp.device(**replace), softmax_scale=scale, out=out, lse=lse,
                                      num_splits=splits, workspace=workspace)
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
        if rel.size:   # argmax finds a NaN first, and NaN <= tol fails
            k = int(np.argmax(rel))
            assert rel[k] <= OUT_TOL, (f"{tag}: request {b}: ||out - ref|| / ||ref|| = {rel[k]:.3g} > {OUT_TOL} at "
                                       f"(row, head) {np.argwhere(full)[k]} (heads checked {list(heads)})")
            k = int(np.argmax(dl))
            assert dl[k] <= LSE_TOL, (f"{tag}: request {b}: |lse - ref| = {dl[k]:.3g} > {LSE_TOL} at "
                                      f"(row, head) {np.argwhere(full)[k]} (got {got_l[full][k]}, "
                                      f"ref {ref_l[full][k]})")


def reference_for(launcher, inp: VerifyInputs, scale, heads, **replace):
    """The float64 reference of `launcher` on `heads` (inputs as inp, with `replace`)."""
    host = inp.host(**replace)
    fn = reference.tree_verify_tail if launcher == "tree_verify_tail" else reference.tree_verify
    return fn(**{**host, "q_nope": host["q_nope"][:, :, heads], "q_pe": host["q_pe"][:, :, heads]},
              softmax_scale=scale)


def verify_all_splits(ks, impl, launcher, inp, scale, heads, tag, ref=None, written=None, **replace):
    """Run with each of impl's split settings, every result checked (rows written / untouched, the bar
    against one reference); {splits: (out bits, lse)}. ref: the reference if not of these inputs."""
    ref = reference_for(launcher, inp, scale, heads, **replace) if ref is None else ref
    n = len(ref.out)
    results = {}
    for splits in impl.splits:
        t = f"{tag} splits={splits}"
        out_bits, lse = run(ks, impl, launcher, inp, scale, splits, **replace)
        check_rows_written(out_bits, lse, inp.q_lens, t, written)
        check_against(out_bits[:n], lse[:n], ref, inp.q_lens[:n], heads, t)
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
    Case("b4-L4096", [4096, 4095, 4097, 4097], [65, 2, 1, 33], ["star", "binary", "random", "random"], "one",
         heads=2),
    Case("b3-L16500", [16500, 16383, 16500], [17, 2, 33], ["random", "chain", "random"], "mla", heads=2),
    Case("b1-L100000", [100000], [2], ["chain"], "mla", heads=2),
    Case("b64-mixed", _b64, lambda rng: [int(x) for x in rng.choice([1, 2, 33, 64, 65], 64)],
         lambda rng: list(rng.choice(["random", "chain", "star", "binary"], 64)), "one", heads=2, junk=True),
]


def build_case(spec, case: Case, seed, bf16_dist):
    rng = np.random.default_rng(seed)
    prefix = case.prefix(rng) if callable(case.prefix) else case.prefix
    qlens = case.qlens(rng) if callable(case.qlens) else case.qlens
    trees = case.trees(rng) if callable(case.trees) else case.trees
    nq = min(case.nq or spec.max_tree_size, spec.max_tree_size)
    qlens = [min(q, nq) for q in qlens]
    inp = make_inputs(spec, rng, prefix, qlens, trees, nq=nq, junk_bits=case.junk, seed=seed, bf16=bf16_dist)
    return inp, rng


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matrix(spec, case, impl, launcher):
    ks = impl.load(spec)
    seed = fresh_seed()
    inp, rng = build_case(spec, case, seed, impl.bf16)
    heads = heads_to_check(spec.num_heads, rng, case.heads)
    scale = SCALES[case.scale]
    tag = f"{impl} {launcher} {spec.name} {case.id} seed={seed}"
    results = verify_all_splits(ks, impl, launcher, inp, scale, heads, tag)
    # no atomics: a rerun gives the same bits
    splits = impl.splits[-2] if impl.split_kv else impl.splits[0]    # tensor cores: split-KV forced on
    again = run(ks, impl, launcher, inp, scale, splits)
    assert (again[0] == results[splits][0]).all(), f"{tag}: out not deterministic"
    assert (again[1].view(np.uint32) == results[splits][1].view(np.uint32)).all(), f"{tag}: lse not deterministic"


def parts_set(spec):
    """A kernel set whose tree_verify_wgmma is the seesaw on the balanced "parts" grid (grid="parts": a block per
    (row tile, part) walking the requests of its part of the batch's key tiles); skipped where the spec's
    tree_verify_wgmma is not the seesaw (the parts grid is the seesaw's)."""
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.wgmma import schedule_for
    from ddtree_gen.build.variant import variant
    if spec.kv_fp8 or schedule_for(spec) != "seesaw":
        pytest.skip(f"spec {spec.name!r}: its tree_verify_wgmma is not the bf16 seesaw (the parts grid is its build)")
    parts = variant(by_name("tree_verify_wgmma"), spec, grid="parts")
    ks = variant_set([parts], also=[k for k in TENSOR_CORE_KERNELS if k != "tree_verify_wgmma"])
    skip_unless_runs(ks, "tree_verify_wgmma")
    return ks


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_parts_grid(spec, case):
    """The seesaw on the parts grid through the matrix's checks: parts 1, 5 and the launcher's count (parts whose
    boundaries cut requests: partials and the combine's spans; one part: every request whole), deterministic."""
    ks = parts_set(spec)
    seed = fresh_seed()
    inp, rng = build_case(spec, case, seed, WGMMA.bf16)
    heads = heads_to_check(spec.num_heads, rng, case.heads)
    tag = f"wgmma parts tree_verify {spec.name} {case.id} seed={seed}"
    results = verify_all_splits(ks, WGMMA, "tree_verify", inp, SCALES[case.scale], heads, tag)
    again = run(ks, WGMMA, "tree_verify", inp, SCALES[case.scale], 5)
    assert (again[0] == results[5][0]).all(), f"{tag}: out not deterministic"
    assert (again[1].view(np.uint32) == results[5][1].view(np.uint32)).all(), f"{tag}: lse not deterministic"


def test_parts_grid_bad_device_values(spec):
    """The parts grid with bad device-side lengths among good requests (a bad q_len, a negative prefix_len: no
    tiles in the scan, nothing written) and a page outside the cache (not visible), parts cutting between them."""
    ks = parts_set(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    nq, page = spec.max_tree_size, spec.page_size
    prefix = [page + 10, 5, 700, 5, 130]
    inp = make_inputs(spec, rng, prefix, [nq] * 5, ["random"] * 5, seed=seed, bf16=WGMMA.bf16)
    q_lens, prefix_lens, table = inp.q_lens.copy(), inp.prefix_lens.copy(), inp.block_table.copy()
    q_lens[1] = 0
    prefix_lens[3] = -3
    bad_page = (prefix[4] + nq - 1) // page
    table[4, bad_page] = inp.kv_cache.shape[0] + 5
    mask = inp.tree_mask.copy()
    for j in range(nq):
        if (prefix[4] + j) // page == bad_page:
            mask[4, :, j // 32] &= ~np.uint32(1 << (j % 32))
    heads = heads_to_check(spec.num_heads, rng, 4)
    keep = [0, 2, 4]
    good = VerifyInputs(**{k: v if k in ("kv_cache", "kv_scale") else v[keep]
                           for k, v in inp.host(tree_mask=mask).items()})   # the good table, the hidden keys' bits cleared
    ref = reference_for("tree_verify", good, SCALES["mla"], heads)
    for splits in WGMMA.splits:
        tag = f"wgmma parts {spec.name} bad values splits={splits} seed={seed}"
        out_bits, lse = run(ks, WGMMA, "tree_verify", inp, SCALES["mla"], splits, block_table=table, q_lens=q_lens,
                            prefix_lens=prefix_lens)
        check_rows_written(out_bits, lse, q_lens, tag, [True, False, True, False, True])
        check_against(out_bits[keep], lse[keep], ref, inp.q_lens[keep], heads, tag)


PAGE16_CASES = [c for c in CASES if c.id in ("b1-L0-q1", "b7-small", "b64-mixed")]


@pytest.mark.parametrize("case", PAGE16_CASES, ids=[c.id for c in PAGE16_CASES])
def test_wgmma_page16(spec, case):
    """A 16-token-page variant of each spec through the matrix's checks: tree_verify_wgmma's seesaw loads its key tiles
    by a TMA box per page there (every spec in specs/ has 64-token pages: a box per tile), the lockstep schedule's
    TMA path only where a page holds whole tiles (uses_tma); tests/test_gpu_page_sizes.py runs every page size."""
    from dataclasses import replace
    from ddtree_gen.ops.tree_verify.wgmma import seesaw_tma, uses_tma
    variant = replace(spec, name=f"{spec.name}-page16", page_size=16)
    assert uses_tma(spec) and not uses_tma(variant) and seesaw_tma(variant)
    ks = WGMMA.load(variant)
    seed = fresh_seed()
    inp, rng = build_case(variant, case, seed, WGMMA.bf16)
    heads = heads_to_check(variant.num_heads, rng, case.heads)
    verify_all_splits(ks, WGMMA, "tree_verify", inp, SCALES[case.scale], heads,
                      f"wgmma tree_verify {variant.name} {case.id} seed={seed}")


@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
def test_empty_rows(spec, group):
    """prefix_len 0 and mask rows without bits in [0, q_len): out exactly 0, lse -inf."""
    ks, group = load_group(spec, group)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [0, 0, 3], [3, 1, 2], ["chain", "chain", "chain"], seed=seed, bf16=group[0].bf16)
    inp.tree_mask[0, 0] = 0                      # row 0 sees nothing
    inp.tree_mask[0, 1] = np.uint32(1 << 3)      # only bit 3 >= q_len: still nothing
    inp.tree_mask[1, 0] = ~np.uint32(1)          # every bit but 0: nothing within q_len 1
    inp.tree_mask[2, :2] = 0                     # prefix 3: rows still see the prefix
    heads = np.arange(spec.num_heads)
    for impl in group:
        for launcher in LAUNCHERS:
            tag = f"{impl} {launcher} {spec.name} empty seed={seed}"
            for splits, (out_bits, lse) in verify_all_splits(ks, impl, launcher, inp, SCALES["mla"], heads,
                                                             tag).items():
                t = f"{tag} splits={splits}"
                for b, i in [(0, 0), (0, 1), (1, 0)]:
                    assert (out_bits[b, i] == 0).all() and np.isneginf(lse[b, i]).all(), t
                assert (out_bits[0, 2] != 0).any() and np.isfinite(lse[0, 2]).all(), t   # sees itself
                if launcher == "tree_verify":
                    assert np.isfinite(lse[2, :2]).all(), t
                else:
                    assert np.isneginf(lse[2, :2]).all() and (out_bits[2, :2] == 0).all(), t


@pytest.mark.parametrize("impl", IMPLS, ids=str)
def test_composition_prefix_plus_tail(spec, impl):
    """tree_verify == merge_states(tree_verify with an all-zero mask (prefix only), tree_verify_tail),
    merged in float64; two kernel results each within the bar of the truth: 2x the bar apart."""
    ks = impl.load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n = spec.max_tree_size
    inp = make_inputs(spec, rng, [0, 4096, 100, 64], [n, min(33, n), 2, n - 1], ["random", "binary", "chain", "star"],
                      seed=seed, bf16=impl.bf16)
    tag = f"{impl} {spec.name} composition seed={seed}"
    scale = SCALES["mla"]
    full_o, full_l = run(ks, impl, "tree_verify", inp, scale)
    pre_o, pre_l = run(ks, impl, "tree_verify", inp, scale, tree_mask=np.zeros_like(inp.tree_mask))
    tail_o, tail_l = run(ks, impl, "tree_verify_tail", inp, scale)
    for what, (o, l) in (("full", (full_o, full_l)), ("prefix", (pre_o, pre_l)), ("tail", (tail_o, tail_l))):
        check_rows_written(o, l, inp.q_lens, f"{tag} {what}")
    assert np.isneginf(pre_l[0, :n]).all() and (pre_o[0, :n] == 0).all(), tag  # no prefix: empty
    for b, q in enumerate(inp.q_lens):
        m = reference.merge_states(pre_o[b, :q], pre_l[b, :q], tail_o[b, :q], tail_l[b, :q])
        f = bf16.from_bits(full_o[b, :q]).astype(np.float64)
        rel = np.linalg.norm(m.out - f, axis=-1) / np.linalg.norm(f, axis=-1)
        assert rel.max() <= 2 * OUT_TOL, f"{tag}: request {b}: merged vs full {rel.max():.3g}"
        assert np.abs(m.lse - full_l[b, :q]).max() <= LSE_TOL, f"{tag}: request {b}: lse"


@pytest.mark.parametrize("impl", TENSOR_CORE, ids=str)
def test_matches_cuda_core_kernel(spec, impl):
    """Where the CUDA-core tree_verify is built, the tensor-core kernel agrees with it within the bar
    (impl="simple": kset.tree_verify would otherwise pick the tensor-core kernel, loaded in the same set)."""
    import ddtree_gen
    from ddtree_gen.ops import all_kernels
    if "tree_verify" not in {k.name for k in all_kernels()}:
        pytest.skip("the CUDA-core tree_verify is not registered")
    ks = ddtree_gen.load(spec, kernels=["tree_verify", *TENSOR_CORE_KERNELS])
    skip_unless_runs(ks, *impl.own)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [70, 0, 1000], [65, 5, 33], ["random", "star", "binary"], seed=seed, bf16=impl.bf16)
    tag = f"{impl} {spec.name} vs cuda-core seed={seed}"
    a_o, a_l = run(ks, impl, "tree_verify", inp, SCALES["mla"])
    b_o, b_l = run(ks, SIMPLE, "tree_verify", inp, SCALES["mla"])
    check_rows_written(a_o, a_l, inp.q_lens, f"{tag} ({impl})")
    check_rows_written(b_o, b_l, inp.q_lens, f"{tag} (simple)")
    for b, q in enumerate(inp.q_lens):
        x = bf16.from_bits(a_o[b, :q]).astype(np.float64)
        y = bf16.from_bits(b_o[b, :q]).astype(np.float64)
        rel = np.linalg.norm(x - y, axis=-1) / np.linalg.norm(y, axis=-1)
        assert rel.max() <= 2 * OUT_TOL, f"{tag}: request {b}: {impl} vs cuda-core {rel.max():.3g}"
        assert np.abs(a_l[b, :q] - b_l[b, :q]).max() <= 2 * LSE_TOL, f"{tag}: request {b}: lse"


@pytest.mark.parametrize("impl", IMPLS, ids=str)
def test_out_none_allocates(spec, impl):
    """out=None / lse=None allocate CuPy arrays holding the same bits as given buffers; q_nope must have
    the launcher's alignment; the tensor-core kernels also reuse a given workspace (and refuse a short one)."""
    import cupy
    from ddtree_gen.ops.tree_verify import split as mod
    ks = impl.load(spec)
    launch = impl.launcher(ks, "tree_verify")
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [700, 0], [65, 5], ["random", "star"], seed=seed, bf16=impl.bf16)
    tag = f"{impl} {spec.name} out=None seed={seed}"
    splits = 3 if impl.split_kv else None
    res = launch(**inp.device(), softmax_scale=SCALES["mla"], num_splits=splits)
    assert isinstance(res.out, cupy.ndarray) and res.out.dtype == np.uint16 and res.out.shape == inp.shape
    assert isinstance(res.lse, cupy.ndarray) and res.lse.dtype == np.float32 and res.lse.shape == inp.shape[:3]
    b, nq = inp.shape[:2]
    ws = None
    if impl.split_kv:   # reused scratch, NaN-filled
        ws = cupy.full(mod.workspace_elems(spec, b, nq, 3) + 16, np.nan, np.float32)
    out_bits, lse = run(ks, impl, "tree_verify", inp, SCALES["mla"], splits, workspace=ws)
    check_rows_written(out_bits, lse, inp.q_lens, tag)
    got_o, got_l = to_host(res.out), to_host(res.lse)
    for k, q in enumerate(inp.q_lens):   # deterministic: the same bits as into given buffers
        assert (got_o[k, :q] == out_bits[k, :q]).all(), f"{tag}: request {k}: out"
        assert (got_l[k, :q].view(np.uint32) == lse[k, :q].view(np.uint32)).all(), f"{tag}: request {k}: lse"
    if impl.split_kv:
        with pytest.raises(ArgumentError, match="workspace"):
            launch(**inp.device(), softmax_scale=SCALES["mla"], workspace=ws[:10], num_splits=3)
    with pytest.raises(ArgumentError, match=f"{impl.q_align}-byte aligned"):
        off = impl.q_align // 4       # elements: an offset of half the alignment
        q = cupy.zeros(inp.q_nope.size + off, np.uint16)[off:].reshape(inp.shape)
        launch(**inp.device(q_nope=q), softmax_scale=SCALES["mla"])


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_impl_auto(spec, launcher):
    """impl="auto" (the default) is the fastest tensor-core kernel the kernel set has that runs on the
    device: the same bits as <launcher>_wgmma called directly when it is loaded (on Hopper, not under
    DDTREE_GEN_ARCH=sm_80), as <launcher>_mma when only that family runs, within the bar of the reference;
    impl="wgmma" / "mma" pick that kernel, or are an ArgumentError naming the kernel and the device where it
    does not run; on a set without them, auto is the CUDA-core kernel and impl="wgmma" / "mma" are refused."""
    import cupy
    import ddtree_gen
    full = ddtree_gen.load(spec, kernels=CUDA_CORE_KERNELS + MMA_KERNELS + WGMMA_KERNELS)
    mma_only = ddtree_gen.load(spec, kernels=CUDA_CORE_KERNELS + MMA_KERNELS)
    cuda_core = SIMPLE.load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [70, 0, 1000], [65, 5, 33], ["random", "star", "binary"], seed=seed)
    scale = SCALES["mla"]
    tag = f"{launcher} {spec.name} auto seed={seed}"
    heads = heads_to_check(spec.num_heads, rng, 4)
    ref = reference_for(launcher, inp, scale, heads)

    def launch(fn, **kw):
        out, lse = poisoned(inp.shape)
        res = fn(**inp.device(), softmax_scale=scale, out=out, lse=lse, **kw)
        assert res.out is out and res.lse is lse
        return to_host(out), to_host(lse)

    device = cupy.cuda.Device().id
    runs = [kind for kind in ("wgmma", "mma") if full.unavailable(f"{launcher}_{kind}", device) is None]
    for kind in ("wgmma", "mma"):
        if kind not in runs:   # e.g. wgmma under DDTREE_GEN_ARCH=sm_80: a clear error, nothing launched
            # (mma.sync for an fp8 spec: not built for its kv_dtype, on any device)
            why = (f"{launcher}_{kind}: not built for kv_dtype 'fp8_e4m3'" if spec.kv_fp8 and kind == "mma" else
                   f"{launcher}_{kind}: not available on device {device}")
            for fn, kw in ((getattr(full, f"{launcher}_{kind}"), {}), (getattr(full, launcher), {"impl": kind})):
                with pytest.raises(ArgumentError, match=why):
                    launch(fn, **kw)
    direct = {kind: launch(getattr(full, f"{launcher}_{kind}")) for kind in runs}
    direct["simple"] = launch(getattr(full, launcher), impl="simple")
    auto = runs[0] if runs else "simple"
    cases = [(full, {}, auto), (full, {"impl": "auto"}, auto), *((full, {"impl": k}, k) for k in runs),
             (mma_only, {}, "mma" if "mma" in runs else "simple")]
    for ks, kw, want in cases:
        got_o, got_l = launch(getattr(ks, launcher), **kw)
        want_o, want_l = direct[want]
        assert (got_o == want_o).all() and (got_l.view(np.uint32) == want_l.view(np.uint32)).all(), \
            f"{tag} {kw} {ks.kernels}: not the {want} kernel's bits"
        check_rows_written(got_o, got_l, inp.q_lens, tag)
        check_against(got_o, got_l, ref, inp.q_lens, heads, tag)
    with pytest.raises(ArgumentError, match="impl: 'wgmma' needs"):
        launch(getattr(mma_only, launcher), impl="wgmma")
    # without the tensor-core kernels loaded: auto is the CUDA-core kernel, "wgmma" / "mma" an ArgumentError
    assert not set(TENSOR_CORE_KERNELS) & set(cuda_core.kernels)
    simple = run(cuda_core, SIMPLE, launcher, inp, scale)
    auto = launch(getattr(cuda_core, launcher), impl="auto")
    assert (simple[0] == auto[0]).all() and (simple[1].view(np.uint32) == auto[1].view(np.uint32)).all(), tag
    for impl in ("wgmma", "mma"):
        with pytest.raises(ArgumentError, match="impl"):
            launch(getattr(cuda_core, launcher), impl=impl)


def test_one_wave_of_chunks(spec, monkeypatch):
    """One request of few rows (Nq = 16) over a long table with split.ONE_WAVE on (off by default until measured): the
    automatic chunk count passes MAX_SPLITS up to one wave of blocks (split.one_wave_splits: 66 chunks of 2 row tiles
    on 132 SMs at H = 8), the combine merges them: rows written and untouched, the bar against the float64 reference
    (and at the fixed counts 1 and 5)."""
    import cupy
    from ddtree_gen.ops.tree_verify import split as mod
    monkeypatch.setattr(mod, "ONE_WAVE", True)
    ks = WGMMA.load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [40000], [16], ["random"], nq=16, seed=seed, bf16=WGMMA.bf16)
    plan = ks.tree_verify_schedule(1, 16, inp.block_table.shape[1], device=cupy.cuda.Device().id)
    if plan.pieces <= mod.MAX_SPLITS:
        pytest.skip(f"spec {spec.name!r}: Nq = 16 is {plan.blocks // plan.pieces} row tiles here, {plan.pieces} chunks "
                    f"(one wave past MAX_SPLITS = {mod.MAX_SPLITS} is for fewer row tiles)")
    heads = heads_to_check(spec.num_heads, rng, 2)
    verify_all_splits(ks, WGMMA, "tree_verify", inp, SCALES["mla"], heads,
                      f"wgmma {spec.name} one wave of {plan.pieces} chunks seed={seed}")


@pytest.mark.parametrize("impl", TENSOR_CORE, ids=str)
def test_cuda_graph_capture(spec, impl):
    """With out, lse and workspace given, a launch (auto split count) captures into a CUDA graph
    and replays to the eager result: nothing reads device values on the host."""
    import cupy
    from ddtree_gen.ops.tree_verify import split as mod
    launch = impl.launcher(impl.load(spec), "tree_verify")
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [3000], [65], ["random"], seed=seed, bf16=impl.bf16)
    dev = inp.device()
    b, nq = inp.shape[:2]
    ws = cupy.empty(mod.workspace_elems(spec, b, nq, mod.MAX_SPLITS), np.float32)
    eager_o, eager_l = poisoned(inp.shape)
    launch(**dev, softmax_scale=SCALES["mla"], out=eager_o, lse=eager_l, workspace=ws)
    cupy.cuda.get_current_stream().synchronize()
    tag = f"{impl} {spec.name} graph seed={seed}"
    check_rows_written(to_host(eager_o), to_host(eager_l), inp.q_lens, f"{tag} eager")
    out, lse = poisoned(inp.shape)
    # the poison's host-to-device copies ran on the current stream, which the non-blocking capture stream does not
    # wait for: without this, a copy that lands after the replay leaves poison in `out` (seen on the H200 under
    # pytest -n 8, on the lockstep and the seesaw builds alike: 2026-12-01)
    cupy.cuda.get_current_stream().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        launch(**dev, softmax_scale=SCALES["mla"], out=out, lse=lse, workspace=ws)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert (to_host(out) == to_host(eager_o)).all(), tag
    assert (to_host(lse).view(np.uint32) == to_host(eager_l).view(np.uint32)).all(), tag


# ------------------------------------------------------------------- device-side values

@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
def test_device_values_are_clamped(spec, group):
    """Without validate=True, bad device-side lengths and pages never fault: a request with a bad
    q_len or a negative prefix_len writes nothing, a key on a page outside [0, num_pages) is not
    visible (compared to the reference with those tree bits cleared)."""
    ks, group = load_group(spec, group)
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    nq = spec.max_tree_size
    # request 0: prefix page + 10, a bad page in the tree tail; 1: a huge page id; 2-4: bad lengths
    prefix = [page + 10, 10, 5, 5, 5]
    inp = make_inputs(spec, rng, prefix, [nq] * 5, ["random"] * 5, seed=seed, bf16=group[0].bf16)
    scale = SCALES["mla"]
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
    # the reference of requests 0 and 1 with the hidden keys' mask bits cleared instead
    mask = inp.tree_mask.copy()
    for b, bp in [(0, bad_page0), (1, bad_page1)]:
        for j in range(nq):
            if (prefix[b] + j) // page == bp:
                mask[b, :, j // 32] &= ~np.uint32(1 << (j % 32))
    heads = heads_to_check(spec.num_heads, rng, 4)
    good = VerifyInputs(**{k: v if k in ("kv_cache", "kv_scale") else v[:2]
                           for k, v in inp.host(tree_mask=mask).items()})
    for launcher in LAUNCHERS:
        ref = reference_for(launcher, good, scale, heads)
        for impl in group:
            verify_all_splits(ks, impl, launcher, inp, scale, heads, f"{impl} {launcher} {tag}", ref=ref,
                              written=[True, True, False, False, False], block_table=bad_table, q_lens=q_lens,
                              prefix_lens=prefix_lens)


@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
def test_keys_past_block_table_are_not_visible(spec, group):
    """prefix_len + q_len beyond max_pages * page_size: keys past the table are not visible."""
    ks, group = load_group(spec, group)
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    nq = spec.max_tree_size
    L = 2 * page - 20                          # tree nodes j >= 20 fall past a 2-page table
    inp = make_inputs(spec, rng, [L], [nq], ["chain"], seed=seed, bf16=group[0].bf16)
    short = np.ascontiguousarray(inp.block_table[:, :2])
    mask = inp.tree_mask.copy()
    for j in range(20, nq):
        mask[0, :, j // 32] &= ~np.uint32(1 << (j % 32))
    scale = SCALES["one"]
    heads = heads_to_check(spec.num_heads, rng, 4)
    for launcher in LAUNCHERS:
        ref = reference_for(launcher, inp, scale, heads, tree_mask=mask)
        for impl in group:
            verify_all_splits(ks, impl, launcher, inp, scale, heads, f"{impl} {launcher} {spec.name} past-table "
                              f"seed={seed}", ref=ref, block_table=short)


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("impl", IMPLS, ids=str)
def test_validate(spec, impl, launcher):
    """validate=True: bad device-side values raise ArgumentError (naming the argument, the request and
    the value) before launch; a bad prefix page is only refused where the launcher reads the prefix."""
    page = spec.page_size
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [page + 3, 0], [5, 2], ["chain", "chain"], seed=seed, bf16=impl.bf16)
    launch = impl.launcher(impl.load(spec), launcher)
    scale = SCALES["mla"]
    out, lse = poisoned(inp.shape)
    launch(**inp.device(), softmax_scale=scale, out=out, lse=lse, validate=True)   # valid: runs
    check_rows_written(to_host(out), to_host(lse), inp.q_lens, f"{impl} {launcher} validate seed={seed}")
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
    if launcher == "tree_verify":
        msg = bad("block_table", block_table=table)
        assert "request 0" in msg and "-1" in msg, msg
    else:
        out, lse = poisoned(inp.shape)
        launch(**inp.device(block_table=table), softmax_scale=scale, out=out, lse=lse, validate=True)


@pytest.mark.parametrize("impl", TENSOR_CORE, ids=str)
def test_argument_errors(spec, impl):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [10], [3], ["chain"], seed=seed, bf16=impl.bf16)
    ks = impl.load(spec)
    full, tail = impl.launcher(ks, "tree_verify"), impl.launcher(ks, "tree_verify_tail")
    with pytest.raises(ArgumentError, match="num_splits"):
        full(**inp.device(), softmax_scale=1.0, num_splits=0)
    with pytest.raises(ArgumentError, match="q_nope"):
        full(**inp.device(q_nope=inp.q_nope.astype(np.float32)), softmax_scale=1.0)
    with pytest.raises(ArgumentError, match="tree_mask"):
        tail(**inp.device(tree_mask=inp.tree_mask[:, :, :1].copy()), softmax_scale=1.0)
    # the cache's dtype and kv_scale follow the spec's kv_dtype
    other = inp.kv_cache.astype(np.uint16) if spec.kv_fp8 else inp.kv_cache.view(np.uint8)[..., ::2].copy()
    with pytest.raises(ArgumentError, match=f"kv_cache: dtype .* for kv_dtype '{spec.kv_dtype}'"):
        full(**inp.device(kv_cache=other), softmax_scale=1.0)
    bad_scale = None if spec.kv_fp8 else 0.5
    with pytest.raises(ArgumentError, match="kv_scale"):
        tail(**inp.device(kv_scale=bad_scale), softmax_scale=1.0)


# --------------------------------------------------------------------------------- fp8

def bf16_twin(spec):
    """The shipped bf16 spec whose every other field is the fp8 spec's (kimi-k2.6-tp8 for kimi-k2.6-tp8-fp8)."""
    import dataclasses
    want = dataclasses.replace(spec, kv_dtype="bf16")
    for s in all_specs():
        if dataclasses.replace(s, name=spec.name) == want:
            return s
    pytest.skip(f"no shipped bf16 spec equals {spec.name!r} but for its kv_dtype")


@pytest.mark.parametrize("impl", (SIMPLE, WGMMA), ids=str)
def test_fp8_matches_bf16_twin(spec, impl):
    """An fp8 spec's kernels on e4m3 bytes with kv_scale = 2^k give the bits of its bf16 twin's kernels on the
    dequantized cache (exact in bf16): the conversion is exact, the scale folded into the scores' factor and
    the output factor changes no rounding (a power of two), and nothing else differs. Fixed split counts (the
    automatic ones may differ between the two specs' tuning). WGMMA: tree_verify's default (fp8_path=None, with the
    dequantize path's kernels loaded: ops.tree_verify.launch.fp8_default takes that path) gives the same bits too."""
    if not spec.kv_fp8:
        pytest.skip(f"spec {spec.name!r} has a bf16 cache")
    import ddtree_gen
    twin = bf16_twin(spec)
    ks = impl.load(spec)
    ks_twin = ddtree_gen.load(twin, kernels=impl.kernels)
    skip_unless_runs(ks_twin, *impl.own)
    if impl is WGMMA:   # the twin's build of the fp8 kernel's schedule and slab order, not necessarily its default
        from ddtree_gen.kernel_set import variant_set
        from ddtree_gen.ops import by_name
        from ddtree_gen.ops.tree_verify.wgmma import schedule_for
        from ddtree_gen.build.variant import variant
        sched = schedule_for(spec)
        # the fp8 seesaw's S products in its slab order: the rope slab in the early group, WG1's early group first
        knobs = {"rope_early": True, "s_order": "slab"} if sched == "seesaw" else {}
        same = variant(by_name("tree_verify_wgmma"), twin, schedule=sched, **knobs)
        ks_twin = variant_set([same], also=[k for k in impl.kernels if k != "tree_verify_wgmma"])
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n = spec.max_tree_size
    inp = make_inputs(spec, rng, [0, 70, 1000, 4100], [n, 33, 2, n], ["random", "binary", "chain", "star"], seed=seed,
                      bf16=impl.bf16, junk_bits=True)
    kv_scale = 2.0 ** int(rng.integers(-4, 2))
    # NaN bytes would compare unequal: make_inputs' caches have none, subnormal bytes included
    assert not np.isin(inp.kv_cache, fp8.NAN_BYTES).any()
    # every e4m3 subnormal (and +-0, the smallest normals) in the root's entry of request 0, seen by all its rows
    inp.kv_cache[inp.block_table[0, 0], 0, :32] = np.concatenate([np.arange(16), 0x80 + np.arange(16)])
    dequant = bf16.to_bits(fp8.dequantize(inp.kv_cache, kv_scale))
    assert np.array_equal(bf16.from_bits(dequant), fp8.dequantize(inp.kv_cache, kv_scale)), "not exact in bf16"
    ks_default = None
    if impl is WGMMA:   # the default path of an fp8 spec's tree_verify, where it is the dequantize path
        import cupy
        from ddtree_gen.ops.tree_verify.launch import fp8_default
        from ddtree_gen.ops.tree_verify.wgmma import DEQUANT
        DEQUANT_KERNELS = ("kv_dequant", DEQUANT, "tree_verify_mma_combine")   # the dequantize path's
        ks_default = ddtree_gen.load(spec, kernels=list(dict.fromkeys(impl.kernels + DEQUANT_KERNELS)))
        skip_unless_runs(ks_default, *DEQUANT_KERNELS)
        path, why = fp8_default(ks_default, "auto", cupy.cuda.Device().id, *inp.block_table.shape)
        assert path == "dequant", why
    for launcher in LAUNCHERS:
        for splits in ((1, 5) if impl.split_kv else (None,)):
            tag = f"{impl} {launcher} {spec.name} vs {twin.name} kv_scale={kv_scale} splits={splits} seed={seed}"
            got = run(ks, impl, launcher, inp, SCALES["mla"], splits, kv_scale=kv_scale)
            want = run(ks_twin, impl, launcher, inp, SCALES["mla"], splits, kv_cache=dequant, kv_scale=None)
            check_rows_written(*got, inp.q_lens, tag)
            assert (got[0] == want[0]).all(), f"{tag}: out differs from the bf16 twin's"
            assert (got[1].view(np.uint32) == want[1].view(np.uint32)).all(), f"{tag}: lse differs"
            if ks_default is not None and launcher == "tree_verify":
                out, lse = poisoned(inp.shape)
                ks_default.tree_verify(**inp.device(kv_scale=kv_scale), softmax_scale=SCALES["mla"], out=out, lse=lse,
                                       num_splits=splits)
                assert (to_host(out) == want[0]).all(), f"{tag} fp8_path=None: out differs from the bf16 twin's"
                assert (to_host(lse).view(np.uint32) == want[1].view(np.uint32)).all(), \
                    f"{tag} fp8_path=None: lse differs"


# ---------------------------------------------------------------------------- merge_states

def _merge_inputs(spec, rng, lead):
    r = spec.kv_lora_rank
    o_a, o_b = random_bf16_bounded(rng, lead + (r,)), random_bf16_bounded(rng, lead + (r,))
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
def test_merge_states(spec, lead):
    ks = SIMPLE.load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lead = tuple(spec.num_heads if d is None else d for d in lead)
    o_a, lse_a, o_b, lse_b = _merge_inputs(spec, rng, lead)
    tag = f"merge {spec.name} {lead} seed={seed}"
    res = ks.merge_states(to_device(o_a), to_device(lse_a), to_device(o_b), to_device(lse_b))
    _check_merge(to_host(res.out), to_host(res.lse), o_a, lse_a, o_b, lse_b, tag)
    # in place: out = o_a, lse = lse_a; then into o_b / lse_b
    for side in ("a", "b"):
        da, dla, db, dlb = (to_device(x) for x in (o_a, lse_a, o_b, lse_b))
        out, lse = (da, dla) if side == "a" else (db, dlb)
        res = ks.merge_states(da, dla, db, dlb, out=out, lse=lse)
        assert res.out is out and res.lse is lse
        _check_merge(to_host(out), to_host(lse), o_a, lse_a, o_b, lse_b, f"{tag} in-place {side}")


# ---------------------------------------------------------------------------------- torch

def test_torch_tensors(spec):
    torch = cuda_torch()
    ks = SIMPLE.load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = make_inputs(spec, rng, [100, 0], [65, 7], ["random", "binary"], seed=seed)
    scale = SCALES["mla"]
    want_o, want_l = run(ks, SIMPLE, "tree_verify", inp, scale)
    check_rows_written(want_o, want_l, inp.q_lens, f"{spec.name} torch seed={seed}")

    def t(k, x):
        if k == "kv_cache":   # torch.bfloat16, or torch.float8_e4m3fn for an fp8 spec
            return kv_torch(spec, x)
        if not isinstance(x, np.ndarray):   # kv_scale
            return x
        if x.dtype == np.uint16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
        if x.dtype == np.uint32:
            return torch.from_numpy(x.view(np.int32)).view(torch.uint32).cuda()
        return torch.from_numpy(x).cuda()

    res = ks.tree_verify(**{k: t(k, v) for k, v in inp.host().items()}, softmax_scale=scale, impl="simple")
    assert isinstance(res.out, torch.Tensor) and res.out.dtype == torch.bfloat16
    assert isinstance(res.lse, torch.Tensor) and res.lse.dtype == torch.float32
    got_o = res.out.view(torch.int16).cpu().numpy().view(np.uint16)
    got_l = res.lse.cpu().numpy()
    for b, q in enumerate(inp.q_lens):
        assert (got_o[b, :q] == want_o[b, :q]).all(), f"seed={seed}"
        assert (got_l[b, :q].view(np.uint32) == want_l[b, :q].view(np.uint32)).all(), f"seed={seed}"
    merged = ks.merge_states(res.out, res.lse, res.out, res.lse)   # a state merged with itself
    assert isinstance(merged.out, torch.Tensor) and merged.out.dtype == torch.bfloat16
    for b, q in enumerate(inp.q_lens):
        np.testing.assert_allclose(merged.lse[b, :q].cpu().numpy(), got_l[b, :q] + math.log(2), atol=1e-5)

"""kv_dequant and tree_verify(fp8_path="dequant") on the GPU (marker gpu; the fp8 specs; skipped with the reason
where the wgmma kernels cannot run: no GPU, not Hopper, DDTREE_GEN_ARCH=sm_80).

* kv_dequant: bit-exact against reference.kv_dequant on caches of every byte value (NaN bytes included), with
  block-table entries outside the cache, requests tree_verify does not serve, pages past the keys: every byte of the
  workspace compared (the converted pages and the table written, every other page byte-identical to the poison
  written before the launch); for the default build and every build option of plans/kv_dequant (CANDIDATES, the
  builds scripts/compare_dequant.py times, and EDGE_OPTIONS, parts that do not divide a page).
* the dequantize path: the bits of the fused fp8 kernel (tree_verify_wgmma: its converter warpgroup, fp8_path="fused")
  on the same inputs, out and lse, for split-KV off, forced on and the launcher's choice, with a kv_scale that is not
  a power of two; rows >= q_len untouched (poisoned before the launch); the float64 bar against the reference too; NaN
  bytes in the cache (read ones give the fused kernel's NaN rows, unread ones nothing); unmapped block-table entries;
  torch tensors, the torch op and CUDA-graph capture.
* the parts grid (B >= 8, a block table of >= 2048 keys, H <= 8): the bits of the bf16 twin's parts build of the same
  slab order on the dequantized cache, and the float64 bar.
* the default (fp8_path=None): the dequantize path where ops.tree_verify.launch.fp8_default allows it (the plan of the
  call holds kv_dequant), the fused kernel past KV_WORKSPACE_LIMIT; the same bits either way; through the torch op
  and in a CUDA graph too (its workspace allocated per call).
The seed of each run is in every failure message (DDTREE_TEST_SEED replays it).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import cuda_torch, skip_unless_runs
from ddtree_gen import inputs, reference
from ddtree_gen.ops.kv_dequant.plan import CANDIDATES, EDGE_OPTIONS, workspace_elems
from test_gpu_tree_verify import (POISON_LSE, POISON_OUT, SCALES, WGMMA, check_against, check_rows_written,
                                  heads_to_check, poisoned)
from verify_cases import fresh_seed, make_inputs, to_device, to_host

pytestmark = pytest.mark.gpu

KERNELS = ("kv_dequant", "tree_verify_wgmma", "tree_verify_mma_combine")   # (tree_verify_wgmma: each of its builds)
POISON_KV = 0xABCD          # a bf16 NaN pattern kv_dequant never writes (its NaN is sign | 0x7ff0)
POISON_TABLE = 0x5EEDBEEF     # an int32 no table entry can be (B * max_pages is far smaller)


OPTIONS = CANDIDATES + EDGE_OPTIONS   # kv_dequant's build options ({}: the default build)


def _option_id(knobs) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(knobs.items())) or "default"


def _load(spec, kernels=KERNELS, knobs=None):
    """The kernel set of `kernels`; with `knobs`, kv_dequant's build of those options (build/variant.variant) beside
    the default builds of the others."""
    if not spec.kv_fp8:
        pytest.skip(f"spec {spec.name!r} has a bf16 cache (kv_dequant is an fp8 spec's)")
    import ddtree_gen
    if knobs:
        from ddtree_gen.kernel_set import variant_set
        from ddtree_gen.ops import by_name
        from ddtree_gen.build.variant import variant
        ks = variant_set([variant(by_name("kv_dequant"), spec, **knobs)],
                         also=[k for k in kernels if k != "kv_dequant"])
        assert not ks.variants["kv_dequant"].is_default
    else:
        ks = ddtree_gen.load(spec, kernels=list(kernels))
    skip_unless_runs(ks, *kernels)
    return ks


# ------------------------------------------------------------------------------- kv_dequant

def _dequant_case(spec, rng):
    """A cache of random bytes (every value, NaN bytes included) and requests of every kind: long, short, one whose
    keys end on a page boundary, unmapped entries (-1, num_pages, past it), q_len 0, prefix_len < 0, a 64-bit key
    count."""
    page, row = spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim
    num_pages, max_pages = 40, 9
    kv = rng.integers(0, 256, (num_pages, page, row), dtype=np.uint8)
    kv[0].reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    table = inputs.block_table(rng, [max_pages * page] * 7, page)[0] % (num_pages + 3)   # repeats, past the cache
    table[0, 0], table[1, 2], table[2, 1] = 0, -1, num_pages
    prefix = np.array([8 * page + 5, 3 * page - 1, page, 2**31 - 3, 4, -1, 0], np.int32)
    qlens = np.array([65, 1, 1, 65, 0, 5, 1], np.int32)
    return kv, table, prefix, qlens


@pytest.mark.parametrize("knobs", OPTIONS, ids=_option_id)
def test_kv_dequant_matches_reference(spec, knobs):
    ks = _load(spec, ("kv_dequant",), knobs)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    kv, table, prefix, qlens = _dequant_case(spec, rng)
    b, max_pages = table.shape
    page, row = kv.shape[1:]
    poison = reference.KvDequantOutput(np.full((b * max_pages, page, row), POISON_KV, np.uint16),
                                       np.full((b, max_pages), POISON_TABLE, np.int32))
    want = reference.kv_dequant(kv, table, prefix, qlens,
                                out=reference.KvDequantOutput(poison.kv_cache.copy(), poison.block_table.copy()))
    assert (want.block_table >= 0).sum() >= 10 and (want.block_table < 0).sum() >= 10, "a case of both kinds"
    out = reference.KvDequantOutput(to_device(poison.kv_cache), to_device(poison.block_table))
    res = ks.kv_dequant(to_device(kv), to_device(table), to_device(prefix), to_device(qlens), out=out)
    assert res.kv_cache is out.kv_cache and res.block_table is out.block_table
    got_kv, got_table = to_host(out.kv_cache), to_host(out.block_table)
    assert np.array_equal(got_table, want.block_table), f"block table differs, seed={seed}"
    bad = np.argwhere(got_kv != want.kv_cache)
    assert not bad.size, (f"workspace differs at {len(bad)} elements, first (page, slot, column) {bad[0]}: "
                          f"{got_kv[tuple(bad[0])]:#06x} vs {want.kv_cache[tuple(bad[0])]:#06x}, seed={seed}")
    # new outputs (allocated): the converted pages and the table are the reference's
    fresh = ks.kv_dequant(to_device(kv), to_device(table), to_device(prefix), to_device(qlens))
    done = want.block_table.reshape(-1) >= 0
    assert np.array_equal(to_host(fresh.block_table), want.block_table)
    assert np.array_equal(to_host(fresh.kv_cache)[done], want.kv_cache[done]), f"seed={seed}"


def test_kv_dequant_torch(spec):
    torch = cuda_torch()
    ks = _load(spec, ("kv_dequant",))
    seed = fresh_seed()
    kv, table, prefix, qlens = _dequant_case(spec, np.random.default_rng(seed))
    want = reference.kv_dequant(kv, table, prefix, qlens)
    t = lambda x: torch.from_numpy(x).cuda()   # noqa: E731
    res = ks.kv_dequant(t(kv).view(torch.float8_e4m3fn), t(table), t(prefix), t(qlens))
    assert isinstance(res.kv_cache, torch.Tensor) and res.kv_cache.dtype == torch.bfloat16
    done = want.block_table.reshape(-1) >= 0
    got = res.kv_cache.view(torch.int16).cpu().numpy().view(np.uint16)
    assert np.array_equal(res.block_table.cpu().numpy(), want.block_table)
    assert np.array_equal(got[done], want.kv_cache[done]), f"seed={seed}"


# ------------------------------------------------------------------------ tree_verify(fp8_path="dequant")

def _run(ks, inp, scale, splits, fp8_path, **replace):
    out, lse = poisoned(inp.shape)
    res = ks.tree_verify(**inp.device(**replace), softmax_scale=scale, out=out, lse=lse, impl="wgmma",
                         num_splits=splits, fp8_path=fp8_path)
    assert res.out is out and res.lse is lse
    return to_host(out), to_host(lse)


def _same_bits(got, want, tag):
    assert (got[0] == want[0]).all(), f"{tag}: out differs from the fused kernel's at {np.argwhere(got[0] != want[0])[:3]}"
    assert (got[1].view(np.uint32) == want[1].view(np.uint32)).all(), f"{tag}: lse differs from the fused kernel's"


def _default_paths(ks) -> set:
    """The paths the fp8_path=None calls prepared in ks took (their plans' first kernel: kv_dequant or not)."""
    # (a cached call's key: (code, VerifyCall.key(), signatures); VerifyCall.key(): (launcher, impl, fp8_path, ...))
    return {"dequant" if prep.steps[0].kernel == "kv_dequant" else "fused"
            for key, prep in ks.prepared_calls.items()
            if isinstance(key, tuple) and len(key) == 3 and isinstance(key[1], tuple) and key[1][:1] == ("tree_verify",)
            and key[1][2] is None and prep.steps}


def _batch(spec, rng, seed):
    n = spec.max_tree_size
    inp = make_inputs(spec, rng, [0, 70, 1000, 4100], [n, 33, 2, n], ["random", "binary", "chain", "star"], seed=seed,
                      bf16=WGMMA.bf16, junk_bits=True)
    # every e4m3 subnormal (and +-0) in the root's entry of request 0, seen by all its rows
    inp.kv_cache[inp.block_table[0, 0], 0, :32] = np.concatenate([np.arange(16), 0x80 + np.arange(16)])
    return inp


@pytest.mark.parametrize("knobs", OPTIONS, ids=_option_id)
def test_dequant_path_matches_fused(spec, knobs):
    """The dequantize path gives the fused fp8 kernel's bits (kv_scale any float32 in [0.01, 2], not only powers of
    two: both apply it in fp32 the same way), at every split setting, with every build of kv_dequant; and it meets
    the float64 bar."""
    ks = _load(spec, knobs=knobs)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = _batch(spec, rng, seed)
    scale = SCALES["mla"]
    heads = heads_to_check(spec.num_heads, rng, 4)
    ref = None
    for splits in (1, 5, None):
        tag = f"{spec.name} kv_scale={inp.kv_scale} splits={splits} seed={seed}"
        fused = _run(ks, inp, scale, splits, "fused")
        got = _run(ks, inp, scale, splits, "dequant")
        default = _run(ks, inp, scale, splits, None)   # fp8_default: the dequantize path here
        check_rows_written(*got, inp.q_lens, tag)
        _same_bits(got, fused, tag)
        _same_bits(default, fused, f"{tag} fp8_path=None")
        if ref is None:
            from test_gpu_tree_verify import reference_for
            ref = reference_for("tree_verify", inp, scale, heads)
        check_against(got[0], got[1], ref, inp.q_lens, heads, tag)
        check_against(default[0], default[1], ref, inp.q_lens, heads, f"{tag} fp8_path=None")
    assert _default_paths(ks) == {"dequant"}, f"{spec.name}: fp8_path=None did not take the dequantize path"


def test_dequant_path_parts_grid(spec):
    """At B >= PARTS_MIN_B with a block table of at least PARTS_MIN_KEYS keys (num_splits not given) the dequantize path,
    fp8_path "dequant" and None, runs its parts-grid build (tree_verify_wgmma/dequant_parts): with kv_scale = 2^k its
    bits (out, lse) are the bf16 twin's parts build of the same slab order on the dequantized cache (exact in bf16);
    with the batch's kv_scale (not a power of two) it meets the float64 bar; rows >= q_len untouched (poisoned)."""
    from ddtree_gen import bf16, fp8
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.ops.tree_verify.which import which_kernel
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.wgmma import DEQUANT, DEQUANT_PARTS, PARTS_KERNEL, PARTS_MIN_B, PARTS_MIN_KEYS
    from ddtree_gen.build.variant import variant
    from test_gpu_tree_verify import bf16_twin, reference_for
    if not spec.kv_fp8 or not by_name(DEQUANT_PARTS).builds_for(spec):
        pytest.skip(f"spec {spec.name!r}: {by_name(DEQUANT_PARTS).why_not_built(spec)}")
    import cupy
    ks = _load(spec, KERNELS)
    twin = bf16_twin(spec)
    ks_twin = variant_set([variant(by_name(PARTS_KERNEL), twin, rope_early=True, s_order="slab")],
                          also=["tree_verify_mma_combine"])
    skip_unless_runs(ks_twin, PARTS_KERNEL)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n = spec.max_tree_size
    lens = [0, 70, 1000, PARTS_MIN_KEYS + 52, 3000, 5, 640, 64, 4100]   # B = 9 >= PARTS_MIN_B
    qlens = [n, 33, 2, n, 1, n, 17, 1, n]
    inp = make_inputs(spec, rng, lens, qlens, "random", seed=seed, bf16=WGMMA.bf16, junk_bits=True)
    b, max_pages = inp.block_table.shape
    assert max_pages * spec.page_size >= PARTS_MIN_KEYS and b >= PARTS_MIN_B
    assert which_kernel(ks, b, inp.shape[1], max_pages, device=cupy.cuda.Device().id, fp8_path="dequant").kernel == DEQUANT_PARTS
    scale = SCALES["mla"]
    kv_scale = 2.0 ** int(rng.integers(-4, 2))
    dequant = bf16.to_bits(fp8.dequantize(inp.kv_cache, kv_scale))
    out, lse = poisoned(inp.shape)
    ks_twin.tree_verify_wgmma(**inp.device(kv_cache=dequant, kv_scale=None), softmax_scale=scale, out=out, lse=lse,
                              build="parts")
    want = to_host(out), to_host(lse)
    heads = heads_to_check(spec.num_heads, rng, 4)
    ref = reference_for("tree_verify", inp, scale, heads)
    for path in ("dequant", None):
        tag = f"{spec.name} fp8_path={path} seed={seed}"
        got = _run(ks, inp, scale, None, path, kv_scale=kv_scale)
        check_rows_written(*got, inp.q_lens, tag)
        assert (got[0] == want[0]).all(), f"{tag}: out differs from the bf16 twin's parts build"
        assert (got[1].view(np.uint32) == want[1].view(np.uint32)).all(), f"{tag}: lse differs from the twin's"
        mine = _run(ks, inp, scale, None, path)   # the batch's own kv_scale: the float64 bar
        check_rows_written(*mine, inp.q_lens, tag)
        check_against(mine[0], mine[1], ref, inp.q_lens, heads, tag)


def test_dequant_path_given_workspace_and_other_scales(spec):
    """A caller's kv_workspace (poisoned: the pre-pass overwrites what the call reads) gives the same bits as one the
    launcher allocates; softmax_scale 1 and a power-of-two kv_scale too."""
    import cupy
    ks = _load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = _batch(spec, rng, seed)
    b, max_pages = inp.block_table.shape
    kvw = cupy.full(workspace_elems(spec, b, max_pages) + 7, POISON_KV, np.uint16)
    for kv_scale in (inp.kv_scale, 0.25, 1.0):
        tag = f"{spec.name} kv_scale={kv_scale} seed={seed}"
        fused = _run(ks, inp, SCALES["one"], None, "fused", kv_scale=kv_scale)
        out, lse = poisoned(inp.shape)
        ks.tree_verify(**inp.device(kv_scale=kv_scale), softmax_scale=SCALES["one"], out=out, lse=lse,
                       fp8_path="dequant", kv_workspace=kvw)
        _same_bits((to_host(out), to_host(lse)), fused, tag)
        assert (to_host(kvw[-7:]) == POISON_KV).all(), f"{tag}: written past the workspace's elements"


def test_default_path_past_the_limit(spec, monkeypatch):
    """fp8_path=None with the workspace over KV_WORKSPACE_LIMIT (here: 0) runs the fused kernel (its plan: no
    kv_dequant), with a caller's kv_workspace the dequantize path: the fused kernel's bits both ways."""
    import cupy
    from ddtree_gen.ops.tree_verify import launch as tv, route as verify_route
    ks = _load(spec)
    seed = fresh_seed()
    inp = _batch(spec, np.random.default_rng(seed), seed)
    b, max_pages = inp.block_table.shape
    device = cupy.cuda.Device().id
    assert tv.fp8_default(ks, "wgmma", device, b, max_pages)[0] == "dequant"
    fused = _run(ks, inp, SCALES["mla"], None, "fused")
    monkeypatch.setattr(verify_route, "KV_WORKSPACE_LIMIT", 0)
    ks.prepared_calls.clear()   # the decisions of this signature were taken under the real limit
    try:
        path, why = tv.fp8_default(ks, "wgmma", device, b, max_pages)
        assert path == "fused" and "over KV_WORKSPACE_LIMIT = 0 MiB" in why, why
        _same_bits(_run(ks, inp, SCALES["mla"], None, None), fused, f"{spec.name} limit 0 seed={seed}")
        assert _default_paths(ks) == {"fused"}
        kvw = cupy.empty(workspace_elems(spec, b, max_pages), np.uint16)
        out, lse = poisoned(inp.shape)
        ks.tree_verify(**inp.device(), softmax_scale=SCALES["mla"], out=out, lse=lse, impl="wgmma", kv_workspace=kvw)
        _same_bits((to_host(out), to_host(lse)), fused, f"{spec.name} limit 0, kv_workspace given, seed={seed}")
        assert _default_paths(ks) == {"fused", "dequant"}
    finally:
        ks.prepared_calls.clear()   # nothing decided under the patched limit outlives the test


def test_dequant_path_unmapped_pages_and_bad_requests(spec):
    """Block-table entries outside [0, num_pages) in a used column (their keys are not visible), a request with
    q_len 0 and one with prefix_len < 0 (not written at all): the fused kernel's bits, its untouched rows."""
    ks = _load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n = spec.max_tree_size
    inp = make_inputs(spec, rng, [300, 200, 64, 5], [n, 9, 3, 4], ["random", "chain", "star", "binary"], seed=seed,
                      bf16=WGMMA.bf16)
    num_pages = inp.kv_cache.shape[0]
    inp.block_table[0, 1] = -1
    inp.block_table[0, 3] = num_pages
    inp.block_table[1, 0] = 2**31 - 1
    inp.q_lens[2] = 0
    inp.prefix_lens[3] = -1
    written = [True, True, False, False]
    for splits in (1, 5, None):
        tag = f"{spec.name} splits={splits} seed={seed}"
        fused = _run(ks, inp, SCALES["mla"], splits, "fused")
        got = _run(ks, inp, SCALES["mla"], splits, "dequant")
        check_rows_written(*got, inp.q_lens, tag, written=written)
        _same_bits(got, fused, tag)
        _same_bits(_run(ks, inp, SCALES["mla"], splits, None), fused, f"{tag} fp8_path=None")


def test_dequant_path_nan_bytes(spec):
    """NaN bytes: in a key request 0 reads (its rows become the fused kernel's NaN rows: the same NaN positions and
    the same bits elsewhere) and in cache slots no call reads (past the keys in the last page of request 1, pages
    outside every table): request 1 stays the fused kernel's finite bits."""
    ks = _load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    page = spec.page_size
    inp = make_inputs(spec, rng, [130, 2 * page + 7], [20, 5], ["random", "chain"], seed=seed, bf16=WGMMA.bf16)
    t0 = 50                                                  # a prefix key of request 0
    inp.kv_cache[inp.block_table[0, t0 // page], t0 % page, 3] = 0x7F
    inp.kv_cache[inp.block_table[0, t0 // page], t0 % page, 520] = 0xFF
    end = int(inp.prefix_lens[1] + inp.q_lens[1])            # request 1's keys end inside a page
    last = inp.block_table[1, (end - 1) // page]
    inp.kv_cache[last, end % page:, :] = 0x7F
    used = set(inp.block_table[0, :2 + 130 // page].tolist()) | set(inp.block_table[1, :end // page + 1].tolist())
    spare = [p for p in range(inp.kv_cache.shape[0]) if p not in used]
    inp.kv_cache[spare] = 0xFF
    for splits in (1, None):
        tag = f"{spec.name} splits={splits} seed={seed}"
        fused = _run(ks, inp, SCALES["mla"], splits, "fused")
        got = _run(ks, inp, SCALES["mla"], splits, "dequant")
        q0, q1 = int(inp.q_lens[0]), int(inp.q_lens[1])
        f32 = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)   # noqa: E731
        a, w = f32(got[0][0, :q0]), f32(fused[0][0, :q0])
        assert np.isnan(a).any(), f"{tag}: request 0 reads a NaN byte, its output has no NaN"
        assert np.array_equal(np.isnan(a), np.isnan(w)), f"{tag}: request 0: NaN elsewhere than the fused kernel's"
        assert np.array_equal(got[0][0, :q0][~np.isnan(a)], fused[0][0, :q0][~np.isnan(w)]), tag
        assert np.array_equal(np.isnan(got[1][0, :q0]), np.isnan(fused[1][0, :q0])), tag
        assert not np.isnan(f32(got[0][1, :q1])).any() and not np.isnan(got[1][1, :q1]).any(), \
            f"{tag}: request 1 reads no NaN byte but has NaN"
        assert (got[0][1] == fused[0][1]).all() and (got[1][1].view(np.uint32) == fused[1][1].view(np.uint32)).all()
        assert (got[0][:, max(q0, q1):] == POISON_OUT).all() and (got[1][1, q1:].view(np.uint32) == POISON_LSE).all()


def test_dequant_path_torch_op_and_cuda_graph(spec):
    """torch tensors (the cache as torch.float8_e4m3fn) through ks.tree_verify and torch.ops.ddtree.tree_verify(...,
    kv_scale, "dequant"), and both with fp8_path=None (the default: the dequantize path here): the CuPy call's bits; a
    CUDA graph captured with the path (given out, lse and kv_workspace, and the op allocating its own, "dequant" and
    the default) replays on new q and lengths to the eager result."""
    torch = cuda_torch()
    import ddtree_gen.torch_ops  # noqa: F401  (registers torch.ops.ddtree)
    ks = _load(spec)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    inp = _batch(spec, rng, seed)
    scale = SCALES["mla"]
    want = _run(ks, inp, scale, None, "dequant")

    def t(k, x):
        if k == "kv_cache":
            return torch.from_numpy(x).cuda().view(torch.float8_e4m3fn)
        if not isinstance(x, np.ndarray):
            return x
        if x.dtype == np.uint16:
            return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
        if x.dtype == np.uint32:
            return torch.from_numpy(x.view(np.int32)).cuda().view(torch.uint32)
        return torch.from_numpy(x).cuda()

    args = {k: t(k, v) for k, v in inp.host().items()}
    bits = lambda x: x.view(torch.int16).cpu().numpy().view(np.uint16)   # noqa: E731
    q = inp.q_lens

    def same(out, lse, tag, w=want):
        for b, n in enumerate(q):
            assert (bits(out)[b, :n] == w[0][b, :n]).all(), f"{tag}: out, request {b}, seed={seed}"
            assert (lse[b, :n].cpu().numpy().view(np.uint32) == w[1][b, :n].view(np.uint32)).all(), f"{tag}: lse"

    res = ks.tree_verify(**args, softmax_scale=scale, fp8_path="dequant")
    same(res.out, res.lse, "torch tensors")
    names = ("q_nope", "q_pe", "kv_cache", "block_table", "prefix_lens", "q_lens", "tree_mask")
    op_out = torch.ops.ddtree.tree_verify(spec.name, *(args[k] for k in names), scale, "auto", inp.kv_scale, "dequant")
    same(*op_out, "torch op")
    # the default (fp8_path=None: the dequantize path here, its workspace allocated by torch per call)
    same(*ks.tree_verify(**args, softmax_scale=scale), "torch tensors, fp8_path=None")
    same(*torch.ops.ddtree.tree_verify(spec.name, *(args[k] for k in names), scale, "auto", inp.kv_scale),
         "torch op, fp8_path=None")
    from ddtree_gen import torch_ops
    assert _default_paths(ks) == {"dequant"} and _default_paths(torch_ops._kset(spec.name)) == {"dequant"}
    # CUDA graphs: captured once, replayed after the inputs changed in place
    b, max_pages = inp.block_table.shape
    kvw = torch.empty(workspace_elems(spec, b, max_pages), dtype=torch.bfloat16, device="cuda")
    out, lse = torch.empty_like(res.out), torch.empty_like(res.lse)
    call = lambda: ks.tree_verify(**args, softmax_scale=scale, out=out, lse=lse, fp8_path="dequant",  # noqa: E731
                                  kv_workspace=kvw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()                                              # prepares (and checks) outside the capture
        op_call = lambda: torch.ops.ddtree.tree_verify(spec.name, *(args[k] for k in names), scale, "auto",  # noqa
                                                       inp.kv_scale, "dequant")
        op_call()
        op_default = lambda: torch.ops.ddtree.tree_verify(spec.name, *(args[k] for k in names), scale,  # noqa: E731
                                                          "auto", inp.kv_scale)
        op_default()
    torch.cuda.current_stream().wait_stream(s)
    g, g_op, g_default = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    with torch.cuda.graph(g_op):
        captured = op_call()
    with torch.cuda.graph(g_default):
        captured_default = op_default()
    other = _batch(spec, np.random.default_rng(seed + 1), seed)   # same shapes, new q (the cache and lengths too)
    for k in names:   # byte for byte (torch.uint32 has few ops)
        args[k].view(torch.uint8).copy_(t(k, getattr(other, k)).view(torch.uint8))
    out.fill_(float("nan"))
    g.replay()
    g_op.replay()
    g_default.replay()
    torch.cuda.synchronize()
    want2 = _run(ks, other, scale, None, "dequant", kv_scale=inp.kv_scale)
    q = other.q_lens
    same(out, lse, "graph replay", want2)
    same(*captured, "torch op graph replay", want2)
    same(*captured_default, "torch op graph replay, fp8_path=None", want2)

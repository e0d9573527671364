"""tree_verify at every page size an engine uses: the seesaw's key tiles by TMA boxes per page (pages of 16 and 32), by a
row gather (pages of 1, 2, 8: the loading warpgroup's cp.async) and by a box per tile (64 and its multiples), for a
bf16 and an fp8 spec (ops/tree_verify/wgmma.seesaw_tma; docs/engine.md "Page sizes").

One logical cache (the matrix's cases on the base spec's 64-token pages) laid out in pages of each size
(inputs.relayout: a random page permutation) gives page 64's bits, out and lse, at fixed split counts (the same key
tiles in the same order: only the loads differ), and meets the contract's bar against the float64 reference with the
launcher's own split count and through tree_verify's route (impl auto: the parts grid, an fp8 spec's dequantize path).
Bad pages (a page outside the cache inside a tile: its keys alone are hidden) and bad lengths run the checks of
test_gpu_tree_verify.py and test_gpu_kv_dequant.py on each page size's spec. Fresh random data every run (the seed
in each message); rows >= q_len stay poisoned."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import test_gpu_kv_dequant as kd
import test_gpu_tree_verify as tv
from conftest import skip_unless_runs
from verify_cases import fresh_seed

pytestmark = pytest.mark.gpu

PAGES = (1, 2, 8, 16, 32, 128)
BASES = ("kimi-k2.6-tp8", "kimi-k2.6-tp8-fp8")
CASE_IDS = ("b7-small", "b3-L16500", "b64-mixed")
CASES = [c for c in tv.CASES if c.id in CASE_IDS]
# the wgmma kernels alone (the matrix's WGMMA loads mma.sync's too) with their builds (the parts grid, the dequantize
# path: an fp8 spec's also loads kv_dequant)
WG = dataclasses.replace(tv.WGMMA, kernels=("tree_verify_wgmma", "tree_verify_tail_wgmma", "tree_verify_mma_combine"))


def page_spec(base: str, page: int):
    from ddtree_gen.bench.specs import page_variant
    from ddtree_gen.spec import find_spec
    return page_variant(find_spec(base), page)


def load(spec):
    import ddtree_gen
    ks = ddtree_gen.load(spec, kernels=[*WG.kernels, *(("kv_dequant",) if spec.kv_fp8 else ())])
    skip_unless_runs(ks, *WG.own)
    return ks


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_page_size_gives_page_64s_bits(base, page, case):
    from ddtree_gen.inputs import relayout
    from ddtree_gen.ops.tree_verify.wgmma import seesaw_tma
    spec64, spec = page_spec(base, 64), page_spec(base, page)
    ks64, ks = load(spec64), load(spec)
    seed = fresh_seed()
    inp, rng = tv.build_case(spec64, case, seed, WG.bf16)
    kv, table = relayout(inp.kv_cache, inp.block_table, inp.prefix_lens + inp.q_lens, page, rng)
    paged = dataclasses.replace(inp, kv_cache=kv, block_table=table)
    heads = tv.heads_to_check(spec.num_heads, rng, case.heads)
    scale = tv.SCALES[case.scale]
    loads = "TMA boxes" if seesaw_tma(spec) else "gathered rows"
    tag = f"{spec.name} ({loads}) {case.id} seed={seed}"
    for splits in (1, 5):
        want = tv.run(ks64, WG, "tree_verify", inp, scale, splits)
        got = tv.run(ks, WG, "tree_verify", paged, scale, splits)
        tv.check_rows_written(*got, inp.q_lens, f"{tag} splits={splits}")
        assert (got[0] == want[0]).all(), f"{tag} splits={splits}: out differs from page 64's"
        assert (got[1].view(np.uint32) == want[1].view(np.uint32)).all(), f"{tag} splits={splits}: lse differs"
    ref = tv.reference_for("tree_verify", inp, scale, heads)
    got = tv.run(ks, WG, "tree_verify", paged, scale, None)
    tv.check_rows_written(*got, inp.q_lens, f"{tag} splits=auto")
    tv.check_against(*got, ref, inp.q_lens, heads, f"{tag} splits=auto")
    # tree_verify's route (impl auto: the parts grid at B >= 2 over long tables; an fp8 spec's dequantize path)
    out, lse = tv.poisoned(inp.shape)
    ks.tree_verify(**paged.device(), softmax_scale=scale, out=out, lse=lse)
    got = tv.to_host(out), tv.to_host(lse)
    tv.check_rows_written(*got, inp.q_lens, f"{tag} tree_verify auto")
    tv.check_against(*got, ref, inp.q_lens, heads, f"{tag} tree_verify auto")


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("base", BASES)
def test_bad_pages_and_lengths(base, page):
    """A page outside the cache in a used column (at pages < 64: some keys of a tile hidden, the others not), bad
    q_len and prefix_len: test_gpu_tree_verify's checks (and the parts grid's, the dequantize path's) at this page
    size."""
    spec = page_spec(base, page)
    if page > 64:   # (prefix page + 10: the bad page then holds prefix keys too, which the reference's mask cannot hide)
        pytest.skip(f"page {page}: the checks hide a page of tree keys only; a page of {page} holds prefix keys too "
                    f"(page 128 runs page 64's loads: test_a_page_size_gives_page_64s_bits holds it to page 64's bits)")
    load(spec)
    tv.test_device_values_are_clamped(spec, (WG,))
    if spec.kv_fp8:
        kd.test_dequant_path_unmapped_pages_and_bad_requests(spec)
    else:
        tv.test_parts_grid_bad_device_values(spec)


# (base spec, grid, the build's other knobs) of the page-by-page builds whose loads are tried against the serial ones;
# page_loads "producer" is a bf16 tile build's: on the fp8 spec its place is the dequantize path's slab order
# (rope_early, s_order "slab") on a bf16 cache, the build that path runs over its workspace
LOAD_BUILDS = {"spread": [("kimi-k2.6-tp8", "chunks", {}), ("kimi-k2.6-tp8", "parts", {}),
                          ("kimi-k2.6-tp8-fp8", "chunks", {})],
               "producer": [("kimi-k2.6-tp8", "chunks", {}), ("kimi-k2.6-tp8", "parts", {}),
                            ("kimi-k2.6-tp8", "chunks", {"rope_early": True, "s_order": "slab"})]}
# the page sizes of each: spread is a page-by-page build's; the producer also loads page 64's whole-tile boxes
LOAD_PAGES = {"spread": (1, 16, 32), "producer": (1, 16, 32, 64)}
LOAD_CASES = [(loads, *b, page) for loads, builds in LOAD_BUILDS.items() for b in builds for page in LOAD_PAGES[loads]]


def _load_id(loads, base, grid, knobs, page):
    return "-".join([loads, base, grid, *knobs, f"page{page}"])


@pytest.mark.parametrize("case_id", ("b7-small", "b3-L16500"))
@pytest.mark.parametrize("loads,base,grid,knobs,page", LOAD_CASES, ids=[_load_id(*c) for c in LOAD_CASES])
def test_page_loads_give_the_serial_bits(loads, base, grid, knobs, page, case_id):
    """page_loads "spread" (the gather's lanes a row's chunks side by side; TMA at pages of 16 / 32 a warp per page,
    LOAD_ARRIVALS = 64 / PAGE) and "producer" (a third warpgroup loads, the computing ones free the slabs; on the
    parts grid it runs ahead into the next segment's Q and tiles; page 64 too), neither the default until measured,
    give the serial build's bits, out and lse, at split counts 1, 5 and the launcher's own, on a table with a page
    outside the cache in request 0's tree keys and a negative one in request 1's prefix (their keys hidden alike),
    rows >= q_len untouched.
    b3-L16500: hundreds of tiles a block, so that each FREE barrier of the producer goes through many phases."""
    from ddtree_gen.build.variant import variant
    from ddtree_gen.inputs import relayout
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.ops.tree_verify.wgmma import seesaw_tma
    spec64, spec = page_spec(base, 64), page_spec(base, page)
    tma = seesaw_tma(spec)
    sets = {k: variant_set([variant(by_name("tree_verify_wgmma"), spec, tma=tma, grid=grid, page_loads=k, **knobs)],
                           also=[COMBINE]) for k in ("serial", loads)}
    skip_unless_runs(sets[loads], "tree_verify_wgmma")
    seed = fresh_seed()
    case = next(c for c in tv.CASES if c.id == case_id)
    inp, rng = tv.build_case(spec64, case, seed, WG.bf16)
    lens = inp.prefix_lens + inp.q_lens
    kv, table = relayout(inp.kv_cache, inp.block_table, lens, page, rng)
    table = table.copy()
    table[0, (int(lens[0]) - 1) // page] = kv.shape[0] + 3    # request 0's last key's page: outside the cache
    table[1, 0] = -1                                          # request 1's first page (prefix keys)
    paged = dataclasses.replace(inp, kv_cache=kv, block_table=table)
    tag = f"{spec.name} {loads} grid={grid} {knobs} ({'TMA' if tma else 'gather'}) {case_id} seed={seed}"
    for splits in tv.TC_SPLITS:
        got = {k: tv.run(ks, WG, "tree_verify", paged, tv.SCALES[case.scale], splits) for k, ks in sets.items()}
        for k in sets:
            tv.check_rows_written(*got[k], inp.q_lens, f"{tag} {k} splits={splits}")
        assert (got[loads][0] == got["serial"][0]).all(), f"{tag} splits={splits}: out differs from serial's"
        assert (got[loads][1].view(np.uint32) == got["serial"][1].view(np.uint32)).all(), \
            f"{tag} splits={splits}: lse differs from serial's"

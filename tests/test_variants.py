"""Variants as named data (ddtree_gen/build/variant.py): a variant is (kernel, spec, target, config); its procedural
name; the default config from one policy; a script's variant built through `variant()` with no monkeypatching."""
from __future__ import annotations

import dataclasses

import pytest

from ddtree_gen.build import artifacts
from ddtree_gen.errors import BuildError, SpecError
from ddtree_gen.ops import all_kernels, by_name
from ddtree_gen.ops.tree_verify import split as split_kv
from ddtree_gen.ops.tree_verify import mma as mma_plans
from ddtree_gen.ops.tree_verify import wgmma as wg_plans
from ddtree_gen.build.variant import default_config, variant
from ddtree_gen.build.render import render
from ddtree_gen.spec import find_spec

WGMMA = by_name("tree_verify_wgmma")


@pytest.fixture(scope="module")
def kimi():
    return find_spec("kimi-k2.6-tp8")


def test_default_variants_are_the_shipped_builds(kimi):
    """`ddtree-gen build`'s variants are the default ones; each names its generated file and its manifest entry."""
    import json

    from ddtree_gen import paths
    manifest = json.loads((paths.generated_dir() / kimi.name / artifacts.MANIFEST).read_text())
    for v in artifacts.variants(kimi, all_kernels()):
        assert v.is_default and v.stem == v.name and v.config == default_config(v.kernel, kimi, v.target)
        b = manifest["kernels"][v.kernel.name]["builds"][v.target]
        assert b["variant"] == v.name and b["source"] == f"{v.name}.cu"
        assert (paths.generated_dir() / kimi.name / b["source"]).is_file()


def test_procedural_names(kimi):
    mma, tail = by_name("tree_verify_mma"), by_name("tree_verify_tail_wgmma")
    assert variant(mma, kimi).name == "tree_verify_mma.bn64.s2"
    assert variant(mma, kimi, "sm_80").name == "tree_verify_mma.bn32.s2"   # the A100-sized sm_80 configuration
    assert variant(WGMMA, kimi).name == "tree_verify_wgmma.seesaw.tma"
    assert variant(WGMMA, kimi, schedule="lockstep", tma=False).name == "tree_verify_wgmma.lockstep.cpasync"
    assert variant(WGMMA, kimi, ablate=3, grid="parts").name == "tree_verify_wgmma.seesaw.tma.ablate3.grid-parts"
    assert variant(WGMMA, kimi, sync_handoffs=True).name == "tree_verify_wgmma.seesaw.tma.sync-handoffs"
    exact = variant(WGMMA, kimi, rescale="exact")
    assert exact.name == "tree_verify_wgmma.seesaw.tma.rescale-exact" and exact.plan().consts["RESCALE_SKIP"] == 0
    assert variant(tail, kimi).name == "tree_verify_tail_wgmma.lockstep.cpasync"
    assert variant(by_name("tree_build"), kimi).name == "tree_build"
    fp8 = variant(WGMMA, find_spec("kimi-k2.6-tp8-fp8"))   # the seesaw with its converter warpgroup
    assert fp8.name == "tree_verify_wgmma.seesaw.tma" and fp8.plan().consts["ROPE_EARLY"] == 1
    assert fp8.plan().consts["CONV_PAIRS"] == 1   # convert_sync "pairs"
    assert fp8.plan().template_constants()["THREADS"] == 384
    assert variant(WGMMA, kimi, rope_early=True).name == "tree_verify_wgmma.seesaw.tma.rope-early"


def test_a_non_default_variant_has_its_own_name_and_key(kimi):
    v = variant(WGMMA, kimi, schedule="lockstep", tma=False)
    assert not v.is_default and v.stem == v.name
    assert v.plan().template_constants()["USE_TMA"] == 0 and v.plan().template_constants()["SEESAW"] == 0
    tma = variant(WGMMA, kimi, schedule="lockstep")
    assert tma.plan().template_constants()["USE_TMA"] == 1
    assert render(v) != render(tma)
    src = render(tma)
    assert artifacts.cache_key(src, tma, "13.0") != artifacts.cache_key(src, variant(WGMMA, kimi), "13.0")
    # knobs named explicitly at their default values are the default variant
    assert variant(WGMMA, kimi, schedule="seesaw", tma=True).is_default


def test_knobs_are_checked(kimi):
    with pytest.raises(BuildError, match="no knob 'BN'.*schedule"):
        variant(WGMMA, kimi, BN=32)
    with pytest.raises(BuildError, match="tree_build: no knob 'x' .*none"):
        variant(by_name("tree_build"), kimi, x=1)
    with pytest.raises(BuildError, match="not built for sm_80"):
        variant(WGMMA, kimi, "sm_80")
    # the seesaw's row gather (tma=False: the build of pages of 1 to 8) is one it can make at any page size; TMA tiles
    # only where a page holds whole tiles or a tile whole pages of 16 or 32 keys
    assert variant(WGMMA, kimi, tma=False).plan().consts["USE_TMA"] == 0
    with pytest.raises(SpecError, match="TMA key tiles need"):
        variant(WGMMA, dataclasses.replace(kimi, name="kimi-page8", page_size=8), tma=True).plan()
    with pytest.raises(SpecError, match="TMA key tiles need"):   # the lockstep schedule's fp8 stages: cp.async
        variant(WGMMA, find_spec("kimi-k2.6-tp8-fp8"), schedule="lockstep", tma=True).plan()
    with pytest.raises(SpecError, match="fp8 seesaw runs the grid 'chunks' only"):
        variant(WGMMA, find_spec("kimi-k2.6-tp8-fp8"), grid="parts").plan()
    with pytest.raises(SpecError, match="convert_sync 'x': one of slab, lean, group, pairs"):
        variant(WGMMA, find_spec("kimi-k2.6-tp8-fp8"), convert_sync="x").plan()
    with pytest.raises(SpecError, match="ablate bits 2-4 .* per-slab converter"):   # the default "pairs" has none
        variant(WGMMA, find_spec("kimi-k2.6-tp8-fp8"), ablate=4).plan()
    with pytest.raises(SpecError, match="bf16 cache: convert_sync and ablate bits 2-4 are the fp8 seesaw's"):
        variant(WGMMA, kimi, convert_sync="slab").plan()
    with pytest.raises(SpecError, match="configuration"):
        variant(by_name("tree_verify_mma"), kimi, BN=48).plan()
    # the retired knobs (measured slower; their code in git history): no longer knobs of the variant, and a config that
    # still names one is refused by the plan, naming where their figures are
    for knob, value in (("fp8_mma", "q1p1"), ("vt_stages", 3), ("convert", "inline")):
        with pytest.raises(BuildError, match=f"no knob '{knob}'"):
            variant(WGMMA, find_spec("kimi-k2.6-tp8-fp8"), **{knob: value})
        config = {**wg_plans.variant_config(find_spec("kimi-k2.6-tp8-fp8")), knob: value}
        with pytest.raises(SpecError, match=f"{knob}: a retired build knob, measured slower \\(docs/perf/journal-fp8.md"):
            wg_plans.verify_plan(find_spec("kimi-k2.6-tp8-fp8"), config=config)


def test_the_policy_is_one_function(kimi):
    """default_config reads each kernel's policy: the mma.sync kernels' tuned configuration per target, the wgmma
    kernels' schedule and TMA choice, nothing for a kernel without knobs."""
    assert default_config(by_name("tree_verify_mma"), kimi) == mma_plans.config_for(kimi)
    assert default_config(by_name("tree_verify_mma"), kimi, "sm_80") == mma_plans.config_for(kimi, "sm_80")
    cfg = default_config(WGMMA, kimi)
    assert cfg["schedule"] == wg_plans.schedule_for(kimi) and cfg["tma"] is True
    assert default_config(by_name("merge_states"), kimi) == {}
    # the build's plan is the default variant's
    for k in all_kernels():
        for a in k.archs_for(kimi):
            assert k.plan_for(kimi, a).template_constants() == variant(k, kimi, a).plan().template_constants()


def test_variant_set_takes_each_builds_plan(kimi, monkeypatch):
    """kernel_set.variant_set: the variants' builds with their own plans (constants, launch geometry) beside the
    default builds of `also` (fake binaries: the wiring the scripts rely on, without NVRTC)."""
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.build.resources import PtxasReport
    report = PtxasReport(registers=32, smem=0, stack=0, spill_stores=0, spill_loads=0)

    def fake(v, source=None):
        return artifacts.Built(v, "", f"key-{v.name}", b"fake", report, "cached")
    monkeypatch.setattr(artifacts, "compile_variant", fake)
    monkeypatch.setattr(artifacts, "ensure_built", lambda spec, kernels=None, arch=None: {
        k: {a: fake(variant(by_name(k), spec, a)) for a in by_name(k).archs_for(spec)} for k in kernels})
    cp = variant(WGMMA, kimi, schedule="lockstep", tma=False)
    vs = variant_set([cp], also=[split_kv.COMBINE])
    assert set(vs.kernels) == {"tree_verify_wgmma", split_kv.COMBINE}
    assert vs.constants("tree_verify_wgmma")["USE_TMA"] == 0 and vs.constants("tree_verify_wgmma")["SEESAW"] == 0
    assert vs.variants["tree_verify_wgmma"] is cp and vs.reports["tree_verify_wgmma"][1] == report
    seesaw = variant_set([variant(WGMMA, kimi)])
    assert seesaw.constants("tree_verify_wgmma")["SEESAW"] == 1 and seesaw.kernels == ["tree_verify_wgmma"]
    assert vs.plan("tree_verify_wgmma").value(vs.plan("tree_verify_wgmma").dynamic_smem) != \
        seesaw.plan("tree_verify_wgmma").value(seesaw.plan("tree_verify_wgmma").dynamic_smem)


def test_a_build_is_a_typed_record(kimi):
    """tree_verify_wgmma's builds are WgmmaBuild records (issue 44): checked when made (no spec needed), the variant
    layer's config round-trips through them, the name spells their non-default fields, and what the plan, the route
    and the launch read are their properties, not tables of build names."""
    Build = wg_plans.WgmmaBuild
    for bad, match in (({"grid": "diagonal"}, "grid 'diagonal': one of chunks, parts"),
                       ({"rescale": "eager"}, "rescale 'eager': one of"), ({"seg_cost": 65}, "seg_cost 65"),
                       ({"seg_cost": True}, "seg_cost True"), ({"ablate": 4}, "ablate bits 2-4"),
                       ({"kv_source": "host"}, "kv_source 'host'")):
        with pytest.raises(SpecError, match=match):
            Build("seesaw", True, **bad)
    assert Build("seesaw", False).spell() == ("seesaw", "cpasync")     # the row gather (pages of 1 to 8)
    with pytest.raises(SpecError, match="no such knob of tree_verify_wgmma"):
        Build.from_config({"schedule": "seesaw", "tma": True, "warps": 12})
    # every build a shipped spec gets: its record, its config (the manifest's) and its name
    for spec in (kimi, find_spec("kimi-k2.6-tp8-fp8"), find_spec("deepseek-v3")):
        for kdef in (k for k in wg_plans.KERNELS[0].build_defs() + (wg_plans.KERNELS[1],) if k.builds_for(spec)):
            v = variant(kdef, spec)
            rec = kdef.build_record(spec)
            assert Build.from_config(v.config) == rec and rec.config() == v.config
            assert v.name == ".".join((kdef.kernel, *rec.spell())) and v.plan().build == rec
            assert rec.parts == (kdef.name in (wg_plans.PARTS_KERNEL, wg_plans.DEQUANT_PARTS))
            assert rec.reads_workspace == (kdef.name in (wg_plans.DEQUANT, wg_plans.DEQUANT_PARTS))
            assert v.plan().template_constants()["PARTS"] == int(rec.parts)
    # the spelling: fields after schedule and TMA, in declaration order, only where not at their defaults
    rec = Build("seesaw", True, ablate=3, grid="parts", seg_cost=4, rope_early=True, kv_source="workspace")
    assert rec.spell() == ("seesaw", "tma", "ablate3", "grid-parts", "seg-cost-4", "rope-early", "workspace")
    assert Build("lockstep", False).spell() == ("lockstep", "cpasync")
    assert not Build("lockstep", False, grid="parts").parts   # the parts grids are the seesaw's
    assert wg_plans.KNOBS == {k: v for k, v in Build("seesaw", True).config().items() if k not in ("schedule", "tma")}


def test_a_kernel_parameter_list_is_declared_once(kimi):
    """The tensor-core kernels' parameters are declared once (ops/tree_verify/params.py, a record's `params`): the rendered
    signature is that list in that order, and the launch binds its values by name (ops/tree_verify/tensor_core.bind: scalars
    as their C type's numpy type, a missing value named)."""
    import numpy as np

    from ddtree_gen.ops.tree_verify.tensor_core import bind
    from ddtree_gen.ops import all_builds
    from ddtree_gen.ops.tree_verify.params import ATTENTION, KV_MAP, SPANS
    from ddtree_gen.ops.tree_verify.params import render as render_params
    for spec in (kimi, find_spec("kimi-k2.6-tp8-fp8"), find_spec("deepseek-v3")):
        for kdef in (k for k in all_builds() if k.signature is not None and k.builds_for(spec)):
            rec = kdef.build_record(spec)
            src = render(variant(kdef, spec))
            assert f"{kdef.entry}({render_params(rec.params)}\n{{" in src, kdef.name
            names = [p.name for p in rec.params]
            assert len(set(names)) == len(names) and rec.params[:len(ATTENTION)] == ATTENTION
            assert (SPANS in rec.params) == rec.parts and (KV_MAP in rec.params) == bool(rec.tma)
    parts = by_name(wg_plans.PARTS_KERNEL).build_record(kimi)
    values = {p.name: i for i, p in enumerate(parts.params)}
    args = bind(parts.params, {**values, "unused": -1})
    assert [type(a) for a in args[7:14]] == [np.float32, np.float32] + [np.int32] * 4 + [np.int64]
    assert [int(a) for a in args] == list(range(len(parts.params)))
    del values["spans"]
    with pytest.raises(AssertionError, match="no value of kernel parameter\\(s\\) spans"):
        bind(parts.params, values)


def test_page_loads_knob(kimi):
    """page_loads "spread" (not yet measured: off by default) is a page-by-page seesaw build's (the gather, or TMA at
    pages of 16 / 32): its own name and source (a warp per page's boxes, LOAD_ARRIVALS = 64 / PAGE; the gather's lanes
    a row's chunks side by side); refused where the tiles are whole pages (page 64 TMA) and on the lockstep schedule."""
    import re
    page16 = dataclasses.replace(kimi, name="kimi-page16", page_size=16)
    page1 = dataclasses.replace(kimi, name="kimi-page1", page_size=1)
    for spec, tma in ((page16, True), (page1, False), (kimi, False)):
        serial, spread = variant(WGMMA, spec, tma=tma), variant(WGMMA, spec, tma=tma, page_loads="spread")
        assert spread.name == serial.name + ".page-loads-spread" and spread.plan().consts["SPREAD_LOADS"] == 1
        assert re.search(r"#define SPREAD 0\b", render(serial)) and re.search(r"#define SPREAD 1\b", render(spread))
        # the gather's new lanes (a row's CHUNKS chunks) or a TMA box issued per warp: only in the spread build
        mark = "const int buf = n & 1, j = wtid >> 5;" if tma else "const int c = wtid % CHUNKS, r0 = wtid / CHUNKS;"
        assert mark in render(spread) and mark not in render(serial)
    with pytest.raises(SpecError, match="page_loads 'spread' is a seesaw build's that loads its tiles page by page"):
        variant(WGMMA, kimi, page_loads="spread").plan()                      # page 64, TMA: whole-page tiles
    with pytest.raises(SpecError, match="page_loads 'spread'"):
        variant(WGMMA, page1, schedule="lockstep", tma=False, page_loads="spread").plan()
    with pytest.raises(SpecError, match="page_loads 'x': one of serial, spread, producer"):
        variant(WGMMA, page16, page_loads="x").plan()


def test_page_loads_producer(kimi):
    """page_loads "producer" (not yet measured: off by default): a third warpgroup (384 threads) loads the tiles of a
    bf16 seesaw build at any page size (the gather, TMA per page, TMA per tile at page 64), a warp per (buffer, slab
    group), behind 4 FREE mbarriers that the computing warpgroups arrive on where the other builds load (the plan's
    shared memory counts them); the computing warps load nothing. Refused on an fp8 cache's own seesaw (its third
    warpgroup converts) and on the lockstep schedule; the dequantize path's build (bf16 tiles from the workspace) takes
    it."""
    import re
    page16 = dataclasses.replace(kimi, name="kimi-page16", page_size=16)
    page1 = dataclasses.replace(kimi, name="kimi-page1", page_size=1)
    for spec, tma in ((page16, True), (page1, False), (kimi, False), (kimi, True)):
        for grid in ("chunks", "parts"):
            serial = variant(WGMMA, spec, tma=tma, grid=grid)
            prod = variant(WGMMA, spec, tma=tma, grid=grid, page_loads="producer")
            assert prod.name == serial.name + ".page-loads-producer"
            ps, pp = serial.plan(), prod.plan()
            assert (pp.value(pp.threads), ps.value(ps.threads)) == (384, 256)
            assert pp.value(pp.dynamic_smem) == ps.value(ps.dynamic_smem) + 6 * 8
            assert pp.consts["PRODUCER_LOADS"] == 1 and ps.consts["PRODUCER_LOADS"] == 0
            src, ser = render(prod), render(serial)
            assert re.search(r"#define PRODUCER 1\b", src) and re.search(r"#define PRODUCER 0\b", ser)
            # the computing warps free the groups (4 sites), never load; the producer's warps wait on FREE
            assert src.count("release(") == 4 and "load_slabs(" not in src and "load_slabs(" in ser
            assert "mbar_wait(pfree" in src and "pfree" not in ser
            assert "setmaxnreg.inc.sync.aligned.u32 224" in src and "setmaxnreg.dec.sync.aligned.u32 56" in src
    fp8 = dataclasses.replace(kimi, name="kimi-page1-fp8", page_size=1, kv_dtype="fp8_e4m3")
    with pytest.raises(SpecError, match="page_loads 'producer' is a bf16 tile build's"):
        variant(WGMMA, fp8, tma=False, page_loads="producer").plan()
    dq = variant(WGMMA, fp8, tma=False, rope_early=True, s_order="slab", kv_source="workspace", page_loads="producer")
    assert dq.plan().value(dq.plan().threads) == 384 and "#define FP8 0" in render(dq)
    with pytest.raises(SpecError, match="page_loads 'producer' is the seesaw's"):
        variant(WGMMA, page1, schedule="lockstep", tma=False, page_loads="producer").plan()


def test_default_page_loads_policy(kimi, monkeypatch):
    """The default builds' page_loads come from wgmma.DEFAULT_PAGE_LOADS by how a build loads its tiles (the gather, a
    box per page, a box per tile): "serial" everywhere until the others are measured. Set to "producer", a bf16 spec's
    default, parts and dequantize builds take it and a fused fp8 build keeps "serial"; the default's name then spells
    it."""
    from ddtree_gen.ops.tree_verify import wgmma
    page1 = dataclasses.replace(kimi, name="kimi-page1", page_size=1)
    page16 = dataclasses.replace(kimi, name="kimi-page16", page_size=16)
    fp8 = dataclasses.replace(kimi, name="kimi-page1-fp8", page_size=1, kv_dtype="fp8_e4m3")
    assert set(wgmma.DEFAULT_PAGE_LOADS.values()) == {"serial"}
    assert [wgmma.loads_kind(s, wgmma.seesaw_tma(s)) for s in (page1, page16, kimi)] == ["gather", "tma_pages",
                                                                                          "tma_tiles"]
    for spec in (page1, page16, kimi, fp8):
        assert wgmma.default_build(spec).page_loads == "serial"
    monkeypatch.setitem(wgmma.DEFAULT_PAGE_LOADS, "gather", "producer")
    assert wgmma.variant_config(page1)["page_loads"] == "producer"
    assert wgmma.parts_config(page1)["page_loads"] == "producer"
    assert wgmma.dequant_config(fp8)["page_loads"] == "producer"         # bf16 tiles from the workspace
    assert wgmma.variant_config(fp8)["page_loads"] == "serial"           # the fused fp8 build's converter
    assert wgmma.variant_config(page16)["page_loads"] == "serial"        # another kind of loads
    assert variant(WGMMA, page1).name.endswith(".page-loads-producer")
    monkeypatch.setitem(wgmma.DEFAULT_PAGE_LOADS, "tma_tiles", "spread")   # not a whole-tile build's: serial
    assert wgmma.variant_config(kimi)["page_loads"] == "serial" and variant(WGMMA, kimi).plan()

"""`ddtree-gen bench tree_verify --sweep / --pages` without a GPU: the drawn shapes (deterministic per seed, Nq
weighted to the node budgets engines run, single requests to 256k keys), the --pages argument, the specs and shapes
it runs, and what the route runs at each page size (docs/engine.md "Page sizes")."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ddtree_gen import cli
from ddtree_gen.bench import shapes
from ddtree_gen.bench import tree_verify as bench_tv
from ddtree_gen.bench.specs import page_variant
from ddtree_gen.errors import DdtreeError, SpecError
from ddtree_gen.ops.tree_verify.which import which_kernel
from ddtree_gen.ops.tree_verify.wgmma import PARTS_KERNEL, seesaw_tma, uses_tma
from ddtree_gen.spec import MAX_PAGE_SIZE, find_spec
from test_archs import fake_devices, fake_set  # noqa: F401  (fake_devices: a fixture)


def test_a_seed_gives_the_same_draw():
    assert shapes.draw(23, 30) == shapes.draw(23, 30)
    assert shapes.draw(23, 30) != shapes.draw(24, 30)
    assert shapes.draw(23, 30)[:10] == shapes.draw(23, 10)          # a longer draw starts with the shorter one


def test_nq_is_weighted_to_the_practical_budgets():
    """Nq in 16..65 always, both ends reached; about NQ_PRACTICAL_P + (1 - NQ_PRACTICAL_P) * 21/50 = 0.855 of the
    draws in 20..40 (uniform would give 0.42), and the rest of the range still drawn."""
    nqs = np.array([s.nq for s in shapes.draw(7, 4000)])
    assert nqs.min() == 16 and nqs.max() == 65
    share = np.mean((nqs >= 20) & (nqs <= 40))
    assert 0.82 <= share <= 0.89, share
    assert np.mean(nqs > 40) > 0.05 and np.mean(nqs < 20) > 0.01
    rng = np.random.default_rng(0)
    assert all(shapes.NQ_RANGE[0] <= shapes.draw_nq(rng) <= shapes.NQ_RANGE[1] for _ in range(1000))


def test_single_requests_reach_256k_keys():
    """The single class draws up to 256k keys (within MAX_FLOPS for every H: never scaled down), the batched classes
    as before (128k; 16k for ragged-many); every length at least MIN_KEYS, every draw within MAX_FLOPS."""
    single = shapes.draw(11, 400, classes=("single",))
    lens = np.array([s.lens[0] for s in single])
    assert all(s.b == 1 for s in single) and lens.max() <= 262144 and lens.min() >= shapes.MIN_KEYS
    assert np.mean(lens > 131072) > 0.05                      # log-uniform: log(2) / log(256) = 1/8 above 128k
    assert shapes.flops(128, 65, [262144]) <= shapes.MAX_FLOPS
    for s in shapes.draw(12, 400):
        assert max(s.lens) <= shapes.MAX_KEYS[s.cls] and min(s.lens) >= shapes.MIN_KEYS
        assert shapes.flops(s.h, s.nq, s.lens) <= shapes.MAX_FLOPS * 1.01 or min(s.lens) == shapes.MIN_KEYS
    assert {s.cls for s in shapes.draw(12, 400)} == set(shapes.CLASSES)


def test_pages_argument():
    parse = cli.build_parser().parse_args
    assert parse(["bench", "tree_verify", "--pages", "1,16,64"]).pages == (1, 16, 64)
    assert parse(["bench", "tree_verify", "--pages", "64"]).pages == (64,)
    assert parse(["bench", "tree_verify", "--sweep"]).pages is None


@pytest.mark.parametrize("bad", ["", "1,,64", "1,x,64", "0,16", "-1", "16,16", f"{MAX_PAGE_SIZE + 1}", "1.5"])
def test_bad_pages_are_refused_first(bad, capsys):
    """A bad --pages value is an argparse error (exit 2) naming the value and what is expected, before any GPU."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["bench", "tree_verify", "--pages", bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --pages: {bad!r}" in err
    assert f"distinct page sizes separated by commas, each an integer in [1, {MAX_PAGE_SIZE}]" in err


def test_pages_is_tree_verify_s():
    args = cli.build_parser().parse_args(["bench", "tree_build", "--pages", "1,64"])
    with pytest.raises(DdtreeError, match="--pages is bench tree_verify's"):
        cli.cmd_bench(args)


def test_page_variant():
    """Page 64: the shipped spec itself (its builds in generated/); another size: a spec made in code with only the
    page size (and the name) changed; a bad one: the spec's own SpecError naming page_size."""
    for name in bench_tv.PAGE_BASES:
        base = find_spec(name)
        assert page_variant(base, base.page_size) is base
        for page in (1, 16):
            v = page_variant(base, page)
            assert v.name == f"{name}-page{page}" and v.page_size == page
            assert dataclasses.replace(v, name=base.name, page_size=base.page_size) == base
    with pytest.raises(SpecError, match="page_size"):
        page_variant(find_spec("kimi-k2.6-tp8"), 0)


def test_page_shapes():
    """The issue's four shapes at Nq = 65 with the base's H, then PAGE_DRAWN drawn shapes of the base's H: the same
    for every run of a seed, and H = 8 and the larger base among the bases."""
    heads = sorted(find_spec(n).num_heads for n in bench_tv.PAGE_BASES)
    assert heads[0] == 8 and heads[-1] > 8
    base = find_spec("kimi-k2.6-tp8")
    got = bench_tv.page_shapes(base, 3)
    assert got == bench_tv.page_shapes(base, 3) and len(got) == len(bench_tv.PAGE_SHAPES) + bench_tv.PAGE_DRAWN
    assert [(s.b, s.nq, s.lens) for s in got[:4]] == [(1, 65, (4096,)), (1, 65, (65536,)), (8, 65, (4096,) * 8),
                                                      (8, 65, (30000, 2000, 9000, 500, 12000, 4000, 700, 60000))]
    assert all(s.h == 8 for s in got)


@pytest.mark.parametrize("page", [1, 2, 8, 16, 32, 64, 128])
def test_what_each_page_size_takes(page, fake_devices):  # noqa: F811
    """docs/engine.md "Page sizes", read from the route on an H200 (fake device 0) for H = 8 and 64: the seesaw at every
    page size, its key tiles by TMA where a page holds whole tiles or a tile whole pages of 16 or 32 keys, else gathered
    row by row (cp.async); the chunks grid at B = 1, the parts grid at B = 8 over 64k keys. An fp8 spec: the dequantize
    path at every page size. (A kernel change that moves these changes that table too.)"""
    tma = page % 64 == 0 or page in (16, 32)
    for name in bench_tv.PAGE_BASES:
        spec = page_variant(find_spec(name), page)
        ks = fake_set(spec)
        assert seesaw_tma(spec) == tma and uses_tma(spec) == (page % 64 == 0)   # (uses_tma: the lockstep's rule)
        for b, keys in ((1, 4096), (8, 4096), (8, 65536)):
            pages = -(-(keys + 65) // page)
            choice = which_kernel(ks, b, 65, pages, device=0)
            plan = ks.tree_verify_schedule(b, 65, pages, device=0)
            assert choice.schedule == "seesaw", (name, page, b, keys)
            assert plan.kernel == choice.kernel
            if b == 1:
                assert plan.grid == "chunks" and plan.kernel == "tree_verify_wgmma"
            if keys == 65536:
                assert plan.grid == "parts" and plan.kernel == PARTS_KERNEL
    fp8 = page_variant(find_spec("kimi-k2.6-tp8-fp8"), page)
    choice = which_kernel(fake_set(fp8), 8, 65, -(-4161 // page), device=0)
    assert (choice.fp8_path, choice.schedule) == ("dequant", "seesaw")


def test_documented_commands_parse():
    """Every `ddtree-gen bench tree_verify ...` command of docs/benchmarks.md and docs/engine.md (the comment cut
    off) is one the command line takes; --sweep and --pages among them."""
    import re
    import shlex
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    found = []
    for doc in ("docs/benchmarks.md", "docs/engine.md"):
        for line in (root / doc).read_text().splitlines():
            m = re.match(r"\s*(ddtree-gen bench tree_verify[^#]*)", line)
            if m:
                argv = shlex.split(m[1].replace("DIR", "out"))[1:]
                args = cli.build_parser().parse_args(argv)
                found.append((doc, args.sweep, args.pages))
    assert any(s for _, s, _ in found) and any(p == (1, 16, 64) for _, _, p in found)
    assert {d for d, _, _ in found} == {"docs/benchmarks.md", "docs/engine.md"}


def test_kernels_are_compiled_together(monkeypatch, capsys):
    """run() compiles every variant either mode loads in one build_variants call, each once (the shipped page-64
    spec is in both lists), says what each spec's compiles cost, and raises a variant's build error."""
    from ddtree_gen.build import artifacts
    calls = []

    def fake(vs):
        calls.append(vs)
        return [artifacts.Built(v, "", "k", b"", None, "compiled" if "page" in v.spec.name else "cached", 2.0)
                for v in vs]
    monkeypatch.setattr(artifacts, "build_variants", fake)
    args = cli.build_parser().parse_args(["bench", "tree_verify", "--sweep", "--pages", "1,64", "--count", "6"])
    builds = bench_tv._sweep_builds(args) + bench_tv._page_builds(args)
    bench_tv._build_together(builds)
    (vs,) = calls
    assert len(vs) == len(set(vs)) and {v.spec.name for v in vs} >= {"kimi-k2.6-tp8", "kimi-k2.6-tp8-page1"}
    assert {v.kernel.kernel for v in vs if v.spec.name == "kimi-k2.6-tp8-page1"} <= set(bench_tv.VERIFY_KERNELS)
    out = capsys.readouterr().out
    n = sum(v.spec.name == "kimi-k2.6-tp8-page1" for v in vs)
    assert f"kimi-k2.6-tp8-page1: {n} variants, {2.0 * n:.1f} s of compiles" in out and "kimi-k2.6-tp8:" not in out
    monkeypatch.setattr(artifacts, "build_variants", lambda vs: [SpecError("no such build")] * len(vs))
    with pytest.raises(SpecError, match="no such build"):
        bench_tv._build_together(builds)


def test_an_fp8_spec_off_the_seesaw_says_why_it_has_no_dequantize_path(fake_devices):  # noqa: F811
    """An fp8 spec the seesaw cannot take (R = 256: the dequantize path's builds are the seesaw's) gets no build of the
    dequantize path: fp8_path=None takes the fused kernel and says why, and fp8_path="dequant" is refused naming the
    build and the reason (not a crash)."""
    from ddtree_gen.errors import ArgumentError
    from ddtree_gen.spec import make_spec
    fp8 = make_spec("fp8-r256", 8, 256, 64, page_size=64, max_tree_size=65, max_depth=15, kv_dtype="fp8_e4m3")
    ks = fake_set(fp8)
    choice = which_kernel(ks, 8, 65, 66, device=0)
    assert choice.fp8_path == "fused" and "not built for spec" in choice.reason, choice
    with pytest.raises(ArgumentError, match="fp8_path: 'dequant': .*not built for spec"):
        which_kernel(ks, 8, 65, 66, device=0, fp8_path="dequant")

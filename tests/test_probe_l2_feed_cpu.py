"""scripts/probe_l2_feed.py without a GPU (issue 45's feed probe): its CUDA source compiles for sm_90a with NVRTC, the
arithmetic of a key tile and of what the compute needs, a row's rates from per-CTA records, the table, and its
argument checks."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_l2_feed.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_l2_feed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["probe_l2_feed"] = mod      # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_tile_arithmetic(probe):
    assert probe.TILE_BYTES == 64 * 576 * 2 == 73728
    assert probe.TILE_FLOP == 2 * 64 * 64 * 576 + 2 * 64 * 64 * 512 == 8912896
    # 989 TFLOP/s = 132 SMs x 4096 FLOP/clk at 1.83 GHz: the issue's ~34 B/clk/SM, and 660 TFLOP/s -> ~5.5 TB/s
    need = probe.needed_rates(989.0, 132, 989e12 / (132 * 4096) / 1e9)
    assert need["b_per_clk_sm"] == pytest.approx(73728 * 4096 / 8912896) == pytest.approx(33.88, abs=0.01)
    assert probe.needed_rates(660.0, 132, 1.83)["chip_tb_s"] == pytest.approx(5.46, abs=0.01)


def _records(ctas, ghz, start_ns, window_ns, sms=132):
    # smid, clock at start and end, globaltimer at start and end, rank
    return [[b % sms, 1000, 1000 + int(window_ns * ghz), start_ns, start_ns + window_ns, 0] for b in range(ctas)]


def test_summarize_rates(probe):
    cfg = probe.Config("x", "l2", cluster=2, mcast=True)
    row = probe.summarize(cfg, _records(132, 1.8, 5000, 1_000_000), 100, 1.1)
    chip = 132 * 100 * 73728 / 1e-3
    assert row["chip_tb_s"] == pytest.approx(chip / 1e12)
    assert row["sm_gb_s"] == pytest.approx(chip / 132 / 1e9)
    assert row["b_per_clk_sm"] == pytest.approx(chip / 132 / 1.8e9, rel=1e-6)
    assert row["l2_read_tb_s"] == pytest.approx(chip / 2 / 1e12)          # multicast: each tile read once per pair
    assert row["tflops_allowed"] == pytest.approx(chip / 73728 * 8912896 / 1e12)
    assert row["co_resident"] and row["ctas_per_sm_max"] == 1 and row["event_us"] == pytest.approx(1100)
    two = probe.summarize(probe.Config("y", "l2", per_sm=2), _records(264, 1.8, 0, 1_000_000), 50, 1.0)
    assert two["sms"] == 132 and two["ctas_per_sm_max"] == 2 and two["l2_read_tb_s"] == two["chip_tb_s"]
    assert row["math_busy"] is None
    # a consumer holding each box 242 clocks: 100 tiles x 9 boxes x 242 of 1.8 M clocks
    held = probe.summarize(probe.Config("h", "l2", hold=probe.HOLD_PEAK), _records(132, 1.8, 0, 1_000_000), 100, 1.0)
    assert probe.HOLD_PEAK == 242 and probe.HOLD_660 == 363 and held["math_busy"] == pytest.approx(217800 / 1.8e6)
    assert "math busy 12 % of the time" in probe.table([dict(held, check=True)], 660.0, 989.0, 132, 1.8, "H100")
    # a second wave: some CTA starts after another has ended
    late = _records(4, 1.8, 0, 1000) + _records(1, 1.8, 5000, 1000)
    assert not probe.summarize(cfg, late, 10, 0.01)["co_resident"]
    with pytest.raises(RuntimeError, match="window"):
        probe.summarize(cfg, [[0, 0, 0, 7, 7, 0]], 10, 0.01)


def test_table_names_the_lower_limit(probe):
    slow = probe.summarize(probe.Config("1 CTA/SM, ring 2 tiles (seesaw)", "l2"),
                           _records(132, 1.8, 0, 1_000_000), 500, 1.0)   # 4.9 TB/s: below 660 TFLOP/s' 5.5
    fast = probe.summarize(probe.Config("cluster 2, multicast", "l2", 2, True),
                           _records(132, 1.8, 0, 1_000_000), 1500, 1.0)
    text = probe.table([dict(slow, check=True), dict(fast, check=False),
                        dict(config="cluster 4, multicast", error="only 0 CTA(s) fit")], 660.0, 989.0, 132, 1.8, "H100")
    lines = text.splitlines()
    assert any(l.startswith("1 CTA/SM, ring 2 tiles (seesaw)") and " 4.87 " in l and " 588 " in l for l in lines)
    assert "DATA CHECK FAILED" in text and "only 0 CTA(s) fit" in text
    assert "1 CTA/SM, ring 2 tiles (seesaw): feed allows 588 TFLOP/s vs 660 measured peak" in text
    assert "lower is the feed" in text
    assert "cluster 2, multicast: feed" not in text      # a row whose data check failed is not concluded from
    assert "needs 33.9 B/clk/SM" in text


def test_arguments(probe):
    assert probe.parse(["--out", "d"]).hbm_gb == 1.5
    for bad in (["--reps", "1"], ["--out", "d", "--reps", "0"], ["--out", "d", "--hbm-gb", "0.1"],
                ["--out", "d", "--only", "no such row"], ["--out", "d", "--peak-tflops", "0"]):
        with pytest.raises(SystemExit):
            probe.parse(bad)
    assert probe.parse(["--out", "d", "--only", "multicast"]).only == ["multicast"]
    assert all(c.smem() <= probe.MAX_SMEM for c in probe.CONFIGS)


def test_ncu_command_profiles_the_third_call(probe):
    cmd = probe.ncu_command("ncu", ["a.sum", "b.pct"])
    assert cmd[cmd.index("--launch-skip") + 1] == "2" and cmd[cmd.index("--metrics") + 1] == "a.sum,b.pct"
    assert cmd[-1] == "--ncu-target" and cmd[-2].endswith("probe_l2_feed.py")


def test_source_compiles_for_sm_90a(probe):
    pytest.importorskip("cupy")
    built = probe.compile_probe()
    ptx = built.ptx.decode()
    assert set(built.reports) == {*probe.ENTRIES.values(), "fill_words"}
    assert ptx.count("multicast::cluster") == 2 and ".reqnctapercluster 4, 1, 1" in ptx
    assert all(r.spill_stores == 0 for r in built.reports.values())


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def _fake_probe(probe, corrupt=False):
    """Probe.run's host side over a stand-in device: launch() does what the CUDA source does (CTA b streams tiles
    (b // gsize * gstride + i) mod n_src, its consumers sum every word `reads` times), in numpy."""
    import types
    import numpy as np
    cp = types.SimpleNamespace(zeros=np.zeros, asnumpy=np.asarray, uint64=np.uint64, uint32=np.uint32,
                               cuda=types.SimpleNamespace(Stream=_Stream, Event=_Event,
                                                          get_elapsed_time=lambda a, b: 2.0))
    p = probe.Probe.__new__(probe.Probe)
    p.cp, p.sms, p.fn, p.launches = cp, 132, {k: k[0] for k in probe.ENTRIES}, []   # a "function": its cluster size
    p.blocks_per_sm = lambda fn, smem: 3 if smem > 60000 else 4
    p.max_clusters = lambda fn, grid, smem: 32 if fn == 4 else grid // fn   # 32 clusters of 4 co-resident, not 33

    def launch(cfg, grid, words, n_src, tiles, gstride, reads, hold, rec, sums, stream):
        p.launches.append((cfg.name, grid, tiles, gstride))
        for b in range(grid):
            t = [(b // (cfg.share or cfg.cluster) * gstride + i) % n_src for i in range(tiles)]
            sums[b] = (int(words[t].sum()) * reads + (b == 5 and corrupt)) % (1 << 32)
            rec[b] = [b % p.sms, 0, 1_800_000, 0, 1_000_000, b % cfg.cluster]
    p.launch = launch
    return p


def test_run_checks_each_ctas_tiles(probe):
    import numpy as np
    words = np.random.default_rng(3).integers(0, 2**32, 64, dtype=np.uint64)   # one "sum" per tile
    src = (words, words % (1 << 32))
    p = _fake_probe(probe)
    by_name = {c.name: c for c in probe.CONFIGS}
    row = p.run(by_name["1 CTA/SM, ring 2 tiles (seesaw)"], src, 3, 1500)
    assert row["check"] and row["ctas"] == 132 and row["tiles_per_cta"] == 1500 and len(row["spread_tb_s"]) == 3
    # the check launch: 3 x 18 / 9 + 5 = 11 tiles (every stage reused), the tiles of CTA b from b x 7
    assert p.launches[0] == ("1 CTA/SM, ring 2 tiles (seesaw)", 132, 11, 7)
    row = p.run(by_name["cluster 4, multicast"], src, 1, 1500)
    assert row["check"] and row["ctas"] == 128 and row["l2_read_tb_s"] == pytest.approx(row["chip_tb_s"] / 4)
    assert p.run(by_name["4 CTA/SM, ring 2/3 tile each"], src, 1, 1500)["tiles_per_cta"] == 375
    assert p.run(by_name["1 SM alone, ring 2 tiles"], src, 1, 1500)["ctas"] == 1
    big = np.random.default_rng(4).integers(0, 2**32, 20345, dtype=np.uint64)   # 1.5 GB of tiles
    hbm = p.run(by_name["HBM, cluster 2, multicast"], (big, big), 1, 1500)
    assert hbm["check"] and hbm["ctas"] == 132 and hbm["tiles_per_cta"] == 20345 // 66   # each tile once per launch
    assert "too small" in p.run(by_name["HBM, 1 CTA/SM, ring 2 tiles"], src, 1, 1500)["error"]
    shared = p.run(by_name["HBM, 9 CTAs share each tile (64k keys)"], (big, big), 1, 1500)
    assert shared["check"] and shared["ctas"] == 126 and shared["tiles_per_cta"] == 20345 // 14
    assert p.launches[-1][1:] == (126, 20345 // 14, 20345 // 14)       # 14 groups of 9, each its own range
    assert not _fake_probe(probe, corrupt=True).run(by_name["cluster 2, own copies"], src, 1, 1500)["check"]
    p.blocks_per_sm = lambda fn, smem: 1
    assert p.run(by_name["2 CTA/SM, ring 1 tile each"], src, 1, 1500)["error"] == "only 1 CTA(s) of 73872 B fit an SM"

"""`bench draft_topk` without a GPU: its table's columns (the floor is a read-only kernel's time, with its read rate),
a row's arithmetic, and the read-only kernel compiled by NVRTC (registers, no spills)."""
from __future__ import annotations

from ddtree_gen.build import compile as nvrtc_compile
from ddtree_gen.bench import draft_topk as bench


def test_header_names_the_read_only_floor():
    assert bench.HEADER == ["V", "B", "rows", "MB", "floor us", "read GB/s", "ours us", "% floor", "torch us",
                            "torch % floor", "speedup", "checked"]


def test_row_is_floor_over_time():
    # 64 x 15 rows of V = 129280 bf16 (248.2 MB): a floor of 60.0 us (4137 GB/s read), ours 108.8 us, torch 900 us
    nbytes = 64 * 15 * 129280 * 2
    row = bench.table_row(129280, 64, 15, nbytes, 60.0, 108.8, 900.0, True)
    assert len(row) == len(bench.HEADER)
    got = dict(zip(bench.HEADER, row))
    assert got["rows"] == 960 and got["MB"] == "248.2" and got["floor us"] == "60.0"
    assert got["read GB/s"] == "4137"                               # 248.2 MB / 60 us
    assert got["% floor"] == "55%" and got["torch % floor"] == "7%" and got["speedup"] == "8.3x"
    assert got["checked"] == "yes"
    assert dict(zip(bench.HEADER, bench.table_row(129280, 1, 15, 15 * 129280 * 2, 3.0, 50.0, 60.0, False)))[
        "checked"] == "NO"


def test_read_only_kernel_compiles_without_spills():
    result = nvrtc_compile.compile_source(bench.READ_ONLY_SRC, "read_once.cu", ["read_once"])
    r = result.reports["read_once"]
    assert r.registers > 0 and r.spill_stores == 0 and r.stack == 0 and r.smem == 0

"""`ddtree-gen bench arch` without a GPU: the command line knows it, its shapes, what it reports each kernel
set ran (kernel sets on fake devices, as in test_archs.py), and the clear errors before any GPU work."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddtree_gen import cli
from ddtree_gen import spec as SPEC_MODULE
from ddtree_gen.bench import arch as bench_arch
from ddtree_gen.ops.tree_verify.launch import why_not
from ddtree_gen.errors import DdtreeError
from ddtree_gen.spec import find_spec, parse_spec
from test_archs import VALID, fake_devices, fake_set  # noqa: F401  (fake_devices: a fixture)


def test_cli_knows_bench_arch(capsys):
    assert "arch" in cli.BENCHES
    args = cli.build_parser().parse_args(["bench", "arch", "--spec", "kimi-k2.6-tp8", "--out", "somewhere"])
    assert args.func is cli.cmd_bench and args.kernels == ["arch"]
    assert args.spec == ["kimi-k2.6-tp8"] and args.out == "somewhere"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--help"])
    assert "arch" in capsys.readouterr().out


def test_verify_shapes():
    """The issue's shapes: B = 1 and 8 with the spec's H, B = 8 with H = 64; no repeats."""
    assert bench_arch.verify_shapes(find_spec("kimi-k2.6-tp8")) == [(1, 8), (8, 8), (8, 64)]
    assert bench_arch.verify_shapes(find_spec("kimi-k2.6")) == [(1, 64), (8, 64)]
    assert bench_arch.verify_shapes(find_spec("deepseek-v3")) == [(1, 128), (8, 128), (8, 64)]


def test_what_each_set_ran(fake_devices):  # noqa: F811
    """On an H200 (fake device 0): the default set runs wgmma (auto) and everything else as sm_90a cubins, the
    set forced to sm_80 runs mma.sync (auto) and the sm_80 PTX; an fp8 spec forced to sm_80 has no mma.sync
    kernels: auto is the CUDA-core kernel and impl="mma" is skipped, saying why."""
    kimi = find_spec("kimi-k2.6-tp8")
    default, forced = fake_set(kimi), fake_set(kimi, arch="sm_80")
    assert [bench_arch.ran(default, "tree_verify", 0, impl) for impl in ("auto", "mma")] == \
        ["wgmma (sm_90a)", "mma (sm_90a)"]
    assert [bench_arch.ran(forced, "tree_verify", 0, impl) for impl in ("auto", "mma")] == \
        ["mma (sm_80)", "mma (sm_80)"]
    assert [bench_arch.ran(ks, k, 0) for ks in (default, forced) for k in ("tree_build", "kv_commit")] == \
        ["sm_90a", "sm_90a", "sm_80", "sm_80"]
    assert all(why_not(ks, impl, 0) is None for ks in (default, forced) for impl in ("auto", "mma"))
    fp8 = find_spec("kimi-k2.6-tp8-fp8")
    default8, forced8 = fake_set(fp8), fake_set(fp8, arch="sm_80")
    assert bench_arch.ran(default8, "tree_verify", 0, "auto") == "wgmma (sm_90a)"
    assert bench_arch.ran(forced8, "tree_verify", 0, "auto") == "simple (sm_80)"
    assert "tree_verify_mma" in why_not(forced8, "mma", 0)


def test_no_gpu_is_a_clear_error(monkeypatch):
    """Without a usable GPU the bench stops with a DdtreeError (the CLI prints it, exit 2), not a traceback."""
    import cupy

    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_device)
    with pytest.raises(DdtreeError, match="bench arch runs on a GPU.*cudaErrorNoDevice"):
        bench_arch.run(SimpleNamespace(spec=None, out=None))


def test_spec_without_sm80_is_refused_first(monkeypatch):
    only90 = parse_spec(dict(VALID, archs=["sm_90a"]), "t.toml")
    monkeypatch.setattr(SPEC_MODULE, "find_spec", lambda name: only90)
    with pytest.raises(DdtreeError, match="not built for sm_80"):
        bench_arch.run(SimpleNamespace(spec=["t"], out=None))


def test_graph_time_below_the_peak_is_refused(monkeypatch):
    """A CUDA-graph time faster than the call's FLOPs at the measured peak is measured again, and a second
    such time raises instead of becoming a table row (bench tree_verify / kv-dtype)."""
    from ddtree_gen.bench import timing as bench
    times = iter([0.001, 0.5])
    monkeypatch.setattr(bench, "graph_time_ms", lambda fn, **kw: next(times))
    assert bench.checked_graph_time_ms(None, "x", 0.1) == 0.5          # re-measured, plausible
    times = iter([0.2])
    assert bench.checked_graph_time_ms(None, "x", 0.1) == 0.2          # plausible at once
    times = iter([0.001, 0.002])
    with pytest.raises(RuntimeError, match="not a measurement"):
        bench.checked_graph_time_ms(None, "x", 0.1)


def test_every_bench_is_one_module_with_run():
    """`ddtree-gen bench NAME` runs ddtree_gen.bench.<NAME> (kv-dtype: kv_dtype): one module per benchmark, each
    with run(args); importing them needs no GPU."""
    import importlib
    for name in cli.BENCHES:
        module = importlib.import_module(f"ddtree_gen.bench.{name.replace('-', '_')}")
        assert callable(module.run), name

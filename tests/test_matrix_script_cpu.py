"""The device-run scripts of this session on the CPU: scripts/gpu_matrix.sh, the matrix runner, on stand-in test files
(BUILD=0: no kernel is built), and scripts/probe_overlap_dequant.py's refusals without a GPU.

gpu_matrix.sh collects the gpu-marked tests, deals them to JOBS pytest processes, and must fail where a test fails,
where a test module does not import, and on a bad JOBS; the summary names every process and sums the skips by reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_matrix.sh"

STAND_IN = '''
    import pytest

    @pytest.mark.gpu
    @pytest.mark.parametrize("i", range(5))
    def test_passes(i):
        assert i < 5

    @pytest.mark.gpu
    def test_skips():
        pytest.skip("a stand-in skip reason")

    @pytest.mark.gpu
    def test_skips_too():
        pytest.skip("a stand-in skip reason")

    def test_not_gpu_marked():
        raise AssertionError("the matrix runs gpu-marked tests only")
'''


def _run(tmp_path, files: dict, jobs="2", build="0"):
    tests = tmp_path / "stand_in_tests"
    tests.mkdir(exist_ok=True)
    (tests / "conftest.py").write_text('def pytest_configure(config):\n'
                                       '    config.addinivalue_line("markers", "gpu: a stand-in")\n')
    for name, text in files.items():
        (tests / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "JOBS": jobs, "BUILD": build, "OUT": str(tmp_path / "out"),
           "DDTREE_GEN_CACHE": str(tmp_path / "cache")}
    # run from the stand-in folder, as the device runs it from the checkout: the collected ids are relative to it
    return subprocess.run(["bash", str(SCRIPT), "."], capture_output=True, text=True, timeout=300, cwd=tests, env=env)


def test_gpu_tests_dealt_to_processes_and_summed(tmp_path):
    r = _run(tmp_path, {"test_stand_in.py": STAND_IN}, jobs="3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "7 tests collected" in r.stdout
    logs = sorted((tmp_path / "out").glob("gpu-tests-*.log"))
    assert [p.name for p in logs] == ["gpu-tests-0.log", "gpu-tests-1.log", "gpu-tests-2.log"]
    for j in range(3):
        assert f"--- process {j} (gpu-tests-{j}.log)" in r.stdout
    # round-robin (id n, from 1, to process n mod 3): 7 ids over 3 processes run 2, 3 and 2 tests, never the test
    # without the gpu marker
    runs = [p.read_text().strip().splitlines()[-1] for p in logs]
    counted = [sum(int(w) for w, nxt in zip(line.split(), line.split()[1:]) if nxt.rstrip(",") in ("passed", "skipped"))
               for line in runs]
    assert counted == [2, 3, 2], runs
    assert "     2  a stand-in skip reason" in r.stdout, r.stdout
    assert "test_not_gpu_marked" not in "".join(p.read_text() for p in logs)
    assert all((tmp_path / "out" / f"gpu-junit-{j}.xml").exists() for j in range(3))


def test_more_processes_than_tests(tmp_path):
    r = _run(tmp_path, {"test_stand_in.py": STAND_IN}, jobs="9")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("(no tests: fewer tests than processes)") == 2   # 7 ids, 9 processes


def test_a_failing_test_fails_the_matrix(tmp_path):
    failing = STAND_IN + '''
    @pytest.mark.gpu
    def test_fails():
        assert 1 == 2, "a stand-in failure"
'''
    r = _run(tmp_path, {"test_stand_in.py": failing}, jobs="2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stdout and "test_fails" in r.stdout, r.stdout


def test_a_module_that_does_not_import_fails_the_matrix(tmp_path):
    broken = "import a_module_that_is_not_there\n" + textwrap.dedent(STAND_IN)
    r = _run(tmp_path, {"test_stand_in.py": STAND_IN, "test_broken.py": broken}, jobs="2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "collecting the gpu tests failed" in r.stdout and "a_module_that_is_not_there" in r.stdout, r.stdout
    assert not list((tmp_path / "out").glob("gpu-tests-*.log"))   # nothing ran


@pytest.mark.parametrize("jobs", ["0", "00", "x", "-1", "2.5"])
def test_bad_jobs_refused_before_anything_runs(tmp_path, jobs):
    r = _run(tmp_path, {"test_stand_in.py": STAND_IN}, jobs=jobs, build="1")
    assert r.returncode == 2 and f"JOBS={jobs}, expected a positive integer" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()   # refused before the build and before $OUT is made


def test_probe_overlap_dequant_without_a_gpu():
    """scripts/probe_overlap_dequant.py (an H200 probe): a bad --shapes value is refused first (exit 2, naming it);
    without a GPU, one line naming what it needs and exit 2."""
    from ddtree_gen.needs import gpu_problem
    script = ROOT / "scripts" / "probe_overlap_dequant.py"
    for shape, word in (("8x4096", "expected B,L"), ("0,4096", "B >= 1")):
        bad = subprocess.run([sys.executable, str(script), "--shapes", shape], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert bad.returncode == 2 and f"--shapes: {shape!r}" in bad.stderr and word in bad.stderr, bad.stderr
    if gpu_problem() is None:
        pytest.skip("a CUDA GPU is here: the probe would run (it is run by hand on the device)")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and len(run.stdout.splitlines()) == 1, run.stdout + run.stderr
    assert run.stdout.startswith("probe_overlap_dequant.py needs a CUDA GPU"), run.stdout


def test_device_queue_runs_its_steps_under_a_deadline(tmp_path):
    """scripts/device_queue.sh (the measurements waiting for a GPU): --help prints its step list; each step's exit
    status and time land in the table printed last, an unknown step fails its row, and a step with no time left
    before DEADLINE is not started (it says so) rather than cut off."""
    script = ROOT / "scripts" / "device_queue.sh"
    h = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert h.returncode == 0 and "prebuild" in h.stdout and "compare_loads.py" in h.stdout, h.stdout + h.stderr
    env = dict(os.environ, OUT=str(tmp_path / "out"), STEPS="bogus bogus", DEADLINE="60")
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    rows = r.stdout.splitlines()[-2:]
    assert all(row.split()[:3] == ["bogus", "rc", "1"] for row in rows), r.stdout
    assert "unknown step bogus" in (tmp_path / "out" / "bogus.log").read_text()
    env["DEADLINE"] = "5"
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.stdout.splitlines()[-1].split()[:3] == ["bogus", "no", "time"], r.stdout

"""A user's first hour (issue 19), CPU only: a spec of one's own never writes generated/, `build --check`
with spec names checks those, another NVRTC leaves the manifests alone, the layout of an installed
wheel, and the small things of the command line (--version, `list | head`, the list's columns, locks).

Every build works on a copy of specs/, templates/ and generated/ under a temporary DDTREE_GEN_ROOT, so the
repository is never written. (The wheel itself is built and used from a fresh venv by .ci/run.)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddtree_gen.build import artifacts
from ddtree_gen import cli, fileio, paths
from ddtree_gen.spec import find_spec
from ddtree_gen.ops.tree_verify.wgmma import PARTS_KERNEL

REPO = Path(__file__).resolve().parent.parent
SHIPPED = "kimi-k2.6-tp8"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """This module's binary cache: the user's copied (tests/conftest.py, seeded_cache), so that a build of a
    shipped spec here compiles nothing after `ddtree-gen build`; the specs of one's own these tests make add
    entries of their own there, not in the user's cache."""
    from conftest import seeded_cache
    return seeded_cache(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def root(tmp_path, monkeypatch, cache) -> Path:
    """A copy of the repository's specs/, templates/ and generated/ as DDTREE_GEN_ROOT."""
    dest = tmp_path / "project"
    for sub in ("specs", "templates", "generated"):
        shutil.copytree(REPO / sub, dest / sub, ignore=shutil.ignore_patterns(".lock"))
    monkeypatch.setenv("DDTREE_GEN_ROOT", str(dest))
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(cache))
    return dest


def _run(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _user_spec(folder: Path, name: str = "my-spec", archs=None) -> Path:
    """The shipped spec's fields under another name (its sources differ by the name in their header: nothing of
    the session's cache serves it); `archs` narrows its targets (fewer variants to compile)."""
    text = (REPO / "specs" / f"{SHIPPED}.toml").read_text().replace(f'name = "{SHIPPED}"', f'name = "{name}"')
    assert f'name = "{name}"' in text
    if archs is not None:
        assert "archs" not in text
        text += f"archs = {json.dumps(list(archs))}\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def test_a_spec_by_path_builds_into_the_cache_or_out_never_generated(root, tmp_path, capsys):
    """(Its spec is built for sm_80 only: the 11 variants of one target, half of a shipped spec's, show the same.)"""
    before = _tree(root)
    mine = _user_spec(tmp_path / "mine", archs=["sm_80"])
    rc, out = _run(capsys, "build", str(mine))
    assert rc == 0, out
    assert "my-spec: not a shipped spec: its binaries are in the cache" in out, out
    assert _tree(root) == before, "building a spec given by path changed specs/, templates/ or generated/"
    rc, out = _run(capsys, "build", "--check")        # what failed after such a build before issue 19
    assert rc == 0, out
    # --out DIR: its sources and manifest there, and `--check --out DIR` checks them
    rc, out = _run(capsys, "build", str(mine), "--out", str(tmp_path / "out"))
    assert rc == 0 and f"my-spec: wrote {tmp_path / 'out' / 'my-spec'}/" in out, out
    manifest = json.loads((tmp_path / "out" / "my-spec" / "manifest.json").read_text())
    assert manifest["spec"] == "my-spec" and manifest["kernels"]
    assert _tree(root) == before
    rc, out = _run(capsys, "build", "--check", "--out", str(tmp_path / "out"), str(mine))
    assert rc == 0 and "is up to date" in out, out
    (tmp_path / "out" / "my-spec" / "tree_build.cu").write_text("// edited\n")
    rc, out = _run(capsys, "build", "--check", "--out", str(tmp_path / "out"), str(mine))
    assert rc == 1 and "tree_build.cu: differs from what the template renders" in out, out
    assert f"ddtree-gen build --out {tmp_path / 'out'} SPEC" in out, out
    # --check of a spec of one's own without --out: there is nothing in generated/ to check, and it says so
    rc, out = _run(capsys, "build", "--check", str(mine))
    assert rc == 2 and "my-spec: not a shipped spec" in out and "--check --out DIR" in out, out


def test_list_of_a_spec_by_path_says_not_shipped(root, tmp_path, capsys):
    rc, out = _run(capsys, "list", str(_user_spec(tmp_path / "mine")))
    assert rc == 0 and "generated/: not shipped" in out and "generated/: up to date" not in out, out


def test_a_shipped_spec_by_path_is_the_shipped_one(root):
    assert artifacts.shipped(find_spec(str(root / "specs" / f"{SHIPPED}.toml")))
    assert artifacts.shipped(find_spec(SHIPPED))


def test_check_with_spec_names_checks_those_only(root, capsys):
    (root / "generated" / "zz-not-a-spec").mkdir()
    rc, out = _run(capsys, "build", "--check", SHIPPED)
    assert rc == 0, out
    assert out.splitlines()[0].startswith(f"{SHIPPED}: kv_dtype=") and "(1 specs)" in out, out
    rc, out = _run(capsys, "build", "--check")           # all specs: the stray folder is reported
    assert rc == 1 and "zz-not-a-spec: no spec specs/zz-not-a-spec.toml" in out, out
    (root / "generated" / SHIPPED / "kv_commit.cu").write_text("// edited\n")
    rc, out = _run(capsys, "build", "--check", SHIPPED)   # a named spec's own drift still fails
    assert rc == 1 and "kv_commit.cu: differs" in out, out


def test_another_nvrtc_leaves_the_manifest_alone(root, capsys):
    """The manifest's binary record is that of the NVRTC it names: a build whose sources are up to date
    keeps it (a fresh clone's first build leaves git clean whatever 13.x NVRTC pip chose), --refresh
    rewrites it, and a changed source rewrites it with the NVRTC of that build."""
    path = root / "generated" / SHIPPED / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["nvrtc_version"] = "13.0"                  # as written by an older NVRTC: other binaries
    for entry in manifest["kernels"].values():
        for b in entry["builds"].values():
            b["binary_sha256"], b["binary_bytes"] = "0" * 64, 1
    other = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    path.write_text(other)
    rc, out = _run(capsys, "build", "--check", SHIPPED)
    assert rc == 0, out
    rc, out = _run(capsys, "build", SHIPPED)
    assert rc == 0, out
    assert path.read_text() == other, "a build with up-to-date sources rewrote the manifest"
    rc, out = _run(capsys, "build", "--refresh", SHIPPED)
    assert rc == 0 and f"{SHIPPED}: wrote generated/{SHIPPED}/" in out, out
    assert path.read_bytes() == (REPO / "generated" / SHIPPED / "manifest.json").read_bytes()


def test_installed_layout_is_the_package_data(tmp_path, monkeypatch):
    """An installed wheel has specs/, templates/, generated/ under ddtree_gen/_data (setup.py's build_py)."""
    monkeypatch.delenv("DDTREE_GEN_ROOT", raising=False)
    assert paths.project_root() == REPO and not paths.installed()     # this checkout
    monkeypatch.setattr(paths, "DATA", tmp_path / "_data")
    (tmp_path / "_data").mkdir()
    assert paths.installed() and paths.specs_dir() == tmp_path / "_data" / "specs"
    assert paths.generated_dir() == tmp_path / "_data" / "generated"
    monkeypatch.setenv("DDTREE_GEN_ROOT", str(REPO))
    assert not paths.installed() and paths.project_root() == REPO


def test_setup_maps_the_shipped_folders_into_the_wheel():
    text = (REPO / "setup.py").read_text()
    assert 'DATA_FOLDERS = ("templates", "specs", "generated")' in text
    manifest_in = (REPO / "MANIFEST.in").read_text().split()
    assert all(f in manifest_in for f in ("templates", "specs", "generated"))


def test_version(capsys):
    from ddtree_gen import __version__
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ddtree-gen {__version__}"


def test_list_piped_into_head_ends_quietly(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), DDTREE_GEN_CACHE=str(tmp_path / "cache"))
    env.pop("DDTREE_GEN_ROOT", None)
    r = subprocess.run(f"{sys.executable} -m ddtree_gen list | head -1", shell=True, capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stdout + r.stderr
    assert r.stderr == "", r.stderr


def test_list_columns_line_up(capsys):
    rc, out = _run(capsys, "list", "deepseek-v3-fp8")   # built kernels and skipped ones
    assert rc == 0, out
    built = [ln.index("generated/:") for ln in out.splitlines() if "generated/:" in ln]
    skipped = [ln.index("not built:") for ln in out.splitlines() if "not built:" in ln]
    assert built and skipped, out
    assert set(built) == set(skipped) and len(set(built)) == 1, out


def test_file_lock_is_exclusive_and_leaves_no_file(tmp_path):
    lock, counter = tmp_path / "x.lock", tmp_path / "n"
    counter.write_text("0")

    def work():
        for _ in range(20):
            with fileio.file_lock(lock):
                n = int(counter.read_text())
                time.sleep(0.0005)
                counter.write_text(str(n + 1))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.read_text() == "80"     # no lost update: the lock excluded the others every time
    assert not lock.exists()


def _shape_spec(folder: Path, name: str, rank: int) -> Path:
    path = _user_spec(folder, name)
    text = path.read_text()
    lines = [f"kv_lora_rank = {rank}" if ln.startswith("kv_lora_rank") else ln for ln in text.splitlines()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_spec_the_tensor_core_kernels_cannot_serve_builds_the_others(root, tmp_path, capsys):
    """kv_lora_rank 320 passes the loader; the mma.sync and wgmma kernels need a multiple of 128: the build
    builds the others and says per kernel what it skipped and why, and so do list, --check and load()."""
    import ddtree_gen
    from ddtree_gen.ops import all_builds, by_name
    path = _shape_spec(tmp_path / "mine", "rank-320", 320)
    spec = find_spec(str(path))
    # the tensor-core tree_verify kernels and their builds (from the declarations), but the fp8 spec's only
    fp8_only = {k.name for k in all_builds() if "bf16" not in k.kv_dtypes}   # a bf16 spec's: not its kv_dtype
    skipped = {k.name for k in all_builds() if k.serves and k.serves[1] in ("mma", "wgmma")} - fp8_only
    assert {"tree_verify_mma", "tree_verify_wgmma", PARTS_KERNEL} <= skipped
    assert {k.name for k in all_builds() if not k.builds_for(spec)} == skipped | fp8_only
    assert all(by_name(k).archs_for(spec) == () for k in skipped)
    rc, out = _run(capsys, "build", str(path))
    assert rc == 0, out
    for k in skipped:
        assert (f"rank-320: {k}: not built for spec 'rank-320': field 'kv_lora_rank' = 320 must be a multiple "
                f"of 128") in out, out
    assert "FAILED" not in out
    rc, out = _run(capsys, "list", str(path))
    assert rc == 0 and out.count("not built: field 'kv_lora_rank' = 320 must be a multiple of 128") == len(skipped), out
    ks = ddtree_gen.load(spec)
    assert "tree_verify" in ks.kernels and not skipped & set(ks.kernels)
    assert "must be a multiple of 128" in ks.unavailable("tree_verify_wgmma", 0)


def test_a_rank_past_the_cuda_core_kernel_says_its_limit():
    from ddtree_gen.ops import by_name
    from ddtree_gen.spec import parse_spec
    spec = parse_spec({**find_spec(SHIPPED).as_dict(), "name": "rank-704", "kv_lora_rank": 704}, "t")
    why = by_name("tree_verify").why_not_built(spec)
    assert why.startswith("tree_verify: not built for spec 'rank-704': kv_lora_rank = 704") and "at most 180" in why
    assert by_name("tree_build").builds_for(spec) and by_name("kv_commit").builds_for(spec)


# ------------------------------------------------------- GPU-only commands without a GPU or torch

BENCH_NEEDS = {"tree_build": "a CUDA GPU", "tree_accept": "a CUDA GPU", "step": "a CUDA GPU",
               "tree_verify": "a CUDA GPU and torch", "kv-dtype": "a CUDA GPU and torch",
               "arch": "a CUDA GPU and torch", "launch": "a CUDA GPU and torch"}


@pytest.mark.parametrize("name", list(BENCH_NEEDS))
def test_bench_without_gpu_or_torch_says_what_it_needs(name, monkeypatch, capsys):
    from ddtree_gen import needs
    monkeypatch.setattr(needs, "gpu_problem", lambda: "no usable CUDA GPU here (test)")
    monkeypatch.setattr(needs, "torch_problem", lambda: "torch is not installed (test)")
    rc, out = _run(capsys, "bench", name)
    assert rc == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddtree-gen: error: bench {name} needs {BENCH_NEEDS[name]}: "), out
    assert ("torch is not installed" in out) == ("torch" in BENCH_NEEDS[name]), out


def test_bench_with_torch_but_no_gpu_names_the_gpu_only(monkeypatch, capsys):
    from ddtree_gen import needs
    monkeypatch.setattr(needs, "gpu_problem", lambda: "no usable CUDA GPU here (test)")
    monkeypatch.setattr(needs, "torch_problem", lambda: None)
    rc, out = _run(capsys, "bench", "launch")
    assert rc == 2 and out.strip() == ("ddtree-gen: error: bench launch needs a CUDA GPU and torch: no usable "
                                       "CUDA GPU here (test)"), out


def test_needs_torch_problem_names_the_extra(monkeypatch):
    import importlib.util

    from ddtree_gen import needs
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert needs.torch_problem() == "torch is not installed (pip install 'ddtree-gen[torch]', or torch itself)"


def _no_gpu() -> str | None:
    from ddtree_gen import needs
    return needs.gpu_problem()


@pytest.mark.parametrize("argv", [["examples/speculative_decode.py"], ["scripts/probe_tree_build.py"],
                                  ["scripts/ablate_wgmma.py"], ["scripts/compare_tma.py"], ["scripts/compare_loads.py"],
                                  ["scripts/compare_one_wave.py"], ["scripts/sweep_splits.py"],
                                  ["scripts/tune_tree_verify.py"], ["scripts/compare_topk.py"],
                                  ["scripts/probe_wgmma.py"], ["scripts/sanitize_loads.py"],
                                  ["scripts/ncu_tree_verify.py"], ["scripts/compare_producer.py"]])
def test_gpu_scripts_without_gpu_say_so_in_one_line(argv, tmp_path):
    if _no_gpu() is None:
        pytest.skip("a CUDA GPU is usable here: this test is of a machine without one")
    env = dict(os.environ, PYTHONPATH=str(REPO), DDTREE_GEN_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(REPO / argv[0])], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr   # needs.EXIT_MISSING, for all of them
    assert r.stderr.strip().splitlines() == [f"error: {argv[0]} needs a CUDA GPU: {_no_gpu()}"], r.stderr


# a run of a file with some packages made unimportable (set to None in sys.modules: `import` raises
# ModuleNotFoundError, find_spec says not importable), as on a machine where they are not installed
_WITHOUT = ("import runpy, sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',') if m]; "
            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("hidden,args", [("torch,transformers", ["--help"]), ("torch,transformers", []),
                                         ("torch", ["--device", "cpu"]), ("transformers", []), ("", ["--device", "cuda"])],
                         ids=["help", "neither", "no-torch", "no-transformers", "cuda-no-gpu"])
def test_hf_example_refuses_in_one_line(hidden, args, tmp_path):
    """examples/hf_ddtree.py: --help anywhere; without torch or transformers (the [hf] extra), or --device cuda
    without a GPU, one line naming what is missing and the extra to install, exit 2 (needs.EXIT_MISSING), no
    traceback."""
    import importlib.util
    from ddtree_gen import needs
    missing = [m for m in ("torch", "transformers") if m in hidden.split(",") or importlib.util.find_spec(m) is None]
    if not missing and _no_gpu() is None:
        pytest.skip("a CUDA GPU is usable here, and torch and transformers installed: the example would run")
    env = dict(os.environ, PYTHONPATH=str(REPO), DDTREE_GEN_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", _WITHOUT, hidden, str(REPO / "examples" / "hf_ddtree.py"), *args],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    if args == ["--help"]:
        assert r.returncode == 0 and r.stdout.startswith("usage:") and r.stderr == "", r.stdout + r.stderr
        return
    assert r.returncode == needs.EXIT_MISSING and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    if missing:
        assert line == (f"error: examples/hf_ddtree.py needs torch and transformers: {' and '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not installed (pip install -e \".[hf]\")"), line
    else:
        assert line == f"error: examples/hf_ddtree.py --device cuda needs a CUDA GPU: {_no_gpu()}", line


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_every_example_without_torch_answers_help_and_refuses_in_one_line(example, tmp_path):
    """Every example, on a machine without torch and transformers: --help works (exit 0), and a plain run ends in
    one line on stderr naming what is missing, exit 2, no traceback (on a machine without a GPU too)."""
    from ddtree_gen import needs
    if _no_gpu() is None:
        pytest.skip("a CUDA GPU is usable here: an example that needs no torch would run")
    env = dict(os.environ, PYTHONPATH=str(REPO), DDTREE_GEN_CACHE=str(tmp_path / "cache"))
    run = lambda *args: subprocess.run([sys.executable, "-c", _WITHOUT, "torch,transformers",
                                        str(REPO / "examples" / example), *args],
                                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    r = run("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stdout + r.stderr
    r = run()
    assert r.returncode == needs.EXIT_MISSING and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: examples/{example} ") and " needs " in line, line


def _repo_files() -> str:
    """Every path git sees in the checkout, ignored ones included (what a script may have written there)."""
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO,
                          capture_output=True, text=True).stdout


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "scripts").iterdir() if p.suffix in (".py", ".sh")))
def test_every_script_answers_help(script, tmp_path):
    """Every script of scripts/ (Python and shell) answers --help: exit 0, its usage on stdout, and nothing
    written, neither where it runs nor in the checkout (gpu_matrix.sh used to build every spec into gpu-out/)."""
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), DDTREE_GEN_CACHE=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1")
    env.pop("OUT", None)
    cmd = ["bash"] if script.endswith(".sh") else [sys.executable]
    before = _repo_files()
    r = subprocess.run(cmd + [str(REPO / "scripts" / script), "--help"], capture_output=True, text=True,
                       env=env, cwd=run_dir, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    if script.endswith(".py"):
        assert r.stdout.startswith("usage:"), r.stdout
    assert "usage" in r.stdout.lower() or "run:" in r.stdout.lower(), r.stdout
    assert list(run_dir.iterdir()) == [] and not (tmp_path / "cache").exists(), list(run_dir.iterdir())
    assert _repo_files() == before, "--help wrote into the checkout"


def test_refs_without_ml_dtypes_refuses_in_one_line(monkeypatch, capsys):
    from ddtree_gen import fp8

    def missing():
        raise ImportError("e4m3 data on the numpy side needs ml_dtypes, a dependency (test)")
    monkeypatch.setattr(fp8, "ml_dtypes", missing)
    rc, out = _run(capsys, "refs", "--check", "deepseek-v3-fp8")
    assert rc == 2 and out.strip().splitlines() == [
        "ddtree-gen: error: refs: the fp8 specs' bundles: e4m3 data on the numpy side needs ml_dtypes, a "
        "dependency (test)"], out


def test_ml_dtypes_is_a_dependency():
    import tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("ml_dtypes") for d in deps), deps


def test_refs_in_an_installed_package_says_it_is_a_repository_command(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("DDTREE_GEN_ROOT", raising=False)
    monkeypatch.setattr(paths, "DATA", tmp_path / "_data")
    (tmp_path / "_data").mkdir()
    rc, out = _run(capsys, "refs", "--check")
    assert rc == 2 and "refs/ (the KDTR bundles) is part of the repository" in out, out


def test_no_specs_at_all_is_an_error_not_an_empty_success(tmp_path, monkeypatch, capsys):
    (tmp_path / "specs").mkdir()
    monkeypatch.setenv("DDTREE_GEN_ROOT", str(tmp_path))
    for args in (["build"], ["list"], ["build", "--check"]):
        rc, out = _run(capsys, *args)
        assert rc == 2 and f"no spec files (*.toml) in {tmp_path / 'specs'}" in out, (args, out)


def test_out_that_is_a_file_is_refused(root, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    for args in (["build", SHIPPED, "--out", str(tmp_path / "f")], ["build", "--check", "--out", str(tmp_path / "f")]):
        rc, out = _run(capsys, *args)
        assert rc == 2 and f"--out {tmp_path / 'f'}: not a folder" in out, out


# ------------------------------------------------------------------ issue 37: the first hour, again

SMALL_KERNELS = ["--kernel", "tree_build", "--kernel", "merge_states", "--kernel", "tree_accept"]


def _no_times(text: str) -> str:
    import re
    return re.sub(r" in [0-9.]+s", "", text)


def test_parallel_build_is_the_sequential_build(tmp_path, monkeypatch, capsys):
    """--jobs 2 and --jobs 1 into fresh caches: the same lines (one per variant as it is compiled, in the order
    the compiles end, then the resource table of --table in build order) and the same cache entries, byte for
    byte; --jobs 0 refused."""
    outs, caches = [], []
    for jobs in ("2", "1"):
        cache = tmp_path / f"cache-{jobs}"
        monkeypatch.setenv("DDTREE_GEN_CACHE", str(cache))
        capsys.readouterr()
        assert cli.main(["build", SHIPPED, *SMALL_KERNELS, "--jobs", jobs, "--table"]) == 0
        out = capsys.readouterr()
        progress = [ln for ln in out.out.splitlines() if ln.startswith("[")]
        assert len(progress) == 6 and all(ln.split()[1] == "compiled" for ln in progress), out.out
        assert f"{jobs} at a time" in out.out.splitlines()[0] and out.err == "", out
        lines = _no_times(out.out).splitlines()
        outs.append((sorted(ln.split("] ", 1)[1] for ln in lines if ln.startswith("[")),   # completion order varies
                     [ln for ln in lines[1:] if not ln.startswith("[")]))
        caches.append({p.name: p.read_bytes() for p in cache.iterdir() if p.suffix in (".cubin", ".ptx")})
    assert outs[0] == outs[1]
    assert caches[0] == caches[1] and len(caches[0]) == 6
    rc, out = _run(capsys, "build", SHIPPED, "--jobs", "0")
    assert rc == 2 and "--jobs 0: expected a number >= 1" in out, out


def test_a_failed_variant_in_a_parallel_build_leaves_the_others_and_generated(root, cache, monkeypatch, capsys):
    """One variant that fails to compile, among others compiled on 2 threads: the others are built and cached,
    the run exits 1 naming the failed one, and generated/ is left as it was (only a complete set is written)."""
    from ddtree_gen.build import compile as compile_mod
    before = _tree(root / "generated")
    real = artifacts.compile_source

    def failing(source, name, entries, opts):
        if "merge_states" in name and "sm_80" in name:
            raise compile_mod.BuildError("planted NVRTC failure")
        return real(source, name, entries, opts)

    # the session's cache (every shipped variant) less tree_build's and merge_states' entries: three compiles
    fresh = root.parent / "fresh-cache"
    keys = {(v.kernel.name, v.target): artifacts.cache_key(artifacts.render(v), v, artifacts.nvrtc_version())
            for v in artifacts.variants(find_spec(SHIPPED), artifacts.select_kernels(["tree_build", "merge_states"]))}
    gone = set(keys.values())
    shutil.copytree(cache, fresh, ignore=lambda d, names: [n for n in names if n.split(".")[0] in gone])
    monkeypatch.setattr(artifacts, "compile_source", failing)
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(fresh))
    rc, out = _run(capsys, "build", SHIPPED, "--jobs", "2")
    assert rc == 1 and "build of kimi-k2.6-tp8/merge_states (sm_80) failed" in out and "planted" in out, out
    assert _tree(root / "generated") == before
    assert sum("tree_build" in ln and "compiled" in ln for ln in out.splitlines() if ln.startswith("[")) == 2, out
    now = {p.name.split(".")[0] for p in fresh.iterdir()}   # the three that compiled are cached, the failed one not
    assert {k for kv, k in keys.items() if kv != ("merge_states", "sm_80")} <= now and keys["merge_states", "sm_80"] not in now


def test_load_says_what_it_compiles(tmp_path, monkeypatch):
    """ensure_built (load's build) says, before compiling, how many variants and which, and one line per variant
    compiled; from a warm cache it says nothing."""
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(tmp_path / "cache"))
    said = []
    artifacts.ensure_built(find_spec(SHIPPED), kernels=["tree_build", "merge_states"], say=said.append)
    assert said[0].startswith(f"ddtree_gen: {SHIPPED}: compiling 4 of 4 variants not in the cache"), said
    assert "tree_build (sm_90a)" in said[0] and "merge_states (sm_80)" in said[0]
    assert sorted(s.split("compiled ")[1].split(" in ")[0] for s in said[1:]) == sorted(
        ["tree_build (sm_90a)", "tree_build (sm_80)", "merge_states (sm_90a)", "merge_states (sm_80)"]), said
    again = []
    artifacts.ensure_built(find_spec(SHIPPED), kernels=["tree_build", "merge_states"], say=again.append)
    assert again == []


def test_load_prints_on_stderr_unless_quiet(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), DDTREE_GEN_CACHE=str(tmp_path / "cache"))
    code = f"import ddtree_gen; ddtree_gen.load({SHIPPED!r}, kernels=['merge_states'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "compiling 2 of 2 variants" in r.stderr and r.stdout == "", r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr      # warm: silent
    (tmp_path / "cache").rename(tmp_path / "old")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(env, DDTREE_GEN_QUIET="1"))
    assert r.returncode == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("above", [False, True], ids=["the-cache", "a-folder-above"])
def test_a_cache_that_is_a_file_is_a_clear_error(above, tmp_path, monkeypatch, capsys):
    (tmp_path / "f").write_text("")
    cache = tmp_path / "f" / "sub" if above else tmp_path / "f"
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(cache))
    rc, out = _run(capsys, "build", SHIPPED, "--kernel", "tree_build")
    assert rc == 2 and f"DDTREE_GEN_CACHE={cache}:" in out and "is a file, not a folder" in out, out
    assert "Traceback" not in out and "FileExistsError" not in out
    import ddtree_gen
    from ddtree_gen.errors import DdtreeError
    with pytest.raises(DdtreeError, match="is a file, not a folder"):
        ddtree_gen.load(SHIPPED, kernels=["tree_build"], arch="sm_80")


def test_an_unknown_arch_is_refused_by_build_as_by_load(tmp_path, monkeypatch, capsys):
    """DDTREE_GEN_ARCH=sm_70: `build` refuses it with load()'s message (it used to build every target)."""
    import ddtree_gen
    from ddtree_gen.errors import DdtreeError
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DDTREE_GEN_ARCH", "sm_70")
    with pytest.raises(DdtreeError) as e:
        ddtree_gen.load(SHIPPED, kernels=["tree_build"])
    for args in (["build", SHIPPED, "--kernel", "tree_build"], ["build", "--check", SHIPPED]):
        rc, out = _run(capsys, *args)
        assert rc == 2 and str(e.value) in out, (args, out)
    assert not (tmp_path / "cache").exists()


def test_flashmla_is_found_by_its_folder_or_said_how_to_get(tmp_path, monkeypatch):
    """needs.import_flash_mla: a folder named by DDTREE_GEN_FLASHMLA is searched; without FlashMLA the error says
    where it comes from and how to build it (the product used to point at ../shared/peers, which users lack)."""
    from ddtree_gen import needs
    monkeypatch.delitem(sys.modules, "flash_mla", raising=False)
    monkeypatch.setenv("DDTREE_GEN_FLASHMLA", str(tmp_path / "nothing"))
    with pytest.raises(ImportError) as e:
        needs.import_flash_mla()
    assert "github.com/deepseek-ai/FlashMLA" in str(e.value) and "python setup.py install" in str(e.value)
    assert f"DDTREE_GEN_FLASHMLA={tmp_path / 'nothing'}" in str(e.value)
    (tmp_path / "pkg" / "flash_mla").mkdir(parents=True)
    (tmp_path / "pkg" / "flash_mla" / "__init__.py").write_text("MARK = 'found'\n")
    monkeypatch.setenv("DDTREE_GEN_FLASHMLA", str(tmp_path / "pkg"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert needs.import_flash_mla().MARK == "found"
    monkeypatch.delitem(sys.modules, "flash_mla")
    for f in (REPO / "ddtree_gen" / "bench" / "peers.py", REPO / "tests" / "test_gpu_flashmla_pairing.py"):
        assert "shared/peers" not in f.read_text(), f


def test_help_of_the_package_is_short():
    """help(ddtree_gen): load, the version and a docstring that names the errors and records (841 lines of
    inherited Exception and tuple methods before)."""
    import pydoc
    import ddtree_gen
    text = pydoc.render_doc(ddtree_gen, renderer=pydoc.plaintext)
    assert len(text.splitlines()) < 100, text
    assert "load(spec" in text and "ArgumentError" in text and "with_traceback" not in text
    from ddtree_gen import ArgumentError, TreeBuildOutput  # noqa: F401  (still importable from the package)


def test_the_wheel_metadata_has_license_and_authors():
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] and project["license-files"] == ["LICENSE"] and (REPO / "LICENSE").is_file()
    assert project["authors"] and all(a.get("name") for a in project["authors"])


def test_tree_verify_plot_redraws_from_its_table(monkeypatch):
    """bench tree_verify's chart can be redrawn from the committed table without a GPU (replot); every row of
    the table is a bar, grouped by config."""
    from ddtree_gen.bench import tree_verify as bench
    got = {}
    monkeypatch.setattr(bench, "_plot", lambda points, peak, path: got.update(points=points, peak=peak))
    bench.replot(REPO / "docs" / "bench" / "bench_tree_verify.txt", "unused.png")
    rows = [ln for ln in (REPO / "docs" / "bench" / "bench_tree_verify.txt").read_text().splitlines()[2:]
            if ln.strip().startswith("B=")]
    assert got["peak"] == 744 and len(got["points"]) == len(rows) > 20
    assert got["points"][0] == ("B=1\nH=8\nL=4096", "ours (wgmma)", 184.9)

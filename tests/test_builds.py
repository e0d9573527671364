"""Builds stay safe (CPU only: NVRTC needs no GPU).

(a) concurrent builds on one cache and one generated/ tree; (b) template and CUDA errors leave
the previous generated/ in place; (c) a corrupted cache entry is rebuilt, never loaded;
(d) an unchanged rebuild compiles nothing; (e) `build --check` catches drift; (f) the resource
model agrees with ptxas for every spec, kernel and build target (sm_90a cubin; sm_80 PTX, through
the sm_80 cubin NVRTC assembles from it); plus the sanitizer driver's CPU parts.

Every test works on a copy of specs/ and templates/ under a temporary DDTREE_GEN_ROOT, so the repository is
never written; a test that compiles reads the user's binary cache (what `ddtree-gen build` filled: shipped
variants are cache hits) or, where it compiles anything else, a cache of its own.
"""
from __future__ import annotations

import hashlib
import json
import re
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtree_gen.build import artifacts, resources
from ddtree_gen import cli, needs, paths, registry, sanitize
from ddtree_gen.ops import all_builds, by_name
from ddtree_gen.build.variant import default_config, variant
from ddtree_gen.spec import find_spec, load_spec, spec_paths

from conftest import SMALL_KERNELS

REPO = Path(__file__).resolve().parent.parent
SPEC_NAMES = [p.stem for p in spec_paths(REPO / "specs")]
KERNELS = all_builds()   # every build of every declared kernel: what a spec compiles


def _variants(name: str) -> list:
    """The (default) variants a shipped spec builds."""
    return artifacts.variants(load_spec(REPO / "specs" / f"{name}.toml"), KERNELS)


# ---------------------------------------------------------------------------- helpers

def _env(root: Path | None, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               DDTREE_GEN_CACHE=str(cache))
    env.pop("DDTREE_GEN_ROOT", None)
    if root is not None:
        env["DDTREE_GEN_ROOT"] = str(root)
    return env


def _cli(root: Path | None, cache: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddtree_gen", *args], capture_output=True, text=True,
                          env=_env(root, cache), cwd=REPO, timeout=timeout)


def _fresh_root(dest: Path) -> Path:
    """specs/ and templates/ of the repository, copied (a snapshot: other work may edit them)."""
    dest.mkdir(parents=True, exist_ok=True)
    for sub in ("specs", "templates"):
        shutil.copytree(REPO / sub, dest / sub)
    return dest


def _clone(root: Path, dest: Path) -> Path:
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(".lock"))
    return dest


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _temp_leftovers(*folders: Path) -> list[str]:
    return [str(p) for f in folders for p in f.rglob("*") if p.name.endswith(".tmp")]


def _check_cache(cache: Path, names=None) -> int:
    """Every cache entry's binary (an sm_90a cubin or sm_80 PTX) matches the SHA-256 in its json;
    returns the number of entries (of those among `names`, file names in `cache`, when given)."""
    metas = sorted(cache.glob("*.json")) if names is None else [cache / n for n in sorted(names) if n.endswith(".json")]
    for meta_path in metas:
        meta = json.loads(meta_path.read_text())
        assert meta["binary"] == {"sm_90a": "cubin", "sm_80": "ptx"}[meta["arch"]], meta_path
        binary = (cache / f"{meta_path.stem}.{meta['binary']}").read_bytes()
        assert hashlib.sha256(binary).hexdigest() == meta["sha256"], meta_path
        assert len(binary) == meta["bytes"], meta_path
        if meta["binary"] == "cubin":
            assert binary[:4] == b"\x7fELF", meta_path
        else:
            assert b"\n.target sm_80\n" in binary[:1024], meta_path
    binaries = [p.name for p in cache.iterdir()] if names is None else names
    assert sum(n.endswith((".cubin", ".ptx")) for n in binaries) == len(metas)
    return len(metas)


def _cli_inproc(monkeypatch, capsys, root: Path, cache: Path, *args: str) -> tuple[int, str]:
    """`python -m ddtree_gen ARGS` in this process (faster than a subprocess); (exit code, output)."""
    monkeypatch.setenv("DDTREE_GEN_ROOT", str(root))
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(cache))
    capsys.readouterr()
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


# --------------------------------------------------------------------------- fixtures

# session_cache, session_root, concurrent_build: tests/conftest.py (the concurrent build's cache is the user's,
# copied, less the small kernels' entries, which it compiles)


@pytest.fixture
def in_session(monkeypatch, session_root, user_cache):
    """The session's copy of specs/ and templates/, and the user's binary cache (shipped variants: cache hits)."""
    monkeypatch.setenv("DDTREE_GEN_ROOT", str(session_root))


# ------------------------------------------------------------------ (a) concurrency

def _compiled_lines(out: str) -> list[tuple[str, str, str]]:
    """(spec, kernel, target) of each variant a build's output says it compiled ("[k/n] compiled spec kernel
    target in Xs")."""
    return [tuple(ln.split()[2:5]) for ln in out.splitlines() if ln.startswith("[") and ln.split()[1] == "compiled"]


def test_concurrent_builds(concurrent_build, session_cache):
    root, results, seconds, before, after = concurrent_build   # the cache's file names before and right after
    for rc, out, err in results:
        assert rc == 0, f"exit {rc}\n{out}\n{err}"
        assert "Traceback" not in err
    total = sum(len(_variants(n)) for n in SPEC_NAMES)
    keys = {}   # (spec, kernel, target) -> cache key, from the manifests the builds wrote
    for name in SPEC_NAMES:
        manifest = json.loads((root / "generated" / name / "manifest.json").read_text())
        keys |= {(name, k, arch): b["cache_key"] for k, e in manifest["kernels"].items() for arch, b in e["builds"].items()}
    assert len(keys) == total
    # every variant missing from the cache (kernel x target; at least every build of the small kernels, which
    # the seed left out) was compiled exactly once across the four processes (the other waited and read it);
    # the rest were cache hits
    missing = {v for v, key in keys.items() if f"{key}.json" not in before}
    assert {v for v in missing if v[1] in SMALL_KERNELS} == {v for v in keys if v[1] in SMALL_KERNELS}
    compiled = [v for _, out, _ in results for v in _compiled_lines(out)]
    assert sorted(compiled) == sorted(missing), "\n".join(out for _, out, _ in results)
    for name in SPEC_NAMES:
        manifest = json.loads((root / "generated" / name / "manifest.json").read_text())
        assert manifest["spec"] == name
        spec = load_spec(root / "specs" / f"{name}.toml")
        assert set(manifest["kernels"]) == {k.name for k in KERNELS if k.builds_for(spec)}   # fp8: no mma.sync
        assert sorted(manifest["targets"]) == ["sm_80", "sm_90a"]
        for kname, entry in manifest["kernels"].items():
            assert entry["archs"] == list(by_name(kname).archs_for(load_spec(root / "specs" / f"{name}.toml")))
            for arch, b in entry["builds"].items():
                assert (root / "generated" / name / b["source"]).is_file()
                assert (session_cache / f"{b['cache_key']}.{b['binary']}").is_file(), (name, kname, arch)
    # (as the four processes left it: later tests add entries of their own to this cache): the entries of the
    # manifests all there and intact (the user's cache, copied, may hold others too, of earlier sources)
    assert {f"{key}.json" for key in keys.values()} <= set(after)
    assert _check_cache(session_cache, after) >= total
    assert [n for n in after if n.endswith(".tmp")] == _temp_leftovers(root) == []
    # a lock is removed when released: none is left beside the cache entries or in generated/
    assert [n for n in after if n.endswith(".lock")] + sorted((root / "generated").glob(".lock")) == []
    r = _cli(root, session_cache, "build", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"4 concurrent builds of {total} variants ({len(missing)} compiled): {seconds:.1f} s")


def test_written_files_respect_umask(concurrent_build, session_cache):
    umask = os.umask(0)
    os.umask(umask)
    want = 0o666 & ~umask
    root, before = concurrent_build[0], concurrent_build[3]
    compiled = next(p for p in session_cache.glob("*.cubin") if f"{p.stem}.json" not in before)   # by the build
    files = [root / "generated" / SPEC_NAMES[0] / "manifest.json", compiled]
    assert {f"{f.name}: {f.stat().st_mode & 0o777:o}" for f in files} == {f"{f.name}: {want:o}" for f in files}


# ------------------------------------------------------ (b) template and CUDA errors

BREAKS = {
    "jinja-undefined": ("{{ undefined_variable_for_test }}\n", ["undefined_variable_for_test", "is undefined",
                                                                "tree_build.cu.j2"]),
    "jinja-syntax": ("{% if %}\n", ["tree_build.cu.j2"]),
    "cuda-syntax": ("\nstatic int syntax_error_marker = ;\n",
                    ["NVRTC failed to compile", "error", "static int syntax_error_marker = ;", "> "]),
}


@pytest.mark.parametrize("kind", list(BREAKS))
def test_template_error_keeps_previous_generated(kind, concurrent_build, session_cache, tmp_path, monkeypatch,
                                                 capsys):
    root = _clone(concurrent_build[0], tmp_path / "project")
    template = root / "templates" / by_name("tree_build").template
    good = template.read_bytes()
    before = _snapshot(root / "generated")
    suffix, needles = BREAKS[kind]
    template.write_bytes(good + suffix.encode())

    built = SPEC_NAMES[:2]  # two specs are enough to see that each failure is named; all four are checked after
    r = _cli(root, session_cache, "build", *built)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out
    for name in built:
        assert f"build of {name}/tree_build (sm_90a) failed" in r.stderr, out
        assert f"build of {name}/tree_build (sm_80) failed" in r.stderr, out
        assert f"{name:<18} tree_build" in r.stdout and "FAILED" in r.stdout
    for needle in needles:
        assert needle in r.stderr, f"{needle!r} missing from:\n{r.stderr}"
    if kind == "cuda-syntax":
        # NVRTC's log names the rendered file, and the excerpt marks the offending line
        assert all(f"{name}-tree_build.cu(" in r.stderr for name in built), r.stderr
        marked = [ln for ln in r.stderr.splitlines() if ln.startswith(">") and "syntax_error_marker" in ln]
        assert marked, r.stderr
    assert _snapshot(root / "generated") == before, "a failed build changed generated/"
    assert _temp_leftovers(root, session_cache) == []

    template.write_bytes(good)
    rc, out = _cli_inproc(monkeypatch, capsys, root, session_cache, "build", "--check")
    assert rc == 0, out


def test_hopper_only_instruction_fails_the_sm80_build(concurrent_build, session_cache, tmp_path):
    """A template that starts using a Hopper-only instruction builds for sm_90a and fails for sm_80 (ptxas
    assembles the PTX of the sm_80 build), naming the target; generated/ is left as it was."""
    root = _clone(concurrent_build[0], tmp_path / "project")
    template = root / "templates" / by_name("merge_states").template
    text = template.read_text()
    marker = "extern \"C\" __global__"
    assert marker in text
    template.write_text(text.replace(marker, 'extern "C" __global__ void hopper_only() { asm volatile("fence.proxy.async;"); }'
                                             '\n' + marker, 1))
    before = _snapshot(root / "generated")
    r = _cli(root, session_cache, "build", SPEC_NAMES[0], "--kernel", "merge_states")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = {ln.split()[4]: ln for ln in r.stdout.splitlines() if "merge_states" in ln and ln.startswith("[")}
    assert "FAILED" not in lines["sm_90a"] and "FAILED" in lines["sm_80"], r.stdout
    assert f"build of {SPEC_NAMES[0]}/merge_states (sm_80) failed" in r.stderr and "requires .target sm_90" in r.stderr
    r = _cli(root, session_cache, "build", SPEC_NAMES[0])
    assert r.returncode == 1 and _snapshot(root / "generated") == before


# -------------------------------------------------------------- (c) corrupted cache

def _truncate(b: bytes) -> bytes:
    return b[: len(b) // 2]


def _flip(b: bytes) -> bytes:
    i = len(b) // 2
    return b[:i] + bytes([b[i] ^ 0x01]) + b[i + 1:]


CORRUPTIONS = {   # "binary": the entry's .cubin (sm_90a) or .ptx (sm_80)
    "truncated": ("binary", _truncate),
    "bit-flip": ("binary", _flip),
    "flip-last-byte": ("binary", lambda b: b[:-1] + bytes([b[-1] ^ 0x80])),
    "empty": ("binary", lambda b: b""),
    "appended": ("binary", lambda b: b + b"\0"),
    "missing-binary": ("binary", None),
    "json-garbage": ("json", lambda b: b"{not json"),
    "json-list": ("json", lambda b: b"[]"),
    "json-wrong-hash": ("json", lambda b: b.replace(b'"sha256": "', b'"sha256": "0')),
    "json-other-kind": ("json", lambda b: json.dumps(dict(json.loads(b), binary={"ptx": "cubin", "cubin": "ptx"}[
        json.loads(b)["binary"]])).encode()),
    "json-no-report": ("json", lambda b: json.dumps(dict(json.loads(b), reports={})).encode()),
    "missing-json": ("json", None),
}


@pytest.fixture(scope="module")
def tree_build_variant(session_root):
    return load_spec(session_root / "specs" / "kimi-k2.6-tp8.toml"), by_name("tree_build")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_cache_entry_is_rebuilt(case, arch, tree_build_variant, session_root, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_GEN_ROOT", str(session_root))
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(tmp_path / "cache"))
    spec, kdef = tree_build_variant
    calls = []
    real = artifacts.compile_source
    monkeypatch.setattr(artifacts, "compile_source", lambda *a, **k: calls.append(a[1]) or real(*a, **k))

    first = artifacts.compile_variant(variant(kdef, spec, arch))
    assert first.status == "compiled" and len(calls) == 1 and first.arch == arch
    assert artifacts.compile_variant(variant(kdef, spec, arch)).status == "cached" and len(calls) == 1

    which, corrupt = CORRUPTIONS[case]
    which = first.kind if which == "binary" else which
    path = tmp_path / "cache" / f"{first.key}.{which}"
    good = path.read_bytes()
    if corrupt is None:
        path.unlink()
        bad = None
    else:
        bad = corrupt(good)
        assert bad != good
        path.write_bytes(bad)

    again = artifacts.compile_variant(variant(kdef, spec, arch))
    assert again.status == "compiled", f"{case}: a corrupted entry was loaded from the cache"
    assert len(calls) == 2
    assert again.binary != bad and again.binary == first.binary
    assert again.report == first.report
    assert _check_cache(tmp_path / "cache") == 1   # repaired on disk
    assert artifacts.compile_variant(variant(kdef, spec, arch)).status == "cached"
    assert _temp_leftovers(tmp_path / "cache") == []


def test_corrupted_cache_entry_cli_says_compiled(tree_build_variant, session_root, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DDTREE_GEN_ROOT", str(session_root))
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(cache))
    for arch in ("sm_90a", "sm_80"):
        spec, kdef = tree_build_variant
        assert artifacts.compile_variant(variant(kdef, spec, arch)).status == "compiled"
    (cubin,) = cache.glob("*.cubin")
    cubin.write_bytes(_flip(cubin.read_bytes()))
    r = _cli(session_root, cache, "build", "kimi-k2.6-tp8", "--kernel", "tree_build", "--verbose")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {ln.split()[4]: ln for ln in r.stdout.splitlines() if "tree_build" in ln and ln.startswith("[")}
    assert lines["sm_90a"].split()[1] == "compiled", r.stdout
    assert lines["sm_80"].split()[1] == "cached", r.stdout   # the other target's entry is intact
    assert _check_cache(cache) == 2


# ------------------------------------------------------------ (d) nothing changed

def test_second_build_compiles_nothing(concurrent_build, session_cache, tmp_path, monkeypatch, capsys):
    """A warm build of every spec says so in two lines (what it builds, and that all was cached; the bar is
    15); --verbose adds a line per variant, every one cached, and the resource table; generated/ is untouched."""
    root = _clone(concurrent_build[0], tmp_path / "project")
    before = _snapshot(root / "generated")
    r = _cli(root, session_cache, "build")
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    total = sum(len(_variants(n)) for n in SPEC_NAMES)
    assert r.stdout.splitlines()[-1].startswith(f"nothing to compile: all {total} variants were cached"), r.stdout
    assert len(r.stdout.splitlines()) == 2, r.stdout
    rc, out = _cli_inproc(monkeypatch, capsys, root, session_cache, "build", SPEC_NAMES[0], "--verbose")
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert rc == 0 and len(lines) == len(_variants(SPEC_NAMES[0])), out
    assert all(ln.split()[1] == "cached" for ln in lines), out
    table = out.splitlines().index(next(ln for ln in out.splitlines() if ln.endswith("model vs ptxas")))
    assert len(out.splitlines()[table + 1:-1]) == len(lines), out   # one row per variant, then the summary
    after = _snapshot(root / "generated")
    after.pop(".lock", None)
    assert after == before, "an unchanged rebuild changed generated/"


# ------------------------------------------------------------------ (e) build --check

def test_check_passes_on_committed_tree(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DDTREE_GEN_ROOT", raising=False)
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(tmp_path / "cache"))
    assert paths.project_root() == REPO
    capsys.readouterr()
    rc = cli.main(["build", "--check"])
    out = capsys.readouterr()
    assert rc == 0, ("the committed generated/ is out of date with specs/ and templates/; "
                     "run `python -m ddtree_gen build`\n" + out.out + out.err)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("*.cubin"))


def _edit_spec(root):
    path = root / "specs" / "kimi-k2.6-tp8.toml"
    text = path.read_text()
    assert "num_heads = 8\n" in text
    path.write_text(text.replace("num_heads = 8\n", "num_heads = 16\n"))
    return ["generated/kimi-k2.6-tp8/manifest.json", "spec hash", "specs/kimi-k2.6-tp8.toml"]


def _edit_template(root):
    path = root / "templates" / by_name("tree_build").template
    path.write_text(path.read_text() + "// an edit\n")
    return ([f"generated/{n}/tree_build.cu" for n in SPEC_NAMES]
            + [f"generated/{n}/manifest.json" for n in SPEC_NAMES] + ["template hash"])


def _edit_included_template(root):
    path = root / "templates" / "common.cuh.j2"
    path.write_text(path.read_text() + "// an edit\n")
    return [f"generated/{n}/tree_build.cu" for n in SPEC_NAMES] + ["template hash"]


def _comment_only_template(root):
    # a Jinja comment does not change the rendered source, but the template hash still moves
    path = root / "templates" / by_name("tree_build").template
    path.write_text(path.read_text() + "{# a comment #}")
    return [f"generated/{n}/manifest.json" for n in SPEC_NAMES] + ["template hash"]


def _edited(rel):
    """The drift of a generated source edited by hand (one space added): `rel`, under the root."""
    def edit(root):
        path = root / rel
        path.write_text(path.read_text().replace("{", "{ ", 1))
        return [rel, "differs from what the template renders"]
    return edit


def _deleted(rel):
    """The drift of a generated file deleted: `rel`, under the root."""
    def delete(root):
        (root / rel).unlink()
        return [rel, "missing"]
    return delete


def _stray_folder(root):
    (root / "generated" / "old-model").mkdir()
    return ["generated/old-model", "no spec"]


def _manifest_options(root):
    path = root / "generated" / "deepseek-v3-tp8" / "manifest.json"
    m = json.loads(path.read_text())
    m["targets"]["sm_90a"]["options"] = m["targets"]["sm_90a"]["options"][:-1]
    path.write_text(json.dumps(m))
    return ["generated/deepseek-v3-tp8/manifest.json", "options", "target sm_90a"]


def _manifest_ptx_options(root):
    path = root / "generated" / "deepseek-v3-tp8" / "manifest.json"
    m = json.loads(path.read_text())
    m["targets"]["sm_80"]["options"][0] = "--gpu-architecture=compute_80"
    path.write_text(json.dumps(m))
    return ["generated/deepseek-v3-tp8/manifest.json", "options", "target sm_80"]


def _manifest_target_dropped(root):
    path = root / "generated" / "kimi-k2.6" / "manifest.json"
    m = json.loads(path.read_text())
    del m["targets"]["sm_80"]
    del m["kernels"]["tree_build"]["builds"]["sm_80"]
    path.write_text(json.dumps(m))
    return ["generated/kimi-k2.6/manifest.json", "targets", "kernel tree_build: targets"]


def _spec_archs(root):
    # the spec drops its sm_80 builds: the hash moves, the manifest's targets and the per-target sources are stale
    path = root / "specs" / "kimi-k2.6-tp8.toml"
    path.write_text(path.read_text() + 'archs = ["sm_90a"]\n')
    return ["generated/kimi-k2.6-tp8/manifest.json", "spec hash", "targets",
            "generated/kimi-k2.6-tp8/tree_verify_mma.bn32.s2.cu", "no registered kernel renders it"]


DRIFTS = {"spec-value": _edit_spec, "template": _edit_template, "included-template": _edit_included_template,
          "template-comment": _comment_only_template,
          "generated-by-hand": _edited("generated/deepseek-v3/tree_build.cu"),
          "manifest-deleted": _deleted("generated/kimi-k2.6/manifest.json"),
          "source-deleted": _deleted("generated/kimi-k2.6/tree_build.cu"), "stray-folder": _stray_folder,
          "manifest-options": _manifest_options, "manifest-ptx-options": _manifest_ptx_options,
          "manifest-target-dropped": _manifest_target_dropped, "spec-archs": _spec_archs,
          # the sm_80 configuration's sources (BN = 32: the variants tree_verify_mma.bn32.s2 and its tail)
          "sm80-source-by-hand": _edited("generated/deepseek-v3/tree_verify_mma.bn32.s2.cu"),
          "sm80-source-deleted": _deleted("generated/deepseek-v3/tree_verify_tail_mma.bn32.s2.cu")}


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_check_detects_drift(drift, concurrent_build, session_cache, tmp_path, monkeypatch, capsys):
    root = _clone(concurrent_build[0], tmp_path / "project")  # passes --check (test_concurrent_builds)
    needles = DRIFTS[drift](root)
    rc, out = _cli_inproc(monkeypatch, capsys, root, session_cache, "build", "--check")
    assert rc == 1, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"
    assert "out of date" in out
    assert not any(session_cache.glob("*.tmp"))


def test_list_shows_targets_per_kernel(concurrent_build, session_cache, tmp_path, monkeypatch, capsys):
    root = _clone(concurrent_build[0], tmp_path / "project")
    rc, out = _cli_inproc(monkeypatch, capsys, root, session_cache, "list", "kimi-k2.6-tp8")
    assert rc == 0, out
    assert "targets=sm_90a,sm_80" in out
    rows = [ln.split() for ln in out.splitlines()[1:]]
    targets, kernel = {}, None
    spec = find_spec("kimi-k2.6-tp8")
    for row in rows:
        if not row[0].startswith("sm_"):
            kernel, row = row[0], row[1:]
        if not by_name(kernel).builds_for(spec):   # an fp8 spec's kernel (the dequantize path's): one row saying so
            assert row[0] == "-" and "not built" in " ".join(row), row
            continue
        targets.setdefault(kernel, []).append(row[0])
        assert "up to date" in " ".join(row) and row[-1] == "cached", row
    assert targets == {k.name: list(k.archs) for k in KERNELS if k.builds_for(spec)}
    (root / "specs" / "kimi-k2.6-tp8.toml").write_text(
        (root / "specs" / "kimi-k2.6-tp8.toml").read_text() + 'archs = ["sm_80"]\n')
    rc, out = _cli_inproc(monkeypatch, capsys, root, session_cache, "list", "kimi-k2.6-tp8")
    assert rc == 0 and "targets=sm_80" in out, out
    assert re.search(r"tree_verify_wgmma +- +not built", out), out


# ------------------------------------------------------------------ (f) resource model

VARIANTS = [(s, v.kernel, v.target) for s in SPEC_NAMES for v in _variants(s)]
@pytest.mark.parametrize("spec_name,kdef,arch", VARIANTS, ids=[f"{s}-{k.name}-{a}" for s, k, a in VARIANTS])
def test_resource_model_matches_ptxas(spec_name, kdef, arch, in_session, session_root):
    spec = load_spec(session_root / "specs" / f"{spec_name}.toml")
    plan = kdef.plan_for(spec, arch)
    plan.check_fits()
    built = artifacts.compile_variant(variant(kdef, spec, arch))
    problems = resources.compare(plan, built.report)   # the same bar for sm_80 as for sm_90a: no exceptions
    assert problems == [], (
        f"{spec_name}/{kdef.name} ({arch}): ptxas {built.report.as_dict()}, model smem "
        f"{plan.value(plan.static_smem)} budget {plan.register_budget}")
    r = built.report
    assert r.registers <= plan.register_budget and r.smem == plan.value(plan.static_smem)
    assert r.spill_stores == r.spill_loads == 0
    assert r.stack == 0


@pytest.mark.parametrize("spec_name,kdef", [(s, k) for s, k, a in VARIANTS if a == "sm_80"],
                         ids=[f"{s}-{k.name}" for s, k, a in VARIANTS if a == "sm_80"])
def test_sm80_build_is_ptx(spec_name, kdef, in_session, session_root):
    """Every sm_80 build is PTX for sm_80 that declares the kernel's entry and uses no Hopper-only
    instruction; its source is the sm_90a one except where the plan differs per target (tree_verify_mma
    and _tail_mma: BN = 32, so that 150 KB of shared memory fit an A100's 163 KB)."""
    spec = load_spec(session_root / "specs" / f"{spec_name}.toml")
    built = artifacts.compile_variant(variant(kdef, spec, "sm_80"))
    assert built.kind == "ptx" and built.arch == "sm_80"
    text = built.binary.decode()
    assert "\n.target sm_80\n" in text and f".entry {kdef.entry}(" in text
    for instruction in ("wgmma", "setmaxnreg", "cp.async.bulk", "fence.proxy", "griddepcontrol", "mbarrier"):
        assert instruction not in text, f"{kdef.name}: {instruction} in the sm_80 PTX"
    same = artifacts.render(variant(kdef, spec, "sm_80")) == artifacts.render(variant(kdef, spec, "sm_90a"))
    per_target = default_config(kdef, spec, "sm_80") != default_config(kdef, spec, "sm_90a")
    assert same == (not per_target), kdef.name
    if per_target:
        plan = kdef.plan_for(spec, "sm_80")
        assert plan.value(plan.dynamic_smem) + plan.value(plan.static_smem) <= resources.SM80_SMEM_PER_BLOCK


def test_wgmma_kernels_have_no_sm80_build(in_session, session_root):
    """The wgmma kernels are built for sm_90a only; their template does not assemble for sm_80 (NVRTC
    passes wgmma through to ptxas, which refuses it), which is why they are excluded."""
    from ddtree_gen.build.compile import compile_source, options
    from ddtree_gen.errors import BuildError
    spec = load_spec(session_root / "specs" / "kimi-k2.6-tp8.toml")
    for name in ("tree_verify_wgmma", "tree_verify_tail_wgmma"):
        kdef = by_name(name)
        assert kdef.archs == ("sm_90a",) and kdef.archs_for(spec) == ("sm_90a",)
        with pytest.raises(BuildError, match="not built for sm_80"):
            artifacts.compile_variant(variant(kdef, spec, "sm_80"))
    with pytest.raises(BuildError, match="wgmma"):
        compile_source(artifacts.render(variant(by_name("tree_verify_wgmma"), spec)), "wgmma-sm80.cu",
                       ["ddtree_tree_verify_wgmma"], options("sm_80"))
    others = [k.name for k in KERNELS if "sm_80" in k.archs]
    assert {"tree_build", "tree_accept", "tree_verify", "tree_verify_tail", "merge_states", "tree_verify_mma",
            "tree_verify_tail_mma", "tree_verify_mma_combine"} <= set(others)


def test_paths_follow_environment(in_session, session_root, user_cache):
    assert paths.project_root() == session_root
    assert paths.specs_dir() == session_root / "specs"
    assert paths.cache_dir() == user_cache


# ------------------------------------------------------------- the sanitizer driver (CPU)

def test_sanitize_parser_defaults():
    args = sanitize.build_parser().parse_args([])
    assert args.specs == [] and args.tools == ["memcheck", "racecheck", "synccheck"] and args.out is None
    assert not args.worker


def test_sanitize_parser_worker_and_options():
    args = sanitize.build_parser().parse_args(["--worker", "kimi-k2.6-tp8", "deepseek-v3"])
    assert args.worker and args.specs == ["kimi-k2.6-tp8", "deepseek-v3"]
    args = sanitize.build_parser().parse_args(["kimi-k2.6", "--tool", "memcheck", "--tool", "initcheck",
                                               "--out", "/tmp/x"])
    assert args.tools == ["memcheck", "initcheck"] and args.out == "/tmp/x" and args.specs == ["kimi-k2.6"]
    with pytest.raises(SystemExit):
        sanitize.build_parser().parse_args(["--tool", "nosuchtool"])


def test_sanitize_register_adds_subcommand():
    import argparse
    p = argparse.ArgumentParser(prog="ddtree-gen")
    sub = p.add_subparsers(dest="command", required=True)
    sanitize.register(sub)
    args = p.parse_args(["sanitize", "kimi-k2.6-tp8", "--tool", "racecheck"])
    assert args.specs == ["kimi-k2.6-tp8"] and args.tools == ["racecheck"] and args.out is None
    assert args.func is sanitize.main
    args = p.parse_args(["sanitize"])
    assert args.tools == ["memcheck", "racecheck", "synccheck"] and args.specs == []


SUMMARIES = [
    ("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n", 0),
    ("========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 3 errors\n", 3),
    ("========= ERROR SUMMARY: 1 error\n", 1),
    ("========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n"
     "========= ERROR SUMMARY: 2 errors\n", 2),
    ("worker output\n========= ERROR SUMMARY: 1,234 errors\n", 1234),
    ("========= ERROR SUMMARY: 5 errors\n========= ERROR SUMMARY: 2 errors\n", 7),  # child processes add up
    ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", 0),  # racecheck, CUDA 13
    ("========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n", 1),
    ("no summary at all\n", None),
    ("", None),
]


@pytest.mark.parametrize("text,errors", SUMMARIES)
def test_sanitize_summary_parsing(text, errors):
    assert sanitize.parse_summary(text) == errors


def test_sanitize_worker_command(monkeypatch):
    cmd = sanitize.tool_command("/opt/cs/compute-sanitizer", "racecheck", ["kimi-k2.6-tp8"])
    assert cmd[:5] == ["/opt/cs/compute-sanitizer", "--tool", "racecheck", "--error-exitcode", "1"]
    assert cmd[5:] == [sys.executable, "-m", "ddtree_gen.sanitize", "--worker", "kimi-k2.6-tp8"]


def test_sanitize_finds_compute_sanitizer(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sanitize, "_candidate_dirs", lambda: list(sanitize.FALLBACK_DIRS))
    monkeypatch.setattr(sanitize, "FALLBACK_DIRS", [str(tmp_path / "cuda" / "bin")])
    assert sanitize.find_sanitizer() is None
    tool = tmp_path / "cuda" / "bin" / "compute-sanitizer"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert sanitize.find_sanitizer() == str(tool)


def test_sanitize_main_with_fake_sanitizer(monkeypatch, tmp_path, capsys):
    """The driver end to end, with a stand-in compute-sanitizer that reports per tool."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\n"
                    "echo \"fake $*\"\n"
                    "case \"$2\" in\n"
                    "  racecheck) echo '========= ERROR SUMMARY: 2 errors'; exit 1;;\n"
                    "  synccheck) echo 'crashed'; exit 3;;\n"
                    "  *) echo '========= ERROR SUMMARY: 0 errors'; exit 0;;\n"
                    "esac\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: str(fake))
    monkeypatch.setattr(needs, "gpu_problem", lambda: None)   # (the worker itself runs under the stand-in)
    args = sanitize.build_parser().parse_args(["kimi-k2.6-tp8", "--out", str(tmp_path / "out")])
    rc = sanitize.main(args)
    out = capsys.readouterr().out
    assert rc != 0
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()
            if ln.split() and ln.split()[0] in ("memcheck", "racecheck", "synccheck")}
    assert rows["memcheck"][:2] == ["0", "0"], out
    assert rows["racecheck"][:2] == ["2", "1"], out
    assert rows["synccheck"][:2] == ["?", "3"], out
    logs = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert logs == ["memcheck.log", "racecheck.log", "synccheck.log"]
    assert "--worker kimi-k2.6-tp8" in (tmp_path / "out" / "memcheck.log").read_text()

    fake.write_text("#!/bin/sh\necho '========= ERROR SUMMARY: 0 errors'\n")
    args = sanitize.build_parser().parse_args(["kimi-k2.6-tp8", "--tool", "memcheck"])
    assert sanitize.main(args) == 0


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "no-gpu"])
@pytest.mark.parametrize("tool", [True, False], ids=["sanitizer", "no-sanitizer"])
def test_sanitize_without_gpu_or_sanitizer_names_what_is_missing(gpu, tool, monkeypatch, capsys):
    """One line, exit 2 (needs.EXIT_MISSING), naming each missing thing: without a GPU the line blames the GPU
    (not compute-sanitizer, which would not help), and names the sanitizer only where it is missing too."""
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: "/bin/true" if tool else None)
    monkeypatch.setattr(needs, "gpu_problem", lambda: None if gpu else "no NVIDIA driver here (a stand-in)")
    if gpu and tool:
        monkeypatch.setattr(sanitize, "_run_tool", lambda cmd, log: ("========= ERROR SUMMARY: 0 errors", 0))
    args = sanitize.build_parser().parse_args(["kimi-k2.6-tp8", "--tool", "memcheck"])
    rc = sanitize.main(args)
    err = capsys.readouterr().err
    if gpu and tool:
        assert rc == 0 and err == "", err
        return
    assert rc == needs.EXIT_MISSING and len(err.strip().splitlines()) == 1, err
    wanted = [w for w, there in (("a CUDA GPU", gpu), ("compute-sanitizer", tool)) if not there]
    assert err.startswith(f"ddtree-gen sanitize: error: sanitize needs {' and '.join(wanted)}: "), err
    assert ("no NVIDIA driver here (a stand-in)" in err) == (not gpu), err
    assert ("compute-sanitizer not found" in err) == (not tool), err


def test_sanitize_main_unknown_spec(monkeypatch, capsys, in_session):
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: "/bin/true")
    args = sanitize.build_parser().parse_args(["no-such-model"])
    assert sanitize.main(args) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "kimi-k2.6-tp8" in err


class _FakeDev:
    """A numpy array posing as a CUDA array (only __cuda_array_interface__), at a fake address."""

    def __init__(self, arr, ptr):
        self.arr, self.ptr = arr, ptr

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.arr.shape, "typestr": self.arr.dtype.str, "strides": None,
                "data": (self.ptr, False), "version": 3}

    def __getitem__(self, sl):  # 1-d slices (the worker's misaligned kv_cache view)
        return _FakeDev(self.arr[sl], self.ptr + (sl.start or 0) * self.arr.itemsize)

    def reshape(self, shape):
        return _FakeDev(self.arr.reshape(shape), self.ptr)


def _fake_gpu(monkeypatch, spec_launch=None):
    """A fake cupy (arrays are numpy arrays at fake addresses) and fake allocations, for CPU runs of the
    worker. Returns (fake cupy module, kernel-set class whose launch calls spec_launch or raises LaunchReached)."""
    import types

    import numpy as np

    from conftest import FakeKernelSet, fake_tensor_map
    from ddtree_gen.launch import arrays, callplan, runtime

    next_ptr = [1 << 20]

    def fake_array(a):
        a = np.ascontiguousarray(a)
        ptr = next_ptr[0]
        next_ptr[0] += -(-max(a.nbytes, 1) // 256) * 256
        return _FakeDev(a, ptr)

    cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(deviceSynchronize=lambda: None, getDeviceCount=lambda: 1),
        set_allocator=lambda *a: None, set_pinned_memory_allocator=lambda *a: None,
        Device=lambda *a: types.SimpleNamespace(id=0))
    fake_cupy = types.SimpleNamespace(asarray=fake_array, cuda=cuda)
    monkeypatch.setattr(runtime, "allocate",
                        lambda kind, device, shape, dtype: fake_array(np.empty(shape, {"bf16": np.uint16}.get(dtype, dtype))))
    monkeypatch.setattr(runtime, "pointer_of", lambda a: a.ptr)
    monkeypatch.setattr(arrays, "_pointer_device", lambda ptr: 0)
    monkeypatch.setattr(callplan, "tensor_map_words", fake_tensor_map)

    class Kset(FakeKernelSet):   # every kernel of the spec loaded (the worker loads them all)
        launched: list = []

        def __init__(self, spec):
            super().__init__(spec, [k.name for k in all_builds() if k.archs_for(spec)])

        def launch(self, name, **kwargs):
            if spec_launch is None:
                return super().launch(name, **kwargs)
            Kset.launched.append(name)
            return spec_launch(name)

    return fake_cupy, Kset


# every build of each kernel with sanitizer cases (a build runs its kernel's cases: sanitize.worker)
CASE_BUILDS = [b.name for k in registry.sanitizer_cases() for b in by_name(k).build_defs()]


@pytest.mark.parametrize("key", CASE_BUILDS)
def test_sanitize_worker_cases_pass_launcher_checks(spec, key, monkeypatch):
    """Every worker case gets through its launcher's host-side checks to the launch of the build it asks for (CPU,
    fake arrays)."""
    import numpy as np

    from conftest import LaunchReached

    kdef = by_name(key)
    kernel, build = kdef.kernel, (kdef.build if kdef.of or kdef.builds else None)   # as sanitize.worker asks
    if not kdef.builds_for(spec):   # the worker skips it with the kernel set's reason
        pytest.skip(kdef.why_not_built(spec))
    fake_cupy, Kset = _fake_gpu(monkeypatch)
    cases = list(registry.sanitizer_cases()[kernel](spec, np.random.default_rng(0)))
    names = [case for case, _ in cases]
    # the rules (docs/adding-a-kernel.md): at least 3 cases, distinct names, each one reaching a launch
    assert len(cases) >= 3, f"{kernel}: {len(cases)} sanitizer case(s) {names}; at least 3 are needed"
    assert len(set(names)) == len(names), f"{kernel}: sanitizer case names repeat: {names}"
    for case, inputs in cases:
        try:
            sanitize._run_case(Kset(spec), kernel, inputs, fake_cupy, build)
        except LaunchReached as reached:
            assert build is None or reached.args[0] in (key, "kv_dequant"), (case, reached.args)   # that build's
            continue
        except Exception as e:  # noqa: BLE001 - reported with the case's name
            pytest.fail(f"{kernel} sanitizer case {case!r} on {spec.name}: refused before its launch: "
                        f"{type(e).__name__}: {e}")
        pytest.fail(f"{kernel} sanitizer case {case!r} on {spec.name}: returned without reaching a launch")


def test_sanitize_worker_loop(monkeypatch, capsys, in_session):
    """The worker's loop on CPU: every case of every registered kernel runs (fake launches), kernels without
    cases get a note, a failing case makes exit 1."""
    from ddtree_gen import kernel_set

    fake_cupy, Kset = _fake_gpu(monkeypatch, spec_launch=lambda name: None)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(kernel_set, "load", lambda spec, kernels=None: Kset(spec))
    registered = KERNELS
    assert sanitize.worker(["kimi-k2.6-tp8"]) == 0
    out = capsys.readouterr().out
    spec = find_spec("kimi-k2.6-tp8")
    for k in registered:
        if not k.builds_for(spec):   # an fp8 spec's kernel: skipped with the reason
            assert f"kimi-k2.6-tp8 {k.name}: " in out and k.why_not_built(spec) in out
        elif k.kernel in registry.sanitizer_cases():   # a build runs its kernel's cases
            assert f"kimi-k2.6-tp8 {k.name} [" in out and "FAILED" not in out
        else:
            assert f"kimi-k2.6-tp8 {k.name}: " in out  # a note: launched by another kernel, or no cases
    assert "0 failed" in out
    assert set(Kset.launched) >= {k.name for k in registered if k.name in registry.sanitizer_cases()
                                  and k.builds_for(spec)}

    def boom(name):
        if name == "merge_states":
            raise RuntimeError("cudaErrorIllegalAddress")
    fake_cupy, Kset = _fake_gpu(monkeypatch, spec_launch=boom)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(kernel_set, "load", lambda spec, kernels=None: Kset(spec))
    assert sanitize.worker(["kimi-k2.6-tp8"], kernels=["merge_states", "tree_build"]) == 1
    out = capsys.readouterr().out
    assert "merge_states [empty sides]: FAILED RuntimeError: cudaErrorIllegalAddress" in out
    assert "tree_build [budget 0]: ok" in out

"""The numpy references against the committed KDTR bundles in refs/ (CPU)."""
import pytest

from ddtree_gen import bundles, kdtr, registry

CASES = [(k, c) for k, b in registry.bundle_cases().items() for c in b.cases]


@pytest.mark.parametrize("kernel,case", CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_reference_matches_bundle(spec, kernel, case):
    bundle = kdtr.read(bundles.bundle_path(spec, kernel, case))
    assert (bundle.spec, bundle.kernel, bundle.case) == (spec.name, kernel, case)
    assert bundles.compare(spec, kernel, bundle) == []


def test_regenerated_bundle_is_identical(spec):
    """`ddtree-gen refs` is reproducible: the same seed gives the same bytes."""
    made = bundles.make(spec, "tree_build", "full")
    stored = kdtr.read(bundles.bundle_path(spec, "tree_build", "full"))
    fresh = kdtr.loads(kdtr.dumps(spec=spec.name, kernel="tree_build", case="full", seed=made["seed"],
                                  arrays=made["arrays"]))
    assert fresh == stored


def test_compare_notices_a_changed_output(spec):
    bundle = kdtr.read(bundles.bundle_path(spec, "tree_build", "full"))
    bundle.arrays["out.tokens"] = bundle.arrays["out.tokens"].copy()
    bundle.arrays["out.tokens"][0, 3] += 1
    assert any("tokens" in p for p in bundles.compare(spec, "tree_build", bundle))


def test_regenerating_keeps_a_bundle_that_still_holds(spec, tmp_path):
    """`ddtree-gen refs` keeps a bundle whose inputs are the seed's and whose outputs pass the check (a float output
    one ulp off, as another machine's BLAS order gives), and rewrites it when an input or an output is wrong."""
    import numpy as np
    kernel, case = next((k, c) for k, c in CASES if k == "tree_verify")
    made = bundles.make(spec, kernel, case)
    path = tmp_path / "b.kdtr"
    arrays = dict(made["arrays"])
    kdtr.write(path, spec=spec.name, kernel=kernel, case=case, seed=made["seed"], arrays=arrays)
    assert bundles.still_holds(spec, kernel, case, made, path)
    lse = arrays["out.lse"].copy()
    finite = np.flatnonzero(np.isfinite(lse.reshape(-1)))
    lse.reshape(-1)[finite[0]] = np.nextafter(lse.reshape(-1)[finite[0]], np.float32(np.inf))   # one ulp
    kdtr.write(path, spec=spec.name, kernel=kernel, case=case, seed=made["seed"], arrays={**arrays, "out.lse": lse})
    assert bundles.still_holds(spec, kernel, case, made, path)
    lse.reshape(-1)[finite[0]] += 1.0                                                              # wrong
    kdtr.write(path, spec=spec.name, kernel=kernel, case=case, seed=made["seed"], arrays={**arrays, "out.lse": lse})
    assert not bundles.still_holds(spec, kernel, case, made, path)
    key = next(k for k in arrays if k.startswith("in.") and arrays[k].size and arrays[k].dtype.kind in "iu")
    changed = arrays[key].copy()
    changed.reshape(-1)[0] += 1                                                                     # another input
    kdtr.write(path, spec=spec.name, kernel=kernel, case=case, seed=made["seed"], arrays={**arrays, key: changed})
    assert not bundles.still_holds(spec, kernel, case, made, path)
    assert not bundles.still_holds(spec, kernel, case, made, tmp_path / "missing.kdtr")


def test_check_calls_a_bundle_not_made_yet_missing(tmp_path, monkeypatch, capsys):
    """`refs --check` on a case declared but never generated (a new kernel before `ddtree-gen refs`) says
    MISSING and how to make it, not DIFFERS; a bundle that is there and wrong still DIFFERS; exit 1 for both."""
    import shutil
    from pathlib import Path

    from ddtree_gen import cli
    repo = Path(__file__).resolve().parent.parent
    name = "kimi-k2.6-tp8"
    shutil.copytree(repo / "specs", tmp_path / "specs")
    (tmp_path / "refs" / name).mkdir(parents=True)
    only = {"tree_build": registry.bundle_cases()["tree_build"]}
    monkeypatch.setattr(registry, "bundle_cases", lambda: only)
    monkeypatch.setenv("DDTREE_GEN_ROOT", str(tmp_path))
    cases = only["tree_build"].cases
    assert len(cases) >= 2
    for case in cases[1:]:
        shutil.copy(repo / "refs" / name / f"tree_build-{case}.kdtr", tmp_path / "refs" / name)
    capsys.readouterr()
    assert cli.main(["refs", "--check", name]) == 1
    out = capsys.readouterr().out
    assert f"tree_build         {cases[0]:<12} MISSING" in out and "`ddtree-gen refs` writes it" in out, out
    assert all(f"{case:<12} ok" in out for case in cases[1:]) and "DIFFERS" not in out, out
    assert "0 bundle(s) differ, 1 missing" in out, out
    (tmp_path / "refs" / name / f"tree_build-{cases[0]}.kdtr").write_bytes(b"not a bundle")
    assert cli.main(["refs", "--check", name]) == 1
    out = capsys.readouterr().out
    assert f"{cases[0]:<12} DIFFERS" in out and "MISSING" not in out, out

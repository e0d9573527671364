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

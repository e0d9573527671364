"""The KDTR bundles in refs/: small sets of reference inputs and outputs, regenerated with fixed seeds.

(The numpy references themselves are ddtree_gen.reference; this module writes and checks what they give. Each
kernel's cases, their inputs and how the reference runs on them are its declaration's Bundles: `bundle_inputs` and
any `bundle_run` of its plan module, ops/<op>/plan.py.)

`ddtree-gen refs` rewrites refs/<spec>/<kernel>-<case>.kdtr from the numpy references;
`ddtree-gen refs --check` recomputes every bundle's outputs from its stored inputs and
compares (discrete outputs exactly, float outputs to float32 rounding), and checks that the
set of bundles is the set of cases.

An fp8 spec's (kv_dtype "fp8_e4m3") bundles hold its cache as uint8 e4m3 bytes (drawn from normal
floats, no NaN bytes), and the attention cases its scale as `in.kv_scale`, a float32 scalar.
"""
from __future__ import annotations

import inspect
import zlib

import numpy as np

from . import fp8, kdtr, paths, registry
from .spec import Spec

INT_KEYS = {"num_nodes", "tokens", "parents", "depths", "positions", "tree_mask", "first_child", "next_sibling",
            "accept_lens", "accepted_nodes", "out_tokens", "new_prefix_lens", "kv_cache_after", "kv_caches_after",
            "topk_ids"}


def _seed(spec: Spec, kernel: str, case: str) -> int:
    return zlib.crc32(f"{spec.name}/{kernel}/{case}".encode())


def _scalar(v):
    v = np.asarray(v)
    return v if v.ndim else (int(v) if v.dtype.kind in "iu" else float(v))


def run_reference(spec, kernel: str, a: dict) -> dict:
    """The reference's outputs for a bundle's inputs `a`: the declared run(spec, a), else the reference called
    with the inputs by name (0-d arrays as Python scalars; a parameter not among them: the spec's field of that
    name), its record's fields as outputs (float64 as float32)."""
    run = registry.bundle_cases()[kernel].run
    if run:
        return run(spec, a)
    ref = registry.reference(kernel)
    params = inspect.signature(ref).parameters
    kwargs = {k: _scalar(a[k]) if k in a else getattr(spec, k) for k in params
              if k in a or (params[k].default is inspect.Parameter.empty and hasattr(spec, k))}
    out = ref(**kwargs)
    return {k: (np.asarray(v).astype(np.float32) if np.asarray(v).dtype == np.float64 else v)
            for k, v in out._asdict().items()}


def bundle_path(spec: Spec, kernel: str, case: str):
    return paths.refs_dir() / spec.name / f"{kernel}-{case}.kdtr"


def make(spec: Spec, kernel: str, case: str) -> dict:
    seed = _seed(spec, kernel, case)
    make_inputs = registry.bundle_cases()[kernel].inputs
    inputs = make_inputs(spec, np.random.default_rng(seed), case)
    outputs = run_reference(spec, kernel, inputs)
    arrays = {f"in.{k}": np.asarray(v) for k, v in inputs.items()}
    arrays.update({f"out.{k}": np.asarray(v) for k, v in outputs.items()})
    return {"seed": seed, "arrays": arrays}


def compare(spec: Spec, kernel: str, bundle) -> list[str]:
    """Recompute a bundle's outputs from its inputs; differences as messages."""
    inputs = {k[3:]: v for k, v in bundle.arrays.items() if k.startswith("in.")}
    stored = {k[4:]: v for k, v in bundle.arrays.items() if k.startswith("out.")}
    got = {k: np.asarray(v) for k, v in run_reference(spec, kernel, inputs).items()}
    return differences(got, stored)


def differences(got: dict, stored: dict) -> list[str]:
    """The reference's outputs `got` against a bundle's `stored` ones (names without the "out." prefix): integer
    and bit-exact outputs equal, float ones within the check's bar; differences as messages."""
    problems = []
    if set(got) != set(stored):
        return [f"outputs {sorted(stored)} stored, reference gives {sorted(got)}"]
    for k in sorted(got):
        g, s = got[k], stored[k]
        if g.shape != s.shape or g.dtype != s.dtype:
            problems.append(f"{k}: stored {s.dtype}{list(s.shape)}, reference gives {g.dtype}{list(g.shape)}")
        elif g.dtype.kind in "iu" or k in INT_KEYS:
            if not np.array_equal(g, s):
                problems.append(f"{k}: {int((g != s).sum())} elements differ")
        elif k == "scores":  # tree_build scores are exact float32 sums
            if not np.array_equal(g.view(np.uint32), s.view(np.uint32)):
                problems.append(f"{k}: not bit-identical")
        elif not np.allclose(g, s, rtol=1e-6, atol=1e-7, equal_nan=True):
            problems.append(f"{k}: max difference {np.nanmax(np.abs(g.astype(np.float64) - s)):.3g}")
    return problems


def still_holds(spec: Spec, kernel: str, case: str, made: dict, path) -> bool:
    """Whether the bundle at `path` may stay as it is when regenerating: its seed and input arrays are exactly
    `made`'s and its outputs pass compare(). Float outputs of the attention references come from float64 BLAS
    products whose summation order depends on the machine, so a regenerated float32 value may differ by an ulp
    from the stored one while both are within compare()'s bar; keeping the stored bundle then stops `refs` from
    rewriting files for nothing (integer and bit-exact outputs differ only when the reference changed). `made`'s
    outputs are the reference's on those inputs: compared as they are, the reference is not run again."""
    try:
        old = kdtr.read(path)
    except (kdtr.KdtrError, OSError):
        return False
    if (old.spec, old.kernel, old.case, old.seed) != (spec.name, kernel, case, made["seed"]):
        return False
    ins = {k: v for k, v in made["arrays"].items() if k.startswith("in.")}
    old_ins = {k: v for k, v in old.arrays.items() if k.startswith("in.")}
    if set(ins) != set(old_ins):
        return False
    if any(a.dtype != old_ins[k].dtype or a.shape != old_ins[k].shape or a.tobytes() != old_ins[k].tobytes()
           for k, a in ins.items()):
        return False
    return not differences({k[4:]: v for k, v in made["arrays"].items() if k.startswith("out.")},
                           {k[4:]: v for k, v in old.arrays.items() if k.startswith("out.")})


def main(args) -> int:
    from .spec import all_specs, find_spec
    from .errors import DdtreeError
    if paths.installed():
        raise DdtreeError("refs: refs/ (the KDTR bundles) is part of the repository, not of the installed package: "
                          "run `ddtree-gen refs` in a checkout")
    specs = [find_spec(n) for n in args.specs] if args.specs else all_specs()
    if any(s.kv_fp8 for s in specs):
        try:   # a dependency; refuse in one line where an environment lacks it, before any bundle
            fp8.ml_dtypes()
        except ImportError as e:
            raise DdtreeError(f"refs: the fp8 specs' bundles: {e}") from None
    bad = missing = 0
    for spec in specs:
        wanted = {bundle_path(spec, k, c) for k, b in registry.bundle_cases().items() for c in b.cases}
        for kernel, b in registry.bundle_cases().items():
            for case in b.cases:
                path = bundle_path(spec, kernel, case)
                if args.check:
                    if not path.exists():   # a case declared but never generated (a new kernel, before `refs`)
                        bad += 1
                        missing += 1
                        print(f"{spec.name:<18} {kernel:<18} {case:<12} MISSING")
                        print(f"    {path}: no such bundle; `ddtree-gen refs` writes it")
                        continue
                    try:
                        problems = compare(spec, kernel, kdtr.read(path))
                    except (kdtr.KdtrError, OSError) as e:
                        problems = [str(e)]
                    bad += bool(problems)
                    print(f"{spec.name:<18} {kernel:<18} {case:<12} {'ok' if not problems else 'DIFFERS'}")
                    for p in problems:
                        print(f"    {p if str(path) in p else f'{path}: {p}'}")
                else:
                    made = make(spec, kernel, case)
                    if still_holds(spec, kernel, case, made, path):
                        print(f"kept {path.relative_to(paths.project_root())} (its inputs are the seed's, its outputs "
                              f"within the check's bar)")
                        continue
                    path.parent.mkdir(parents=True, exist_ok=True)
                    kdtr.write(path, spec=spec.name, kernel=kernel, case=case, seed=made["seed"],
                               arrays=made["arrays"])
                    print(f"wrote {path.relative_to(paths.project_root())} ({path.stat().st_size} bytes)")
        spec_dir = paths.refs_dir() / spec.name
        stray = sorted(set(spec_dir.glob("*.kdtr")) - wanted) if spec_dir.is_dir() else []
        for p in stray:
            print(f"{p}: not a known case (stray bundle)")
            bad += 1
    if args.check:
        print("refs/ match the references" if not bad else
              f"{bad - missing} bundle(s) differ, {missing} missing; run `ddtree-gen refs`")
    return 1 if bad else 0

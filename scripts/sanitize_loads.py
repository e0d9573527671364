#!/usr/bin/env python
"""compute-sanitizer (memcheck, synccheck) on the seesaw's loaders that no spec ships by default: page_loads "spread" and
"producer" (ops/tree_verify/wgmma.py), at pages 1 and 16 (and the producer at page 64), on the chunks and the parts
grid, over tree_verify_wgmma's sanitizer cases (ddtree_gen/registry.py: edge lengths, bad pages, empty requests).
`ddtree-gen sanitize` runs each spec's declared builds only; this runs these builds the same way, the script under
the tool once per tool (a worker process), and prints the table of errors per tool.
When: on a GPU after a change to the seesaw's loads (templates/tree_verify_seesaw.cu.j2: load_slabs, the producer).
Run: PYTHONPATH=. python scripts/sanitize_loads.py [--tool memcheck --tool synccheck] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

# (base spec, page size, grid, page_loads): the page-by-page builds of both knobs, and the producer at page 64
BUILDS = [("kimi-k2.6-tp8", page, grid, loads) for page in (1, 16) for grid in ("chunks", "parts")
          for loads in ("spread", "producer")] + [("kimi-k2.6-tp8", 64, grid, "producer") for grid in ("chunks", "parts")]
TOOLS = ("memcheck", "synccheck")


def worker() -> int:
    import cupy

    from ddtree_gen import registry
    from ddtree_gen.bench.specs import page_variant
    from ddtree_gen.build.variant import variant
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.ops.tree_verify.wgmma import seesaw_tma
    from ddtree_gen.sanitize import run_cases
    from ddtree_gen.spec import find_spec
    cupy.cuda.set_allocator(None)         # one cudaMalloc per array: memcheck sees every overrun
    cases = registry.sanitizer_cases()["tree_verify_wgmma"]
    failures = launched = 0
    for base, page, grid, loads in BUILDS:
        spec = page_variant(find_spec(base), page)
        v = variant(by_name("tree_verify_wgmma"), spec, tma=seesaw_tma(spec), grid=grid, page_loads=loads)
        ks = variant_set([v], also=[COMBINE])
        ran, failed = run_cases(ks, "tree_verify_wgmma", cases(spec, np.random.default_rng(0)), cupy,
                                f"{v.name} {spec.name}")
        launched += ran
        failures += len(failed)
    print(f"sanitize_loads worker: {launched} cases ran, {failures} failed", flush=True)
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tool", action="append", choices=TOOLS, help="repeatable; default: memcheck and synccheck")
    ap.add_argument("--out", help="write each tool's output to OUT/<tool>.log")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker()
    from ddtree_gen import needs
    from ddtree_gen.sanitize import _run_tool, find_sanitizer, parse_summary
    needs.script_requires(__file__)
    sanitizer = find_sanitizer()
    if not sanitizer:
        print("error: scripts/sanitize_loads.py needs compute-sanitizer (the CUDA toolkit's): not on PATH",
              file=sys.stderr)
        return needs.EXIT_MISSING
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tool in a.tool or TOOLS:
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", sys.executable, __file__, "--worker"]
        t0 = time.perf_counter()
        text, rc = _run_tool(cmd, out / f"{tool}.log" if out else None)
        rows.append((tool, parse_summary(text), rc, time.perf_counter() - t0))
    print(f"\n{'tool':<10} {'errors':>6} {'exit':>5} {'seconds':>8}")
    for tool, errors, rc, seconds in rows:
        print(f"{tool:<10} {'?' if errors is None else errors:>6} {rc:>5} {seconds:>8.1f}")
    return 0 if all(errors == 0 and rc == 0 for _, errors, rc, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""compute-sanitizer racecheck on the seesaw tree_verify_wgmma: the default build, and the same kernel with its
warpgroup hand-offs as bar.sync on both sides (the variant tree_verify_wgmma.seesaw.tma.sync-handoffs: build/variant.py).

Why: `ddtree-gen sanitize --kernel tree_verify_wgmma` (H200, 2026-12-01) gave memcheck 0, synccheck 0 and 42
racecheck reports at 5 sites, while every GPU test passes. Every ordering between the two warpgroups of the seesaw
goes through a named barrier that one side arrives at (bar.arrive: a release) and the other syncs on (bar.sync:
an acquire). If racecheck does not take bar.arrive as a release, it reports exactly those hand-offs; the
sync_handoffs build orders the same accesses with bar.sync on both sides. Reports in the default build and none in
sync_handoffs say the hazards are the tool's reading of bar.arrive; reports in both are races to fix.
When: on a GPU after a change to templates/tree_verify_seesaw.cu.j2's hand-offs (docs/perf/journal-tree-verify.md, "The seesaw schedule on TMA tiles").
Controls (2026-12-01): both builds gave reports (default 10 sites, sync_handoffs 12, H200), among them a write and
a read of the epilogue's row sums separated by two __syncthreads(), which no execution can order wrongly. So the
script also runs two small kernels with no race at all: "control-even" (a hand-off through bar.sync 1, 256 on both
sides, then __syncthreads and a write/read across it) and "control-uneven" (the same, but one warpgroup also passes
a barrier of its own 128 threads first, as the seesaw's warpgroups do when a tile's V rows are zeroed), and
"control-mbarrier" (control-uneven after every thread has waited on an mbarrier, as the seesaw's threads wait on
its tile barriers). First run (H200): control-even and control-uneven 0 hazards, so named barriers that part of the
block passes are not what racecheck misreads. Second run (H200, docs/bench/sanitize_seesaw.txt): control-mbarrier
(1 report: the write and read across __syncthreads) and control-loop-arrive (16: the loop's hand-offs and the same
pair) are flagged, control-loop-sync is not: racecheck misreads code after an mbarrier wait and bar.arrive hand-offs
in a loop, the seesaw's two patterns; --stress found no run that differs.
Run: PYTHONPATH=. python scripts/racecheck_seesaw.py   (it runs itself under compute-sanitizer, once per build;
it prints the counts, and the controls' distinct reported sites as file:line of their source, compiled with
-lineinfo; the kernel's builds carry no line information: a -lineinfo build of it, 2026-12-01, put its sites at
the sScale0 / sScale1 hand-offs and the epilogue's row sums, docs/perf/journal-tree-verify.md)
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

BUILDS = ("default", "sync_handoffs", "control-even", "control-uneven", "control-mbarrier", "control-loop-arrive",
          "control-loop-sync")

CONTROLS = ["control-even", "control-uneven", "control-mbarrier", "control-loop-arrive", "control-loop-sync"]  # modes 0-4
CONTROL = r"""
extern "C" __global__ void control(float* out, float* sums, int mode) {
    __shared__ float a[128], b[256];
    __shared__ unsigned long long bar;
    const int t = threadIdx.x;
    const int uneven = mode >= 1;
    if (mode == 2) {                      // every thread first waits on an mbarrier (the seesaw's tile barriers)
        const unsigned addr = (unsigned)__cvta_generic_to_shared(&bar);
        if (t == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(addr) : "memory");
        __syncthreads();
        if (t == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(addr) : "memory");
        asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n@!p bra WAIT;\n}\n"
                     :: "r"(addr) : "memory");
    }
    if (mode >= 3) {                      // the seesaw's pattern: two hand-offs per iteration, the barriers reused
        float acc = 0.0f;
        for (int it = 0; it < 8; ++it) {
            if (t < 128) {
                a[t] = (float)(t + it);
                if (mode == 3) asm volatile("bar.arrive 1, 256;" ::: "memory");
                else asm volatile("bar.sync 1, 256;" ::: "memory");
                asm volatile("bar.sync 2, 256;" ::: "memory");
                acc += b[t];
            } else {
                asm volatile("bar.sync 1, 256;" ::: "memory");
                acc += a[t - 128];
                b[t - 128] = (float)it;
                if (mode == 3) asm volatile("bar.arrive 2, 256;" ::: "memory");
                else asm volatile("bar.sync 2, 256;" ::: "memory");
            }
        }
        sums[t] = acc;                    // 28 (warpgroup 0), 28 + 8 (t - 128) (warpgroup 1)
        __syncthreads();
    }
    if (t < 128) {                        // warpgroup 0 writes a, then hands it to warpgroup 1
        a[t] = (float)t;
        if (uneven) asm volatile("bar.sync 5, 128;" ::: "memory");   // a barrier of its own threads only
        asm volatile("bar.sync 1, 256;" ::: "memory");
    } else {
        asm volatile("bar.sync 1, 256;" ::: "memory");
        out[t] = a[t - 128];
    }
    __syncthreads();
    b[t] = (float)t;                      // a write and a read across __syncthreads
    __syncthreads();
    out[t] += b[255 - t];
}
"""


def control(mode: int) -> None:
    """The control kernels: no race in either; see the docstring."""
    import cupy
    out, sums = cupy.zeros(256, cupy.float32), cupy.zeros(256, cupy.float32)
    cupy.RawKernel(CONTROL, "control", options=("-lineinfo", "-arch=sm_90"))((1,), (256,), (out, sums, cupy.int32(mode)))
    cupy.cuda.Device().synchronize()
    want = [(t - 128 if t >= 128 else 0) + 255 - t for t in range(256)]
    ok = out.get().tolist() == want
    if mode >= 3:
        ok = ok and sums.get().tolist() == [28.0 + (8.0 * (t - 128) if t >= 128 else 0.0) for t in range(256)]
    print(f"{CONTROLS[mode]}: result {'correct' if ok else 'WRONG'}", flush=True)


def worker(build: str) -> None:
    """Launch the build on a few shapes (one and two chunks, a partial last tile, tree tiles), then synchronize."""
    if build in CONTROLS:
        control(CONTROLS.index(build))
        return
    import cupy
    import numpy as np

    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.split import COMBINE
    from ddtree_gen.build.variant import variant
    from ddtree_gen.spec import find_spec
    spec = find_spec("kimi-k2.6-tp8")
    v = variant(by_name("tree_verify_wgmma"), spec, schedule="seesaw", sync_handoffs=build == "sync_handoffs")
    ks = variant_set([v], also=[COMBINE])
    x = verify_inputs(spec, 2, np.array([300, 1000]), 65)
    for splits in (1, 2):
        res = ks.tree_verify_wgmma(**x, num_splits=splits)
        cupy.cuda.Device().synchronize()
        print(f"{build}: num_splits={splits}: lse finite {bool(np.isfinite(cupy.asnumpy(res.lse)).all())}", flush=True)


def sites(lines: list[str]) -> list[str]:
    """The distinct reported pairs of racecheck's output ('Write at x.cu:534 / Read at x.cu:589': lines of the
    rendered source; without line information, none)."""
    found = set()
    for ln, nxt in zip(lines, lines[1:] + [""]):
        if "Race reported" in ln:
            pair = re.findall(r"(Read|Write) access at .*? in (\S+:\d+)", ln + " " + nxt)
            found.add(" / ".join(f"{kind} at {src}" for kind, src in pair))
    return sorted(found)


def stress(n: int) -> int:
    """The default build launched n times per case on the same inputs: every output bitwise equal to the first.
    A race on the hand-offs would show as a difference now and then (no atomics: the kernel is deterministic)."""
    import cupy
    import numpy as np

    from ddtree_gen.inputs import verify_inputs
    from ddtree_gen.kernel_set import load
    from ddtree_gen.spec import find_spec
    bad = 0
    # (kimi-k2.6-tp8 at B >= 8 with num_splits None runs its parts-grid build, tree_verify_wgmma/parts: the 8 and
    # the 16 requests of mixed lengths, whose parts cut requests and walk several each)
    mixed = [4096, 100, 2000, 65, 3000, 1, 700, 4096, 1500, 64, 2500, 900, 33, 4000, 1200, 350]
    for name, lens in (("kimi-k2.6-tp8", [300, 1000]), ("kimi-k2.6-tp8", [4096] * 8), ("kimi-k2.6-tp8", mixed),
                       ("kimi-k2.6", [3000])):
        ks = load(find_spec(name), kernels=["tree_verify_wgmma", "tree_verify_mma_combine"])
        x = verify_inputs(ks.spec, len(lens), np.array(lens), 65, seed=7)
        for splits in (1, 2, None):
            first = ks.tree_verify_wgmma(**x, num_splits=splits)
            want = (cupy.asnumpy(first.out), cupy.asnumpy(first.lse).view(np.uint32))
            diff = 0
            for _ in range(n):
                r = ks.tree_verify_wgmma(**x, num_splits=splits, out=first.out, lse=first.lse)
                got = (cupy.asnumpy(r.out), cupy.asnumpy(r.lse).view(np.uint32))
                diff += not (np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]))
            print(f"stress {name} lens={lens[:3]}{'...' if len(lens) > 3 else ''} num_splits={splits}: "
                  f"{diff} of {n} runs differ from the first", flush=True)
            bad += diff
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=BUILDS, help=argparse.SUPPRESS)
    ap.add_argument("--stress", type=int, metavar="N",
                    help="instead: launch the default build N times per case, outputs compared bitwise")
    args = ap.parse_args()
    from ddtree_gen import needs
    needs.script_requires(__file__, gpu=True)
    if args.worker:
        worker(args.worker)
        return 0
    if args.stress:
        return stress(args.stress)
    rc = 0
    for build in BUILDS:
        cmd = ["compute-sanitizer", "--tool", "racecheck", "--error-exitcode", "1", sys.executable, __file__,
               "--worker", build]
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = (r.stdout + r.stderr).splitlines()
        summary = [ln for ln in lines if "SUMMARY" in ln or ln.startswith(build)]
        print(f"{build}: exit {r.returncode}; " + "; ".join(summary))
        for site in sites(lines)[:12]:
            print(f"    {site}")
        rc |= r.returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""`ddtree-gen sanitize`: every kernel of every spec under NVIDIA compute-sanitizer.

Driver (`ddtree-gen sanitize [SPEC...] [--tool T]... [--out DIR]`, or `main(args)`): for each tool
(memcheck, racecheck, synccheck by default) it runs

    compute-sanitizer --tool T --error-exitcode 1 python -m ddtree_gen.sanitize --worker SPEC...

streams the output (and writes it to DIR/T.log with --out), reads the sanitizer's
"ERROR SUMMARY: N errors" line (racecheck: "RACECHECK SUMMARY: ... (N errors, ...)"), and prints a table (tool, errors, exit code). It returns 0 only
when every tool reported 0 errors and exited 0; 1 otherwise; 2 when there is no usable CUDA GPU or
compute-sanitizer is not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, the
nvidia-cuda-sanitizer-api wheel), one line naming what is missing, or when a spec is unknown.

Worker (`python -m ddtree_gen.sanitize --worker [SPEC...] [--kernel K]...`): loads each spec's
kernel set and launches every registered kernel on small edge-case inputs (batch 2-3), with a
device synchronization after each launch: tree_build with budget 0 and N-1 and NaN / +-inf
log-probs; tree_verify, tree_verify_tail (and the _mma and _wgmma versions, also with forced split-KV)
with prefix_len 0, 63, 64, 65, q_len 1 and Nq, an empty row, a permuted block table, and the
out-of-range lengths and pages the kernels promise to tolerate; merge_states with empty sides (-inf, +inf, NaN), both sides empty, a row
count that is not a multiple of the block, and in place; tree_accept with full and zero
acceptance, malformed trees (num_nodes out of range, links out of range, cycles), bad
block-table entries, and a kv_cache that is not 16-byte aligned; kv_commit (after the walk) with zero,
full and random paths, bad block-table entries and nodes, in a sequence of layer caches and a stacked
one; draft_topk with bf16 and float32 rows of one and several chunks, a vocabulary of scalar loads,
ties that overflow its candidates, NaN / -inf / +inf rows and k = V. An fp8 spec (kv_dtype "fp8_e4m3") runs the same cases on e4m3 caches (finite bytes) with a
kv_scale; its mma.sync kernels are not built and are skipped with that reason. CuPy's memory pool is turned
off so that every array is its own allocation and memcheck sees every overrun. Each kernel's cases are
those its declaration holds (Declaration.sanitize: `sanitizer_cases` of its plan module, ops/<op>/plan.py); a
kernel without cases (the split-KV combine, launched by the tensor-core kernels' cases) is skipped with its
declaration's reason. The worker exits 1 if any case raised.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
DEFAULT_TOOLS = ["memcheck", "racecheck", "synccheck"]
FALLBACK_DIRS = ["/usr/local/cuda/bin", "/opt/cuda/bin"]
_SUMMARY_RE = re.compile(r"ERROR SUMMARY:\s*([\d,]+)\s+errors?\b")
# racecheck (CUDA 13) ends with this line alone: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
_RACECHECK_RE = re.compile(r"RACECHECK SUMMARY:.*?\(([\d,]+)\s+errors?\b")
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


# ------------------------------------------------------------------------ arguments

class _ToolsAction(argparse.Action):
    """--tool T (repeatable): the first use replaces the default list, later uses append."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        if current is None or current is self.default:
            current = []
        setattr(namespace, self.dest, [*current, values])


def _add_arguments(p: argparse.ArgumentParser, worker: bool) -> None:
    p.add_argument("specs", nargs="*", help="spec names (specs/<name>.toml) or paths; default: every spec")
    p.add_argument("--tool", dest="tools", action=_ToolsAction, choices=TOOLS, default=DEFAULT_TOOLS,
                   help=f"sanitizer tool (repeatable; default: {' '.join(DEFAULT_TOOLS)})")
    p.add_argument("--out", default=None, help="write each tool's full output to OUT/<tool>.log")
    p.add_argument("--kernel", dest="kernels", action="append", default=None,
                   help="only this kernel (repeatable; default: every registered kernel)")
    if worker:
        p.add_argument("--worker", action="store_true",
                       help="run the kernels (what compute-sanitizer runs); no sanitizer involved")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m ddtree_gen.sanitize` (driver, or --worker)."""
    p = argparse.ArgumentParser(prog="python -m ddtree_gen.sanitize",
                                description="Run every kernel under compute-sanitizer.")
    _add_arguments(p, worker=True)
    return p


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `sanitize` subcommand to the ddtree-gen CLI: `sanitize.register(sub)` in cli.build_parser."""
    p = subparsers.add_parser("sanitize", help="run every kernel under compute-sanitizer (memcheck, racecheck, "
                                               "synccheck); needs a GPU",
                              description="Run every kernel of every spec on edge-case inputs under "
                                          "compute-sanitizer and summarise the errors per tool.")
    _add_arguments(p, worker=False)
    p.set_defaults(func=main)
    return p


# ---------------------------------------------------------------------------- driver

def _candidate_dirs() -> list[str]:
    dirs = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(os.path.join(os.environ[var], "bin"))
    dirs.extend(FALLBACK_DIRS)
    try:  # pip wheel nvidia-cuda-sanitizer-api-*: nvidia/cuda_sanitizer_api/compute-sanitizer/
        import nvidia
        for root in getattr(nvidia, "__path__", []):
            dirs.append(os.path.join(root, "cuda_sanitizer_api", "compute-sanitizer"))
    except ImportError:
        pass
    return dirs


def find_sanitizer() -> str | None:
    """compute-sanitizer's path: PATH first, then the CUDA install folders; None if absent."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for d in _candidate_dirs():
        path = os.path.join(d, "compute-sanitizer")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def tool_command(sanitizer: str, tool: str, specs: list[str], kernels: list[str] | None = None) -> list[str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1",
           sys.executable, "-m", "ddtree_gen.sanitize", "--worker", *specs]
    for k in kernels or []:
        cmd += ["--kernel", k]
    return cmd


def parse_summary(text: str) -> int | None:
    """Errors reported by compute-sanitizer ("ERROR SUMMARY: N errors", summed over processes);
    None when the output holds no summary (the tool did not run to its end)."""
    counts = [int(m.group(1).replace(",", "")) for m in _SUMMARY_RE.finditer(text)]
    if not counts:  # no ERROR SUMMARY: racecheck's own summary line is the count
        counts = [int(m.group(1).replace(",", "")) for m in _RACECHECK_RE.finditer(text)]
    return sum(counts) if counts else None


def _run_tool(cmd: list[str], log_path: Path | None) -> tuple[str, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          env=env) as proc:
        for line in proc.stdout:
            lines.append(line)
            print(f"  | {line}", end="", flush=True)
        rc = proc.wait()
    text = "".join(lines)
    if log_path is not None:
        log_path.write_text(f"$ {' '.join(cmd)}\n{text}\n[exit code {rc}]\n")
    return text, rc


def main(args) -> int:
    """Run the worker under each sanitizer tool; print the table; non-zero if any tool found errors."""
    from .build import artifacts
    from .errors import DdtreeError
    from .spec import find_spec
    specs = list(getattr(args, "specs", None) or [])
    tools = list(getattr(args, "tools", None) or DEFAULT_TOOLS)
    kernels = getattr(args, "kernels", None)
    out = getattr(args, "out", None)
    try:
        for name in specs:
            find_spec(name)
        if kernels:
            artifacts.select_kernels(kernels)
    except DdtreeError as e:
        print(f"ddtree-gen sanitize: error: {e}", file=sys.stderr)
        return 2
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        print(f"ddtree-gen sanitize: error: unknown tool {bad[0]!r} (known: {', '.join(TOOLS)})", file=sys.stderr)
        return 2
    # what the machine lacks, all of it in one line (a GPU first: without one, no sanitizer would help)
    from . import needs
    sanitizer, gpu = find_sanitizer(), needs.gpu_problem()
    missing = [(what, why) for what, why in (
        ("a CUDA GPU", gpu),
        ("compute-sanitizer", None if sanitizer else f"compute-sanitizer not found on PATH or in "
                                                     f"{', '.join(_candidate_dirs())} (it ships with the CUDA toolkit)"))
        if why]
    if missing:
        print(f"ddtree-gen sanitize: error: sanitize needs {' and '.join(w for w, _ in missing)}: "
              f"{'; '.join(why for _, why in missing)}", file=sys.stderr)
        return needs.EXIT_MISSING
    out_dir = Path(out) if out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    rows = []
    for tool in tools:
        cmd = tool_command(sanitizer, tool, specs, kernels)
        print(f"== {tool}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        log_path = out_dir / f"{tool}.log" if out_dir is not None else None
        try:
            text, rc = _run_tool(cmd, log_path)
        except OSError as e:
            text, rc = f"cannot run {cmd[0]}: {e}", 127
            print(text)
        rows.append((tool, parse_summary(text), rc, time.perf_counter() - t0, log_path))

    print(f"\n{'tool':<10} {'errors':>6} {'exit':>5} {'seconds':>8}  log")
    for tool, errors, rc, seconds, log_path in rows:
        print(f"{tool:<10} {'?' if errors is None else errors:>6} {rc:>5} {seconds:>8.1f}  {log_path or '-'}")
    failed = [t for t, errors, rc, _, _ in rows if errors != 0 or rc != 0]
    if failed:
        print(f"sanitizer: problems under {', '.join(failed)} (a non-zero exit code with 0 or '?' errors means "
              f"the worker failed or the tool did not finish; see its output)")
        return 1
    print(f"sanitizer: no errors under {', '.join(tools)}")
    return 0


# ---------------------------------------------------------------------------- worker

def _to_device(value, cupy):
    from .types import TreeAcceptOutput, TreeBuildOutput
    if isinstance(value, (TreeBuildOutput, TreeAcceptOutput)):
        return type(value)(*(cupy.asarray(np.ascontiguousarray(a)) for a in value))
    if isinstance(value, list):   # kv_commit's layer caches
        return [cupy.asarray(a) for a in value]
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], tuple):  # (flat, (start, shape))
        flat, (start, shape) = value
        dev = cupy.asarray(flat)
        return dev[start:start + math.prod(shape)].reshape(shape)
    if isinstance(value, np.ndarray):
        return cupy.asarray(value)
    return value


def _run_case(kset, kernel, inputs, cupy, build=None):
    """One case of `kernel` (`build`: one of its builds by name, for a kernel that ships several)."""
    args = {k: _to_device(v, cupy) for k, v in inputs.items()}
    if build is not None:
        args["build"] = build
    for k, v in list(args.items()):  # in-place merge: out="o_a" names an input
        if isinstance(v, str) and v in args:
            args[k] = args[v]
    if kernel in ("tree_verify", "tree_verify_tail"):
        args["impl"] = "simple"  # the CUDA-core kernel; the tensor-core ones run under their own names
    getattr(kset, kernel)(**args)
    cupy.cuda.runtime.deviceSynchronize()


def run_cases(kset, kernel, cases, cupy, tag: str, build=None) -> tuple[int, list]:
    """Each (case name, inputs) of `cases` launched on `kernel` of kset, one line each (`tag` [case]: ok / FAILED);
    a failure is reported and the next case runs. Returns (cases that ran, names of those that failed)."""
    launched, failed = 0, []
    for case, inputs in cases:
        t0 = time.perf_counter()
        try:
            _run_case(kset, kernel, inputs, cupy, build)
        except Exception as e:  # report and go on: the other cases still tell something
            failed.append(case)
            print(f"{tag} [{case}]: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        launched += 1
        print(f"{tag} [{case}]: ok ({time.perf_counter() - t0:.2f} s)", flush=True)
    return launched, failed


def worker(specs: list[str], kernels: list[str] | None = None, seed: int = 0) -> int:
    """Launch every kernel of every spec on its edge cases; 0 if every case ran, else 1."""
    from .build import artifacts
    from . import kernel_set, registry
    from .errors import DdtreeError
    from .spec import all_specs, find_spec
    cases = registry.sanitizer_cases()
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        print(f"sanitize worker: no usable CUDA device ({type(e).__name__}: {e})", flush=True)
        return 2
    cupy.cuda.set_allocator(None)         # one cudaMalloc per array: memcheck sees every overrun
    cupy.cuda.set_pinned_memory_allocator(None)
    try:
        spec_objs = [find_spec(s) for s in specs] if specs else all_specs()
        # (kernel, build) of every build asked: a kernel's name asks each of its builds, "<kernel>/<build>" one
        selected = [(k.kernel, k.build if k.of or k.builds else None, k) for k in artifacts.select_kernels(kernels)]
    except DdtreeError as e:
        print(f"sanitize worker: error: {e}", flush=True)
        return 2
    failures, launched = [], 0
    for spec in spec_objs:
        try:
            kset = kernel_set.load(spec)  # every kernel: some launchers launch a second one (split-KV combine)
        except Exception as e:  # a build error, or a CUDA error loading a module
            print(f"{spec.name}: cannot load the kernels: {type(e).__name__}: {e}", flush=True)
            failures.append((spec.name, "*", "load"))
            continue
        for kernel, build, kdef in selected:
            label = kdef.name   # the build's key: the kernel's name for its default build
            if kernel not in cases:   # its declaration says why (launched by another kernel's cases)
                print(f"{spec.name} {kernel}: no cases of its own: {registry.declaration(kernel).missing['sanitize']}",
                      flush=True)
                continue
            if not kdef.archs_for(spec):   # a build of another kv_dtype (the dequantize path's for a bf16 spec)
                print(f"{spec.name} {label}: skipped: {kdef.why_not_built(spec)}", flush=True)
                continue
            why = kset.unavailable(label, cupy.cuda.Device().id)
            if why:   # e.g. the wgmma kernels off Hopper or with DDTREE_GEN_ARCH=sm_80
                print(f"{spec.name} {label}: skipped: {why}", flush=True)
                continue
            ran, failed = run_cases(kset, kernel, cases[kernel](spec, np.random.default_rng(seed)), cupy,
                                    f"{spec.name} {label}", build)
            launched += ran
            failures += [(spec.name, label, case) for case in failed]
    print(f"sanitize worker: {launched} cases ran, {len(failures)} failed", flush=True)
    return 1 if failures else 0


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args.specs, args.kernels)
    return main(args)


if __name__ == "__main__":
    raise SystemExit(_main())

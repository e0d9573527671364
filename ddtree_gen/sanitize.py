"""`ddtree-gen sanitize`: every kernel of every spec under NVIDIA compute-sanitizer.

Driver (`ddtree-gen sanitize [SPEC...] [--tool T]... [--out DIR]`, or `main(args)`): for each tool
(memcheck, racecheck, synccheck by default) it runs

    compute-sanitizer --tool T --error-exitcode 1 python -m ddtree_gen.sanitize --worker SPEC...

streams the output (and writes it to DIR/T.log with --out), reads the sanitizer's
"ERROR SUMMARY: N errors" line (racecheck: "RACECHECK SUMMARY: ... (N errors, ...)"), and prints a table (tool, errors, exit code). It returns 0 only
when every tool reported 0 errors and exited 0; 1 otherwise; 2 when compute-sanitizer is not
found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, the nvidia-cuda-sanitizer-api wheel) or a spec
is unknown.

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
those its declaration names (plans/: Declaration.sanitize); a kernel without cases (the split-KV combine,
launched by the tensor-core kernels' cases) is skipped with its declaration's reason. The worker
exits 1 if any case raised.
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

from .inputs import bad_pages, bf16_finite, block_table, e4m3_finite

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
    from . import artifacts
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
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("ddtree-gen sanitize: error: compute-sanitizer not found on PATH or in "
              f"{', '.join(_candidate_dirs())} (it ships with the CUDA toolkit)", file=sys.stderr)
        return 2
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

def _bits(rng, shape):
    """Random finite bf16 bits of magnitude < 2 (the input factory's: no inf, no NaN)."""
    return bf16_finite(rng, shape)


def _kv(spec, rng, shape):
    """Random finite KV-cache elements of the spec's kv_dtype, magnitude < 2: bf16 bits, or e4m3 bytes (no NaN)."""
    return (e4m3_finite if spec.kv_fp8 else bf16_finite)(rng, shape)


def _tree_build_cases(spec, rng):
    n, d = spec.max_tree_size, spec.max_depth

    def topk(b, dp, kp, lps=None):
        ids = rng.integers(0, 32000, (b, dp, kp), dtype=np.int32)
        if lps is None:
            lps = -np.sort(rng.exponential(1.0, (b, dp, kp)), axis=2)
        return ids, lps.astype(np.float32)

    roots = np.array([1, 2, 3], np.int32)
    prefix = np.array([0, 63, 65], np.int32)
    ids, lps = topk(3, d, n - 1)
    yield "budget 0", dict(topk_ids=ids, topk_logprobs=lps, root_tokens=roots, prefix_lens=prefix, budget=0)
    yield "budget N-1", dict(topk_ids=ids, topk_logprobs=lps, root_tokens=roots, prefix_lens=prefix,
                             budget=n - 1)
    odd = lps.copy()
    odd[0, :, 1::2] = np.nan
    odd[1, 2:, :] = -np.inf
    odd[1, 0, 0] = np.inf
    odd[2] = np.nan
    yield "NaN/-inf/+inf log-probs", dict(topk_ids=ids, topk_logprobs=odd, root_tokens=roots, prefix_lens=prefix,
                                          budget=n - 1)
    ids1, lps1 = topk(2, 1, 1)
    yield "D'=1 K'=1 budget N-1", dict(topk_ids=ids1, topk_logprobs=lps1, root_tokens=roots[:2],
                                       prefix_lens=prefix[:2], budget=n - 1)
    ids2, lps2 = topk(2, d, 1)
    yield "chain D'=D K'=1", dict(topk_ids=ids2, topk_logprobs=lps2, root_tokens=roots[:2], prefix_lens=prefix[:2],
                                  budget=n - 1)


def _reference_tree(spec, rng, b, dp, kp, budget, prefix):
    from . import reference
    ids = rng.integers(0, 50, (b, dp, kp), dtype=np.int32)
    lps = (-np.sort(rng.exponential(1.0, (b, dp, kp)), axis=2)).astype(np.float32)
    return reference.tree_build(ids, lps, np.arange(b, dtype=np.int32), np.asarray(prefix, np.int32), budget,
                                spec.max_tree_size)


def _pages(spec, rng, b, tokens, extra=2):
    """A permuted block table covering `tokens` positions per request, and the page count (inputs.block_table)."""
    return block_table(rng, [tokens] * b, spec.page_size, extra_pages=extra)


def _verify_cases(spec, rng):
    h, r, p, n, page = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.max_tree_size, spec.page_size
    scale = 1.0 / math.sqrt(r + p)

    def inputs(prefix, qlens, nq, mask, table, num_pages):
        b = len(prefix)
        out = dict(q_nope=_bits(rng, (b, nq, h, r)), q_pe=_bits(rng, (b, nq, h, p)),
                   kv_cache=_kv(spec, rng, (num_pages, page, r + p)), block_table=table,
                   prefix_lens=np.asarray(prefix, np.int32), q_lens=np.asarray(qlens, np.int32),
                   tree_mask=mask, softmax_scale=scale)
        if spec.kv_fp8:
            out["kv_scale"] = 0.37
        return out

    prefix = [0, 63, 64]
    tree = _reference_tree(spec, rng, 3, spec.max_depth, min(4, n - 1), n - 1, prefix)
    table, num_pages = _pages(spec, rng, 3, 65 + n)
    yield "prefix 0/63/64, q_len 1/Nq/Nq", inputs(prefix, [1, n, n], n, tree.tree_mask, table, num_pages)

    prefix = [65, 0, 64]
    tree = _reference_tree(spec, rng, 3, spec.max_depth, min(4, n - 1), n // 2, prefix)
    mask = tree.tree_mask.copy()
    mask[1, 0] = 0          # prefix 0 and no mask bit: a row with no visible key
    mask[0, 3] = 0          # an empty tail row (tree_verify_tail) with a full prefix
    yield "prefix 65/0/64, empty rows", inputs(prefix, [n, n, 1], n, mask, table, num_pages)

    small = tree.tree_mask[:, :1].copy()
    yield "Nq 1", inputs([0, 63, 65], [1, 1, 1], 1, small, table, num_pages)

    full = np.full((2, n, spec.mask_words), 0xFFFFFFFF, np.uint32)  # bits beyond q_len set too
    table2, num_pages2 = _pages(spec, rng, 2, 65 + n)
    yield "all mask bits set", inputs([64, 1], [n, n - 1], n, full, table2, num_pages2)

    # values the kernels promise to tolerate without reading out of bounds (see kernels/tree_verify.py)
    bad_table = bad_pages(table, num_pages)
    yield "out-of-range lengths and pages", inputs([0, 64, 10**6], [0, n + 1, n], n, tree.tree_mask, bad_table,
                                                   num_pages)
    yield "negative prefix, q_len > Nq", inputs([-1, 5, 2**31 - 1], [n, 2**31 - 1, -3], n, tree.tree_mask,
                                                table, num_pages)


def _merge_cases(spec, rng):
    r = spec.kv_lora_rank

    def sides(lead):
        o_a, o_b = _bits(rng, (*lead, r)), _bits(rng, (*lead, r))
        lse_a = rng.normal(5.0, 3.0, lead).astype(np.float32)
        lse_b = rng.normal(5.0, 3.0, lead).astype(np.float32)
        return o_a, lse_a, o_b, lse_b

    o_a, lse_a, o_b, lse_b = sides((3, 7, spec.num_heads))
    flat_a, flat_b = lse_a.reshape(-1), lse_b.reshape(-1)
    flat_a[0::5] = -np.inf
    flat_b[1::5] = np.inf        # FlashMLA's empty row
    flat_a[2::5] = -np.inf
    flat_b[2::5] = -np.inf       # both sides empty
    flat_a[3::7] = np.nan
    o_a.reshape(-1, r)[0::5] = 0x7FC0   # NaN in an empty side's o: must be ignored
    yield "empty sides", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    o_a, lse_a, o_b, lse_b = sides((2, 3))
    yield "rows not a multiple of the block", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    o_a, lse_a, o_b, lse_b = sides((2, 5, spec.num_heads))
    yield "in place", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out="o_a", lse="lse_a")
    o_a, lse_a, o_b, lse_b = sides((1,))
    lse_a[:] = -np.inf
    lse_b[:] = np.inf
    yield "one row, both empty", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)


def _accept_cases(spec, rng):
    from .types import TreeBuildOutput
    n, d, r, p, page = spec.max_tree_size, spec.max_depth, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size
    prefix = np.array([0, 63, 64], np.int32)

    def cache(b, num_pages=None, misalign=False):
        table, pages = _pages(spec, rng, b, 64 + n + 1)
        num_pages = num_pages or pages
        kv = _kv(spec, rng, (num_pages * page * (r + p) + 16,))
        start = 1 if misalign else 0
        return table, kv, (start, (num_pages, page, r + p))

    def follow(tree):  # target tokens that walk the first-child chain
        target = np.full((tree.tokens.shape[0], n), -7, np.int32)
        for b in range(tree.tokens.shape[0]):
            for i in range(n):
                c = tree.first_child[b, i]
                if c > 0:
                    target[b, i] = tree.tokens[b, c]
        return target

    chain = _reference_tree(spec, rng, 3, d, 1, n - 1, prefix)   # a chain of D nodes: full accept
    table, kv, view = cache(3)
    yield "full accept", dict(tree=chain, target_tokens=follow(chain), prefix_lens=prefix, kv_cache=(kv, view),
                              block_table=table)
    bushy = _reference_tree(spec, rng, 3, d, min(4, n - 1), n - 1, prefix)
    yield "first-child walk", dict(tree=bushy, target_tokens=follow(bushy), prefix_lens=prefix,
                                   kv_cache=(kv, view), block_table=table)
    yield "zero accept", dict(tree=bushy, target_tokens=np.full((3, n), -7, np.int32), prefix_lens=prefix,
                              kv_cache=(kv, view), block_table=table)

    # malformed trees: every token matches, so only the link checks end the walks
    bad = TreeBuildOutput(*(np.array(a, copy=True) for a in bushy))
    bad.num_nodes[:] = [0, n + 5, -1]
    bad.tokens[:] = 5
    target = np.full((3, n), 5, np.int32)
    yield "num_nodes out of range", dict(tree=bad, target_tokens=target, prefix_lens=prefix, kv_cache=(kv, view),
                                         block_table=table)
    bad = TreeBuildOutput(*(np.array(a, copy=True) for a in bushy))
    bad.num_nodes[:] = n
    bad.tokens[:] = 5
    bad.first_child[0] = np.arange(n)              # self links
    bad.first_child[1] = 0                         # back to the root
    bad.first_child[2] = 2**31 - 1
    bad.first_child[2, 0] = 1
    bad.next_sibling[2] = 1                        # a sibling cycle
    bad.next_sibling[0] = -5
    bad.next_sibling[1] = n + 100
    yield "links out of range and cycles", dict(tree=bad, target_tokens=target, prefix_lens=prefix,
                                                kv_cache=(kv, view), block_table=table)
    bad_table = table.copy()
    bad_table[0, :] = -1
    bad_table[1, 1] = 10**6
    bad_table[2, 0] = 2**31 - 1
    yield "block-table entries out of range", dict(tree=chain, target_tokens=follow(chain), prefix_lens=prefix,
                                                   kv_cache=(kv, view), block_table=bad_table)
    yield "block table too narrow", dict(tree=chain, target_tokens=follow(chain),
                                         prefix_lens=np.array([60, 63, 2**31 - d - 2], np.int32),
                                         kv_cache=(kv, view), block_table=table[:, :1].copy())
    table_m, kv_m, view_m = cache(3, misalign=True)
    yield "kv_cache not 16-byte aligned", dict(tree=chain, target_tokens=follow(chain), prefix_lens=prefix,
                                               kv_cache=(kv_m, view_m), block_table=table_m)


def _commit_cases(spec, rng):
    """kv_commit after the walk: given paths (zero, full depth with real moves, random), bad block-table entries
    and nodes, a sequence of 3 layer caches and a stacked [3, ...] one."""
    from .types import TreeAcceptOutput
    n, d, r, p, page = spec.max_tree_size, spec.max_depth, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size
    b = 3
    prefix = np.array([0, 63, 64], np.int32)
    table, num_pages = _pages(spec, rng, b, 64 + n + 1)

    def paths(kind):
        lens = {"zero": np.zeros(b), "full": np.full(b, d), "random": rng.integers(0, d + 1, b)}[kind].astype(np.int32)
        nodes = np.full((b, d + 1), -1, np.int32)
        nodes[:, 0] = 0
        for i in range(b):
            if kind == "full":
                nodes[i, 1:] = np.minimum(np.arange(1, d + 1) + 16, n - 1)
            else:
                nodes[i, 1:lens[i] + 1] = np.sort(rng.choice(np.arange(1, n), lens[i], replace=False))
        return TreeAcceptOutput(lens, nodes, np.zeros_like(nodes), prefix + 1 + lens)

    def layers(k):
        return [_kv(spec, rng, (num_pages, page, r + p)) for _ in range(k)]

    for kind in ("zero", "full", "random"):
        yield f"{kind} paths, 3 layers", dict(accepted=paths(kind), prefix_lens=prefix, kv_caches=layers(3),
                                              block_table=table)
    bad_table = table.copy()
    bad_table[0, :] = -1
    bad_table[1, 1] = 10**6
    bad_table[2, 0] = 2**31 - 1
    yield "block-table entries out of range", dict(accepted=paths("full"), prefix_lens=prefix, kv_caches=layers(2),
                                                   block_table=bad_table)
    odd = paths("full")
    odd.accept_lens[:] = [-5, d + 7, 2**31 - 1]     # clamped to [0, D]
    odd.accepted_nodes[2, 1:] = [-1 if k % 2 else 2**31 - 1 for k in range(d)]
    yield "accept_lens and nodes out of range", dict(accepted=odd, prefix_lens=prefix, kv_caches=layers(2),
                                                     block_table=table)
    yield "stacked layers", dict(accepted=paths("random"), prefix_lens=prefix,
                                 kv_caches=np.stack(layers(3)), block_table=table)


def _verify_mma_cases(spec, rng):
    """The tree_verify cases with the launcher's own split choice, then forced split-KV (combine kernel)."""
    for i, (case, inputs) in enumerate(_verify_cases(spec, rng)):
        yield case, inputs
        if i < 2 or "out-of-range" in case:
            yield f"{case}, num_splits 3", dict(inputs, num_splits=3)
            yield f"{case}, num_splits 32", dict(inputs, num_splits=32)   # more chunks than keys


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


def worker(specs: list[str], kernels: list[str] | None = None, seed: int = 0) -> int:
    """Launch every kernel of every spec on its edge cases; 0 if every case ran, else 1."""
    from . import artifacts, kernel_set, registry
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
            rng = np.random.default_rng(seed)
            for case, inputs in cases[kernel](spec, rng):
                t0 = time.perf_counter()
                try:
                    _run_case(kset, kernel, inputs, cupy, build)
                except Exception as e:  # report and go on: the other cases still tell something
                    failures.append((spec.name, label, case))
                    print(f"{spec.name} {label} [{case}]: FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                launched += 1
                print(f"{spec.name} {label} [{case}]: ok ({time.perf_counter() - t0:.2f} s)", flush=True)
    print(f"sanitize worker: {launched} cases ran, {len(failures)} failed", flush=True)
    return 1 if failures else 0


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args.specs, args.kernels)
    return main(args)


if __name__ == "__main__":
    raise SystemExit(_main())

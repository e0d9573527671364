"""The `ddtree-gen` command line (also `python -m ddtree_gen`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import DdtreeError


def _specs(names):
    from . import paths
    from .spec import all_specs, find_spec
    if names:
        return [find_spec(n) for n in names]
    specs = all_specs()
    if not specs:   # (an install without its specs printed nothing and built "all 0 variants" before issue 19)
        raise DdtreeError(f"no spec files (*.toml) in {paths.specs_dir()}: name a spec file, or set "
                          f"DDTREE_GEN_ROOT to a folder with specs/ and templates/")
    return specs


def _destination(spec, out):
    """Where `build` writes the sources and manifest of `spec`: (folder or None, what it is). A shipped spec
    goes to generated/ of a checkout; a spec given by path that is not a shipped one, or any spec of an
    installed package, to the binary cache only, unless `--out DIR` names a folder (DIR/<spec>/)."""
    from .build import artifacts
    from . import paths
    if out is not None:
        return Path(out), f"{Path(out) / spec.name}/"
    if not artifacts.shipped(spec):
        return None, (f"not a shipped spec: its binaries are in the cache ({paths.cache_dir()}), generated/ is "
                      f"untouched (`--out DIR` writes its sources and manifest to DIR/{spec.name}/)")
    if paths.installed():
        return None, (f"an installed package's generated/ is the shipped record: not written; the binaries are "
                      f"in the cache ({paths.cache_dir()})")
    return paths.generated_dir(), f"generated/{spec.name}/"


def _variant_line(done, total, status, v, width, took="") -> str:
    """One line of `build`: [done/total] status spec kernel target; the kernel by its build's name (what
    --kernel, `list`, the manifest and the kernel set call it)."""
    return f"[{done}/{total}] {status:<8} {v.spec.name:<18} {v.kernel.name:<{width}} {v.target:<6}{took}".rstrip()


def cmd_build(args) -> int:
    from . import archs, paths
    from .build import artifacts
    specs = _specs(args.specs)
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise DdtreeError(f"--out {args.out}: not a folder")
    archs.forced()   # an invalid $DDTREE_GEN_ARCH is refused here as load() refuses it (a valid one: see --help)
    if args.check:
        return _check(args, specs)
    jobs = artifacts.default_jobs() if args.jobs is None else args.jobs
    if jobs < 1:
        raise DdtreeError(f"--jobs {jobs}: expected a number >= 1")
    kdefs = artifacts.select_kernels(args.kernel)
    plan = [(spec, artifacts.variants(spec, kdefs)) for spec in specs]
    total = sum(len(v) for _, v in plan)
    print(f"building {total} variants of {len(specs)} spec(s) into the cache {paths.cache_dir()}, "
          f"{min(jobs, max(total, 1))} at a time", flush=True)
    for spec in specs:   # a kernel the spec's shape cannot serve (a kernel of another kv_dtype is not the spec's)
        for k in kdefs:
            if spec.kv_dtype in k.kv_dtypes and k.unfit(spec):
                print(f"skipped  {spec.name}: {k.why_not_built(spec)}", flush=True)

    width = _kernel_width()

    def progress(done, total, v, result):
        # one line per variant as it finishes (completion order): compiled and failed ones; cached ones with -v
        if isinstance(result, DdtreeError):
            print(_variant_line(done, total, "FAILED", v, width), flush=True)
        elif result.status == "compiled":
            print(_variant_line(done, total, "compiled", v, width, f" in {result.seconds:.1f}s"), flush=True)
        elif args.verbose:
            print(_variant_line(done, total, result.status, v, width), flush=True)

    results = iter(artifacts.build_variants([v for _, vs in plan for v in vs], jobs=jobs, progress=progress))
    rows, failed, notes, compiled = [], [], [], 0
    for spec, variants in plan:
        built = []
        for v in variants:
            b = next(results)
            if isinstance(b, DdtreeError):
                failed.append((spec.name, v.kernel.name, v.target, str(b)))
                continue
            compiled += b.status == "compiled"
            built.append(b)
            rows.append((spec.name, v.kernel.name, v.target, v.plan(), b.report))
        if len(built) == len(variants) and not args.kernel:   # only a complete, successful set is written
            root, where = _destination(spec, args.out)
            if root is None:
                notes.append(f"{spec.name}: {where}")
            elif args.refresh or artifacts.check_generated([spec], root, strays=False):
                artifacts.write_generated(spec, built, root)
                notes.append(f"{spec.name}: wrote {where}")
            # else: up to date; a manifest's binary record is that of the NVRTC it names (check_generated)
    if rows and (args.table or args.verbose):
        _resource_table(rows)
    for note in notes:
        print(note)
    for spec_name, kernel, arch, msg in failed:
        print(f"\nbuild of {spec_name}/{kernel} ({arch}) failed (previous artifacts left in place):\n{msg}",
              file=sys.stderr)
    cached = total - compiled - len(failed)
    more = "" if args.table or args.verbose else " (--verbose: every variant; --table: ptxas against the resource model)"
    if failed:
        print(f"{len(failed)} of {total} variants FAILED, compiled {compiled}, {cached} cached")
        return 1
    print((f"nothing to compile: all {total} variants were cached" if compiled == 0 else
           f"compiled {compiled} of {total} variants, {cached} cached") + more)
    return 0


def _check(args, specs) -> int:
    """`build --check`: the named specs (all shipped ones by default) against generated/ (or --out DIR)."""
    from .build import artifacts
    from . import paths
    if args.out is not None:
        root, what, fix = Path(args.out), f"{args.out}", f"ddtree-gen build --out {args.out} SPEC"
    else:
        for spec in specs:
            if not artifacts.shipped(spec):
                raise DdtreeError(f"build --check {spec.name}: not a shipped spec (specs/{spec.name}.toml), so it "
                                  f"has no folder in generated/ to check; `build --check --out DIR` checks the "
                                  f"folder that `build --out DIR` wrote")
        root, what = paths.generated_dir(), "generated/"
        fix = ("reinstall the package: its shipped generated/ differs from its specs and templates"
               if paths.installed() else "run `ddtree-gen build`")
    problems = artifacts.check_generated(specs, root, strays=not args.specs and args.out is None)
    for spec in specs:
        print(_spec_summary(spec))
    for p in problems:
        print(f"out of date: {p}")
    if problems:
        print(f"{what} is out of date ({len(problems)} problem(s)); {fix}")
        return 1
    print(f"{what} is up to date with specs/ and templates/ ({len(specs)} specs)")
    return 0


def _spec_summary(spec) -> str:
    """One line per spec for `build --check`: its kv_dtype, targets and kernel count (and what it does not get)."""
    from .ops import all_builds, all_kernels
    built = [k for k in all_kernels() if k.archs_for(spec)]
    # the builds it does not get (a kernel's further builds too: tree_verify_wgmma/parts reads bf16 caches only)
    skipped = [k.name for k in all_builds() if spec.kv_dtype not in k.kv_dtypes]
    unfit = [k.name for k in all_builds() if spec.kv_dtype in k.kv_dtypes and k.unfit(spec)]
    line = (f"{spec.name}: kv_dtype={spec.kv_dtype} targets={','.join(spec.archs)}, {len(built)} kernels, "
            f"{sum(len(k.archs_for(spec)) for k in all_builds())} variants")
    line += f" (not built for {spec.kv_dtype}: {', '.join(skipped)})" if skipped else ""
    return line + (f" (not built for its shape: {', '.join(unfit)}; `ddtree-gen list` says why)" if unfit else "")


def _resource_table(rows) -> None:
    """ptxas vs the model per variant. For sm_80 the report is of an sm_80 cubin assembled from the shipped
    PTX (the driver JIT-compiles that PTX on the device: the figures are indicative there)."""
    from .build.resources import compare
    w = _kernel_width()
    print(f"\n{'spec':<18} {'kernel':<{w}} {'target':<6} {'threads':>7} {'regs':>5} {'budget':>6} {'smem B':>7} "
          f"{'model':>7} {'stack':>5} {'spill':>5}  model vs ptxas")
    for spec, kernel, arch, plan, r in rows:
        problems = compare(plan, r)
        print(f"{spec:<18} {kernel:<{w}} {arch:<6} {plan.value(plan.threads):>7} {r.registers:>5} "
              f"{plan.register_budget:>6} {r.smem:>7} {plan.value(plan.static_smem):>7} {r.stack:>5} "
              f"{r.spill_stores + r.spill_loads:>5}  {'agree' if not problems else '; '.join(problems)}")


def _kernel_width() -> int:
    """The kernel column's width: the longest kernel name (at least 24), so that the columns line up."""
    from .ops import all_builds
    return max(24, *(len(k.name) for k in all_builds()))


def cmd_list(args) -> int:
    from .build import artifacts
    from . import registry
    w = _kernel_width()
    for spec in _specs(args.specs):
        print(f"{spec.name}: H={spec.num_heads} R={spec.kv_lora_rank} P={spec.qk_rope_head_dim} "
              f"page={spec.page_size} N={spec.max_tree_size} D={spec.max_depth} kv_dtype={spec.kv_dtype} "
              f"targets={','.join(spec.archs)}")
        state = artifacts.generated_state(spec)
        # every declared kernel in build order, each followed by its further builds ("<kernel>/<build>")
        for kdef in (b for d in registry.declarations() for b in d.build.build_defs()):
            order = kdef.archs_for(spec)
            if not order:
                why = (f"it reads {', '.join(kdef.kv_dtypes)} caches, the spec's kv_dtype is {spec.kv_dtype}"
                       if spec.kv_dtype not in kdef.kv_dtypes else kdef.unfit(spec) if kdef.unfit(spec) else
                       f"its targets ({', '.join(kdef.archs)}) are not the spec's")
                print(f"  {kdef.name:<{w}} {'-':<14}  not built: {why}")
                continue
            for i, arch in enumerate(order):
                cached = "cached" if _is_cached(spec, kdef, arch) else "not compiled here"
                name = kdef.name if i == 0 else ""
                print(f"  {name:<{w}} {arch:<6} {'(' + _binary(arch) + ')':<7}  generated/: "
                      f"{state[kdef.name][arch]:<11}  binary: {cached}")
    return 0


def _binary(arch) -> str:
    from .archs import BINARY
    return BINARY[arch]


def _is_cached(spec, kdef, arch) -> bool:
    from .build import artifacts
    from .build.compile import nvrtc_version
    from .build.variant import variant
    from .build.render import render
    v = variant(kdef, spec, arch)
    key = artifacts.cache_key(render(v), v, nvrtc_version())
    return artifacts._read_cache(key, kdef.entry, arch) is not None


def cmd_refs(args) -> int:
    from . import bundles
    return bundles.main(args)


BENCHES = ("tree_build", "draft_topk", "tree_verify", "kv-dtype", "arch", "tree_accept", "step", "launch")
# what each benchmark needs besides a GPU (torch: its peers, the measured matmul peak, torch ops, fp8 inputs)
BENCH_TORCH = {"draft_topk", "tree_verify", "kv-dtype", "arch", "launch"}


def page_sizes(text: str) -> tuple:
    """--pages "1,16,64" -> (1, 16, 64): distinct page sizes in the spec's range (an argparse type: a bad value is
    an argparse error naming it, before any GPU work)."""
    from .spec import MAX_PAGE_SIZE
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or max(values) > MAX_PAGE_SIZE or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct page sizes separated by commas, each an "
                                         f"integer in [1, {MAX_PAGE_SIZE}] (e.g. 1,16,64)")
    return values


def cmd_bench(args) -> int:
    from . import needs
    for name in args.kernels:
        if name not in BENCHES:
            raise DdtreeError(f"no benchmark for {name!r} (have: {', '.join(BENCHES)})")
    if getattr(args, "pages", None) and "tree_verify" not in args.kernels:
        raise DdtreeError(f"--pages is bench tree_verify's (asked for: {', '.join(args.kernels)})")
    fp8 = any(_specs([s])[0].kv_fp8 for s in args.spec or [])   # an fp8 cache is made through torch
    for name in args.kernels:
        needs.require(f"bench {name}", gpu=True, torch=name in BENCH_TORCH or fp8)
    from .bench import arch, draft_topk, kv_dtype, launch, step, tree_accept, tree_build, tree_verify
    run = {"tree_build": tree_build.run, "draft_topk": draft_topk.run, "tree_verify": tree_verify.run,
           "kv-dtype": kv_dtype.run, "arch": arch.run, "tree_accept": tree_accept.run, "step": step.run,
           "launch": launch.run}
    for name in args.kernels:
        try:
            run[name](args)
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            needs.require(f"bench {name}", gpu=False, torch=True)   # (a path that needs torch after all)
            raise
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="ddtree-gen", description=__doc__)
    p.add_argument("--version", action="version", version=f"ddtree-gen {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="render, compile and write generated/<spec>/ (all specs by default)")
    b.add_argument("specs", nargs="*", help="spec names (specs/<name>.toml) or paths")
    b.add_argument("--kernel", action="append", help="build only this kernel (repeatable; generated/ untouched)")
    b.add_argument("--check", action="store_true", help="exit 1 if generated/ is out of date; compiles nothing")
    b.add_argument("--out", metavar="DIR", help="write (or --check) DIR/<spec>/ instead of generated/: the place "
                                                "for a spec of your own")
    b.add_argument("--refresh", action="store_true", help="rewrite generated/<spec>/ even when its sources are "
                                                          "up to date (records this NVRTC's binaries)")
    b.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help="variants compiled at a time (default: the CPUs this process may use)")
    b.add_argument("--verbose", "-v", action="store_true", help="a line for every variant (cached ones too), then "
                                                                "the resource table")
    b.add_argument("--table", action="store_true", help="the resource table: ptxas's registers, shared memory "
                                                        "and spills per variant against the resource model")
    b.set_defaults(func=cmd_build)
    ls = sub.add_parser("list", help="specs, kernels and their build state")
    ls.add_argument("specs", nargs="*")
    ls.set_defaults(func=cmd_list)
    r = sub.add_parser("refs", help="regenerate refs/ (KDTR bundles) from the numpy references")
    r.add_argument("specs", nargs="*")
    r.add_argument("--check", action="store_true", help="compare refs/ with the references instead")
    r.set_defaults(func=cmd_refs)
    be = sub.add_parser("bench", help="time kernels against their peers on the GPU")
    be.add_argument("kernels", nargs="+", help=f"what to bench: {', '.join(BENCHES)}")
    be.add_argument("--spec", action="append", help="spec(s) to bench (default: per benchmark)")
    be.add_argument("--out", help="write the table (and plot) to this folder")
    be.add_argument("--sweep", action="store_true", help="tree_verify: shapes drawn from the classes of served "
                    "traffic (ragged, long, small batches: ddtree_gen/bench/shapes.py) instead of the fixed table")
    be.add_argument("--seed", type=int, default=1, help="--sweep, --pages: the draw's seed (default 1)")
    be.add_argument("--count", type=int, default=24, help="--sweep: how many shapes (default 24)")
    be.add_argument("--pages", type=page_sizes, metavar="P,P,...", help="tree_verify: one logical cache laid out in "
                    "pages of each size (e.g. 1,16,64: SGLang's, vLLM's, FlashMLA's), side by side: the build taken, "
                    "time, ratio to page 64, the outputs agreeing (with --sweep: both)")
    be.set_defaults(func=cmd_bench)
    from . import sanitize
    sanitize.register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DdtreeError as e:
        print(f"ddtree-gen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # `ddtree-gen list | head`: the reader is gone; say nothing more
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (no second error at exit's flush)
        return 0

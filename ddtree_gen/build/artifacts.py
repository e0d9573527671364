"""Artifacts: the content-hashed binary cache, generated/<spec>/, manifests and drift checks.

- Builds are of variants (build/variant.py: kernel, spec, target, config); the shipped ones are the default
  variants (the policy's config), a script's others are named by their procedural name (Variant.name).
- Cache (outside git, paths.cache_dir()): <key>.cubin (sm_90a) or <key>.ptx (sm_80) + <key>.json,
  key = hash of the rendered source, the target's compile options, NVRTC version, entry and variant
  name: the same source built for two targets has two keys. The json holds the binary's SHA-256, so a
  truncated or corrupted binary is detected and rebuilt, never loaded.
- generated/<spec>/: the rendered .cu of every kernel and manifest.json (spec hash, template
  hash, NVRTC version, the targets with their options; per build (a kernel's default build under the kernel's
  name, its further builds as "<kernel>/<build>", each naming its kernel and build) its targets and per target the
  variant's name and config, source file, cache key, binary size and hash, ptxas report and model). A
  source file is named by its variant: <variant name>.cu (tree_build.cu, tree_verify_mma.bn64.s2.cu and,
  for the sm_80 configuration, tree_verify_mma.bn32.s2.cu). Committed to git.
Every write is atomic (temp file + rename) and builders take a file lock, so concurrent
builds end with valid artifacts and a failed build leaves the previous ones in place.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .. import archs, paths
from ..archs import PRIMARY
from .compile import compile_source, nvrtc_version, options
from ..errors import BuildError, DdtreeError, SpecError
from ..fileio import atomic_write, file_lock
from ..ops import KernelDef, all_builds
from .variant import Variant, default_variants, variant
from .render import render, templates_digest
from .resources import PtxasReport, compare
from ..spec import Spec, load_spec

MANIFEST = "manifest.json"


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def shipped(spec: Spec) -> bool:
    """Whether `spec` is one of the shipped specs (specs/<name>.toml with the same values): only those have
    a folder in generated/. A spec given by path that is not one builds into the cache (or `build --out`)."""
    path = paths.specs_dir() / f"{spec.name}.toml"
    try:
        return path.is_file() and load_spec(path) == spec
    except SpecError:
        return False


def select_kernels(kernels=None) -> list[KernelDef]:
    """The builds of `kernels` (kernel names: each with all its builds; or a build's own "<kernel>/<build>"), in
    build order; every build of every kernel by default."""
    defs = all_builds()
    if not kernels:
        return defs
    names = {k.name for k in defs} | {k.kernel for k in defs}
    unknown = [k for k in kernels if k not in names]
    if unknown:
        raise BuildError(f"unknown kernel {unknown[0]!r} (known: {', '.join(sorted({k.kernel for k in defs}))})")
    return [k for k in defs if k.name in kernels or k.kernel in kernels]


@dataclass
class Built:
    variant: Variant   # what was built: kernel, spec, target, config
    source: str
    key: str
    binary: bytes      # what is shipped: the cubin (sm_90a) or the PTX text (sm_80)
    report: PtxasReport  # ptxas -v of the cubin (sm_80: of the sm_80 cubin assembled from the PTX, not shipped)
    status: str        # "cached" or "compiled"
    seconds: float = 0.0

    @property
    def kernel(self) -> str:
        """The build's name (a kernel's own for its default build, "<kernel>/<build>" for another: a kernel set's and
        a manifest's key)."""
        return self.variant.kernel.name

    @property
    def arch(self) -> str:
        """The target it was built for."""
        return self.variant.target

    @property
    def kind(self) -> str:
        """The kind of the shipped binary: 'cubin' or 'ptx'."""
        return archs.BINARY[self.arch]


def variants(spec: Spec, kdefs, arch: str | None = None) -> list[Variant]:
    """The default variants a spec builds, in build order: every target of each kernel (KernelDef.archs_for),
    or only `arch` when given."""
    return default_variants(spec, kdefs, arch)


def cache_key(source: str, v: Variant, nvrtc: str) -> str:
    """The cache key of `v` built from `source`: the source's hash, the target's options, the NVRTC version, the
    entry and the variant's name."""
    return sha256(json.dumps({"source": sha256(source), "options": list(options(v.target)), "nvrtc": nvrtc,
                              "entry": v.kernel.entry, "variant": v.name}, sort_keys=True))


def _read_cache(key: str, entry: str, arch: str = PRIMARY) -> tuple[bytes, PtxasReport] | None:
    root = paths.cache_dir()
    kind = archs.BINARY[arch]
    try:
        meta = json.loads((root / f"{key}.json").read_text())
        binary = (root / f"{key}.{kind}").read_bytes()
        if meta["binary"] != kind or sha256(binary) != meta["sha256"] or len(binary) != meta["bytes"]:
            return None  # truncated or corrupted: rebuild
        return binary, PtxasReport(**meta["reports"][entry])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def compile_variant(v: Variant, source: str | None = None) -> Built:
    """A variant's rendered source (or `source`, a script's edit of it) -> the binary of its target (archs.py),
    through the cache."""
    spec, kdef, arch = v.spec, v.kernel, v.target
    if arch not in kdef.archs:
        raise BuildError(f"kernel {kdef.name} is not built for {arch} (its targets: {', '.join(kdef.archs)})")
    if not kdef.builds_for(spec):
        raise BuildError(kdef.why_not_built(spec))
    source = render(v) if source is None else source
    nvrtc = nvrtc_version()
    key = cache_key(source, v, nvrtc)
    hit = _read_cache(key, kdef.entry, arch)
    if hit:
        return Built(v, source, key, hit[0], hit[1], "cached")
    root = paths.cache_dir()
    kind = archs.BINARY[arch]
    with file_lock(root / f"{key}.lock"):
        hit = _read_cache(key, kdef.entry, arch)  # another process may have built it while we waited
        if hit:
            return Built(v, source, key, hit[0], hit[1], "cached")
        t0 = time.perf_counter()
        name = f"{spec.name}-{v.stem}.cu" if arch == PRIMARY else f"{spec.name}-{v.stem}.{arch}.cu"   # (not in the binary)
        result = compile_source(source, name, [kdef.entry], options(arch))
        seconds = time.perf_counter() - t0
        report = result.reports[kdef.entry]
        binary = result.cubin if kind == "cubin" else result.ptx
        atomic_write(root / f"{key}.{kind}", binary)
        meta = {"binary": kind, "sha256": sha256(binary), "bytes": len(binary), "arch": arch, "nvrtc": nvrtc,
                "options": list(options(arch)), "reports": {kdef.entry: report.as_dict()}, "log": result.log,
                "variant": v.name}
        atomic_write(root / f"{key}.json", json.dumps(meta, indent=1))
    return Built(v, source, key, binary, report, "compiled", seconds)


def is_cached(v: Variant) -> bool:
    """Whether the default-source build of `v` is in the binary cache (and intact)."""
    return _read_cache(cache_key(render(v), v, nvrtc_version()), v.kernel.entry, v.target) is not None


def default_jobs() -> int:
    """Compile threads by default: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def build_variants(vs, jobs: int | None = None, progress=None) -> list:
    """compile_variant of each variant of `vs` on `jobs` threads (default: default_jobs(); NVRTC runs without
    the GIL, so the compiles overlap). Returns, in the order of `vs` (not of completion: the result does not
    depend on `jobs`), a Built or the DdtreeError of each; any other exception is raised. progress(done,
    total, variant, result) is called in this thread as each one finishes. Each entry is written to the cache
    atomically, under its own file lock, as compile_variant does alone."""
    vs = list(vs)
    jobs = default_jobs() if jobs is None else int(jobs)
    if jobs < 1:
        raise BuildError(f"jobs: {jobs}, expected >= 1")
    out = [None] * len(vs)

    def one(i):
        try:
            return i, compile_variant(vs[i])
        except DdtreeError as e:
            return i, e

    if jobs == 1 or len(vs) <= 1:
        done = map(one, range(len(vs)))
        pool = None
    else:
        pool = ThreadPoolExecutor(max_workers=min(jobs, len(vs)), thread_name_prefix="ddtree-gen-build")
        done = (f.result() for f in as_completed([pool.submit(one, i) for i in range(len(vs))]))
    try:
        for k, (i, result) in enumerate(done, 1):
            out[i] = result
            if progress is not None:
                progress(k, len(vs), vs[i], result)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return out


def ensure_built(spec: Spec, kernels=None, arch: str | None = None, *, jobs: int | None = None,
                 say=None) -> dict:
    """Compiled binaries of a spec's kernels (from the cache, compiling what is missing, on `jobs` threads):
    kernel name -> {target: Built}, for every target of the kernel in the spec (only `arch` when given;
    a kernel with no such target maps to {}). say(line), if given, hears what is compiled: one line before
    (how many variants, which, where) and one per compiled variant; nothing when everything is cached. A variant
    is named as `ddtree-gen build` names it: its build's name (tree_verify_wgmma/parts) and target."""
    kdefs = select_kernels(kernels)
    built = {k.name: {} for k in kdefs}
    vs = variants(spec, kdefs, arch)
    missing = [v for v in vs if not is_cached(v)] if say is not None else []
    if missing:
        say(f"ddtree_gen: {spec.name}: compiling {len(missing)} of {len(vs)} variants not in the cache "
            f"({paths.cache_dir()}) with NVRTC, {min(len(missing), jobs or default_jobs())} at a time; "
            f"later loads read them from the cache: " + ", ".join(f"{v.kernel.name} ({v.target})" for v in missing))

    def progress(k, total, v, result):
        if say is not None and not isinstance(result, DdtreeError) and result.status == "compiled":
            say(f"ddtree_gen: {spec.name}: compiled {v.kernel.name} ({v.target}) in {result.seconds:.1f}s")

    for v, result in zip(vs, build_variants(vs, jobs=jobs, progress=progress)):
        if isinstance(result, DdtreeError):
            raise result
        built[v.kernel.name][v.target] = result
    return built


def source_files(sources: dict) -> dict:
    """target -> file name under generated/<spec>/ of one kernel's sources (target -> (Variant, text), in
    preference order): <variant name>.cu (Variant.stem), one file for the targets of one name (their text is the
    same: the config is), <variant name>.<target>.cu for a later target whose text differs all the same."""
    files, texts = {}, {}
    for a, (v, text) in sources.items():
        stem = v.stem
        files[a] = f"{stem}.cu" if texts.setdefault(stem, text) == text else f"{stem}.{a}.cu"
    return files


# what the ptxas report of a build is the report of
PTXAS_OF = {"cubin": "the shipped cubin",
            "ptx": "an sm_80 cubin assembled by NVRTC from the shipped PTX (not shipped: the driver JIT-compiles "
                   "the PTX for the device, and its registers may differ)"}


def targets_for(spec: Spec) -> dict:
    """The manifest's "targets": per target of the spec, its NVRTC options, what is shipped, where it runs."""
    return {a: {"options": list(options(a)), "binary": archs.BINARY[a], "runs_on": archs.RUNS_ON[a]}
            for a in spec.archs}


def manifest_for(spec: Spec, built: list[Built]) -> dict:
    kdefs = {k.name: k for k in all_builds()}
    by_kernel: dict = {}
    for b in built:
        by_kernel.setdefault(b.kernel, {})[b.arch] = b
    kernels = {}
    for name, builds in by_kernel.items():
        kdef = kdefs[name]
        order = [a for a in kdef.archs_for(spec) if a in builds]
        files = source_files({a: (builds[a].variant, builds[a].source) for a in order})
        per_arch = {}
        for a in order:
            b = builds[a]
            plan = b.variant.plan()
            per_arch[a] = {
                "variant": b.variant.name, "config": b.variant.config,
                "source": files[a], "source_sha256": sha256(b.source), "cache_key": b.key,
                "binary": b.kind, "binary_bytes": len(b.binary), "binary_sha256": sha256(b.binary),
                "ptxas": b.report.as_dict(), "ptxas_of": PTXAS_OF[b.kind],
                "model": {n: {"formula": f, "value": v} for n, (f, v) in plan.formulas().items()}
                         | {"register_budget": {"formula": "min(255, floor8(65536 / (threads * min_blocks)))",
                                                "value": plan.register_budget}},
                "model_vs_ptxas": compare(plan, b.report) or "agree",
            }
        kernels[name] = {"kernel": kdef.kernel, "build": kdef.build, "template": kdef.template, "entry": kdef.entry,
                         "archs": order, "builds": per_arch}
    return {"spec": spec.name, "spec_sha256": spec.digest(), "spec_values": spec.as_dict(),
            "template_sha256": templates_digest(), "targets": targets_for(spec), "nvrtc_version": nvrtc_version(),
            "kernels": kernels}


def write_generated(spec: Spec, built: list[Built], root: Path | None = None) -> None:
    """Write generated/<spec>/ (or <root>/<spec>/) atomically, file by file, the manifest last, under a lock;
    .cu files of the folder that no build wrote any more (a kernel or a per-target source that is gone) are
    removed."""
    root = paths.generated_dir() if root is None else Path(root)
    out = root / spec.name
    manifest = manifest_for(spec, built)
    by_kernel: dict = {}
    for b in built:
        by_kernel.setdefault(b.kernel, {})[b.arch] = b
    with file_lock(root / ".lock"):
        written = set()
        for name, entry in manifest["kernels"].items():
            for a, info in entry["builds"].items():
                if info["source"] not in written:
                    atomic_write(out / info["source"], by_kernel[name][a].source)
                    written.add(info["source"])
        atomic_write(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for stale in sorted(out.glob("*.cu")):
            if stale.name not in written:
                stale.unlink()


def expected_sources(spec: Spec) -> dict:
    """kernel -> {target: (file name, rendered text, variant name, config)} of what generated/<spec>/ must hold:
    its default variants'."""
    out = {}
    for kdef in all_builds():
        order = kdef.archs_for(spec)
        if not order:
            continue
        made = {a: (v, render(v)) for a in order for v in [variant(kdef, spec, a)]}
        files = source_files(made)
        out[kdef.name] = {a: (files[a], made[a][1], made[a][0].name, made[a][0].config) for a in order}
    return out


def check_generated(specs: list[Spec], root: Path | None = None, strays: bool = True) -> list[str]:
    """What in generated/ (or `root`) is out of date with specs/ and templates/ (empty list: up to date).
    `strays`: also report folders of no spec among `specs` (a check of every spec, not of named ones).

    Only what the specs and templates determine is compared (sources, hashes, targets and options); the
    binary record (cache keys, sizes, hashes, ptxas reports) is that of the NVRTC the manifest names, and
    another NVRTC of the allowed range neither fails the check nor rewrites it (docs/decisions.md)."""
    problems = []
    tdigest = templates_digest()
    root = paths.generated_dir() if root is None else Path(root)
    for spec in specs:
        out = root / spec.name
        expected = expected_sources(spec)
        try:
            manifest = json.loads((out / MANIFEST).read_text())
            if not isinstance(manifest, dict):
                raise ValueError
        except (OSError, ValueError):
            problems.append(f"{out / MANIFEST}: missing or unreadable")
            manifest = None
        if manifest is not None:
            if manifest.get("spec_sha256") != spec.digest():
                problems.append(f"{out / MANIFEST}: spec hash differs from specs/{spec.name}.toml")
            if manifest.get("template_sha256") != tdigest:
                problems.append(f"{out / MANIFEST}: template hash differs from templates/")
            targets = manifest.get("targets")
            want = targets_for(spec)
            if not isinstance(targets, dict) or set(targets) != set(want):   # (json.dumps sorts the keys)
                problems.append(f"{out / MANIFEST}: targets {sorted(targets) if isinstance(targets, dict) else targets} "
                                f"!= the spec's {sorted(want)}")
            else:
                for a in want:
                    if targets[a] != want[a]:
                        problems.append(f"{out / MANIFEST}: compile options or binary of target {a} differ from "
                                        f"the generator's")
            kernels = manifest.get("kernels", {})
            if not isinstance(kernels, dict) or set(kernels) != set(expected):
                problems.append(f"{out / MANIFEST}: kernels {sorted(kernels) if isinstance(kernels, dict) else kernels} "
                                f"!= {sorted(expected)}")
            else:
                for name, per_arch in expected.items():
                    entry = kernels[name] if isinstance(kernels[name], dict) else {}
                    builds = entry.get("builds") if isinstance(entry.get("builds"), dict) else {}
                    if entry.get("archs") != list(per_arch) or set(builds) != set(per_arch):
                        problems.append(f"{out / MANIFEST}: kernel {name}: targets {entry.get('archs')} != "
                                        f"{list(per_arch)}")
                        continue
                    for a, (file, text, vname, config) in per_arch.items():
                        b = builds[a] if isinstance(builds[a], dict) else {}
                        if b.get("variant") != vname or b.get("config") != config:
                            problems.append(f"{out / MANIFEST}: kernel {name}, target {a}: variant "
                                            f"{b.get('variant')!r} {b.get('config')} is not the one the policy builds "
                                            f"({vname} {config})")
                        elif b.get("source") != file or b.get("source_sha256") != sha256(text):
                            problems.append(f"{out / MANIFEST}: kernel {name}, target {a}: source "
                                            f"{b.get('source')!r} is not the one the template renders ({file})")
        files = {}
        for per_arch in expected.values():
            for file, text, *_ in per_arch.values():
                files[file] = text
        for stray in sorted(out.glob("*.cu")):
            if stray.name not in files:
                problems.append(f"{stray}: no registered kernel renders it")
        for file, text in files.items():
            path = out / file
            try:
                current = path.read_text()
            except OSError:
                problems.append(f"{path}: missing")
                continue
            if current != text:
                problems.append(f"{path}: differs from what the template renders")
    if strays and root.is_dir():
        names = {s.name for s in specs}
        for d in sorted(root.iterdir()):
            if d.is_dir() and d.name not in names:
                problems.append(f"{d}: no spec specs/{d.name}.toml")
    return problems


def generated_state(spec: Spec) -> dict:
    """kernel -> {target: 'up to date' / 'stale' / 'missing' / 'not shipped'} (for `ddtree-gen list`; a spec
    that is not a shipped one has no folder in generated/)."""
    if not shipped(spec):
        return {k.name: {a: "not shipped" for a in k.archs_for(spec)} for k in all_builds()}
    out = paths.generated_dir() / spec.name
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        kernels = manifest.get("kernels", {})
    except (OSError, ValueError, AttributeError):
        manifest, kernels = {}, {}
    fresh = (manifest.get("spec_sha256") == spec.digest() and manifest.get("template_sha256") == templates_digest())
    state = {}
    for kdef in all_builds():
        builds = kernels.get(kdef.name, {}).get("builds", {}) if isinstance(kernels.get(kdef.name), dict) else {}
        state[kdef.name] = {a: ("missing" if a not in builds else "up to date" if fresh else "stale")
                            for a in kdef.archs_for(spec)}
    return state

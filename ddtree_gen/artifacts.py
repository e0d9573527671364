"""Artifacts: the content-hashed binary cache, generated/<spec>/, manifests and drift checks.

- Cache (outside git, paths.cache_dir()): <key>.cubin + <key>.json, key = hash of the rendered
  source, compile options, NVRTC version and entry. The json holds the cubin's SHA-256, so a
  truncated or corrupted binary is detected and rebuilt, never loaded.
- generated/<spec>/: the rendered .cu of every kernel and manifest.json (spec hash, template
  hash, options, NVRTC version, ptxas report and model per kernel). Committed to git.
Every write is atomic (temp file + rename) and builders take a file lock, so concurrent
builds end with valid artifacts and a failed build leaves the previous ones in place.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .compile import OPTIONS, compile_source, nvrtc_version
from .errors import BuildError, SpecError
from .fileio import atomic_write, file_lock
from .plans import KernelDef, all_kernels
from .render import render, templates_digest
from .resources import PtxasReport, compare
from .spec import Spec, load_spec, spec_paths

MANIFEST = "manifest.json"


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def find_spec(name) -> Spec:
    """A spec by name (specs/<name>.toml) or by path to a .toml file."""
    p = Path(str(name))
    if p.suffix == ".toml" or os.sep in str(name):
        return load_spec(p)
    path = paths.specs_dir() / f"{name}.toml"
    if not path.exists():
        known = ", ".join(q.stem for q in spec_paths(paths.specs_dir())) or "none"
        raise SpecError(f"unknown spec {name!r}: no file {path} (known specs: {known})")
    return load_spec(path)


def all_specs() -> list[Spec]:
    return [load_spec(p) for p in spec_paths(paths.specs_dir())]


def select_kernels(kernels=None) -> list[KernelDef]:
    defs = all_kernels()
    if not kernels:
        return defs
    names = {k.name for k in defs}
    unknown = [k for k in kernels if k not in names]
    if unknown:
        raise BuildError(f"unknown kernel {unknown[0]!r} (known: {', '.join(sorted(names))})")
    return [k for k in defs if k.name in kernels]


@dataclass
class Built:
    kernel: str
    source: str
    key: str
    cubin: bytes
    report: PtxasReport
    status: str        # "cached" or "compiled"
    seconds: float = 0.0


def cache_key(source: str, kdef: KernelDef, nvrtc: str) -> str:
    return sha256(json.dumps({"source": sha256(source), "options": list(OPTIONS), "nvrtc": nvrtc,
                              "entry": kdef.entry}, sort_keys=True))


def _read_cache(key: str, entry: str) -> tuple[bytes, PtxasReport] | None:
    root = paths.cache_dir()
    try:
        meta = json.loads((root / f"{key}.json").read_text())
        cubin = (root / f"{key}.cubin").read_bytes()
        if sha256(cubin) != meta["cubin_sha256"] or len(cubin) != meta["cubin_bytes"]:
            return None  # truncated or corrupted: rebuild
        return cubin, PtxasReport(**meta["reports"][entry])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def compile_variant(spec: Spec, kdef: KernelDef, source: str | None = None) -> Built:
    """Rendered source -> cubin, through the cache."""
    source = render(spec, kdef) if source is None else source
    nvrtc = nvrtc_version()
    key = cache_key(source, kdef, nvrtc)
    hit = _read_cache(key, kdef.entry)
    if hit:
        return Built(kdef.name, source, key, hit[0], hit[1], "cached")
    root = paths.cache_dir()
    with file_lock(root / f"{key}.lock"):
        hit = _read_cache(key, kdef.entry)  # another process may have built it while we waited
        if hit:
            return Built(kdef.name, source, key, hit[0], hit[1], "cached")
        t0 = time.perf_counter()
        result = compile_source(source, f"{spec.name}-{kdef.name}.cu", [kdef.entry])
        seconds = time.perf_counter() - t0
        report = result.reports[kdef.entry]
        atomic_write(root / f"{key}.cubin", result.cubin)
        meta = {"cubin_sha256": sha256(result.cubin), "cubin_bytes": len(result.cubin), "nvrtc": nvrtc,
                "options": list(OPTIONS), "reports": {kdef.entry: report.as_dict()}, "log": result.log}
        atomic_write(root / f"{key}.json", json.dumps(meta, indent=1))
    return Built(kdef.name, source, key, result.cubin, report, "compiled", seconds)


def ensure_built(spec: Spec, kernels=None) -> dict:
    """Compiled binaries of a spec's kernels (from the cache, compiling what is missing)."""
    return {k.name: compile_variant(spec, k) for k in select_kernels(kernels)}


def manifest_for(spec: Spec, built: list[Built]) -> dict:
    kdefs = {k.name: k for k in all_kernels()}
    kernels = {}
    for b in built:
        plan = kdefs[b.kernel].plan(spec)
        kernels[b.kernel] = {
            "source": f"{b.kernel}.cu", "source_sha256": sha256(b.source), "template": kdefs[b.kernel].template,
            "entry": kdefs[b.kernel].entry, "cache_key": b.key, "ptxas": b.report.as_dict(),
            "model": {name: {"formula": f, "value": v} for name, (f, v) in plan.formulas().items()}
                     | {"register_budget": {"formula": "min(255, floor8(65536 / (threads * min_blocks)))",
                                            "value": plan.register_budget}},
            "model_vs_ptxas": compare(plan, b.report) or "agree",
        }
    return {"spec": spec.name, "spec_sha256": spec.digest(), "spec_values": spec.as_dict(),
            "template_sha256": templates_digest(), "options": list(OPTIONS), "nvrtc_version": nvrtc_version(),
            "kernels": kernels}


def write_generated(spec: Spec, built: list[Built]) -> None:
    """Write generated/<spec>/ atomically, file by file, the manifest last, under a lock."""
    out = paths.generated_dir() / spec.name
    with file_lock(paths.generated_dir() / ".lock"):
        for b in built:
            atomic_write(out / f"{b.kernel}.cu", b.source)
        atomic_write(out / MANIFEST, json.dumps(manifest_for(spec, built), indent=2, sort_keys=True) + "\n")


def check_generated(specs: list[Spec]) -> list[str]:
    """What in generated/ is out of date with specs/ and templates/ (empty list: up to date)."""
    problems = []
    tdigest = templates_digest()
    kernel_names = {k.name for k in all_kernels()}
    for spec in specs:
        out = paths.generated_dir() / spec.name
        try:
            manifest = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            problems.append(f"{out / MANIFEST}: missing or unreadable")
            continue
        if manifest.get("spec_sha256") != spec.digest():
            problems.append(f"{out / MANIFEST}: spec hash differs from specs/{spec.name}.toml")
        if manifest.get("template_sha256") != tdigest:
            problems.append(f"{out / MANIFEST}: template hash differs from templates/")
        if manifest.get("options") != list(OPTIONS):
            problems.append(f"{out / MANIFEST}: compile options differ from the generator's")
        if set(manifest.get("kernels", {})) != kernel_names:
            problems.append(f"{out / MANIFEST}: kernels {sorted(manifest.get('kernels', {}))} "
                            f"!= {sorted(kernel_names)}")
        expected = {f"{k.name}.cu" for k in all_kernels()}
        for stray in sorted(out.glob("*.cu")):
            if stray.name not in expected:
                problems.append(f"{stray}: no registered kernel renders it")
        for kdef in all_kernels():
            path = out / f"{kdef.name}.cu"
            try:
                current = path.read_text()
            except OSError:
                problems.append(f"{path}: missing")
                continue
            if current != render(spec, kdef):
                problems.append(f"{path}: differs from what the template renders")
    if paths.generated_dir().is_dir():
        names = {s.name for s in specs}
        for d in sorted(paths.generated_dir().iterdir()):
            if d.is_dir() and d.name not in names:
                problems.append(f"{d}: no spec specs/{d.name}.toml")
    return problems


def generated_state(spec: Spec) -> dict:
    """kernel -> 'up to date' / 'stale' / 'missing' (for `ddtree-gen list`)."""
    out = paths.generated_dir() / spec.name
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = {}
    fresh = (manifest.get("spec_sha256") == spec.digest() and manifest.get("template_sha256") == templates_digest())
    state = {}
    for kdef in all_kernels():
        if kdef.name not in manifest.get("kernels", {}):
            state[kdef.name] = "missing"
        else:
            state[kdef.name] = "up to date" if fresh else "stale"
    return state

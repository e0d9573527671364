"""Compiling: CUDA source -> cubin and PTX with NVRTC (through CuPy), plus the ptxas report.

Needs no GPU and no CUDA toolkit: NVRTC comes from its pip wheel. One compile per target
(archs.py): `--gpu-architecture=sm_90a` gives the sm_90a cubin that is shipped; for sm_80,
`--gpu-architecture=sm_80` gives the PTX that is shipped (nvrtcGetPTX: the same text as a
compute_80 compile) and, from the same run, an sm_80 cubin that is not shipped: ptxas has
assembled the PTX, which a compute_80 compile alone never checks (NVRTC passes inline PTX of a
virtual target through unread: wgmma "compiles" for compute_80), and its report is what the
model is compared with.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .. import archs
from ..errors import BuildError
from .resources import PtxasReport

COMMON_OPTIONS = ("--std=c++17", "-Xptxas=-v", "--device-as-default-execution-space")


def options(arch: str) -> tuple:
    """NVRTC options of a target's compile."""
    return (f"--gpu-architecture={archs.NVRTC_ARCH[archs.check(arch)]}", *COMMON_OPTIONS)


# sm_90a: Hopper's architecture-specific target, for wgmma (tree_verify_wgmma). Its cubins run on
# compute capability 9.0 exactly (H100 / H200), the chips the kernels are written for.
ARCH = archs.PRIMARY
OPTIONS = options(ARCH)


def nvrtc_version() -> str:
    from cupy.cuda import nvrtc
    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    reports: dict  # entry name -> PtxasReport
    ptx: bytes = b""   # the PTX the cubin was assembled from


_FUNC_RE = re.compile(r"Compiling entry function '([^']+)' for")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_PERF_RE = re.compile(r"\((C\d+)\) Potential Performance Loss: (.*)")
_PERF_FUNC_RE = re.compile(r"in the function '([^']+)'")


def parse_ptxas(log: str) -> dict:
    """Parse `ptxas -v` output into {entry: PtxasReport}. A "Potential Performance Loss" note goes to
    the function it names, or to every entry of the log when it names none (C7507 does not)."""
    reports, current, frame, perf = {}, None, {}, []
    for line in log.splitlines():
        m = _PERF_RE.search(line)
        if m:
            f = _PERF_FUNC_RE.search(m.group(2))
            perf.append((f.group(1) if f else None, f"{m.group(1)} {' '.join(m.group(2).split())}"))
            continue
        m = _FUNC_RE.search(line)
        if m:
            current = m.group(1)
            continue
        m = _PROPS_RE.search(line)
        if m:
            current = m.group(1)
            continue
        m = _FRAME_RE.search(line)
        if m and current:
            frame[current] = tuple(int(x) for x in m.groups())
            continue
        m = _USED_RE.search(line)
        if m and current:
            s = _SMEM_RE.search(line)
            stack, st, ld = frame.get(current, (0, 0, 0))
            reports[current] = PtxasReport(registers=int(m.group(1)), smem=int(s.group(1)) if s else 0,
                                           stack=stack, spill_stores=st, spill_loads=ld)
    for name, report in reports.items():
        notes = tuple(dict.fromkeys(msg for func, msg in perf if func in (None, name)))
        if notes:
            reports[name] = dataclasses.replace(report, perf_warnings=notes)
    return reports


def _excerpt(source: str, log: str, filename: str, context: int = 2) -> str:
    """The rendered source lines that NVRTC's errors point at."""
    lines = source.splitlines()
    shown, out = set(), []
    for m in re.finditer(re.escape(filename) + r"\((\d+)\)", log):
        n = int(m.group(1))
        if n in shown:
            continue
        shown.add(n)
        out.append(f"--- {filename}:{n} ---")
        for i in range(max(1, n - context), min(len(lines), n + context) + 1):
            out.append(f"{'>' if i == n else ' '}{i:5d} | {lines[i - 1]}")
    return "\n".join(out)


# NVRTC 12.9+ keeps a cache of the programs it compiled, across processes (CUDA_CACHE_DISABLE=1 also turns it off); a
# compile it finds there skips ptxas and returns an empty log, so a kernel compiled before on the machine (into another
# binary cache, by `build --out`, before the ddtree-gen cache was cleared) would get no ptxas report and fail its
# build. Seen on the H200 machine (NVRTC 13.0). Our binary cache already keeps every variant, so NVRTC's adds nothing.
# Not a codegen option: not part of options(), the cache keys or the manifests.
NO_CACHE = "--no-cache"


def compile_source(source: str, filename: str, entries: list[str], options=OPTIONS) -> CompileResult:
    from cupy.cuda import nvrtc
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*options, NO_CACHE])
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            raise BuildError(f"NVRTC failed to compile {filename}:\n{log.strip(chr(0) + ' ' + chr(10))}\n\n"
                             f"{_excerpt(source, log, filename)}") from None
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    reports = parse_ptxas(log)
    missing = [e for e in entries if e not in reports]
    if missing:
        raise BuildError(f"{filename}: ptxas reported nothing for entry {missing[0]!r}; "
                         f"is it declared extern \"C\" __global__?\n{log}")
    return CompileResult(cubin=cubin, log=log, reports=reports, ptx=ptx)

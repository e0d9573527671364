"""Build targets (GPU architectures) and the rule that picks the one a device runs.

* sm_90a: cubins of Hopper's architecture-specific target (the only one with wgmma). They run on
  compute capability 9.0 exactly: H100, H200.
* sm_80: PTX for compute_80, shipped as text; the driver JIT-compiles it for the device at module
  load, so it runs on any GPU of compute capability 8.0 or later: A100 (8.0), A10 / RTX 30xx (8.6),
  L4 / L40S / RTX 40xx (8.9), Hopper (9.0, when forced), B200 / B300 (10.x), RTX 50xx (12.x).

Which targets a spec is built for is its `archs` field (ddtree_gen/spec.py); which targets a
kernel can be built for is its KernelDef's `archs` (ddtree_gen/ops/). A kernel set picks, per
kernel and device, with select(): the sm_90a cubin on compute capability 9.0, the sm_80 PTX on
any other of 8.0 or later. DDTREE_GEN_ARCH=sm_80 (or ddtree_gen.load(spec, arch="sm_80")) forces
one target everywhere, for testing the PTX path on a Hopper GPU.
"""
from __future__ import annotations

import os

from .errors import ArgumentError, DdtreeError

ARCHS = ("sm_90a", "sm_80")      # every target the generator knows, in order of preference
PRIMARY = "sm_90a"               # the target the kernels are written and tuned for
DEFAULT = ARCHS                  # a spec without an `archs` field is built for these
ENV = "DDTREE_GEN_ARCH"          # forces one target (sm_80: the PTX path on any device)

# what NVRTC is asked for and what is shipped: (--gpu-architecture, kind of the shipped binary)
NVRTC_ARCH = {"sm_90a": "sm_90a", "sm_80": "sm_80"}
BINARY = {"sm_90a": "cubin", "sm_80": "ptx"}
RUNS_ON = {"sm_90a": "compute capability 9.0 (H100, H200)",
           "sm_80": "compute capability 8.0 or later, through the driver's PTX JIT (A100, A10, L4, L40S, "
                    "RTX 30xx/40xx/50xx, B200, B300, and Hopper when forced)"}
MIN_CC = (8, 0)


def check(arch, where: str = "arch", error=ArgumentError) -> str:
    """`arch` if it is a known target, else `error` naming `where` and the known ones."""
    if arch not in ARCHS:
        raise error(f"{where}: unknown target {arch!r} (known: {', '.join(ARCHS)})")
    return arch


def ordered(archs) -> tuple:
    """`archs` in preference order (ARCHS order), without duplicates."""
    return tuple(a for a in ARCHS if a in set(archs))


def forced(arch=None) -> str | None:
    """The target forced by `arch` (load's argument) or else by $DDTREE_GEN_ARCH; None: pick per device.
    "" and "auto" mean no forcing."""
    if arch is None:
        arch = os.environ.get(ENV, "")
        if arch in ("", "auto"):
            return None
        return check(arch, f"${ENV}", DdtreeError)
    if arch in ("", "auto"):
        return None
    return check(arch, "arch")


def runs_on(arch: str, cc: tuple) -> bool:
    """Whether a build for `arch` runs on a device of compute capability `cc` = (major, minor)."""
    if arch == "sm_90a":
        return tuple(cc) == (9, 0)     # architecture-specific: not forward compatible
    if arch == "sm_80":
        return tuple(cc) >= MIN_CC     # PTX: JIT-compiled for any later device
    return False


def select(cc: tuple, built, forced_arch: str | None = None) -> str | None:
    """The target a device of compute capability `cc` runs, among the targets `built` for a kernel:
    the first of ARCHS (sm_90a, then sm_80) that is built, runs on the device and, when a target is
    forced, is that one. None: no build of the kernel runs there (why_not() says why)."""
    for arch in ARCHS:
        if arch in built and (forced_arch is None or arch == forced_arch) and runs_on(arch, cc):
            return arch
    return None


def cc_text(cc: tuple) -> str:
    return f"{cc[0]}.{cc[1]}"


def why_not(cc: tuple, built, forced_arch: str | None = None) -> str:
    """Why select() found nothing (a phrase for an error message)."""
    if tuple(cc) < MIN_CC:
        return f"ddtree-gen kernels need compute capability {cc_text(MIN_CC)} or later"
    built = ordered(built)
    if forced_arch is not None and forced_arch not in built:
        return (f"the target is forced to {forced_arch} (${ENV} or load(arch=)) and the kernel is built for "
                f"{', '.join(built) or 'no target'} only")
    if forced_arch is not None:
        return f"the target is forced to {forced_arch} (${ENV} or load(arch=)), which runs on {RUNS_ON[forced_arch]}"
    if not built:
        return "the kernel is built for no target of this kernel set"
    return f"the kernel is built for {', '.join(built)} only, which runs on " + \
        "; ".join(RUNS_ON[a] for a in built)

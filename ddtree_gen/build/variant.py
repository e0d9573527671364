"""Variants as named data: a variant is (kernel, spec, target, config), and everything that builds one reads it.

* `config` is the kernel's build configuration: tile sizes, schedule, the knobs of the comparison and ablation
  scripts (plain values, hashable). A kernel without knobs has the empty config.
* The default config of a (kernel, spec, target) comes from one policy function, `default_config` (each kernel
  family's `KernelDef.policy`: the mma.sync kernels' tuned BN / STAGES per target, tree_verify_wgmma's schedule
  and TMA choice); `variant(kernel, spec, target, **knobs)` is the one builder: the default config with the knobs
  changed (an unknown knob is a BuildError naming the known ones). The tuner, the ablation and the comparison
  scripts build their variants through it.
* Its procedural name, `Variant.name`, spells the config (`tree_verify_mma.bn64.s2`, `tree_verify_wgmma.seesaw.tma`,
  `tree_build` for a kernel without knobs): the stem of its generated file (generated/<spec>/<name>.cu), its entry
  in the manifest (each build's "variant"), part of its cache key, and the name of its NVRTC compile.
* render, compile and artifacts take a Variant where they took (spec, kernel, target).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..archs import PRIMARY
from ..errors import BuildError
from .resources import Plan
from ..spec import Spec
from .kernel_def import KernelDef


def default_config(kernel: KernelDef, spec: Spec, target: str = PRIMARY) -> dict:
    """The policy: the config `kernel` is built with for `spec` on `target` by default (empty for a kernel without
    knobs)."""
    return dict(kernel.policy(spec, target)) if kernel.policy is not None else {}


@dataclass(frozen=True)
class Variant:
    """One build of a kernel: for a spec, a target (archs.py) and a config (the kernel's knobs as sorted items)."""
    kernel: KernelDef
    spec: Spec
    target: str
    config_items: tuple = ()

    @property
    def config(self) -> dict:
        return dict(self.config_items)

    @property
    def is_default(self) -> bool:
        """Whether this is the build `ddtree-gen build` makes and ships (the policy's config)."""
        return self.config == default_config(self.kernel, self.spec, self.target)

    @property
    def name(self) -> str:
        """The procedural name: the kernel's (also for its further builds: their configs differ), then the config
        spelled by the kernel (KernelDef.spell)."""
        parts = self.kernel.spell(self.config) if self.kernel.spell is not None else ()
        return ".".join((self.kernel.kernel, *parts))

    @property
    def stem(self) -> str:
        """The generated file's stem: the procedural name (artifacts.source_files)."""
        return self.name

    def plan(self) -> Plan:
        """The resource plan of this build (template constants, shared memory, threads)."""
        return self.kernel.plan_for(self.spec, self.target, self.config if self.kernel.policy is not None else None)

    def __repr__(self) -> str:
        return f"Variant({self.name!r}, spec={self.spec.name!r}, target={self.target!r})"

    def __hash__(self) -> int:   # (a KernelDef holds a dict: hashed by its name)
        return hash((self.kernel.name, self.spec, self.target, self.config_items))


def variant(kernel: KernelDef, spec: Spec, target: str = PRIMARY, **knobs) -> Variant:
    """The variant of `kernel` for `spec` and `target` with the default config (default_config) and `knobs`
    changed: variant(by_name("tree_verify_wgmma"), spec, schedule="lockstep", tma=False)."""
    if target not in kernel.archs:
        raise BuildError(f"kernel {kernel.name} is not built for {target} (its targets: {', '.join(kernel.archs)})")
    config = default_config(kernel, spec, target)
    unknown = [k for k in knobs if k not in config]
    if unknown:
        known = ", ".join(config) or "none"
        raise BuildError(f"kernel {kernel.name}: no knob {unknown[0]!r} (its knobs: {known})")
    config.update(knobs)
    return Variant(kernel, spec, target, tuple(sorted(config.items())))


def default_variants(spec: Spec, kernels, target: str | None = None) -> list[Variant]:
    """The default variant of each of `kernels` for every target it is built for in `spec`
    (KernelDef.archs_for), in build order; only `target`'s when given."""
    return [variant(k, spec, a) for k in kernels for a in k.archs_for(spec) if target is None or a == target]

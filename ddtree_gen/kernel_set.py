"""KernelSet: a spec's compiled kernels with their launchers bound as methods, and load().

The top of the import graph: it joins the build layer (artifacts), the runtime and the
launchers (kernels/). One KernelSet serves every GPU of the process and every thread: modules are
loaded per device on first use, and launches go to the current stream of the inputs' device.
"""
from __future__ import annotations

import threading

from . import artifacts
from .kernels import LAUNCHERS
from .plans import KernelDef, all_kernels
from .plans import tree_verify_mma as mma_plans
from .runtime import DeviceModules
from .spec import Spec

__all__ = ["KernelSet", "load", "variant_set"]


class KernelSet:
    """The compiled kernels of one spec. Launchers are attributes: kset.tree_build(...)."""

    def __init__(self, spec, built: dict, kdefs: list[KernelDef] | None = None):
        """`built`: kernel name -> artifacts.Built; `kdefs`: the KernelDefs (default: every registered one)."""
        self.spec = spec
        self._plans = {}
        self._constants = {}
        modules = {}
        for kdef in kdefs if kdefs is not None else all_kernels():
            if kdef.name not in built:
                continue
            plan = kdef.plan(spec)
            # launch geometry is evaluated once here: sympy has no place on the launch path
            modules[kdef.name] = (built[kdef.name].cubin, kdef.entry, plan.value(plan.threads),
                                  plan.value(plan.dynamic_smem))
            self._plans[kdef.name] = plan
            self._constants[kdef.name] = plan.template_constants()
            setattr(self, kdef.name, _bind(LAUNCHERS[kdef.name], self))
        self._modules = DeviceModules(modules)
        self.prepared_calls: dict = {}   # call signature -> runtime.Prepared (see runtime.run_call)

    @property
    def kernels(self) -> list[str]:
        return self._modules.names

    def plan(self, name):
        return self._plans[name]

    def constants(self, name) -> dict:
        """The kernel's template constants (THREADS, BN, ...), evaluated once at load."""
        return self._constants[name]

    def launch(self, name: str, *, grid: tuple, args: list, device: int, kind: str, fmt: str) -> None:
        """Launch kernel `name` on `device`'s current stream (torch's for kind "torch", else CuPy's)."""
        self._modules.launch(name, grid, args, device, kind, fmt)

    def __repr__(self):
        return f"KernelSet({self.spec.name!r}, kernels={self.kernels})"


def _bind(launch, kset):
    def bound(*args, **kwargs):
        return launch(kset, *args, **kwargs)
    bound.__name__ = launch.__name__
    bound.__doc__ = launch.__doc__
    return bound


_LOADED: dict = {}
_LOCK = threading.Lock()


def load(spec, *, kernels=None) -> KernelSet:
    """The compiled kernel set of a spec (a name from specs/, a path, or a Spec), building it if needed.
    Loading touches no GPU: modules are loaded on each device at its first launch."""
    spec = spec if isinstance(spec, Spec) else artifacts.find_spec(spec)
    key = (spec, tuple(kernels) if kernels else None)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = KernelSet(spec, artifacts.ensure_built(spec, kernels=kernels))
        return _LOADED[key]


def variant_set(spec, config) -> KernelSet:
    """A KernelSet of one tree_verify_mma configuration (for the tuner): compiled through the cache,
    with `.config` and `.reports` (kernel name -> (plan, ptxas report)).

    vs = variant_set(spec, {"BN": 32, "STAGES": 3}); vs.tree_verify_mma(...)
    """
    config = mma_plans._normalise(config)
    defs = mma_plans.variant_defs(config)
    built = {k.name: artifacts.compile_variant(spec, k) for k in defs}
    vs = KernelSet(spec, built, kdefs=defs)
    vs.config = config
    vs.reports = {k.name: (k.plan(spec), built[k.name].report) for k in defs}
    return vs


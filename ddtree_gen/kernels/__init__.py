"""The launchers, one module per kernel family, with the kernels' declarations, and KernelSetLike: what a launcher
asks of its kernel set.

A launcher is `launch(kset, *args, **kwargs)`: it checks its arguments (kernels/checks.py, once
per call signature) and launches through the runtime. Next to it, its module declares the kernel
(`DECLARATIONS = [Declaration(...)]`, plans/declaration.py): the launcher, reference, output record, torch ops
(their fakes and implementations are here too), sanitizer cases and bundles, as the objects themselves. A module
of this package with DECLARATIONS is listed in declarations() (docs/adding-a-kernel.md);
ddtree_gen.registry collects them and ddtree_gen.kernel_set makes each launcher the KernelSet method of the
kernel's name. The build data of each kernel (template, entry, resource plan) and the inputs of its cases are in
ddtree_gen.plans, which imports nothing from here.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class KernelSetLike(Protocol):
    """The kernel set a launcher is given: kernel_set.KernelSet (a spec's compiled kernels), or
    kernel_set.StandInKernelSet (the same without a GPU: CPU tests, host-side profiling)."""

    spec: object               # the Spec
    prepared_calls: dict       # call signature -> runtime.Prepared (runtime.run_call's cache)

    @property
    def kernels(self) -> list:
        """The kernels with a build in this set."""

    @property
    def requested(self) -> tuple:
        """The kernels the set was loaded with (also those without a build for its targets)."""

    def unavailable(self, name: str, device: int) -> str | None:
        """None if kernel `name` runs on `device`, else why not."""

    def require(self, name: str, device: int) -> str:
        """The target `name` runs as on `device`; ArgumentError (unavailable()'s message) if none."""

    def offer(self, device: int | None):
        """What the set offers on `device` as data (runtime.DeviceOffer): what tree_verify's route reads."""

    def plan(self, name: str, device: int | None = None):
        """The resource plan of `name`'s build for `device`."""

    def constants(self, name: str, device: int | None = None) -> dict:
        """The template constants of `name`'s build for `device`."""

    def launch(self, name: str, *, grid: tuple, args: list, device: int, kind: str, fmt: str) -> None:
        """Launch kernel `name` on `device`'s current stream."""


def declarations() -> list:
    """The DECLARATIONS of every launcher module (ddtree_gen.registry orders them by build order): one per family of
    plans.FAMILIES (split_kv's combine kernel: tensor_core's)."""
    from . import (draft_topk, kv_commit, kv_dequant, tensor_core, tree_accept, tree_build, tree_verify,
                   tree_verify_mma, tree_verify_wgmma)
    modules = (tree_build, tree_verify, tree_verify_mma, tensor_core, tree_verify_wgmma, tree_accept, kv_commit,
               draft_topk, kv_dequant)
    return [d for m in modules for d in m.DECLARATIONS]


__all__ = ["KernelSetLike", "declarations"]

"""KernelSetLike: what a launcher (ops/<op>/launch.py) asks of its kernel set.

A launcher is `launch(kset, *args, **kwargs)`: it checks its arguments (launch/checks.py, once per call signature) and
launches through the runtime (launch/runtime.py). kernel_set.KernelSet and kernel_set.StandInKernelSet answer it.
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

    def launch(self, name: str, *, grid: tuple, args: list, device: int, kind: str, fmt: str, pdl: bool = False) -> None:
        """Launch kernel `name` on `device`'s current stream (pdl: as a programmatic dependent of the launch before
        it; the runtime passes pdl= only where a step asks for it)."""


__all__ = ["KernelSetLike"]

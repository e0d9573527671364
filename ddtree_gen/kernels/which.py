"""Which kernel a tree_verify / tree_verify_tail call runs: `which_kernel(kset, B, Nq, max_pages)`.

A thin view of the launchers' own rules (nothing is decided here): kernels/tree_verify.py picks the implementation
(_pick_impl, _first_that_runs: impl="auto" is the first of wgmma, mma whose kernels are loaded and run on the
device, else the CUDA-core kernel) and an fp8 spec's path (fp8_default); kernels/tensor_core.grid_kernel the grid
build (the parts grid where it applies); plans/tree_verify_wgmma.schedule_for the wgmma kernels' schedule. Decided
from shapes and the device only, like the launch itself, so the answer is the call's (docs/engine.md: tune by it).
"""
from __future__ import annotations

from typing import NamedTuple

from ..plans.tree_verify_wgmma import DEQUANT, schedule_for
from . import tree_verify as _tv
from .tensor_core import grid_kernel


class TreeVerifyChoice(NamedTuple):
    launcher: str          # "tree_verify" or "tree_verify_tail"
    impl: str              # "wgmma", "mma" or "simple"
    kernel: str            # the attention kernel launched, e.g. tree_verify_wgmma, tree_verify_wgmma_parts
    schedule: str | None   # a wgmma kernel's schedule ("seesaw" / "lockstep"), else None
    fp8_path: str | None   # an fp8 spec's tree_verify: "fused" or "dequant"; None for a bf16 spec or the tail
    reason: str            # why that fp8 path (fp8_default's reason), else ""


def which_kernel(kset, b: int, nq: int, max_pages: int, *, device: int = 0, impl: str = "auto",
                 name: str = "tree_verify", num_splits=None, workspace=None, fp8_path=None,
                 kv_workspace: bool = False) -> TreeVerifyChoice:
    """What `kset.<name>(q_nope [b, nq, H, R], ..., block_table [b, max_pages], impl=impl, num_splits=num_splits,
    workspace=workspace, fp8_path=fp8_path)` runs on CUDA device `device`. `kv_workspace`: whether the call passes
    one. The split count is the launcher's (plans/split_kv.choose_splits) and not part of the record. ArgumentError
    where the launch itself would refuse impl / fp8_path for this kernel set."""
    spec = kset.spec
    path, reason = None, ""
    if spec.kv_fp8 and name == "tree_verify":
        choice = _tv._fp8_choice(kset, impl, fp8_path, object() if kv_workspace else None)
        path, reason = (_tv.fp8_default(kset, impl, device, b, max_pages, kv_workspace) if choice == "auto"
                        else (choice, f"fp8_path={fp8_path!r}"))
    if path == "dequant":
        kernel = grid_kernel(kset, DEQUANT, b, nq, max_pages, num_splits, workspace, device)
        return TreeVerifyChoice(name, "wgmma", kernel, schedule_for(spec, kernel), path, reason)
    kind = _tv._first_that_runs(kset, name, _tv._pick_impl(kset, name, impl, workspace, num_splits), device)
    if kind == "simple":
        return TreeVerifyChoice(name, "simple", name, None, path, reason)
    kernel = grid_kernel(kset, _tv._kernel(name, kind), b, nq, max_pages, num_splits, workspace, device)
    return TreeVerifyChoice(name, kind, kernel, schedule_for(spec, kernel) if kind == "wgmma" else None, path, reason)

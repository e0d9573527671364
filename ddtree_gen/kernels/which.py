"""Which kernel a tree_verify / tree_verify_tail call runs, `which_kernel(kset, B, Nq, max_pages)`, and its schedule,
`schedule(kset, B, Nq, max_pages)` (ks.tree_verify_schedule): grid, pieces, blocks, combine, workspace.

A thin view of the launchers' own rules (nothing is decided here): kernels/tree_verify.py picks the implementation
(_pick_impl, _first_that_runs: impl="auto" is the first of wgmma, mma whose kernels are loaded and run on the
device, else the CUDA-core kernel) and an fp8 spec's path (fp8_default); kernels/tensor_core.grid_kernel the grid
build (the parts grid where it applies); plans/tree_verify_wgmma.schedule_for the wgmma kernels' schedule. Decided
from shapes and the device only, like the launch itself, so the answer is the call's (docs/engine.md: tune by it).
"""
from __future__ import annotations

from typing import NamedTuple

from ..plans.split_kv import BM, parts_workspace_elems, workspace_elems as split_workspace_elems
from ..plans.tree_verify_wgmma import DEQUANT, schedule_for
from ..types import Schedule
from . import tree_verify as _tv
from .tensor_core import grid_kernel, pieces


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


def schedule(kset, b: int, nq: int, max_pages: int, *, device: int = 0, impl: str = "auto", name: str = "tree_verify",
             num_splits=None, fp8_path=None, kv_workspace: bool = False) -> Schedule:
    """The schedule of the call which_kernel describes: its kernel, grid ("parts": the batch's work cut into balanced
    parts on the device, from the lengths; "chunks": each request cut into chunks; "rows": the CUDA-core kernel), piece
    count, blocks, whether the combine follows and the float32 workspace it needs (ddtree_gen.types.Schedule). The
    launcher's own rule, from shapes only: an engine may ask once per step (B, Nq and max_pages are the step's) and
    size one workspace for every layer (docs/engine.md "The schedule")."""
    spec = kset.spec
    choice = which_kernel(kset, b, nq, max_pages, device=device, impl=impl, name=name, num_splits=num_splits,
                          fp8_path=fp8_path, kv_workspace=kv_workspace)
    if choice.impl == "simple":
        groups = kset.constants(name, device)["HEAD_GROUPS"]
        return Schedule(choice.kernel, "rows", 1, groups * nq * b, False, 0, choice.fp8_path)
    parts, count = pieces(kset, choice.kernel, name == "tree_verify_tail", b, nq, max_pages, num_splits, device,
                          kset.require(choice.kernel, device))
    row_tiles = -(-nq * spec.num_heads // BM)
    blocks = (count * row_tiles if parts else b * count * row_tiles) if b else 0
    need = parts_workspace_elems(spec, b, nq, count) if parts else split_workspace_elems(spec, b, nq, count)
    return Schedule(choice.kernel, "parts" if parts else "chunks", count, blocks, count > 1 and b > 0, need,
                    choice.fp8_path)

"""Which kernel a tree_verify / tree_verify_tail call runs, `which_kernel(kset, B, Nq, max_pages)`, and its schedule,
`schedule(kset, B, Nq, max_pages)` (ks.tree_verify_schedule): grid, pieces, blocks, combine, workspace.

A view of the launcher's own route (ops/tree_verify/route.route, which every call takes; nothing is decided here): an
fp8 spec's path, the backend, the build of the tensor-core kernel, and that build's record's schedule (a wgmma
build's). Decided from shapes and the device
only, like the launch itself, so the answer is the call's (docs/engine.md: tune by it).
"""
from __future__ import annotations

from typing import NamedTuple

from .split import BM, DEFAULT_SMS, parts_workspace_elems, workspace_elems as split_workspace_elems
from ...launch.runtime import sm_count
from ...types import Schedule
from .tensor_core import pieces
from .route import VerifyCall, route


class TreeVerifyChoice(NamedTuple):
    launcher: str          # "tree_verify" or "tree_verify_tail"
    impl: str              # "wgmma", "mma" or "simple"
    kernel: str            # the attention build launched, e.g. tree_verify_wgmma, tree_verify_wgmma/parts
    schedule: str | None   # a wgmma kernel's schedule ("seesaw" / "lockstep"), else None
    fp8_path: str | None   # an fp8 spec's tree_verify: "fused" or "dequant"; None for a bf16 spec or the tail
    reason: str            # why that fp8 path (fp8_default's reason), else ""


def which_kernel(kset, b: int, nq: int, max_pages: int, *, device: int = 0, impl: str = "auto",
                 name: str = "tree_verify", num_splits=None, workspace=None, fp8_path=None,
                 kv_workspace: bool = False, build=None) -> TreeVerifyChoice:
    """What `kset.<name>(q_nope [b, nq, H, R], ..., block_table [b, max_pages], impl=impl, num_splits=num_splits,
    workspace=workspace, fp8_path=fp8_path, build=build)` runs on CUDA device `device`. `kv_workspace`: whether the
    call passes one. The split count is the launcher's (ops/tree_verify/split.choose_splits) and not part of the record.
    ArgumentError where the launch itself would refuse impl / fp8_path / build for this kernel set."""
    r = _route(kset, b, nq, max_pages, device, impl, name, num_splits, workspace, fp8_path, kv_workspace, build)
    return TreeVerifyChoice(name, r.impl, r.build, getattr(r.record, "schedule", None), r.fp8_path, r.reason)


def _route(kset, b, nq, max_pages, device, impl, name, num_splits, workspace, fp8_path, kv_workspace, build):
    arrays = (None,) * 9 + (workspace, object() if kv_workspace else None)
    call = VerifyCall(name, arrays, 1.0, None, False, impl, num_splits, fp8_path if name == "tree_verify" else None,
                      build)
    return route(kset.offer(device), call, b, nq, max_pages)


def schedule(kset, b: int, nq: int, max_pages: int, *, device: int = 0, impl: str = "auto", name: str = "tree_verify",
             num_splits=None, fp8_path=None, kv_workspace: bool = False, build=None) -> Schedule:
    """The schedule of the call which_kernel describes: its kernel, grid (its build record's: "parts", the batch's work
    cut into balanced parts on the device, from the lengths; "chunks": each request cut into chunks; "rows": the
    CUDA-core kernel), piece count, blocks, whether the combine follows and the float32 workspace it needs
    (ddtree_gen.types.Schedule). The launcher's own rule, from shapes only: an engine may ask once per step (B, Nq and
    max_pages are the step's) and size one workspace for every layer (docs/engine.md "The schedule")."""
    spec = kset.spec
    r = _route(kset, b, nq, max_pages, device, impl, name, num_splits, None, fp8_path, kv_workspace, build)
    if r.impl == "simple":
        groups = kset.constants(name, device)["HEAD_GROUPS"]
        return Schedule(r.build, "rows", 1, groups * nq * b, False, 0, r.fp8_path)
    offer = kset.offer(device)
    parts, count = pieces(offer, r.build, name == "tree_verify_tail", b, nq, max_pages, num_splits,
                          offer.require(r.build))
    row_tiles = -(-nq * spec.num_heads // BM)
    blocks = r.record.launch_grid(b, count, row_tiles, sm_count(device) if b else DEFAULT_SMS)[0] if b else 0
    need = parts_workspace_elems(spec, b, nq, count) if parts else split_workspace_elems(spec, b, nq, count)
    return Schedule(r.build, r.record.grid if parts else "chunks", count, blocks, count > 1 and b > 0, need,
                    r.fp8_path)

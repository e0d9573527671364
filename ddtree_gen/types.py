"""Output records shared by the GPU launchers and the numpy references (same names)."""
from typing import Any, NamedTuple


class TreeBuildOutput(NamedTuple):
    num_nodes: Any      # [B] int32
    tokens: Any         # [B, N] int32, -1 padded
    parents: Any        # [B, N] int32, -1 for the root and padding
    depths: Any         # [B, N] int32, -1 padded
    positions: Any      # [B, N] int32 (prefix_len + depth), -1 padded
    scores: Any         # [B, N] float32, -inf padded
    tree_mask: Any      # [B, N, W] uint32
    first_child: Any    # [B, N] int32, -1 = none
    next_sibling: Any   # [B, N] int32, -1 = none


class AttentionOutput(NamedTuple):
    out: Any            # [B, Nq, H, R] (bf16 bits as uint16 on the GPU; float64 in the reference)
    lse: Any            # [B, Nq, H] float32 (float64 in the reference), natural log


class TreeAcceptOutput(NamedTuple):
    accept_lens: Any      # [B] int32
    accepted_nodes: Any   # [B, D+1] int32, -1 padded
    out_tokens: Any       # [B, D+1] int32, -1 padded
    new_prefix_lens: Any  # [B] int32


class Schedule(NamedTuple):
    """What a tree_verify call of given shapes runs (ops.tree_verify.launch.schedule; ks.tree_verify_schedule)."""
    kernel: str            # the attention build launched (e.g. tree_verify_wgmma/parts, tree_verify_wgmma)
    grid: str              # "parts" (the batch's work cut into balanced parts on the device), "chunks" (each request
                           # cut into `pieces` chunks) or "rows" (the CUDA-core kernel: a block per row and head group)
    pieces: int            # parts or chunks (1: none)
    blocks: int            # blocks of the attention launch
    combine: bool          # whether tree_verify_mma_combine merges the pieces after it
    workspace_elems: int   # float32 elements of workspace= the call needs (0: none)
    fp8_path: str | None   # an fp8 spec's path ("dequant": kv_dequant runs first; "fused"), None for bf16

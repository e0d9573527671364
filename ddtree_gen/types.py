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

"""Resource plans of the CUDA-core attention kernels: tree_verify, tree_verify_tail, merge_states.

tree_verify / tree_verify_tail: one block per (request, query row, group of heads), keys streamed
through shared memory in double-buffered tiles with an online softmax, so any prefix length runs
in fixed shared memory. An fp8 spec's kernel double-buffers the tiles' e4m3 bytes and converts each
into one bf16 tile: 2 x TK x (R+P) bytes + TK x (R+P) x 2, the same total as the bf16 kernel's two
bf16 tiles. merge_states: a warp per (row, head).
"""
from __future__ import annotations

import sympy

from ..errors import SpecError
from ..resources import SM90_STATIC_SMEM, H, P, R, Plan
from .kernel_def import KernelDef
from .declaration import Bundles, Declaration, TorchOp

_MAX_LIVE = 180   # registers per thread the verify kernel may spend on q and accumulators

def _verify_tiles(spec):
    """(heads per warp, keys per tile) with HPW * TK = 32: the smallest HPW whose two tiles fit."""
    row = spec.kv_lora_rank + spec.qk_rope_head_dim
    for hpw in (2, 4, 8):
        tk = 32 // hpw
        if 2 * tk * row * 2 + 2 * tk * 4 <= SM90_STATIC_SMEM:
            return hpw, tk
    return 8, 4  # does not fit: Plan.check_fits refuses the spec with the formula


def verify_plan(spec, kernel="tree_verify") -> Plan:
    hpw, tk = _verify_tiles(spec)
    warps = sympy.Min(8, sympy.ceiling(H / hpw))      # up to 8 warps of hpw heads
    heads_per_block = warps * hpw
    threads = 32 * warps
    # bf16 cache: two key tiles of tk rows (R + P bf16); fp8: two tiles of e4m3 bytes and one bf16 tile;
    # + two tiles of per-key visibility flags (int)
    tiles = 2 * tk * (R + P) * 2 if not spec.kv_fp8 else 2 * tk * (R + P) + tk * (R + P) * 2
    static_smem = tiles + 2 * tk * 4
    nwarps = int(warps.subs({H: spec.num_heads}))
    # q (2 (RW + PW)) and output accumulators (2 RW) per head live in registers in every lane
    live = hpw * (4 * -(-spec.kv_lora_rank // 64) + 2 * -(-spec.qk_rope_head_dim // 64))
    if live > _MAX_LIVE:
        raise SpecError(f"spec {spec.name!r}, kernel {kernel}: kv_lora_rank = {spec.kv_lora_rank} with "
                        f"qk_rope_head_dim = {spec.qk_rope_head_dim} needs {live} query/accumulator registers per "
                        f"thread ({hpw} heads per warp); this kernel holds at most {_MAX_LIVE}")
    # up to 72 of them (R = 512, P = 64: 68) fit 128 registers: 16 warps per SM; beyond, one block
    min_blocks = max(1, 16 // nwarps) if live <= 72 else 1
    return Plan(kernel=kernel, spec=spec, threads=threads, min_blocks=min_blocks,
                static_smem=static_smem,
                consts={"WARPS": warps, "HEADS_PER_WARP": sympy.Integer(hpw), "TILE_KEYS": sympy.Integer(tk),
                        "HEADS_PER_BLOCK": heads_per_block, "HEAD_GROUPS": sympy.ceiling(H / heads_per_block),
                        "RANK_WORDS_PER_LANE": sympy.ceiling(R / 64), "ROPE_WORDS_PER_LANE": sympy.ceiling(P / 64)})


def tail_plan(spec) -> Plan:
    return verify_plan(spec, "tree_verify_tail")


MERGE_WARPS = 8


def merge_plan(spec) -> Plan:
    return Plan(kernel="merge_states", spec=spec, threads=sympy.Integer(32 * MERGE_WARPS), min_blocks=4,
                static_smem=sympy.Integer(0),
                consts={"ROWS_PER_BLOCK": sympy.Integer(MERGE_WARPS), "RANK_WORDS_PER_LANE": sympy.ceiling(R / 64)})


KERNELS = [
    KernelDef(name="tree_verify", template="tree_verify.cu.j2", entry="ddtree_tree_verify",
              plan=verify_plan, context={"tail": False}),
    KernelDef(name="tree_verify_tail", template="tree_verify.cu.j2", entry="ddtree_tree_verify_tail",
              plan=tail_plan, context={"tail": True}),
    KernelDef(name="merge_states", template="merge_states.cu.j2", entry="ddtree_merge_states", plan=merge_plan),
]


# the torch ops' attention arguments (tree_verify, tree_verify_tail: the same schema)
ATTENTION_ARGS = ("Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor prefix_lens, "
           "Tensor q_lens, Tensor tree_mask, float softmax_scale, str impl='auto', float? kv_scale=None")
_VERIFY_BUNDLES = Bundles("bundles:_verify_inputs", ("prefix70",), run="bundles:_run_attention")

DECLARATIONS = [
    Declaration(KERNELS[0], launcher="kernels.tree_verify:tree_verify", reference="reference:tree_verify",
                output="types:AttentionOutput", serves=("tree_verify", "simple"),
                # tree_verify's own last argument: an fp8 spec's path (None / "fused" / "dequant": kernels/tree_verify.py)
                torch_ops=(TorchOp(f"tree_verify(str spec, {ATTENTION_ARGS}, str? fp8_path=None) -> (Tensor, Tensor)",
                                   fake="torch_ops:attention_fake", impl="torch_ops:tree_verify"),),
                sanitize="sanitize:_verify_cases", bundles=_VERIFY_BUNDLES),
    Declaration(KERNELS[1], launcher="kernels.tree_verify:tree_verify_tail", reference="reference:tree_verify_tail",
                output="types:AttentionOutput", serves=("tree_verify_tail", "simple"),
                torch_ops=(TorchOp(f"tree_verify_tail(str spec, {ATTENTION_ARGS}) -> (Tensor, Tensor)",
                                   fake="torch_ops:attention_fake", impl="torch_ops:tree_verify_tail"),),
                sanitize="sanitize:_verify_cases", bundles=_VERIFY_BUNDLES),
    Declaration(KERNELS[2], launcher="kernels.tree_verify:merge_states", reference="reference:merge_states",
                output="types:AttentionOutput",
                torch_ops=(TorchOp("merge_states(str spec, Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b) "
                                   "-> (Tensor, Tensor)", fake="torch_ops:merge_states_fake"),),
                sanitize="sanitize:_merge_cases", bundles=Bundles("bundles:_merge_inputs", ("empty-sides",))),
]

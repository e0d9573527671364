"""kv_commit's resource plan (move the accepted KV entries of every layer, one block per (request, layer)), and the
inputs of its sanitizer cases and bundles (its declaration: ops/kv_commit/launch.py)."""
from __future__ import annotations

import numpy as np
import sympy

from ... import bf16, fp8, reference
from ...inputs import equal_block_table, kv_finite, paged_cache
from ...build.resources import D, Plan
from ...types import TreeAcceptOutput
from ...build.kernel_def import KernelDef
from ..tree_accept.plan import ENTRY, chunks

MAX_LAYERS = 128    # layer pointers passed by value in the parameters (8 bytes each: 1 KB)


def plan(spec) -> Plan:
    c = chunks(spec)                                 # 16-byte chunks per entry (R + P elements of kv_dtype)
    threads = 32 * sympy.ceiling(c / 32)  # a thread per chunk column of an entry
    static_smem = 16 * D * c + 8 * D + 8 * D   # staged sources, source and destination offsets
    return Plan(kernel="kv_commit", spec=spec, threads=threads, min_blocks=4, static_smem=static_smem,
                consts={"ENTRY": ENTRY, "CHUNKS": c, "BATCH": sympy.Min(D, 16),
                        "MAX_LAYERS": sympy.Integer(MAX_LAYERS)})


KERNELS = [KernelDef(name="kv_commit", template="kv_commit.cu.j2", entry="ddtree_kv_commit", plan=plan)]



# ---------------------------------------------------------------------------------- sanitizer cases

def sanitizer_cases(spec, rng):
    """kv_commit after the walk: given paths (zero, full depth with real moves, random), bad block-table entries
    and nodes, a sequence of 3 layer caches and a stacked [3, ...] one."""
    n, d, r, p, page = spec.max_tree_size, spec.max_depth, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size
    b = 3
    prefix = np.array([0, 63, 64], np.int32)
    table, num_pages = equal_block_table(spec, rng, b, 64 + n + 1)

    def paths(kind):
        lens = {"zero": np.zeros(b), "full": np.full(b, d), "random": rng.integers(0, d + 1, b)}[kind].astype(np.int32)
        nodes = np.full((b, d + 1), -1, np.int32)
        nodes[:, 0] = 0
        for i in range(b):
            if kind == "full":
                nodes[i, 1:] = np.minimum(np.arange(1, d + 1) + 16, n - 1)
            else:
                nodes[i, 1:lens[i] + 1] = np.sort(rng.choice(np.arange(1, n), lens[i], replace=False))
        return TreeAcceptOutput(lens, nodes, np.zeros_like(nodes), prefix + 1 + lens)

    def layers(k):
        return [kv_finite(spec, rng, (num_pages, page, r + p)) for _ in range(k)]

    for kind in ("zero", "full", "random"):
        yield f"{kind} paths, 3 layers", dict(accepted=paths(kind), prefix_lens=prefix, kv_caches=layers(3),
                                              block_table=table)
    bad_table = table.copy()
    bad_table[0, :] = -1
    bad_table[1, 1] = 10**6
    bad_table[2, 0] = 2**31 - 1
    yield "block-table entries out of range", dict(accepted=paths("full"), prefix_lens=prefix, kv_caches=layers(2),
                                                   block_table=bad_table)
    odd = paths("full")
    odd.accept_lens[:] = [-5, d + 7, 2**31 - 1]     # clamped to [0, D]
    odd.accepted_nodes[2, 1:] = [-1 if k % 2 else 2**31 - 1 for k in range(d)]
    yield "accept_lens and nodes out of range", dict(accepted=odd, prefix_lens=prefix, kv_caches=layers(2),
                                                     block_table=table)
    yield "stacked layers", dict(accepted=paths("random"), prefix_lens=prefix,
                                 kv_caches=np.stack(layers(3)), block_table=table)


# ------------------------------------------------------------------------------------------ bundles

BUNDLE_CASES = ("layers",)


def bundle_inputs(spec, rng, case):
    """kv_commit of 2 requests (prefix 0, and 63: moves across a page boundary) in 2 layer caches stacked
    [2, num_pages, page_size, R+P] over one block table: request 0 accepts D nodes, request 1 three, each path
    of increasing node ids."""
    n, d = spec.max_tree_size, spec.max_depth
    prefix = np.array([0, 63], np.int32)
    lens = np.array([d, min(3, d)], np.int32)
    nodes = np.full((2, d + 1), -1, np.int32)
    nodes[:, 0] = 0
    for b in range(2):
        nodes[b, 1:lens[b] + 1] = np.sort(rng.choice(np.arange(1, n), lens[b], replace=False))
    kv, table = paged_cache(spec, rng, prefix + n, extra_pages=0)
    other = rng.standard_normal(kv.shape)
    other = fp8.from_float(other.astype(np.float32)) if spec.kv_fp8 else bf16.to_bits(other)
    return {"accept_lens": lens, "accepted_nodes": nodes, "prefix_lens": prefix, "kv_caches": np.stack([kv, other]),
            "block_table": table}


def bundle_run(spec, a):
    """The reference's commit of a bundle's inputs `a` (on a copy of its caches: kv_caches_after)."""
    kv = a["kv_caches"].copy()
    acc = TreeAcceptOutput(a["accept_lens"], a["accepted_nodes"], None, None)
    reference.kv_commit(acc, a["prefix_lens"], kv, a["block_table"])
    return {"kv_caches_after": kv}

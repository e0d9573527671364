"""tree_accept's resource plan (walk the draft tree, commit the accepted KV, one block per request), and the inputs
of its sanitizer cases and bundles (its declaration: ops/tree_accept/launch.py)."""
from __future__ import annotations

import numpy as np
import sympy

from ... import reference
from ...inputs import equal_block_table, kv_finite, paged_cache, reference_tree
from ...build.resources import D, N, P, PAGE, R, Plan
from ...types import TreeBuildOutput
from ...build.kernel_def import KernelDef
from ..tree_build.plan import bundle_inputs as tree_build_inputs

ENTRY = R + P                          # elements per cache entry (latent, then rope)
NPAGES = sympy.ceiling((N - 2) / PAGE) + 1  # block-table entries covering positions [L+1, L+N-1]


def entry_bytes(spec):
    """Bytes of one cache entry: R + P elements of the spec's kv_dtype (bf16: 2 bytes, fp8_e4m3: 1)."""
    return ENTRY * sympy.Integer(spec.kv_itemsize)


def chunks(spec):
    """16-byte chunks per cache entry (R and P are multiples of 16, so an entry is a whole number of them)."""
    return entry_bytes(spec) / 16


def plan(spec) -> Plan:
    threads = 32 * sympy.ceiling(chunks(spec) / 32)  # a thread per chunk column of an entry
    # struct TreeAcceptShared: staged source entries (D moves at most), move offsets (int64),
    # tree rows (tokens, first_child, next_sibling, target), block-table window, path, accept_len;
    # sizeof rounds up to the uint4 alignment of the staging buffer
    fields = sympy.Integer(spec.kv_itemsize) * D * ENTRY + 8 * D + 8 * D + 4 * 4 * N + 4 * NPAGES + 4 * (D + 1) + 4
    static_smem = 16 * sympy.ceiling(fields / 16)
    return Plan(kernel="tree_accept", spec=spec, threads=threads, min_blocks=4, static_smem=static_smem,
                consts={"ENTRY": ENTRY, "CHUNKS": chunks(spec), "NPAGES": NPAGES, "BATCH": sympy.Min(D, 16)})


KERNELS = [KernelDef(name="tree_accept", template="tree_accept.cu.j2", entry="ddtree_tree_accept", plan=plan)]



# ---------------------------------------------------------------------------------- sanitizer cases

def sanitizer_cases(spec, rng):
    """Full and zero acceptance, a first-child walk, malformed trees (num_nodes out of range, links out of range,
    cycles), bad block-table entries, a block table too narrow and a kv_cache that is not 16-byte aligned. A
    kv_cache is (flat host array, (start, shape)): the sanitizer's device copy is the view at `start`."""
    n, d, r, p, page = spec.max_tree_size, spec.max_depth, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size
    prefix = np.array([0, 63, 64], np.int32)

    def cache(b, num_pages=None, misalign=False):
        table, pages = equal_block_table(spec, rng, b, 64 + n + 1)
        num_pages = num_pages or pages
        kv = kv_finite(spec, rng, (num_pages * page * (r + p) + 16,))
        start = 1 if misalign else 0
        return table, kv, (start, (num_pages, page, r + p))

    def follow(tree):  # target tokens that walk the first-child chain
        target = np.full((tree.tokens.shape[0], n), -7, np.int32)
        for b in range(tree.tokens.shape[0]):
            for i in range(n):
                c = tree.first_child[b, i]
                if c > 0:
                    target[b, i] = tree.tokens[b, c]
        return target

    chain = reference_tree(spec, rng, 3, d, 1, n - 1, prefix)   # a chain of D nodes: full accept
    table, kv, view = cache(3)
    yield "full accept", dict(tree=chain, target_tokens=follow(chain), prefix_lens=prefix, kv_cache=(kv, view),
                              block_table=table)
    bushy = reference_tree(spec, rng, 3, d, min(4, n - 1), n - 1, prefix)
    yield "first-child walk", dict(tree=bushy, target_tokens=follow(bushy), prefix_lens=prefix,
                                   kv_cache=(kv, view), block_table=table)
    yield "zero accept", dict(tree=bushy, target_tokens=np.full((3, n), -7, np.int32), prefix_lens=prefix,
                              kv_cache=(kv, view), block_table=table)

    # malformed trees: every token matches, so only the link checks end the walks
    bad = TreeBuildOutput(*(np.array(a, copy=True) for a in bushy))
    bad.num_nodes[:] = [0, n + 5, -1]
    bad.tokens[:] = 5
    target = np.full((3, n), 5, np.int32)
    yield "num_nodes out of range", dict(tree=bad, target_tokens=target, prefix_lens=prefix, kv_cache=(kv, view),
                                         block_table=table)
    bad = TreeBuildOutput(*(np.array(a, copy=True) for a in bushy))
    bad.num_nodes[:] = n
    bad.tokens[:] = 5
    bad.first_child[0] = np.arange(n)              # self links
    bad.first_child[1] = 0                         # back to the root
    bad.first_child[2] = 2**31 - 1
    bad.first_child[2, 0] = 1
    bad.next_sibling[2] = 1                        # a sibling cycle
    bad.next_sibling[0] = -5
    bad.next_sibling[1] = n + 100
    yield "links out of range and cycles", dict(tree=bad, target_tokens=target, prefix_lens=prefix,
                                                kv_cache=(kv, view), block_table=table)
    bad_table = table.copy()
    bad_table[0, :] = -1
    bad_table[1, 1] = 10**6
    bad_table[2, 0] = 2**31 - 1
    yield "block-table entries out of range", dict(tree=chain, target_tokens=follow(chain), prefix_lens=prefix,
                                                   kv_cache=(kv, view), block_table=bad_table)
    yield "block table too narrow", dict(tree=chain, target_tokens=follow(chain),
                                         prefix_lens=np.array([60, 63, 2**31 - d - 2], np.int32),
                                         kv_cache=(kv, view), block_table=table[:, :1].copy())
    table_m, kv_m, view_m = cache(3, misalign=True)
    yield "kv_cache not 16-byte aligned", dict(tree=chain, target_tokens=follow(chain), prefix_lens=prefix,
                                               kv_cache=(kv_m, view_m), block_table=table_m)


# ------------------------------------------------------------------------------------------ bundles

BUNDLE_CASES = ("walks",)


def bundle_inputs(spec, rng, case):
    """3 requests' trees (tree_build's reference on its "full" inputs), target tokens that accept the full first-child
    chain, a path through a sibling, and nothing, and their paged cache."""
    n = spec.max_tree_size
    tb = tree_build_inputs(spec, rng, "full")
    tb["prefix_lens"] = np.array([0, 63, 130], np.int32)
    tree = reference.tree_build(**{k: v for k, v in tb.items() if k != "budget"}, budget=int(tb["budget"]),
                                max_tree_size=n)
    target = rng.integers(0, 32000, (3, n), dtype=np.int32)
    # follow a few first children so that something is accepted (request 0: the full first-child chain)
    for b, steps in enumerate([spec.max_depth, 3, 0]):
        cur = 0
        for _ in range(steps):
            c = int(tree.first_child[b, cur])
            if c < 0:
                break
            nxt = int(tree.next_sibling[b, c])
            pick = nxt if (b == 1 and nxt > 0) else c   # request 1 takes a sibling
            target[b, cur] = tree.tokens[b, pick]
            cur = pick
    kv, table = paged_cache(spec, rng, tb["prefix_lens"] + n)
    return {"num_nodes": tree.num_nodes, "tokens": tree.tokens, "first_child": tree.first_child,
            "next_sibling": tree.next_sibling, "target_tokens": target, "prefix_lens": tb["prefix_lens"],
            "kv_cache": kv, "block_table": table}


class _Tree:
    def __init__(self, a):
        self.num_nodes, self.tokens = a["num_nodes"], a["tokens"]
        self.first_child, self.next_sibling = a["first_child"], a["next_sibling"]


def bundle_run(spec, a):
    """The reference's walk and commit of a bundle's inputs `a` (on a copy of its cache: kv_cache_after)."""
    kv = a["kv_cache"].copy()
    out = reference.tree_accept(_Tree(a), a["target_tokens"], a["prefix_lens"], kv, a["block_table"],
                                max_depth=spec.max_depth)
    return dict(out._asdict()) | {"kv_cache_after": kv}

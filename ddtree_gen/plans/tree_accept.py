"""tree_accept's resource plan: walk the draft tree, commit the accepted KV, one block per request."""
from __future__ import annotations

import sympy

from ..resources import D, N, P, PAGE, R, Plan
from .kernel_def import KernelDef
from .declaration import Bundles, Declaration, TorchOp

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


DECLARATIONS = [Declaration(
    KERNELS[0], launcher="kernels.tree_accept:launch", reference="reference:tree_accept", output="types:TreeAcceptOutput",
    torch_ops=(TorchOp("tree_accept(str spec, Tensor num_nodes, Tensor tokens, Tensor first_child, Tensor next_sibling, "
                       "Tensor target_tokens, Tensor prefix_lens, Tensor(a!) kv_cache, Tensor block_table) "
                       "-> (Tensor, Tensor, Tensor, Tensor)", fake="torch_ops:tree_accept_fake",
                       impl="torch_ops:tree_accept"),
               # the walk alone (no cache): kv_commit then moves every layer's entries
               TorchOp("tree_walk(str spec, Tensor num_nodes, Tensor tokens, Tensor first_child, Tensor next_sibling, "
                       "Tensor target_tokens, Tensor prefix_lens) -> (Tensor, Tensor, Tensor, Tensor)",
                       fake="torch_ops:tree_walk_fake", impl="torch_ops:tree_walk")),
    sanitize="sanitize:_accept_cases",
    bundles=Bundles("bundles:_accept_inputs", ("walks",), run="bundles:_run_tree_accept"))]

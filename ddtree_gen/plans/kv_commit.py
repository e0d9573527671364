"""kv_commit's resource plan: move the accepted KV entries of every layer, one block per (request, layer)."""
from __future__ import annotations

import sympy

from ..resources import D, Plan
from .kernel_def import KernelDef
from .declaration import Bundles, Declaration, TorchOp
from .tree_accept import ENTRY, chunks

MAX_LAYERS = 128    # layer pointers passed by value in the parameters (8 bytes each: 1 KB)


def plan(spec) -> Plan:
    c = chunks(spec)                                 # 16-byte chunks per entry (R + P elements of kv_dtype)
    threads = 32 * sympy.ceiling(c / 32)  # a thread per chunk column of an entry
    static_smem = 16 * D * c + 8 * D + 8 * D   # staged sources, source and destination offsets
    return Plan(kernel="kv_commit", spec=spec, threads=threads, min_blocks=4, static_smem=static_smem,
                consts={"ENTRY": ENTRY, "CHUNKS": c, "BATCH": sympy.Min(D, 16),
                        "MAX_LAYERS": sympy.Integer(MAX_LAYERS)})


KERNELS = [KernelDef(name="kv_commit", template="kv_commit.cu.j2", entry="ddtree_kv_commit", plan=plan)]


DECLARATIONS = [Declaration(
    KERNELS[0], launcher="kernels.kv_commit:launch", reference="reference:kv_commit",
    torch_ops=(TorchOp("kv_commit(str spec, Tensor accept_lens, Tensor accepted_nodes, Tensor prefix_lens, "
                       "Tensor(a!)[] kv_caches, Tensor block_table) -> ()", fake="torch_ops:kv_commit_fake",
                       impl="torch_ops:kv_commit"),
               # the layers as one [layers, num_pages, page_size, R+P] tensor: no list for the dispatcher to convert
               TorchOp("kv_commit_stacked(str spec, Tensor accept_lens, Tensor accepted_nodes, Tensor prefix_lens, "
                       "Tensor(a!) kv_cache, Tensor block_table) -> ()", fake="torch_ops:kv_commit_stacked_fake",
                       impl="torch_ops:kv_commit_stacked")),
    sanitize="sanitize:_commit_cases",
    bundles=Bundles("bundles:_commit_inputs", ("layers",), run="bundles:_run_kv_commit"),
    missing={"output": "none: it moves the caches in place and returns None"})]

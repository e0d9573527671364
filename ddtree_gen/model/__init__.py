"""A tiny MLA decoder with random weights: the end-to-end proof that the kernels compose losslessly.

The attention is DeepSeek-V3 MLA at a spec's dimensions (H heads, latent rank R, rope dim P,
page size); everything else is tiny (vocab, hidden size, two layers, a small MLP). The same
weights run three ways:

* **numpy, float64** (`NumpyMLA`, `generate_numpy`): the oracle. Plain decoding (one token per
  step) and the DDTree speculative loop on the numpy references (`reference.tree_build`,
  `reference.tree_verify` in every layer, `reference.tree_accept`).
* **device loop** (`DeviceDecoder`): the loop an engine runs, on preallocated buffers with no
  host synchronisation inside a step. Its backend is either `CupyOps` (float32 CuPy, custom
  row-deterministic kernels for the model's matmuls and norms, and the generated kernels
  `kset.tree_build` / `kset.tree_verify` / `kset.tree_accept`), or `NumpyOps` (a float32 numpy
  emulation of the same kernels with the numpy references as the kernel set; CI runs the GPU
  loop's exact orchestration this way, without a GPU).
* On the GPU a step can be captured in a CUDA graph and replayed (`DeviceDecoder.capture_step`).

MLA, per layer (weights `[in, out]`, x @ W):
    x = rmsnorm(h);  q = rmsnorm(x @ wq_a) @ wq_b -> [H, Dn + P];  q_pe = rope(q[Dn:], pos)
    q_nope_absorbed[h] = W_UK[h] @ q_nope[h]  (w_uk_t[h] is [Dn, R])  -> [H, R]
    kv = x @ wkv_a -> [R + P];  c_kv = rmsnorm(kv[:R]);  k_pe = rope(kv[R:], pos)
    cache row (bf16) = [c_kv | k_pe];  queries rounded to bf16 too
    attn = tree_verify(...) -> [H, R] (bf16, as the kernel's);  o = (attn[h] @ w_uv[h]) -> [H * Dv] @ wo
    h += o;  h += (silu(x2 @ w_gate) * (x2 @ w_up)) @ w_down;  logits = rmsnorm(h) @ lm_head
RoPE (rotate-half) at position prefix_len + depth: the absolute position of the token.
softmax_scale = (qk_nope_head_dim + P) ** -0.5. Every value stored as bf16 (cache rows,
queries, attention output) is float32 first, as on the GPU (the numpy model rounds its float64
value to float32, then to bf16 with ddtree_gen.bf16), so both numpy paths see identical caches.
Tree node j's KV is written at cache position prefix_len + j (RoPE at prefix_len + depth_j);
tree_accept moves the accepted nodes' entries to prefix_len + 1 .. prefix_len + accept_len.

Token choice: greedy = argmax (lowest index among equal maxima); sampled = Gumbel-max,
argmax(logits / T + g) with g = gumbel(seed, request, position, vocab index), a counter-based
hash of the request index, the absolute position of the token being chosen and the vocab
index, so plain and speculative decoding draw the same noise for the same token.

Drafter (acceptance only changes speed, never the tokens): from the root, the target itself is
rolled out D' steps along its own chosen tokens (each step a q_len 1 pass that writes scratch
cache slots beyond the committed prefix, overwritten by the tree pass); depth d's draft
distribution is log_softmax(logits_d / T + noise * g'), g' a Gumbel draw of a separate seed;
the top K per depth, sorted, feed tree_build. Depth d's distribution does not depend on the
parent chosen in the tree, as in DDTree.

Modules (each imports only modules listed above it; only this file imports `device`):
    config       ModelConfig, Sampling, Drafter, Generation; checks of a loop's arguments
    sampling     counter-based Gumbel noise, select_tokens, draft_topk
    weights      init_weights (seeded, float64)
    tensor_parallel  head sharding of config, weights and spec (TP ranks); the near-tie rule
    cache        make_block_table, chain_mask, cache capacity
    numpy_model  NumpyMLA, the float64 oracle
    numpy_loop   generate_numpy (plain and speculative, numpy references)
    near_tie     is a divergence between two decodings a near-tie? decided in float64 (the examples' rule)
    cuda_source  CUDA_SOURCE / KERNEL_NAMES: CupyOps' own kernels
    backends     CupyOps, NumpyOps, ReferenceKernels
    device       DeviceDecoder, CapturedStep, generate_device
"""

from .backends import CupyOps, NumpyOps, ReferenceKernels
from .cache import chain_mask, make_block_table
from .config import GREEDY, Drafter, Generation, ModelConfig, Sampling
from .cuda_source import CUDA_SOURCE, KERNEL_NAMES
from .device import CapturedStep, DecodeState, DeviceDecoder, generate_device
from .numpy_loop import generate_numpy
from .numpy_model import NumpyMLA
from .sampling import draft_topk, gumbel, seed_key, select_tokens
from .weights import LAYER_WEIGHTS, init_weights

__all__ = ["ModelConfig", "Sampling", "Drafter", "Generation", "init_weights", "make_block_table",
           "gumbel", "NumpyMLA", "generate_numpy", "NumpyOps", "CupyOps", "ReferenceKernels",
           "DeviceDecoder", "CapturedStep", "generate_device", "CUDA_SOURCE"]

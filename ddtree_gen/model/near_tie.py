"""Is a divergence between two decodings a near-tie? Decided in float64 on the reference path.

Two decodings of the same model (plain and speculative, or TP = 1 and TP = T) that both compute within the
contract's numerical bar may still part at a token: their float32 logits differ by rounding, and where the two
best candidates nearly tie, the argmax can flip. A fixed margin on the GPU's own logits is no criterion (it
says nothing about what the bar allows). Here, for a divergence at token i of request b, where one run chose
token `a` and the other token `c` after the same tokens before i:

1. The float64 reference path (NumpyMLA: numpy float64 with every stored value rounded to bf16 as on the GPU,
   attention by reference.tree_verify) recomputes the scores at that token from the same inputs (the weights,
   the prompt and tokens[:i]): `margin` = s[a] - s[c] (greedy: s = logits; sampled: logits / T + the
   Gumbel noise of that token, as the loops choose).
2. `bound`: how far the bar lets s[a] - s[c] move. Contract section 10: every attention output (per row and
   head) within `||out - ref|| <= 5e-3 ||ref||` (the bar; bf16 rounding of the output alone is ~2e-3). To
   first order, an error e_lh of the diverging token's attention output (layer l, head h, R values) moves
   s[a] - s[c] by G_lh . e_lh, G_lh = (W_UV[h] W_O[h]) g_l and g_l = d(s[a] - s[c]) / d(o_proj_l), the
   gradient through the rest of the model (later layers' attention, the MLP, the final norm, lm_head), by
   central differences of the float64 model without its bf16 roundings (a smooth function). Rounding
   errors are not aimed at G: taking e_lh of norm bar * ||att_lh|| in a direction independent of G_lh, its
   projection has variance (bar ||att_lh|| ||G_lh||)^2 / R, and over the independent (layer, head) terms
       sigma^2 = sum over l, h of (bar * ||att_lh|| * ||G_lh||)^2 / R,      bound = Z * sigma, Z = 5.
   (The worst case, sum of bar ||att_lh|| ||G_lh||, is about sqrt(R) times larger, 0.7 to 1.8 logits in the
   tiny model: it would accept nearly every divergence, bugs included.) Earlier tokens' attention errors
   reach this token only through the cache rows of later layers; they are not counted.
3. A near-tie: |margin| <= bound (a run within the bar can choose either, so two such runs can part here),
   and neither candidate is beaten by a third token by more than the bound. Anything else is a violation:
   a run outside the bar, a bug.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import bf16
from .cache import make_block_table
from .config import GREEDY, Sampling
from .numpy_model import NumpyMLA
from .sampling import gumbel

BAR = 5e-3   # contract section 10: ||out - ref|| / ||ref|| per (request, row, head) of the attention output
Z = 5.0      # standard deviations of the bar's rounding error that the bound allows


@dataclass(frozen=True)
class TieCheck:
    """One divergence, decided: request, token index, the reference run's token `a`, the other run's `c`,
    the float64 score margin s[a] - s[c], the bar's bound on it, the float64 best token, near_tie."""
    request: int
    token: int
    a: int
    c: int
    margin: float
    bound: float
    best: int
    near_tie: bool

    def __str__(self) -> str:
        third = "" if self.best in (self.a, self.c) else f", float64 best {self.best}"
        return (f"(request {self.request}, token {self.token}: {self.a} vs {self.c}, float64 margin "
                f"{self.margin:+.3g}, bound {self.bound:.3g}{third})")


def decide(margin: float, bound: float, gap: float = 0.0) -> bool:
    """The near-tie rule on numbers: |margin| <= bound and the best other score's lead gap <= bound."""
    return bool(np.isfinite(margin) and np.isfinite(bound) and abs(margin) <= bound and gap <= bound)


def _single(model: NumpyMLA, spec, context: list[int]):
    """(cache, table, one_mask, pos): the cache after prefilling context[:-1], for a q_len 1 pass of context[-1]."""
    cfg = model.cfg
    table, num_pages = make_block_table(1, len(context) + 1, cfg.page_size)
    kv = model.new_cache(num_pages)
    model.prefill(kv, table, [context], spec.max_tree_size, spec.mask_words)
    one_mask = np.zeros((1, 1, spec.mask_words), np.uint32)
    one_mask[0, 0, 0] = 1
    return kv, table, one_mask, len(context) - 1


def judge(model: NumpyMLA, spec, context, a: int, c: int, *, request: int = 0, token: int = 0,
          sampling: Sampling = GREEDY, bar: float = BAR, z: float = Z) -> TieCheck:
    """Decide the divergence after `context` (the prompt and the tokens both runs agree on) where the
    reference run chose `a` and the other run `c`; `request` (the Gumbel noise's request index) and
    `token` are reported. See the module docstring for the rule."""
    cfg = model.cfg
    context = [int(t) for t in context]
    kv, table, one_mask, pos = _single(model, spec, context)
    args = (table, np.array([[context[-1]]]), np.array([[pos]]), np.array([[pos]]), np.array([pos]),
            np.array([1]), one_mask)
    logits = model.forward(kv, *args)[0, 0]
    noise = (0.0 if sampling.greedy else
             gumbel(sampling.seed, np.array(request), np.array(pos + 1), np.arange(cfg.vocab_size)))
    s = logits * sampling.inv_temp + noise
    margin = float(s[a] - s[c])
    gap = float(s.max() - max(s[a], s[c]))
    # the sensitivity, on the smooth float64 model (same cache values, as float64)
    kvf = [bf16.from_bits(layer).astype(np.float64) for layer in kv]
    att_norm, base_oproj = {}, {}

    def diff(layer=None, delta=None):
        def hook(li, att, o_proj):
            if layer is None:
                att_norm[li] = np.linalg.norm(att[0, 0], axis=-1)          # [H]
                base_oproj[li] = float(np.linalg.norm(o_proj))
                return o_proj
            return o_proj + delta if li == layer else o_proj
        lg = model.forward(kvf, *args, smooth=True, hook=hook)[0, 0] * sampling.inv_temp
        return float(lg[a] - lg[c])

    diff()
    w, dv, h = model.w, cfg.v_head_dim, cfg.num_heads
    var = 0.0
    for layer in range(cfg.num_layers):
        step = 1e-6 * max(1.0, base_oproj[layer])
        g = np.empty(cfg.hidden_size)
        for k in range(cfg.hidden_size):
            e = np.zeros(cfg.hidden_size)
            e[k] = step
            g[k] = (diff(layer, e) - diff(layer, -e)) / (2 * step)
        lw = w["layers"][layer]
        for head in range(h):
            grad_att = lw["w_uv"][head] @ (lw["wo"][head * dv:(head + 1) * dv] @ g)   # [R]
            var += (bar * float(att_norm[layer][head]) * float(np.linalg.norm(grad_att))) ** 2 / grad_att.size
    bound = z * var ** 0.5
    return TieCheck(request, token, int(a), int(c), margin, bound, int(np.argmax(s)), decide(margin, bound, gap))

"""The device loop: DeviceDecoder (preallocated buffers, no host sync inside a step), its CUDA-graph
capture (CapturedStep) and generate_device."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..reference import DraftTopkOutput
from ..types import TreeAcceptOutput, TreeBuildOutput
from .backends import CupyOps, ReferenceKernels
from .cache import _capacity, chain_mask, make_block_table
from .config import GREEDY, Drafter, Generation, ModelConfig, Sampling, _check_prompts, _tree_sizes
from .sampling import gumbel
from .weights import LAYER_WEIGHTS, init_weights


@dataclass
class DecodeState:
    """Per-request state on the device, updated in place by every step (graph-replay safe)."""
    prefix: Any      # [B] int32: committed cache length; the root sits at position prefix
    root: Any        # [B] int32: the last emitted token, not yet in the cache
    gen: Any         # [B, cap] int32: emitted tokens (-1 padded)
    count: Any       # [B] int32: emitted tokens so far
    steps: Any       # [B] int32: steps taken while generating
    accepted: Any    # [B] int32: accepted draft tokens
    target: int      # tokens wanted per request


class DeviceDecoder:
    """The decoding loop an engine runs, on preallocated device buffers.

    `step()` launches one step (speculative: rollout drafter, draft top-k (kset.draft_topk on the
    logits when the drafter is exact, noise 0, and the kernel set has it; else the model's own
    noisy top-k), kset.tree_build, one
    model pass over the tree with kset.tree_verify in every layer, token choice, kset.tree_accept
    for every layer's cache, commit; plain: one q_len 1 pass and commit) with no host
    synchronisation; its only host inputs are Python constants, so it can be captured in a CUDA
    graph (`capture_step`, CuPy backend) and replayed. `run()` loops until every request has
    `new_tokens` tokens, synchronising between steps to decide termination.

    ops: CupyOps() (GPU; kernels = ddtree_gen.load(spec)) or NumpyOps() (CPU; kernels =
    ReferenceKernels(spec)). weights: init_weights(cfg) (float64; cast to float32 here).
    all_reduce: None (the whole model), or, for a tensor-parallel rank holding some heads
    (tensor_parallel.shard_weights), a callable that sums its o_proj partial [M, d] float32 over
    the ranks (in place or not; it returns the sum) in stream order on the decoder's stream; it
    is applied before the residual add of every layer, prefill included.
    """

    def __init__(self, cfg: ModelConfig, spec, prompts, new_tokens: int, *, ops, kernels, weights=None,
                 speculative: bool = True, sampling: Sampling = GREEDY, drafter: Drafter = Drafter(),
                 budget: int | None = None, page_seed: int = 0, stream=None, all_reduce=None):
        _check_prompts(prompts, cfg.vocab_size)
        if (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.page_size) != (
                spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size):
            raise ValueError("cfg: attention dimensions differ from the spec's")
        self.cfg, self.spec, self.ops, self.kernels = cfg, spec, ops, kernels
        self.speculative, self.sampling, self.drafter = speculative, sampling, drafter
        self.budget, self.dp, self.k = _tree_sizes(spec, cfg, budget, drafter)
        self.new_tokens = int(new_tokens)
        self.timer = None          # a list: (name, start event, end event) per kernel call (CuPy only)
        self.stream = stream
        self.all_reduce = all_reduce
        self._is_cupy = ops.xp is not np
        if self._is_cupy and self.stream is None:
            self.stream = ops.xp.cuda.Stream(non_blocking=True)   # capturable (not the legacy stream)
        with self._on_stream():
            self._allocate(prompts, weights if weights is not None else init_weights(cfg), page_seed)

    # ------------------------------------------------------------------ setup (not captured)
    def _on_stream(self):
        return self.stream if self._is_cupy else contextlib.nullcontext()

    def _allocate(self, prompts, weights, page_seed):
        xp, cfg, spec = self.ops.xp, self.cfg, self.spec
        f32 = lambda a: xp.asarray(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
        self.w = {"embed": f32(weights["embed"]), "final_norm": f32(weights["final_norm"]),
                  "lm_head": f32(weights["lm_head"]),
                  "layers": [{k: f32(lw[k]) for k in LAYER_WEIGHTS} for lw in weights["layers"]]}
        self.inv_freq = f32(cfg.inv_freq)
        bsz = len(prompts)
        n, d, w, h, r, p = (spec.max_tree_size, spec.max_depth, spec.mask_words, cfg.num_heads, cfg.kv_lora_rank,
                            cfg.qk_rope_head_dim)
        self.batch = bsz
        table, num_pages = make_block_table(bsz, _capacity(spec, prompts, self.new_tokens), cfg.page_size,
                                            page_seed)
        self.block_table = xp.asarray(table)
        self.kv = [xp.zeros((num_pages, cfg.page_size, r + p), xp.uint16) for _ in range(cfg.num_layers)]
        i32 = lambda a: xp.asarray(np.asarray(a, np.int32))  # noqa: E731
        cap = self.new_tokens + d + 1
        self.state = DecodeState(prefix=i32([len(q) - 1 for q in prompts]), root=i32([q[-1] for q in prompts]),
                                 gen=i32(np.full((bsz, cap), -1)), count=i32(np.zeros(bsz)),
                                 steps=i32(np.zeros(bsz)), accepted=i32(np.zeros(bsz)), target=self.new_tokens)
        # constant inputs
        self.ones_b = i32(np.ones(bsz))
        self.zeros_b = i32(np.zeros(bsz))
        one_mask = np.zeros((bsz, 1, w), np.uint32)
        one_mask[:, 0, 0] = 1
        self.one_mask = xp.asarray(one_mask)
        # out= buffers of the kernels (reused by every step: fixed addresses for a graph)
        self.att = {nq: (xp.zeros((bsz, nq, h, r), xp.uint16), xp.zeros((bsz, nq, h), xp.float32))
                    for nq in ((1, n) if self.speculative else (1,))}
        self.next_tok = xp.empty((bsz, 1), xp.int32)
        if self.speculative:
            self.roll_tok = xp.empty((bsz,), xp.int32)
            self.draft_logits = xp.empty((bsz, self.dp, cfg.vocab_size), xp.float32)
            self.topk_ids = xp.empty((bsz, self.dp, self.k), xp.int32)
            self.topk_lps = xp.empty((bsz, self.dp, self.k), xp.float32)
            # an exact drafter (no noise): the generated draft_topk on the logits, same tokens and log-probs
            # (log_softmax(logits / T), descending, ties lower id); a noisy one keeps ops.draft_topk
            # (a KernelSet has every kernel's method: `requested` says whether it was loaded with draft_topk)
            self.device_topk = (self.drafter.noise == 0 and hasattr(self.kernels, "draft_topk")
                                and "draft_topk" in getattr(self.kernels, "requested", ("draft_topk",)))
            if self.device_topk:
                from ..ops.draft_topk.launch import workspace_elems
                self.topk = DraftTopkOutput(self.topk_ids, self.topk_lps)
                self.topk_temp = 1.0 if self.sampling.greedy else float(self.sampling.temperature)
                self.topk_ws = xp.empty((max(1, workspace_elems(bsz, self.dp, cfg.vocab_size, self.k, "float32")),),
                                        xp.int32)
            self.tree = TreeBuildOutput(
                num_nodes=xp.empty((bsz,), xp.int32), tokens=xp.empty((bsz, n), xp.int32),
                parents=xp.empty((bsz, n), xp.int32), depths=xp.empty((bsz, n), xp.int32),
                positions=xp.empty((bsz, n), xp.int32), scores=xp.empty((bsz, n), xp.float32),
                tree_mask=xp.empty((bsz, n, w), xp.uint32), first_child=xp.empty((bsz, n), xp.int32),
                next_sibling=xp.empty((bsz, n), xp.int32))
            self.target_tokens = xp.empty((bsz, n), xp.int32)
            self.acc = TreeAcceptOutput(accept_lens=xp.empty((bsz,), xp.int32),
                                        accepted_nodes=xp.empty((bsz, d + 1), xp.int32),
                                        out_tokens=xp.empty((bsz, d + 1), xp.int32),
                                        new_prefix_lens=xp.empty((bsz,), xp.int32))
        self._prefill(prompts)

    def _prefill(self, prompts):
        """Commit prompt[:-1] per request in causal chunks of <= N tokens (not part of a step)."""
        xp, spec = self.ops.xp, self.spec
        n, w = spec.max_tree_size, spec.mask_words
        for b, prompt in enumerate(prompts):
            ctx = np.asarray(prompt[:-1], np.int32)
            for s in range(0, len(ctx), n):
                toks = ctx[s:s + n]
                q = len(toks)
                pos = xp.asarray((s + np.arange(q, dtype=np.int32))[None])
                base = xp.asarray(np.array([s], np.int32))
                self._forward(xp.asarray(toks[None]), pos, base, 0, base, xp.asarray(np.array([q], np.int32)),
                              xp.asarray(chain_mask(q, w)[None]), self.block_table[b:b + 1], None)

    # --------------------------------------------------------------------- the model (device)
    def _kernel(self, name, fn, *args, **kwargs):
        if self.timer is None:
            return fn(*args, **kwargs)
        ev = self.ops.xp.cuda.Event
        start, end = ev(), ev()
        start.record()
        result = fn(*args, **kwargs)
        end.record()
        self.timer.append((name, start, end))
        return result

    def _forward(self, tokens, rope_pos, slot_base, slot_offset, attn_prefix, q_lens, mask, block_table, att):
        """logits [B * Nq, V] float32 of tokens [B, Nq] at RoPE positions rope_pos [B, Nq]; the rows'
        KV goes to cache positions slot_base[b] + slot_offset + j; attention through
        kset.tree_verify(prefix_lens=attn_prefix, q_lens, tree_mask=mask) into the out= buffers att."""
        ops, cfg, w = self.ops, self.cfg, self.w
        b, nq = tokens.shape
        m = b * nq
        h, r, p, dn, dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        rope = rope_pos.reshape(m)
        x_h = ops.embed(w["embed"], tokens.reshape(m))                          # [M, d]
        for layer, lw in enumerate(w["layers"]):
            x = ops.rmsnorm(x_h, lw["attn_norm"], cfg.rms_eps)
            q = ops.mm(ops.rmsnorm(ops.mm(x, lw["wq_a"]), lw["q_norm"], cfg.rms_eps), lw["wq_b"])
            q_nope, q_pe = ops.q_rope(q.reshape(m, h, dn + p), rope, self.inv_freq, dn)
            q_abs = ops.to_bits(ops.mm(q_nope, lw["w_uk_t"]))                   # [M, H, R] bf16
            ops.write_kv(ops.mm(x, lw["wkv_a"]), lw["kv_norm"], rope, self.inv_freq, slot_base, slot_offset, nq,
                         block_table, self.kv[layer], cfg.rms_eps)
            out, lse = att if att is not None else (None, None)
            name = "tree_verify (q_len 1)" if nq == 1 else f"tree_verify (Nq {nq})"
            out, _ = self._kernel(name, self.kernels.tree_verify, q_abs.reshape(b, nq, h, r),
                                  q_pe.reshape(b, nq, h, p), self.kv[layer], block_table, attn_prefix, q_lens, mask,
                                  cfg.softmax_scale, out=out, lse=lse)
            o = ops.mm(ops.from_bits(out).reshape(m, h, r), lw["w_uv"]).reshape(m, h * dv)
            o_proj = ops.mm(o, lw["wo"])
            if self.all_reduce is not None:   # tensor parallel: sum the heads of every rank
                o_proj = self.all_reduce(o_proj)
            x_h = x_h + o_proj
            x2 = ops.rmsnorm(x_h, lw["mlp_norm"], cfg.rms_eps)
            x_h = x_h + ops.mm(ops.silu_mul(ops.mm(x2, lw["w_gate"]), ops.mm(x2, lw["w_up"])), lw["w_down"])
        return ops.mm(ops.rmsnorm(x_h, w["final_norm"], cfg.rms_eps), w["lm_head"])

    # ------------------------------------------------------------------------------ one step
    def step(self):
        """Launch one decoding step on the decoder's stream (no host sync)."""
        with self._on_stream():
            if self.speculative:
                self._speculative_step()
            else:
                self._plain_step()

    def _plain_step(self):
        st, ops = self.state, self.ops
        bsz = self.batch
        logits = self._forward(st.root.reshape(bsz, 1), st.prefix.reshape(bsz, 1), st.prefix, 0, st.prefix,
                               self.ones_b, self.one_mask, self.block_table, self.att[1])
        ops.select(logits, st.prefix, 1, 1, self.sampling, self.next_tok)
        ops.commit(self.zeros_b, self.next_tok, st.prefix, False, st)
        return logits

    def _speculative_step(self):
        st, ops, kern = self.state, self.ops, self.kernels
        bsz, n = self.batch, self.spec.max_tree_size
        # 1. draft: the target rolled out D' steps from the root, into scratch slots prefix + d
        self.roll_tok[...] = st.root
        for d in range(self.dp):
            pos = st.prefix + np.int32(d)                           # device temporary, int32
            logits = self._forward(self.roll_tok.reshape(bsz, 1), pos.reshape(bsz, 1), st.prefix, d, pos,
                                   self.ones_b, self.one_mask, self.block_table, self.att[1])
            self.draft_logits[:, d, :] = logits
            if d + 1 < self.dp:
                ops.select(logits, pos, 1, 1, self.sampling, self.roll_tok)
        if self.device_topk:
            self._kernel("draft_topk", kern.draft_topk, self.draft_logits, self.k, self.topk_temp, out=self.topk,
                         workspace=self.topk_ws)
        else:
            ops.draft_topk(self.draft_logits, st.prefix, self.drafter, self.sampling, self.topk_ids, self.topk_lps)
        # 2. tree_build
        tree = self._kernel("tree_build", kern.tree_build, self.topk_ids, self.topk_lps, st.root, st.prefix,
                            self.budget, out=self.tree)
        # 3. target pass over the N tree rows (q_len = num_nodes); node j's KV at prefix + j
        logits = self._forward(tree.tokens, tree.positions, st.prefix, 0, st.prefix, tree.num_nodes,
                               tree.tree_mask, self.block_table, self.att[n])
        ops.select(logits, tree.positions.reshape(bsz * n), 1, n, self.sampling, self.target_tokens.reshape(bsz * n))
        # 4. the walk once, then the accepted KV of every layer in one launch
        acc = self._kernel("tree_accept", kern.tree_accept, tree, self.target_tokens, st.prefix, out=self.acc)
        self._kernel("kv_commit", kern.kv_commit, acc, st.prefix, self.kv, self.block_table)
        # 5. commit: append the accepted tokens + bonus, advance prefix and root
        ops.commit(acc.accept_lens, acc.out_tokens, acc.new_prefix_lens, True, st)

    # ------------------------------------------------------------------------- driving loops
    def snapshot(self) -> dict:
        """Host copies (a sync) of the state and of every layer's cache, for comparisons."""
        host = (lambda a: a.get(stream=self.stream)) if self._is_cupy else np.array  # noqa: E731
        st = self.state
        snap = {k: host(getattr(st, k)) for k in ("prefix", "root", "gen", "count", "steps", "accepted")}
        snap["kv"] = [host(layer_kv) for layer_kv in self.kv]
        return snap

    def done(self) -> bool:
        """Host check between steps (a sync)."""
        count = self.state.count
        count = count.get(stream=self.stream) if self._is_cupy else count
        return bool(np.min(count) >= self.new_tokens)

    def result(self, steps: int) -> Generation:
        get = (lambda a: a.get(stream=self.stream)) if self._is_cupy else (lambda a: np.array(a))  # noqa: E731
        st = self.state
        return Generation(get(st.gen)[:, :self.new_tokens].astype(np.int32), steps, int(get(st.steps).sum()),
                          int(get(st.accepted).sum()))

    def run(self, *, graph: bool = False, max_steps: int | None = None, keep_margins: bool = False) -> Generation:
        """Step until every request has new_tokens tokens. graph=True (CuPy): the first step runs
        eagerly as the warm-up, the second is captured and every later step replays the graph.
        keep_margins (plain, eager): record top1 - top2 of the scores behind every token."""
        max_steps = max_steps or (self.new_tokens + 1) * 2
        captured, steps = None, 0
        margins = [[] for _ in range(self.batch)] if keep_margins else None
        while not self.done():
            if steps >= max_steps:
                raise RuntimeError(f"no progress after {steps} steps")
            if graph and steps == 1:
                captured = self.capture_step(warmup=False)
            if captured is not None:
                captured.replay()
            elif graph:
                with self._private_pool():
                    self.step()
            elif keep_margins:
                self._margin_step(margins)
            else:
                self.step()
            steps += 1
        gen = self.result(steps)
        if keep_margins:
            gen.margins = np.array([row[:self.new_tokens] for row in margins], np.float32)
        return gen

    def _margin_step(self, margins):
        """A plain step that also records, per active request, the top1 - top2 gap of the scores
        its token was chosen from (host side: a sync; for the near-tie diagnosis of tests)."""
        if self.speculative:
            raise ValueError("keep_margins: plain decoding only")
        host = (lambda a: a.get(stream=self.stream)) if self._is_cupy else np.array  # noqa: E731
        st = self.state
        active = host(st.count) < self.new_tokens
        prefix = host(st.prefix).astype(np.int64)
        with self._on_stream():
            logits = self._plain_step()
            scores = host(logits).astype(np.float64)
        if not self.sampling.greedy:
            scores = scores * self.sampling.inv_temp + gumbel(
                self.sampling.seed, np.arange(self.batch)[:, None], prefix[:, None] + 1,
                np.arange(scores.shape[-1]))
        top = np.sort(scores, axis=-1)
        for b in np.flatnonzero(active):
            margins[b].append(float(top[b, -1] - top[b, -2]))

    # ------------------------------------------------------------------------ CUDA graphs
    def _private_pool(self):
        """Temporaries of captured steps come from a pool of their own: after the capture, the
        graph owns those addresses, and no later allocation may be handed one of them."""
        if not self._is_cupy:
            return contextlib.nullcontext()
        if getattr(self, "_pool", None) is None:
            self._pool = self.ops.xp.cuda.MemoryPool()
        return self.ops.xp.cuda.using_allocator(self._pool.malloc)

    def capture_step(self, *, warmup: bool = True) -> "CapturedStep":
        """Capture one step into a CUDA graph (CuPy backend). warmup=True first runs one real step
        eagerly (it advances the state like any step) so that every kernel is compiled and loaded
        and the private pool holds the step's temporaries before the capture."""
        if not self._is_cupy:
            raise RuntimeError("capture_step: CUDA graphs need the CuPy backend")
        if self.timer is not None:
            raise RuntimeError("capture_step: per-kernel timing (events) cannot be captured; set timer = None")
        with self._private_pool():
            if warmup:
                self.step()
            self.stream.synchronize()
            with self.stream:
                self.stream.begin_capture()
                try:
                    self.step()
                except BaseException:
                    try:
                        self.stream.end_capture()   # leave capture mode; the first error is the one
                    except Exception:
                        pass
                    raise
                graph = self.stream.end_capture()
        graph.upload(self.stream)
        return CapturedStep(graph, self.stream, self._pool)


class CapturedStep:
    """One captured decoding step: replay() launches it on the decoder's stream (no sync). It
    reads and updates the decoder's state buffers in place, so each replay is the next step."""

    def __init__(self, graph, stream, pool):
        self.graph, self.stream, self._pool = graph, stream, pool  # the pool owns the graph's temporaries

    def replay(self):
        self.graph.launch(self.stream)


def generate_device(cfg: ModelConfig, spec, prompts, new_tokens: int, *, kernels=None, ops=None,
                    graph: bool = False, **kwargs) -> Generation:
    """Run the device loop: on the GPU by default (ops = CupyOps(), kernels = ddtree_gen.load(spec));
    pass ops=NumpyOps(), kernels=ReferenceKernels(spec) for the CPU emulation."""
    if ops is None:
        ops = CupyOps()
    if kernels is None:
        if ops.xp is np:
            kernels = ReferenceKernels(spec)
        else:
            from ..kernel_set import load
            kernels = load(spec)
    dec = DeviceDecoder(cfg, spec, prompts, new_tokens, ops=ops, kernels=kernels, **kwargs)
    return dec.run(graph=graph)

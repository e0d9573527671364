"""`ddtree-gen bench step`: where a whole speculative step's kernel time goes.

From the drafter's logits (random bf16 [B, D', V], D' = max_depth, V = 129280): draft_topk (k = N - 1),
tree_build on its output, then tree_verify in each of 61 layers, then the walk and the commit, captured in
one CUDA graph at B = 1, 8, 64 and L = 4096; each part is also replayed alone for its share. The model's own
GEMMs are not ours and are left out. Beside it, from the same run, plain decoding's attention: FlashMLA's dense
decode at s_q = 1 (one new token a request over its L + 1 keys) in every layer's cache, where flash_mla is importable
(peers.flashmla_decode), so that the step's cost reads against what a step of plain decoding spends in attention.
"""
from __future__ import annotations

import numpy as np

from ..inputs import tree_build_inputs, verify_inputs
from .peers import flashmla_decode
from .specs import LAYERS
from .timing import emit, graph_time_ms

VOCAB = 129280   # the drafter logits' vocabulary in bench step (DeepSeek-V3's)
VERIFY = f"tree_verify x {LAYERS}"   # the part whose per-layer figure the absolute-cost lines give


def run(args) -> None:
    import cupy

    from ..spec import find_spec
    from ..kernel_set import load
    from ..ops.draft_topk.launch import workspace_elems
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec)
    n, L = spec.max_tree_size, 4096
    dp, k = spec.max_depth, n - 1
    rows, decode, why = [], {}, None
    for b in (1, 8, 64):
        rng = np.random.default_rng(0)
        _, _, roots, prefix_np = tree_build_inputs(spec, b, rng, k=1)
        prefix_np[:] = L
        roots_d, prefix_d = cupy.asarray(roots), cupy.asarray(prefix_np)
        # the drafter's logits: random bf16 (the top 16 bits of float32 normals of scale 3)
        f32 = cupy.random.RandomState(b).standard_normal((b, dp, VOCAB), dtype=cupy.float32) * 3
        logits = (f32.view(cupy.uint32) >> 16).astype(cupy.uint16)
        del f32
        ws = cupy.empty(max(1, workspace_elems(b, dp, VOCAB, k, "bf16")), cupy.int32)
        top = ks.draft_topk(logits, k, workspace=ws)
        x0 = verify_inputs(spec, b, np.full(b, L), n)
        # every layer its own cache (as in a model: no layer finds another's keys in L2), the same values
        layers = [x0] + [dict(x0, kv_cache=x0["kv_cache"].copy()) for _ in range(LAYERS - 1)]
        tree = ks.tree_build(*top, roots_d, prefix_d, n - 1)
        target = cupy.asarray(rng.integers(0, 150000, (b, n)).astype(np.int32))
        outs = [ks.tree_verify(**x) for x in layers]
        acc = ks.tree_accept(tree, target, x0["prefix_lens"])
        caches = [x["kv_cache"] for x in layers]
        cupy.cuda.runtime.deviceSynchronize()   # the cache copies above must not overlap the timings

        def topk():
            ks.draft_topk(logits, k, out=top, workspace=ws)

        def build():
            ks.tree_build(*top, roots_d, prefix_d, n - 1, out=tree)

        def verify():
            for x, o in zip(layers, outs):
                ks.tree_verify(**x, out=o.out, lse=o.lse)

        def accept():
            ks.tree_accept(tree, target, x0["prefix_lens"], out=acc)
            ks.kv_commit(acc, x0["prefix_lens"], caches, x0["block_table"])

        parts = {name: graph_time_ms(fn, per_graph=1, reps=10) * 1e3
                 for name, fn in (("draft_topk", topk), ("tree_build", build), (VERIFY, verify),
                                  ("tree_accept + kv_commit", accept))}
        step = graph_time_ms(lambda: (topk(), build(), verify(), accept()), per_graph=1, reps=10) * 1e3
        rows.append((b, step, parts))
        plain, why = flashmla_decode(layers)
        if plain is not None:   # every layer's s_q = 1 call in one graph, as a decode step captures them
            decode[b] = graph_time_ms(plain, per_graph=1, reps=10) * 1e3
    lines = step_table(spec.name, dp, k, L, n, rows, decode, why)
    emit(getattr(args, "out", None), "bench_step.txt", "\n".join(lines))
    if getattr(args, "out", None):
        _plot_step(rows, spec.name, args.out)


def step_table(spec_name: str, dp: int, k: int, L: int, n: int, rows: list, decode: dict, why: str | None) -> list:
    """The bench's lines: the header, one row per B (the step, each part with its share), then per B one line of
    absolute cost: the step and tree_verify a layer, beside plain decoding's attention (FlashMLA at s_q = 1, a step
    and a layer) where `decode` has B's time, else `why` it was not measured. rows: (B, step us, {part: us}) with
    the part VERIFY among them; decode: {B: us of every layer's s_q = 1 call}."""
    lines = [f"one DDTree step from the drafter's logits, spec {spec_name}, bf16 logits [B, {dp}, {VOCAB}], "
             f"k = {k}, {LAYERS} layers, L = {L}, N = {n} (CUDA graph; GPU us; the model's GEMMs are not ours "
             f"and are left out)",
             f"{'B':>3} {'step':>10} " + " ".join(f"{name:>26}" for name in rows[0][2])]
    for b, step, parts in rows:
        lines.append(f"{b:>3} {step:10.1f} " + " ".join(f"{v:12.1f} ({100 * v / step:5.1f} %)".rjust(26)
                                                        for v in parts.values()))
    lines.append(f"absolute cost, the same run: a DDTree step (N = {n} rows a request) against plain decoding's "
                 f"attention (FlashMLA dense decode, s_q = 1, L + 1 keys) in {LAYERS} layers")
    for b, step, parts in rows:
        line = (f"B = {b:>2}: DDTree step {step:9.1f} us, tree_verify {parts[VERIFY] / LAYERS:7.1f} us a layer; ")
        if b in decode:
            line += (f"plain decode attention {decode[b]:9.1f} us a step, {decode[b] / LAYERS:7.1f} us a layer "
                     f"(DDTree step / plain attention: {step / decode[b]:.2f}x)")
        else:
            line += f"plain decode attention not measured ({why or 'no FlashMLA'})"
        lines.append(line)
    return lines


def _plot_step(rows, spec_name: str, out: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    from pathlib import Path
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(rows[0][2])
    labels = [f"B={b}\n{step / 1e3:.2f} ms" for b, step, _ in rows]
    left = np.zeros(len(rows))
    for name in names:
        share = np.array([100 * parts[name] / step for _, step, parts in rows])
        ax.barh(labels, share, left=left, label=name)
        left += share
    ax.set_xlabel("share of the step's kernel time (%)")
    ax.set_title(f"One DDTree step from the drafter's logits ({spec_name}, {LAYERS} layers, L = 4096); "
                 f"the model's GEMMs not included",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(out) / "bench_step.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")

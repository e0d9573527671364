"""`ddtree-gen bench tree_accept` and `ddtree-gen bench step`: the commit of every layer, and where
a whole speculative step's kernel time goes.

tree_accept: the walk once plus kv_commit of 61 layers in one launch, next to 61 per-layer
tree_accept calls (walk + commit each) and a device-to-device copy of the bytes the commit moves
(its bandwidth floor), at B = 1, 8, 64 and acceptance 0, typical (4-5) and full (D). All GPU times
are CUDA-graph replays.

step: from the drafter's logits (random bf16 [B, D', V], D' = max_depth, V = 129280): draft_topk
(k = N - 1), tree_build on its output, then tree_verify in each of 61 layers, then the walk and the
commit, captured in one CUDA graph at B = 1, 8, 64 and L = 4096; each part is also replayed alone
for its share. The model's own GEMMs are not ours and are left out.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .bench import graph_time_ms, tree_build_inputs, verify_inputs

LAYERS = 61
VOCAB = 129280   # the drafter logits' vocabulary in bench step (DeepSeek-V3's)
CHAIN = 17    # the accepted path runs through nodes CHAIN, CHAIN + 1, ...: every move is a real one


def accept_tree(spec, b: int):
    """A tree whose accepted path is CHAIN, CHAIN+1, ... (a chain under the root), the root's other
    children decoys; node j carries token j. Returns (tree arrays, target for a path of length a)."""
    n = spec.max_tree_size
    first = np.full(n, -1, np.int32)
    nxt = np.full(n, -1, np.int32)
    chain = list(range(CHAIN, min(n, CHAIN + spec.max_depth)))
    root_children = [j for j in range(1, n) if j not in chain[1:]]
    first[0] = root_children[0]
    for x, y in zip(root_children, root_children[1:]):
        nxt[x] = y
    for x, y in zip(chain, chain[1:]):
        first[x] = y
    tree = dict(num_nodes=np.full(b, n, np.int32), tokens=np.tile(np.arange(n, dtype=np.int32), (b, 1)),
                first_child=np.tile(first, (b, 1)), next_sibling=np.tile(nxt, (b, 1)))

    def target(a):
        t = np.full(n, -5, np.int32)        # no child carries -5: the walk stops there
        path = [0] + chain[:a]
        for x, y in zip(path, path[1:]):
            t[x] = y
        return np.tile(t, (b, 1))
    return tree, target, len(chain)


def bench_tree_accept(args) -> None:
    import cupy

    from .spec import find_spec
    from .kernel_set import load
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec)
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    entry = width * spec.kv_itemsize        # bytes per cache entry (bf16 or e4m3)
    rows = []
    for b in (1, 8, 64):
        tree_np, target_of, full = accept_tree(spec, b)
        tree = SimpleNamespace(**{k: cupy.asarray(v) for k, v in tree_np.items()})
        prefix_np = np.full(b, 512, np.int32)
        per = -(-(512 + spec.max_tree_size) // spec.page_size)
        table = cupy.asarray(np.arange(b * per, dtype=np.int32).reshape(b, per))
        prefix = cupy.asarray(prefix_np)
        caches = [cupy.zeros((b * per, spec.page_size, width), cupy.uint8 if spec.kv_fp8 else cupy.uint16)
                  for _ in range(LAYERS)]
        for name, a in (("0", 0), ("typical", 5 if b % 2 else 4), ("full", full)):
            target = cupy.asarray(target_of(a))
            acc = ks.tree_accept(tree, target, prefix)
            assert int(acc.accept_lens.max()) == a, (a, int(acc.accept_lens.max()))
            both = graph_time_ms(lambda: (ks.tree_accept(tree, target, prefix, out=acc),
                                          ks.kv_commit(acc, prefix, caches, table)), per_graph=5) * 1e3
            per_layer = graph_time_ms(lambda: [ks.tree_accept(tree, target, prefix, kv, table, out=acc)
                                               for kv in caches], per_graph=1) * 1e3
            moved = b * LAYERS * a * entry
            if moved:
                src, dst = cupy.empty(moved, cupy.uint8), cupy.empty(moved, cupy.uint8)
                copy = graph_time_ms(lambda: dst.__setitem__(slice(None), src), per_graph=5) * 1e3
            else:
                copy = float("nan")
            rows.append((b, name, a, moved, both, per_layer, copy))
    print(f"tree_accept + kv_commit, spec {spec.name}, {LAYERS} layers, prefix 512 (GPU us, CUDA-graph replay)")
    lines = [f"{'B':>3} {'accept':>8} {'MB moved':>9} {'walk+commit':>12} {'61x tree_accept':>16} "
             f"{'copy (floor)':>13} {'commit GB/s':>12} {'% of copy':>10}"]
    for b, name, a, moved, both, per_layer, copy in rows:
        gbs = 2 * moved / (both * 1e-6) / 1e9 if moved else 0.0
        frac = f"{100 * copy / both:9.0f}%" if moved else f"{'-':>10}"
        lines.append(f"{b:>3} {name + f' ({a})':>8} {moved / 1e6:9.2f} {both:12.1f} {per_layer:16.1f} "
                     f"{copy:13.1f} {gbs:12.0f} {frac}")
    _emit(args, "bench_tree_accept.txt", "\n".join(lines))


def bench_step(args) -> None:
    import cupy

    from .spec import find_spec
    from .kernel_set import load
    from .kernels.draft_topk import workspace_elems
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec)
    n, L = spec.max_tree_size, 4096
    dp, k = spec.max_depth, n - 1
    rows = []
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
                 for name, fn in (("draft_topk", topk), ("tree_build", build), (f"tree_verify x {LAYERS}", verify),
                                  ("tree_accept + kv_commit", accept))}
        step = graph_time_ms(lambda: (topk(), build(), verify(), accept()), per_graph=1, reps=10) * 1e3
        rows.append((b, step, parts))
    lines = [f"one DDTree step from the drafter's logits, spec {spec.name}, bf16 logits [B, {dp}, {VOCAB}], "
             f"k = {k}, {LAYERS} layers, L = {L}, N = {n} (CUDA graph; GPU us; the model's GEMMs are not ours "
             f"and are left out)",
             f"{'B':>3} {'step':>10} " + " ".join(f"{k:>26}" for k in rows[0][2])]
    for b, step, parts in rows:
        lines.append(f"{b:>3} {step:10.1f} " + " ".join(f"{v:12.1f} ({100 * v / step:5.1f} %)".rjust(26)
                                                        for v in parts.values()))
    _emit(args, "bench_step.txt", "\n".join(lines))
    if getattr(args, "out", None):
        _plot_step(rows, spec.name, args.out)


def _emit(args, name: str, text: str) -> None:
    print(text)
    if getattr(args, "out", None):
        from pathlib import Path
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / name).write_text(text + "\n")


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

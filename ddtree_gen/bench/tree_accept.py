"""`ddtree-gen bench tree_accept`: the commit of every layer.

The walk once plus kv_commit of 61 layers in one launch, next to 61 per-layer tree_accept calls (walk + commit
each) and a device-to-device copy of the bytes the commit moves (its bandwidth floor), at B = 1, 8, 64 and
acceptance 0, typical (4-5) and full (D). All GPU times are CUDA-graph replays.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..inputs import accept_tree, block_table, cache_shape
from .specs import LAYERS
from .timing import emit, graph_time_ms


def run(args) -> None:
    import cupy

    from ..spec import find_spec
    from ..kernel_set import load
    spec = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    ks = load(spec)
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    entry = width * spec.kv_itemsize        # bytes per cache entry (bf16 or e4m3)
    rows = []
    for b in (1, 8, 64):
        tree_np, target_of, full = accept_tree(spec, b)
        tree = SimpleNamespace(**{k: cupy.asarray(v) for k, v in tree_np.items()})
        prefix_np = np.full(b, 512, np.int32)
        table_np, num_pages = block_table(None, [512 + spec.max_tree_size] * b, spec.page_size, permute=False)
        table = cupy.asarray(table_np)
        prefix = cupy.asarray(prefix_np)
        caches = [cupy.zeros(cache_shape(spec, num_pages), cupy.uint8 if spec.kv_fp8 else cupy.uint16)
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
    emit(getattr(args, "out", None), "bench_tree_accept.txt", "\n".join(lines))


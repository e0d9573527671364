"""kv_commit (every layer's commit in one launch) and the walk-only tree_accept, without a GPU:
the launchers' checks and launch arguments (fake arrays), and the numpy reference against the
per-layer tree_accept commit it replaces."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import FakeCudaArray, FakeKernelSet
from ddtree_gen import inputs, reference
from ddtree_gen.errors import ArgumentError
from ddtree_gen.ops.kv_commit.launch import launch as kv_commit
from ddtree_gen.ops.tree_accept.launch import launch as tree_accept
from ddtree_gen.ops.kv_commit.plan import MAX_LAYERS
from ddtree_gen.trees import tree_parents

B, PAGES, MAX_PAGES = 3, 12, 4
DEV1 = 1 << 40


class Recorder(FakeKernelSet):
    def launch(self, name, **kw):
        self.seen = (name, kw)


def _w(spec):
    return spec.kv_lora_rank + spec.qk_rope_head_dim


def kvd(spec):
    """The spec's cache dtype on the CuPy side: uint16 bf16 bits, uint8 e4m3 bytes (an fp8 spec)."""
    return np.uint8 if spec.kv_fp8 else np.uint16


def commit_args(spec, layers=3, stacked=False, b=B):
    d1 = spec.max_depth + 1
    acc = SimpleNamespace(accept_lens=FakeCudaArray((b,), np.int32), accepted_nodes=FakeCudaArray((b, d1), np.int32))
    shape = (PAGES, spec.page_size, _w(spec))
    step = PAGES * spec.page_size * _w(spec) * spec.kv_itemsize
    caches = (FakeCudaArray((layers, *shape), kvd(spec), ptr=1 << 32) if stacked else
              [FakeCudaArray(shape, kvd(spec), ptr=(1 << 32) + k * step) for k in range(layers)])
    return dict(accepted=acc, prefix_lens=FakeCudaArray((b,), np.int32), kv_caches=caches,
                block_table=FakeCudaArray((b, MAX_PAGES), np.int32))


def test_sequence_and_stacked_launch_the_same_pointers(spec, fake_device):
    """One launch, grid (B, layers); the layers' pointers by value, padded to MAX_LAYERS with 0 (a stacked
    tensor's layers are R+P elements of kv_dtype apart per entry: 2 bytes each for bf16, 1 for e4m3)."""
    step = PAGES * spec.page_size * _w(spec) * spec.kv_itemsize
    got = {}
    for stacked in (False, True):
        kset = Recorder(spec)
        kv_commit(kset, **commit_args(spec, 3, stacked))
        name, kw = kset.seen
        assert name == "kv_commit" and kw["grid"] == (B, 3)
        a = kw["args"]
        assert len(a) == 4 + MAX_LAYERS + 2
        assert a[4:7] == [(1 << 32) + k * step for k in range(3)] and all(int(x) == 0 for x in a[7:4 + MAX_LAYERS])
        assert (int(a[-2]), int(a[-1])) == (PAGES, MAX_PAGES)
        got[stacked] = a
    assert got[False] == got[True]


def _bad_layer_shape(a, spec):
    a["kv_caches"][2] = FakeCudaArray((PAGES + 1, spec.page_size, _w(spec)), kvd(spec), ptr=1 << 36)


def _bad_layer_dtype(a, spec):
    a["kv_caches"][1] = FakeCudaArray((PAGES, spec.page_size, _w(spec)), np.float32, ptr=1 << 36)


def _other_kv_dtype_layer(a, spec):   # bf16 bits in an fp8 spec's call, e4m3 bytes in a bf16 one's
    other = np.uint16 if spec.kv_fp8 else np.uint8
    a["kv_caches"][1] = FakeCudaArray((PAGES, spec.page_size, _w(spec)), other, ptr=1 << 36)


def _layer_on_device1(a, spec):
    a["kv_caches"][1] = FakeCudaArray((PAGES, spec.page_size, _w(spec)), kvd(spec), ptr=DEV1)


def _misaligned_layer(a, spec):
    a["kv_caches"][2] = FakeCudaArray((PAGES, spec.page_size, _w(spec)), kvd(spec), ptr=(1 << 36) + 8)


def _too_many_layers(a, spec):
    a["kv_caches"] = a["kv_caches"] * (MAX_LAYERS // 3 + 1)


CASES = [
    ("layer-shape", _bad_layer_shape, "kv_caches[2]: shape"),
    ("layer-dtype", _bad_layer_dtype, "kv_caches[1]: dtype"),
    ("layer-kv-dtype", _other_kv_dtype_layer, "kv_dtype"),
    ("layer-device", _layer_on_device1, "kv_caches[1]: on device 1"),
    ("layer-misaligned", _misaligned_layer, "kv_caches[2]: data pointer"),
    ("too-many-layers", _too_many_layers, f"[1, {MAX_LAYERS}]"),
    ("no-layers", lambda a, s: a.update(kv_caches=[]), "empty sequence"),
    ("page-size", lambda a, s: a.update(kv_caches=[FakeCudaArray((PAGES, s.page_size * 2, _w(s)), kvd(s))]),
     "page_size"),
    ("width", lambda a, s: a.update(kv_caches=[FakeCudaArray((PAGES, s.page_size, _w(s) + 8), kvd(s))]),
     "entry width"),
    ("stacked-rank", lambda a, s: a.update(kv_caches=FakeCudaArray((2, PAGES, s.page_size), kvd(s))),
     "kv_caches: 3 dimensions"),
    ("accepted-missing", lambda a, s: a.update(accepted=SimpleNamespace(accept_lens=a["accepted"].accept_lens)),
     "accepted_nodes"),
    ("nodes-width", lambda a, s: setattr(a["accepted"], "accepted_nodes", FakeCudaArray((B, s.max_depth), np.int32)),
     "accepted.accepted_nodes"),
    ("prefix-batch", lambda a, s: a.update(prefix_lens=FakeCudaArray((B + 1,), np.int32)), "prefix_lens"),
    ("table-rows", lambda a, s: a.update(block_table=FakeCudaArray((B + 1, MAX_PAGES), np.int32)), "block_table"),
]


@pytest.mark.parametrize("case,change,word", CASES, ids=[c[0] for c in CASES])
def test_kv_commit_argument_errors(spec, fake_device, case, change, word):
    args = commit_args(spec)
    change(args, spec)
    kset = Recorder(spec)
    with pytest.raises(ArgumentError) as e:
        kv_commit(kset, **args)
    assert word in str(e.value), str(e.value)
    assert not hasattr(kset, "seen")


def test_walk_only_tree_accept_passes_no_cache(spec, fake_device):
    n, d1 = spec.max_tree_size, spec.max_depth + 1
    tree = SimpleNamespace(num_nodes=FakeCudaArray((B,), np.int32), tokens=FakeCudaArray((B, n), np.int32),
                           first_child=FakeCudaArray((B, n), np.int32), next_sibling=FakeCudaArray((B, n), np.int32))
    out = SimpleNamespace(accept_lens=FakeCudaArray((B,), np.int32), accepted_nodes=FakeCudaArray((B, d1), np.int32),
                          out_tokens=FakeCudaArray((B, d1), np.int32), new_prefix_lens=FakeCudaArray((B,), np.int32))
    kset = Recorder(spec)
    tree_accept(kset, tree, FakeCudaArray((B, n), np.int32), FakeCudaArray((B,), np.int32), out=out)
    name, kw = kset.seen
    a = kw["args"]
    assert name == "tree_accept" and kw["grid"] == (B,) and len(a) == 15
    assert int(a[6]) == 0 and int(a[7]) == 0 and [int(x) for x in a[8:11]] == [0, 0, 0]
    with pytest.raises(ArgumentError, match="^block_table: required with the other"):
        tree_accept(FakeKernelSet(spec), tree, FakeCudaArray((B, n), np.int32), FakeCudaArray((B,), np.int32),
                    FakeCudaArray((PAGES, spec.page_size, _w(spec)), kvd(spec)), out=out)


# ------------------------------------------------------------------------------ reference

def _random_case(spec, rng, b, layers):
    n, d, page, w = spec.max_tree_size, spec.max_depth, spec.page_size, 8   # narrow entries: the logic only
    table, num_pages = inputs.block_table(rng, [200 + n] * b, page, extra_pages=3)
    prefix = rng.integers(0, 200, b).astype(np.int32)
    trees = []
    for _ in range(b):
        parents = tree_parents("random", n, rng)
        first = np.full(n, -1, np.int32)
        nxt = np.full(n, -1, np.int32)
        for j in range(n - 1, 0, -1):
            nxt[j] = first[parents[j]]
            first[parents[j]] = j
        trees.append((first, nxt))
    tokens = rng.integers(0, 3, (b, n)).astype(np.int32)
    tree = SimpleNamespace(num_nodes=np.full(b, n, np.int32), tokens=tokens,
                           first_child=np.stack([t[0] for t in trees]), next_sibling=np.stack([t[1] for t in trees]))
    target = rng.integers(0, 3, (b, n)).astype(np.int32)
    caches = [rng.integers(0, 2**16, (num_pages, page, w)).astype(np.uint16) for _ in range(layers)]
    return tree, target, prefix, table, caches, d


def test_reference_walk_then_commit_equals_tree_accept_per_layer(spec):
    rng = np.random.default_rng(7)
    for _ in range(20):
        tree, target, prefix, table, caches, d = _random_case(spec, rng, 4, 3)
        per_layer = [c.copy() for c in caches]
        for c in per_layer:
            want = reference.tree_accept(tree, target, prefix, c, table, d)
        walk = reference.tree_accept(tree, target, prefix, None, None, d)
        for got, ref in zip(walk, want):
            assert np.array_equal(got, ref)
        seq = [c.copy() for c in caches]
        reference.kv_commit(walk, prefix, seq, table)
        stacked = np.stack(caches)
        reference.kv_commit(walk, prefix, stacked, table)
        for k in range(3):
            assert np.array_equal(seq[k], per_layer[k]) and np.array_equal(stacked[k], per_layer[k])
        assert any(not np.array_equal(a, b) for a, b in zip(per_layer, caches)) or not walk.accept_lens.any()


def test_layer_pointers_are_one_struct_parameter(spec, fake_device):
    """cuLaunchKernel takes one pointer per kernel parameter: the 128 layer pointers are one struct
    parameter (LayerCaches) at offset 32, so num_pages and max_pages sit at 1056 and 1060."""
    from ddtree_gen.launch.runtime import param_offsets
    kset = FakeKernelSet(spec)
    args = commit_args(spec, 2)
    seen = {}
    kset.launch = lambda name, **kw: seen.update(kw)
    kv_commit(kset, **args)
    assert seen["fmt"].count("[") == 1 and param_offsets(seen["fmt"]) == [0, 8, 16, 24, 32, 1056, 1060]
    assert param_offsets("@QfiqQ") == [0, 8, 12, 16, 24]

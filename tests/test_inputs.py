"""The input factory (ddtree_gen/inputs.py) without a GPU: block tables, tree masks, the edge-case knobs, a
tree_verify batch the numpy reference accepts for every spec, and one logical cache laid out in other page sizes
(relayout: bench tree_verify --pages)."""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_gen import bf16, inputs, reference
from ddtree_gen.errors import ArgumentError
from ddtree_gen.spec import find_spec
from ddtree_gen.trees import ancestor_mask, tree_parents


def test_block_table_pages_are_a_permutation():
    rng = np.random.default_rng(0)
    table, num_pages = inputs.block_table(rng, [1, 64, 65, 300], 64, extra_pages=3, spare_columns=2)
    need = [1, 1, 2, 5]
    assert num_pages == sum(need) + 3 and table.shape == (4, 5 + 2) and table.dtype == np.int32
    used = np.concatenate([table[i, :n] for i, n in enumerate(need)])
    assert len(set(used.tolist())) == len(used) and used.min() >= 0 and used.max() < num_pages
    assert all((table[i, n:] == 0).all() for i, n in enumerate(need))          # unused: 0 by default
    assert not all(np.diff(table[3, :5]) == 1)                                   # permuted, not contiguous


def test_block_table_unused_entries_and_order():
    table, num_pages = inputs.block_table(None, [130, 130], 64, permute=False, unused=-1, spare_columns=1)
    assert num_pages == 6 and table.tolist() == [[0, 1, 2, -1], [3, 4, 5, -1]]
    table, num_pages = inputs.block_table(np.random.default_rng(1), [10], 64, spare_columns=4, unused="garbage")
    assert set(table[0, 1:].tolist()) <= set(inputs.garbage_entries(num_pages).tolist())
    with pytest.raises(ValueError):
        inputs.block_table(np.random.default_rng(1), [10], 64, unused="zeros")
    table, num_pages = inputs.block_table(np.random.default_rng(1), [10, 10], 64, spare_columns=6, unused="any")
    assert table[:, 1:].min() >= -3 and table[:, 1:].max() < num_pages + 3 and len(set(table[:, 1:].ravel())) > 2


def test_block_table_windows():
    """first_pages: each request's pages from that column on (its tree's window), only those pages in the pool;
    the columns before and after are unused."""
    table, num_pages = inputs.block_table(np.random.default_rng(6), [200, 65, 64], 64, first_pages=[2, 0, 1],
                                          unused=-1, spare_columns=1)
    assert num_pages == 2 + 2 + 0 and table.shape == (3, 5)
    assert (table[0, :2] == -1).all() and (table[0, 4:] == -1).all() and (table[1, 2:] == -1).all()
    assert (table[2] == -1).all()                                                # its one page before the window
    assert sorted(np.concatenate([table[0, 2:4], table[1, :2]]).tolist()) == list(range(num_pages))
    for bad in ([5, 0, 0], [0, 0]):
        with pytest.raises(ValueError, match="first_pages"):
            inputs.block_table(np.random.default_rng(6), [200, 65, 64], 64, first_pages=bad)


def test_bad_pages_point_outside_the_cache():
    table, num_pages = inputs.block_table(np.random.default_rng(2), [200] * 3, 64)
    bad = inputs.bad_pages(table, num_pages)
    assert bad[0, 0] == -1 and bad[1, 1] == num_pages + 5 and (bad[2] == 2**31 - 1).all()
    assert (bad[0, 1:] == table[0, 1:]).all() and (table >= 0).all()           # the original is untouched


def test_tree_masks():
    rng = np.random.default_rng(3)
    mask = inputs.tree_masks(rng, [5, 0, 3], ["chain", "star", "binary"], 6, 1)
    assert mask.shape == (3, 6, 1) and mask.dtype == np.uint32
    assert (mask[0, :5] == ancestor_mask(tree_parents("chain", 5, None), 1)).all() and (mask[0, 5] == 0).all()
    assert (mask[1] == 0).all()                                                  # q_len 0: an empty request
    junk = inputs.tree_masks(np.random.default_rng(4), [3], "chain", 4, 1, junk_bits=True)
    assert (junk[0, :3] & 0b111 == ancestor_mask(tree_parents("chain", 3, None), 1)).all()


def test_tree_verify_batch_for_every_spec(spec):
    """Shapes and dtypes of the spec, an fp8 spec's e4m3 cache and kv_scale, cleared rows; the numpy reference
    takes the batch as it is (finite outputs on every row with a visible key)."""
    n = spec.max_tree_size
    inp = inputs.tree_verify(spec, np.random.default_rng(5), [0, 70], [n, 3], ["random", "chain"], nq=n,
                             clear_rows=[(1, 0)], values=inputs.bf16_normal)
    h, r, p = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    assert inp.q_nope.shape == (2, n, h, r) and inp.q_pe.shape == (2, n, h, p) and inp.q_nope.dtype == np.uint16
    assert inp.kv_cache.shape[1:] == (spec.page_size, r + p) and inp.kv_cache.dtype == inputs.kv_dtype(spec)
    assert (inp.kv_scale is not None) == spec.kv_fp8
    assert (inp.tree_mask[1, 0] == 0).all() and inp.tree_mask[1, 1].any()
    heads = [0]
    out = reference.tree_verify(**inp.host(q_nope=inp.q_nope[:, :, heads], q_pe=inp.q_pe[:, :, heads]),
                                softmax_scale=(r + p) ** -0.5)
    assert np.isfinite(out.out[0, :n]).all() and np.isfinite(out.out[1, :3]).all()
    tail = reference.tree_verify_tail(**inp.host(q_nope=inp.q_nope[:, :, heads], q_pe=inp.q_pe[:, :, heads]),
                                      softmax_scale=(r + p) ** -0.5)
    assert np.isneginf(tail.lse[1, 0]).all()          # the cleared row sees no tail key


def test_value_samplers():
    rng = np.random.default_rng(6)
    b = inputs.bf16_bounded(rng, (1000,))
    x = np.abs(bf16.from_bits(b))
    assert (x >= 0.125).all() and (x < 2).all()
    f = bf16.from_bits(inputs.bf16_finite(rng, (1000,)))
    assert np.isfinite(f).all() and (np.abs(f) < 2).all()
    assert (inputs.e4m3_finite(rng, (100,)) & 0x40 == 0).all()
    assert 0.01 <= inputs.kv_scale(rng) <= 2.0


def test_the_same_seed_gives_the_same_batch(spec):
    a = inputs.tree_verify(spec, np.random.default_rng(7), [3, 9], [2, 2], "random")
    b = inputs.tree_verify(spec, np.random.default_rng(7), [3, 9], [2, 2], "random")
    assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
               for x, y in zip(a.host().values(), b.host().values()))


def _logical_rows(kv, table, tokens):
    """Request i's positions 0..tokens[i]-1 as rows, in order, whatever the page size."""
    page = kv.shape[1]
    return [np.array([kv[table[i, t // page], t % page] for t in range(n)]).reshape(n, kv.shape[2])
            for i, n in enumerate(tokens)]


def test_relayout_keeps_the_logical_cache():
    """One logical cache laid out in pages of 1, 5, 16, 64 and 128 tokens: the same rows at the same positions of
    every request (a random page permutation each: never the identity), rows past a request's tokens 0, on numpy."""
    spec = find_spec("kimi-k2.6-tp8")
    tokens = [73, 0, 130, 5]
    kv, table = inputs.paged_cache(spec, np.random.default_rng(8), tokens)
    want = _logical_rows(kv, table, tokens)
    for page in (1, 5, 16, 64, 128):
        new_kv, new_table = inputs.relayout(kv, table, tokens, page, np.random.default_rng(page), extra_pages=1)
        need = [-(-n // page) for n in tokens]
        assert new_kv.shape == (sum(need) + 1, page, kv.shape[2]) and new_kv.dtype == kv.dtype
        assert new_table.dtype == np.int32 and new_table.shape == (4, max(need))
        got = _logical_rows(new_kv, new_table, tokens)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), page
        used = np.concatenate([new_table[i, :n] for i, n in enumerate(need)])
        assert sorted(used.tolist()) == sorted(set(used.tolist())) and used.max() <= sum(need)
        if page == 1:   # the permutation is random: page p of request 0 is not page p of the cache
            assert not np.array_equal(new_table[0, :73], np.arange(73))
        rows = new_kv.reshape(-1, kv.shape[2])
        written = {int(new_table[i, t // page]) * page + t % page for i, n in enumerate(tokens) for t in range(n)}
        assert not rows[[r for r in range(len(rows)) if r not in written]].any()


def test_layouts_give_the_same_reference_output():
    """The three layouts of bench tree_verify --pages (pages of 1, 16 and 64 tokens) of one small batch: the numpy
    reference gives the same bits for each (the same keys in the same order), and a head's outputs are finite."""
    spec = find_spec("kimi-k2.6-tp8")
    inp = inputs.tree_verify(spec, np.random.default_rng(9), [70, 5, 130], [3, 2, 4], "random", nq=4,
                             values=inputs.bf16_normal)
    heads = [0, 5]
    scale = (spec.kv_lora_rank + spec.qk_rope_head_dim) ** -0.5
    tokens = inp.prefix_lens + inp.q_lens
    outs = []
    for page in (1, 16, 64):
        kv, table = inputs.relayout(inp.kv_cache, inp.block_table, tokens, page, np.random.default_rng(page))
        outs.append(reference.tree_verify(**inp.host(q_nope=inp.q_nope[:, :, heads], q_pe=inp.q_pe[:, :, heads],
                                                     kv_cache=kv, block_table=table), softmax_scale=scale))
    assert np.isfinite(outs[0].out[0, :3]).all() and np.isfinite(outs[0].lse[2, :4]).all()
    for o in outs[1:]:   # (rows past q_len: the reference's NaN in each)
        assert np.array_equal(o.out, outs[0].out, equal_nan=True)
        assert np.array_equal(o.lse, outs[0].lse, equal_nan=True)


@pytest.mark.parametrize("page", [0, -16, 4097, 2.5, True, "16", None])
def test_relayout_refuses_a_bad_page_size(page):
    kv, table = inputs.paged_cache(find_spec("kimi-k2.6-tp8"), np.random.default_rng(10), [10])
    with pytest.raises(ArgumentError, match=r"page_size: .* is not a page size \(expected an int in \[1, 4096\]"):
        inputs.relayout(kv, table, [10], page, np.random.default_rng(0))


def test_relayout_refuses_a_table_that_does_not_hold_the_tokens():
    kv, table = inputs.paged_cache(find_spec("kimi-k2.6-tp8"), np.random.default_rng(11), [10, 70])
    rng = np.random.default_rng(0)
    with pytest.raises(ArgumentError, match=r"tokens: each in \[0, 128\]"):
        inputs.relayout(kv, table, [10, 129], 16, rng)
    with pytest.raises(ArgumentError, match="table: expected \\[3, max_pages\\]"):
        inputs.relayout(kv, table, [10, 70, 1], 16, rng)
    with pytest.raises(ArgumentError, match="names no page"):
        inputs.relayout(kv, inputs.bad_pages(table, kv.shape[0]), [10, 70], 16, rng)
    with pytest.raises(ArgumentError, match="kv_cache: expected"):
        inputs.relayout(kv[0], table, [10, 70], 16, rng)

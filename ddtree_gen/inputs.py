"""Valid inputs of each kernel from a spec: one factory for the benches, the tests and the scripts.

Everything is built with numpy from a numpy Generator (the same seed gives the same inputs), then uploaded
where a caller wants device arrays (upload: CuPy, optionally misaligned). Pieces and knobs:

* values: bf16 bits (bounded, normal, any finite), an fp8 spec's e4m3 bytes (normal, any finite; kv_finite: the
  spec's kind), a kv_scale, any bit pattern of a cache element (cache_bits);
* the paged cache: block_table (pages from a random permutation, never contiguous; spare columns and pages;
  unused entries 0, -1 or garbage that points outside the cache; equal_block_table: requests of one length),
  paged_cache (a cache of normal values with its table), bad_pages (used entries out of range) and relayout (one
  logical cache laid out in pages of another size: an engine's own layout, for bench tree_verify --pages);
* trees: tree_masks (the ancestor masks of chain / star / binary / random trees, optionally with junk bits
  at and past q_len), accept_tree (a tree whose accepted path is known) and reference_tree (the numpy
  reference's tree of a random top-k table);
* the pieces the kernels' sanitizer cases and bundles (ops/<op>/plan.py) share are among these;
* per kernel: tree_verify (VerifyInputs: host arrays, .device() uploads), tree_build_inputs, accept_tree, and
  verify_inputs (the benches' large batches: the structure from here, the values drawn on the GPU) and
  chain_verify_inputs (the tuning scripts' timing batches: chain trees, drawn on the GPU).
Edge cases: q_lens 0 (empty requests) or rows whose mask is cleared (clear_rows: rows with no visible tail
key), bad_pages, and misaligned device copies (upload(..., misalign=)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import bf16, fp8, reference
from .errors import ArgumentError
from .spec import MAX_PAGE_SIZE
from .trees import ancestor_mask, tree_parents

CHAIN = 17    # accept_tree's accepted path runs through nodes CHAIN, CHAIN + 1, ...: every move is a real one

# ------------------------------------------------------------------------------------------ values


def bf16_bounded(rng, shape) -> np.ndarray:
    """Random bf16 bits: random sign and mantissa, exponent 124..127, i.e. values +-[0.125, 2)
    (RMS about 1). Drawn as raw 64-bit words (fast: B = 64 requests of 128 heads is 272 M values)."""
    n = math.prod(shape)
    bits = rng.integers(0, 2**64 - 1, -(-n // 4), dtype=np.uint64, endpoint=True).view(np.uint16)[:n]
    bits = bits.reshape(shape)
    bits &= np.uint16(0x81FF)   # sign, the 2 low exponent bits, mantissa
    bits |= np.uint16(0x3E00)   # exponent 0b011111xx = 124..127
    return bits


def bf16_normal(rng, shape) -> np.ndarray:
    """bf16 bits of N(0, 1) samples (truncated: the bits are the data, the reference reads the same)."""
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_finite(rng, shape) -> np.ndarray:
    """Any finite bf16 bits of magnitude < 2 (the top exponent bit cleared: no inf, no NaN)."""
    return rng.integers(0, 1 << 16, shape, dtype=np.uint16) & np.uint16(0xBFFF)


def e4m3_normal(rng, shape) -> np.ndarray:
    """e4m3 bytes (uint8) of N(0, 1) float32 samples, rounded to nearest even (|x| < 448: no NaN byte)."""
    return fp8.from_float(rng.standard_normal(shape, dtype=np.float32))


def e4m3_finite(rng, shape) -> np.ndarray:
    """Any e4m3 bytes of magnitude < 2 (the top exponent bit cleared: no NaN)."""
    return rng.integers(0, 1 << 8, shape, dtype=np.uint8) & np.uint8(0xBF)


def kv_scale(rng) -> float:
    """A kv_scale in [0.01, 2], exactly a float32 (the kernels apply it in fp32)."""
    return float(np.float32(rng.uniform(0.01, 2.0)))


def kv_finite(spec, rng, shape) -> np.ndarray:
    """Random finite KV-cache elements of the spec's kv_dtype, magnitude < 2: bf16 bits, or e4m3 bytes (no NaN)."""
    return (e4m3_finite if spec.kv_fp8 else bf16_finite)(rng, shape)


def kv_dtype(spec):
    """The numpy dtype of the spec's cache on the host: uint16 bf16 bits, or uint8 e4m3 bytes."""
    return np.uint8 if spec.kv_fp8 else np.uint16


def cache_bits(rng, spec, shape) -> np.ndarray:
    """Any bit patterns of the spec's cache elements (the discrete kernels only move them)."""
    return rng.integers(0, 1 << (8 * np.dtype(kv_dtype(spec)).itemsize), shape, dtype=kv_dtype(spec))


def cache_shape(spec, num_pages: int) -> tuple:
    return (num_pages, spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim)


# ------------------------------------------------------------------------------------- paged cache

def garbage_entries(num_pages: int) -> np.ndarray:
    """Block-table entries that name no page of a cache of num_pages (the kernels must never follow them)."""
    return np.array([-1, -7, num_pages, 2**31 - 1, -2**31], np.int32)


def block_table(rng, tokens, page_size: int, *, extra_pages: int = 0, spare_columns: int = 0, unused=0,
                permute: bool = True, first_pages=None) -> tuple[np.ndarray, int]:
    """(block table [B, max_pages] int32, num_pages) for requests of `tokens` cache positions each: request i
    gets ceil(tokens[i] / page_size) pages, in order, from a random permutation of num_pages = their sum +
    extra_pages (permute=False: 0, 1, 2, ...); max_pages = the most any request needs (at least 1) +
    spare_columns. first_pages: per request, the first column that gets a page (a window of the request's
    positions, e.g. its tree's pages only; the columns before it are unused, and it needs only the pages from
    there). Entries past (or before) a request's pages: `unused` (an int), "garbage" (garbage_entries) or "any"
    (any value in [-3, num_pages + 3): pages of other requests among them), drawn after the permutation."""
    first = [0] * len(tokens) if first_pages is None else [int(f) for f in first_pages]
    end = [-(-int(t) // page_size) for t in tokens]
    if len(first) != len(end) or any(not 0 <= f <= e for f, e in zip(first, end)):
        raise ValueError(f"first_pages {first}: one per request, each in [0, its pages {end}]")
    need = [e - f for f, e in zip(first, end)]
    max_pages = max(end + [1]) + spare_columns
    num_pages = sum(need) + extra_pages
    order = rng.permutation(num_pages).astype(np.int32) if permute else np.arange(num_pages, dtype=np.int32)
    if unused == "garbage":
        table = rng.choice(garbage_entries(num_pages), size=(len(need), max_pages)).astype(np.int32)
    elif unused == "any":
        table = rng.integers(-3, num_pages + 3, (len(need), max_pages)).astype(np.int32)
    elif isinstance(unused, str):
        raise ValueError(f"unused: {unused!r}, expected an int, 'garbage' or 'any'")
    else:
        table = np.full((len(need), max_pages), unused, np.int32)
    used = 0
    for i, (f, e) in enumerate(zip(first, end)):
        table[i, f:e] = order[used:used + e - f]
        used += e - f
    return table, num_pages


def equal_block_table(spec, rng, b: int, tokens: int, extra: int = 2) -> tuple[np.ndarray, int]:
    """block_table of `b` requests of `tokens` cache positions each, on the spec's pages, `extra` pages spare."""
    return block_table(rng, [tokens] * b, spec.page_size, extra_pages=extra)


def paged_cache(spec, rng, lens, extra_pages: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(kv cache, block table) for requests of `lens` positions: the table a random permutation of pages (never
    contiguous, block_table), the cache N(0, 1) values as bf16 bits, or e4m3 bytes for an fp8 spec (no NaN byte)."""
    table, num_pages = block_table(rng, lens, spec.page_size, extra_pages=extra_pages)
    values = rng.standard_normal(cache_shape(spec, num_pages))
    kv = fp8.from_float(values.astype(np.float32)) if spec.kv_fp8 else bf16.to_bits(values)
    return kv, table


def bad_pages(table: np.ndarray, num_pages: int) -> np.ndarray:
    """A copy of `table` whose used entries point outside the cache: request 0's first page -1, request 1's
    second num_pages + 5, every page of request 2 2**31 - 1 (as many of these as the table has)."""
    bad = table.copy()
    if bad.shape[0] > 0:
        bad[0, 0] = -1
    if bad.shape[0] > 1 and bad.shape[1] > 1:
        bad[1, 1] = num_pages + 5
    if bad.shape[0] > 2:
        bad[2, :] = 2**31 - 1
    return bad


def relayout(kv_cache, table, tokens, page_size: int, rng, *, extra_pages: int = 0):
    """The same logical cache in pages of `page_size` tokens: (kv_cache [num_pages, page_size, D], block table
    [B, max_pages] int32) where request i's positions 0..tokens[i]-1 hold the rows they hold in (kv_cache, table)
    (its block table, any page size), its pages drawn from a random permutation (block_table(); extra_pages spare);
    rows past a request's tokens are 0. numpy or CuPy arrays, as given (the rows are gathered where they lie: the
    benches' caches stay on the GPU). ArgumentError for a page size outside [1, MAX_PAGE_SIZE] (the spec's
    range), tokens the table does not hold, or a used entry outside the cache."""
    if isinstance(page_size, (bool, np.bool_)) or not isinstance(page_size, (int, np.integer)) \
            or not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ArgumentError(f"page_size: {page_size!r} is not a page size (expected an int in [1, {MAX_PAGE_SIZE}], "
                            f"the spec's range)")
    page_size = int(page_size)
    if getattr(kv_cache, "ndim", 0) != 3:
        raise ArgumentError(f"kv_cache: expected [num_pages, page_size, D], got shape "
                            f"{getattr(kv_cache, 'shape', '?')}")
    num_pages, old_page, width = (int(v) for v in kv_cache.shape)
    host_table = table if isinstance(table, np.ndarray) else table.get()   # (CuPy: .get())
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    if host_table.ndim != 2 or host_table.shape[0] != len(tokens):
        raise ArgumentError(f"table: expected [{len(tokens)}, max_pages] for {len(tokens)} requests, got "
                            f"shape {host_table.shape}")
    if (tokens < 0).any() or (tokens > host_table.shape[1] * old_page).any():
        raise ArgumentError(f"tokens: each in [0, {host_table.shape[1] * old_page}] (the table's "
                            f"{host_table.shape[1]} pages of {old_page}), got {tokens.tolist()}")
    new_table, new_pages = block_table(rng, tokens, page_size, extra_pages=extra_pages)
    req = np.repeat(np.arange(len(tokens)), tokens)
    pos = np.arange(int(tokens.sum())) - np.repeat(np.cumsum(tokens) - tokens, tokens)   # position within request
    old = host_table[req, pos // old_page].astype(np.int64)
    if len(old) and (old.min() < 0 or old.max() >= num_pages):
        raise ArgumentError(f"table: a used entry names no page of the {num_pages}-page cache")
    src = old * old_page + pos % old_page
    dst = new_table[req, pos // page_size].astype(np.int64) * page_size + pos % page_size
    if isinstance(kv_cache, np.ndarray):
        flat = np.zeros((new_pages * page_size, width), kv_cache.dtype)
        flat[dst] = kv_cache.reshape(-1, width)[src]
        return flat.reshape(new_pages, page_size, width), new_table
    import cupy
    flat = cupy.zeros((new_pages * page_size, width), kv_cache.dtype)
    flat[cupy.asarray(dst)] = kv_cache.reshape(-1, width)[cupy.asarray(src)]
    return flat.reshape(new_pages, page_size, width), cupy.asarray(new_table)


# ------------------------------------------------------------------------------------------- trees

def reference_tree(spec, rng, b: int, dp: int, kp: int, budget: int, prefix):
    """The TreeBuildOutput of the numpy reference (reference.tree_build) on a random top-k table of b requests,
    D' = dp, K' = kp (token ids below 50, descending log-probs), roots 0..b-1, prefix lengths `prefix`."""
    ids = rng.integers(0, 50, (b, dp, kp), dtype=np.int32)
    lps = (-np.sort(rng.exponential(1.0, (b, dp, kp)), axis=2)).astype(np.float32)
    return reference.tree_build(ids, lps, np.arange(b, dtype=np.int32), np.asarray(prefix, np.int32), budget,
                                spec.max_tree_size)


def tree_masks(rng, q_lens, kinds, nq: int, words: int, *, junk_bits: bool = False) -> np.ndarray:
    """[B, nq, words] uint32: request i's rows < q_lens[i] hold the ancestor mask of a tree of kind kinds[i]
    (a str: the same kind for all), rows past it 0. junk_bits: random words first, and the tree's rows keep
    their random bits at positions >= q_len (they name keys outside the call: ignored)."""
    b = len(q_lens)
    kinds = [kinds] * b if isinstance(kinds, str) else kinds
    mask = np.zeros((b, nq, words), np.uint32)
    if junk_bits:
        mask[:] = rng.integers(0, 2**32, size=mask.shape, dtype=np.uint32)
    for i, (q, kind) in enumerate(zip(q_lens, kinds)):
        if q <= 0:   # an empty request (q_len 0): no tree
            continue
        tree = ancestor_mask(tree_parents(kind, int(q), rng), words)
        if junk_bits:
            keep = np.array([sum(1 << k for k in range(32) if 32 * word + k >= q) for word in range(words)],
                            np.uint32)
            mask[i, :q] = (mask[i, :q] & keep) | tree
        else:
            mask[i, :q] = tree
    return mask


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


# ----------------------------------------------------------------------------------------- uploads

def upload(value, misalign: int = 0):
    """A host array as a CuPy array (other values pass through). misalign: the copy starts that many elements
    into an aligned allocation (a kernel that needs 16-byte alignment must refuse it)."""
    if not isinstance(value, np.ndarray):
        return value
    import cupy
    if not misalign:
        return cupy.asarray(value)
    flat = cupy.empty(value.size + misalign, value.dtype)
    view = flat[misalign:].reshape(value.shape)
    view[...] = cupy.asarray(value)
    return view


# ------------------------------------------------------------------------------------- tree_verify

@dataclass
class VerifyInputs:
    """One tree_verify batch on the host (bf16 as uint16 bits); .device() gives the launcher's arguments."""
    q_nope: np.ndarray       # [B, Nq, H, R]
    q_pe: np.ndarray         # [B, Nq, H, P]
    kv_cache: np.ndarray     # [num_pages, page, R + P]
    block_table: np.ndarray  # [B, max_pages] int32
    prefix_lens: np.ndarray  # [B] int32
    q_lens: np.ndarray       # [B] int32
    tree_mask: np.ndarray    # [B, Nq, W] uint32
    kv_scale: float | None = None   # an fp8 cache's scale (None: a bf16 cache)
    seed: int = 0

    @property
    def shape(self):
        return self.q_nope.shape

    def host(self, **replace) -> dict:
        """The launchers' and the references' keyword arguments (kv_scale included), on the host."""
        d = dict(q_nope=self.q_nope, q_pe=self.q_pe, kv_cache=self.kv_cache, block_table=self.block_table,
                 prefix_lens=self.prefix_lens, q_lens=self.q_lens, tree_mask=self.tree_mask, kv_scale=self.kv_scale)
        d.update(replace)
        return d

    def device(self, misalign: dict | None = None, **replace) -> dict:
        """host(**replace) uploaded (CuPy); misalign: {argument: elements} for misaligned copies."""
        misalign = misalign or {}
        return {k: upload(v, misalign.get(k, 0)) for k, v in self.host(**replace).items()}


def tree_verify(spec, rng, prefix_lens, q_lens, trees="random", *, nq=None, extra_pages=0, spare_columns=0,
                unused=0, junk_bits=False, values=bf16_bounded, kv_values=None, clear_rows=(), seed=0
                ) -> VerifyInputs:
    """A tree_verify / tree_verify_tail batch: pages of a random permutation (block_table: extra_pages spare
    pages, spare_columns, unused entries), tree masks of `trees` (tree_masks, junk_bits), then q drawn with
    `values(rng, shape)` and the cache with kv_values (default: `values` for bf16, e4m3_normal for an fp8
    spec, which also gets a kv_scale). clear_rows: (request, row) pairs whose mask is cleared (rows that see
    the prefix only; with prefix 0, nothing). `seed` is only recorded."""
    h, r, p, page, w = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size, spec.mask_words
    nq = spec.max_tree_size if nq is None else nq
    prefix_lens = np.asarray(prefix_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    b = len(prefix_lens)
    table, num_pages = block_table(rng, [int(L) + int(q) for L, q in zip(prefix_lens, q_lens)], page,
                                   extra_pages=extra_pages, spare_columns=spare_columns, unused=unused)
    mask = tree_masks(rng, q_lens, trees, nq, w, junk_bits=junk_bits)
    for i, row in clear_rows:
        mask[i, row] = 0
    q_nope, q_pe = values(rng, (b, nq, h, r)), values(rng, (b, nq, h, p))
    kv_values = kv_values or (e4m3_normal if spec.kv_fp8 else values)
    kv = kv_values(rng, cache_shape(spec, num_pages))
    return VerifyInputs(q_nope=q_nope, q_pe=q_pe, kv_cache=kv, block_table=table, prefix_lens=prefix_lens,
                        q_lens=q_lens, tree_mask=mask, kv_scale=kv_scale(rng) if spec.kv_fp8 else None, seed=seed)


def verify_inputs(spec, b: int, lens, nq: int, seed: int = 0):
    """The benches' tree_verify batch, on the GPU: prefix lens[i] and q_len nq per request, a random-permutation
    block table and random trees (numpy, seeded), random bf16 q and cache drawn on the GPU (cupy uint16 bits: the
    large batches would take seconds on the host). An fp8 spec's cache is the e4m3 bytes (cupy uint8, converted
    by torch) of the same normal samples, with kv_scale 1; the same seed gives the same q, table, masks and cache
    values for both kv_dtypes."""
    import cupy
    rng = np.random.default_rng(seed)
    h, r, p = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    lens = np.asarray(lens, np.int32)
    table, num_pages = block_table(rng, lens + nq, spec.page_size)
    # random trees: parent of node j uniformly among 0..j-1 (root 0)
    mask = tree_masks(rng, [nq] * b, "random", nq, spec.mask_words)
    g = cupy.random.default_rng(seed)

    def bf(shape):   # bf16 bits rounded to nearest even on the GPU (the samples are finite): to_bits' bits
        w = g.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32)
        return ((w + cupy.uint32(0x7FFF) + ((w >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16)

    def e4m3(shape):   # normal samples -> e4m3 bytes (round to nearest even; |x| < 448 here)
        import torch
        x = torch.utils.dlpack.from_dlpack(g.standard_normal(shape, dtype=cupy.float32))
        return cupy.from_dlpack(x.to(torch.float8_e4m3fn).view(torch.uint8).contiguous())

    q_nope, q_pe = bf((b, nq, h, r)), bf((b, nq, h, p))
    kv_shape = cache_shape(spec, num_pages)
    out = dict(q_nope=q_nope, q_pe=q_pe, kv_cache=e4m3(kv_shape) if spec.kv_fp8 else bf(kv_shape),
               block_table=cupy.asarray(table), prefix_lens=cupy.asarray(lens),
               q_lens=cupy.full(b, nq, dtype=cupy.int32), tree_mask=cupy.asarray(mask),
               softmax_scale=192 ** -0.5)
    if spec.kv_fp8:
        out["kv_scale"] = 1.0
    return out


def chain_verify_inputs(spec, b: int, L: int, nq: int) -> dict:
    """A tree_verify timing batch drawn on the GPU (CuPy's global random state): every request has prefix L and
    q_len nq with a chain tree (the mask does not change the work), random bf16 q and cache (the top 16 bits of
    float32 normals), a random-permutation block table; no softmax_scale (the tuning scripts pass theirs)."""
    import cupy
    h, r, p, page, w = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.page_size, spec.mask_words
    pages_per = -(-(L + nq) // page)

    def rnd(shape):
        x = cupy.random.standard_normal(shape, dtype=np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    table = cupy.random.permutation(b * pages_per).astype(np.int32).reshape(b, pages_per)
    mask = np.zeros((nq, w), np.uint32)
    for i in range(nq):
        for k in range(i + 1):
            mask[i, k // 32] |= np.uint32(1 << (k % 32))
    return dict(q_nope=rnd((b, nq, h, r)), q_pe=rnd((b, nq, h, p)), kv_cache=rnd((b * pages_per, page, r + p)),
                block_table=table, prefix_lens=cupy.full(b, L, np.int32), q_lens=cupy.full(b, nq, np.int32),
                tree_mask=cupy.asarray(np.broadcast_to(mask, (b, nq, w)).copy()))


# -------------------------------------------------------------------------------------- tree_build

def tree_build_inputs(spec, b: int, rng, depth: int | None = None, k: int | None = None):
    """(topk_ids, topk_logprobs, root_tokens, prefix_lens) of tree_build, numpy: B requests, D' = depth (default
    the spec's D) rows of k (default N - 1) candidates each, log-probs descending per row."""
    d = depth or spec.max_depth
    k = k or spec.max_tree_size - 1
    ids = rng.integers(0, 150000, size=(b, d, k), dtype=np.int32)
    lps = -np.sort(rng.exponential(1.0, size=(b, d, k)).astype(np.float32), axis=-1)
    roots = rng.integers(0, 150000, size=b, dtype=np.int32)
    prefix = rng.integers(0, 100000, size=b, dtype=np.int32)
    return ids, np.ascontiguousarray(lps), roots, prefix

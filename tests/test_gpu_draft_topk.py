"""draft_topk on the GPU against reference.draft_topk: ids bit for bit, log-probs within
1e-5 + 2^-22 |ref| of the float64 log-softmax (docs/contract.md section 5a), on every spec.

Every test runs on every build of the schedule option (ops/draft_topk/plan.SCHEDULES): "chunks" and "rows" (the
default build and a variant build), and on the rows build made to stream a row per block on every call ("rows
streaming"; by default it does so only where the rows fill the GPU). Fresh random inputs each run: the seed is in
every failure message, and DDTREE_TEST_SEED=<seed> replays it. Every output is poisoned before the launch (ids
0x7BADBEEF, log-probs NaN) and every element is checked, so an element the kernel forgets to write shows up.
"""
import os
import secrets

import numpy as np
import pytest

from conftest import need

from ddtree_gen import bf16
from ddtree_gen import reference as ref
from ddtree_gen.ops.draft_topk.plan import NVEC, SCHEDULES, THREADS  # a chunk: THREADS x NVEC 16-byte vectors
from ddtree_gen.reference import DraftTopkOutput

pytestmark = pytest.mark.gpu

POISON = 0x7BADBEEF
FLT_MAX = float(np.finfo(np.float32).max)
# a chunk's logits (ops/draft_topk/plan.CHUNK): 16384 bf16, 8192 float32; the candidate list holds 1024


def load_schedule(spec, schedule):
    """The kernel set with draft_topk built with `schedule`: the default build for its default, else a variant."""
    import ddtree_gen
    from ddtree_gen.kernel_set import variant_set
    from ddtree_gen.ops import by_name
    from ddtree_gen.build.variant import default_config, variant
    kdef = by_name("draft_topk")
    if default_config(kdef, spec)["schedule"] == schedule:
        return ddtree_gen.load(spec, kernels=["draft_topk"])
    return variant_set([variant(kdef, spec, schedule=schedule)])


# the rows build streams a row per block only where the rows fill the GPU and a row is long (ops/draft_topk/launch.ROWS_PER_SM,
# ROWS_MIN_CHUNKS); "rows streaming" is that build with both 0: its stage 2 on every call, whatever the batch and V
RUNS = (*SCHEDULES, "rows streaming")
STREAMING = ("rows streaming",)


def streaming_everywhere(monkeypatch, kset):
    from ddtree_gen.ops.draft_topk import launch as mod
    monkeypatch.setattr(mod, "ROWS_PER_SM", 0)
    monkeypatch.setattr(mod, "ROWS_MIN_CHUNKS", 0)
    kset.prepared_calls.clear()   # the path is chosen when a call's signature is prepared


@pytest.fixture(params=RUNS)
def ks(spec, request, monkeypatch):
    schedule = request.param.split()[0]
    got = load_schedule(spec, schedule)
    assert got.constants("draft_topk")["ROWS"] == int(schedule == "rows")
    if request.param != schedule:
        streaming_everywhere(monkeypatch, got)
    yield got
    got.prepared_calls.clear()


@pytest.fixture
def seed():
    return int(os.environ.get("DDTREE_TEST_SEED") or secrets.randbits(31))


def where(seed):
    return f"seed {seed} (DDTREE_TEST_SEED={seed} replays it)"


def as_dtype(x, dtype):
    """float64 values -> the kernel's input: uint16 bf16 bits or float32 (and the values the reference sees)."""
    return bf16.to_bits(x) if dtype == "bf16" else np.asarray(x, np.float32)


def run(ks, logits, k, temperature=1.0, workspace=False):
    """Launch with poisoned out= buffers (and an explicit workspace if asked); host copies of the outputs."""
    import cupy
    from ddtree_gen.ops.draft_topk.launch import workspace_elems
    b, dp, v = logits.shape
    ids = cupy.full((b, dp, k), POISON, dtype=np.uint32).view(np.int32)
    lps = cupy.full((b, dp, k), np.nan, dtype=np.float32)
    kw = {}
    if workspace:
        n = workspace_elems(b, dp, v, k, "bf16" if logits.dtype == np.uint16 else "float32")
        kw["workspace"] = cupy.full(max(n, 1), POISON, dtype=np.uint32).view(np.int32)
    got = ks.draft_topk(cupy.asarray(logits), k, temperature, out=DraftTopkOutput(ids, lps), **kw)
    assert got.topk_ids is ids and got.topk_logprobs is lps
    return cupy.asnumpy(ids), cupy.asnumpy(lps)


def check(got_ids, got_lps, logits, k, temperature, msg):
    want = ref.draft_topk(logits, k, temperature)
    bad = np.argwhere(got_ids != want.topk_ids)
    assert bad.size == 0, (f"{msg}: {len(bad)} ids differ, first at {tuple(bad[0])}: got {got_ids[tuple(bad[0])]}, "
                           f"want {want.topk_ids[tuple(bad[0])]}")
    w = want.topk_logprobs
    assert not np.isnan(got_lps).any(), f"{msg}: NaN log-probs (unwritten: {np.isnan(got_lps).sum()})"
    # -inf exactly where the reference is -inf (a -inf / NaN logit, or a finite one beside +inf); a finite logit's
    # log-prob is finite, at least -FLT_MAX (contract 5a), in the reference and in the kernel
    neg = np.isneginf(w)
    assert np.all(w[~neg] >= -FLT_MAX), f"{msg}: the reference below -FLT_MAX"
    assert np.array_equal(np.isneginf(got_lps), neg), f"{msg}: -inf where the reference is not, or not where it is"
    fin = ~neg
    err = np.abs(got_lps[fin].astype(np.float64) - w[fin])
    bar = 1e-5 + 2.0**-22 * np.abs(w[fin])
    if err.size:
        i = int(np.argmax(err - bar))
        assert np.all(err <= bar), (f"{msg}: log-prob error {err[i]:.3g} > bar {bar[i]:.3g} "
                                    f"(got {got_lps[fin][i]!r}, want {w[fin][i]!r})")
    return float(err.max()) if err.size else 0.0


# ------------------------------------------------------------------------------------ random rows

@pytest.mark.parametrize("dtype", ["bf16", "float32"])
@pytest.mark.parametrize("v", [129280, 163840, 262144, 16384, 8192, 1000, 20011])
def test_random_rows(ks, spec, seed, dtype, v):
    """Normal logits (scale 2-4) over every vocabulary size class: several chunks (the merge), exactly one
    chunk, one partial chunk, and a V that is not a multiple of the 16-byte vector (scalar loads)."""
    rng = np.random.default_rng(seed)
    b, dp = 2, min(3, spec.max_depth)
    kmax = spec.max_tree_size - 1
    x = as_dtype(rng.standard_normal((b, dp, v)) * rng.uniform(2, 4), dtype)
    for k, t in ((kmax, 1.0), (int(rng.integers(1, kmax + 1)), float(rng.uniform(0.3, 2.0)))):
        ids, lps = run(ks, x, k, t, workspace=bool(k % 2))
        check(ids, lps, x, k, t, f"{spec.name} {dtype} V={v} k={k} T={t:.3f}, {where(seed)}")


def test_full_depth_batch(ks, spec, seed):
    """A whole step's table: B = 4, D' = D, k = N - 1, V = 129280 bf16 (what tree_build takes)."""
    rng = np.random.default_rng(seed)
    x = bf16.to_bits(rng.standard_normal((4, spec.max_depth, 129280)) * 3)
    ids, lps = run(ks, x, spec.max_tree_size - 1)
    check(ids, lps, x, spec.max_tree_size - 1, 1.0, f"{spec.name} full depth, {where(seed)}")


# ------------------------------------------------------------------------------------ edge rows

def _thread_ids(chunk_base, threads, vec):
    """The row ids a block's threads `threads` hold in one chunk (stage 0's layout: vector j of thread t
    is ids chunk_base + j * THREADS * vec + t * vec + [0, vec))."""
    out = [chunk_base + j * THREADS * vec + t * vec + u for t in threads for j in range(NVEC) for u in range(vec)]
    return np.array(out)


def edge_rows(rng, v, dtype, k):
    """[1, R, v] rows for every route of the kernel: ties (a few values, a constant row, +-0), NaN and -inf,
    an all -inf row, +inf, sorted rows, ties at the threshold with enough logits above it, and more than the
    candidate list above the threshold (big values packed into fewer than k threads)."""
    vec = 8 if dtype == "bf16" else 4
    rows = []
    rows.append(rng.integers(-3, 3, v).astype(np.float64))                    # six values: ties everywhere
    rows.append(rng.integers(0, 2, v).astype(np.float64))                     # two: half the row ties at the top
    rows.append(np.zeros(v))                                                  # constant
    z = np.zeros(v)
    z[::2] = -0.0
    z[::3] = -1.0
    rows.append(z)                                                            # +0 and -0 tie
    r = rng.standard_normal(v) * 3
    r[rng.random(v) < 0.2] = np.nan
    r[rng.random(v) < 0.2] = -np.inf
    rows.append(r)                                                            # NaN and -inf among finite
    r = np.full(v, -np.inf)
    r[rng.random(v) < 0.3] = np.nan
    rows.append(r)                                                            # all -inf (NaN too)
    r = rng.standard_normal(v) * 3
    r[rng.choice(v, 3, replace=False)] = np.inf
    rows.append(r)                                                            # +inf shares
    rows.append(np.sort(rng.standard_normal(v) * 3))                          # ascending
    rows.append(-np.sort(rng.standard_normal(v) * 3))                         # descending
    r = np.full(v, -5.0)                                                      # ties at the threshold, and
    r[rng.choice(v, min(v, 3000), replace=False)] = 0.0                       # 200 logits above it in a few threads
    big = _thread_ids(0, range(50), vec)
    big = big[big < v][:200]
    r[big] = 10.0 + rng.standard_normal(len(big))
    rows.append(r)
    r = rng.standard_normal(v) - 10.0                                         # > 1024 logits above the
    big = _thread_ids(0, range(k - 1), vec)                                   # threshold, in k - 1 threads
    big = big[big < v]
    r[big] = 20.0 + rng.standard_normal(len(big)) * 4
    rows.append(r)
    return as_dtype(np.stack(rows)[None], dtype)


@pytest.mark.parametrize("dtype", ["bf16", "float32"])
@pytest.mark.parametrize("v", [40000, 16384, 3000])
def test_edge_rows(ks, spec, seed, dtype, v):
    rng = np.random.default_rng(seed)
    kmax = spec.max_tree_size - 1
    x = edge_rows(rng, v, dtype, kmax)
    if dtype == "bf16":   # NaN bits of every kind (quiet, signalling, both signs)
        x[0, 4, :8] = [0x7fc0, 0xffc0, 0x7f81, 0xff81, 0x7fff, 0xffff, 0xff80, 0x7f80]
    for k in (kmax, 1, 7):
        for t in (1.0, 0.5):
            ids, lps = run(ks, x, k, t)
            check(ids, lps, x, k, t, f"{spec.name} {dtype} V={v} edge rows k={k} T={t}, {where(seed)}")
    ids, _ = run(ks, x, kmax)
    assert ids[0, 5].tolist() == list(range(kmax))                            # all -inf: ids in order


@pytest.mark.parametrize("dtype", ["bf16", "float32"])
def test_k_equals_v_and_one_token(ks, spec, seed, dtype):
    rng = np.random.default_rng(seed)
    kmax = spec.max_tree_size - 1
    x = as_dtype(rng.standard_normal((3, 2, kmax)) * 2, dtype)
    ids, lps = run(ks, x, kmax)
    check(ids, lps, x, kmax, 1.0, f"{spec.name} k = V, {where(seed)}")
    assert np.allclose(np.exp(lps.astype(np.float64)).sum(-1), 1.0, atol=1e-4)
    one = np.ascontiguousarray(x[:, :, :1])
    ids, lps = run(ks, one, 1)
    assert np.all(ids == 0) and np.all(np.abs(lps) <= 1e-6)


def test_temperatures(ks, spec, seed):
    """Small and large temperatures (large 1/T: the exponent's rounding grows with |x - M| / T) and big logits."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 3, 50000)) * 3
    x[0, 1] *= 1000.0        # |M c| large: still the fma route
    x[0, 2] += 1e4
    for dtype in ("bf16", "float32"):
        xs = as_dtype(x, dtype)
        for t in (0.01, 0.2, 5.0, 100.0):
            ids, lps = run(ks, xs, 16, t)
            check(ids, lps, xs, 16, t, f"{spec.name} {dtype} T={t}, {where(seed)}")


# the smallest and the largest temperature the contract accepts (fl32(log2(e) / T) finite; fl32(1 / T) normal)
T_MIN, T_MAX = 4.25e-39, 2.0**126
EXTREME_T = (1.0, 1e-9, 1e-12, 1e-20, 1e-37, T_MIN, 1e30, T_MAX)


def extreme_rows(rng, v, dtype):
    """[1, 6, v] finite rows over float32's range (issue 37): the maximum 1e10 / 1e30 among near-ties, both ends of
    the range (-FLT_MAX against +FLT_MAX: x - M overflows float32), an ascending run of float32 units below 3.0 (a rise
    of every lane's maximum every round, in the plain form at tiny T), two tied maxima, and subnormals."""
    big = 3.3e38 if dtype == "bf16" else FLT_MAX   # bf16's largest finite is 3.39e38
    rows = []
    for top in (1e10, 1e30):
        r = rng.standard_normal(v) * top / 10
        r[rng.choice(v, 5, replace=False)] = top * (1 - rng.integers(0, 3, 5) * 2.0**-20)
        rows.append(r)
    r = rng.uniform(-big, big, v)
    r[rng.choice(v, 4, replace=False)] = [big, -big, big, -big]
    rows.append(r)
    f = np.float32(3.0)
    steps = np.arange(v)[::-1] % 4096                                          # 3.0 less 0..4095 float32 units
    r = np.array([np.float64(f) - s * 2.0**-22 for s in steps])                # ascending in each run of 4096
    rows.append(r)
    r = rng.standard_normal(v)
    i, j = rng.choice(v, 2, replace=False)
    r[i] = r[j] = 7.5
    rows.append(r)
    sub = float(np.finfo(np.float32).smallest_subnormal)
    rows.append(rng.integers(-4, 5, v) * sub)                                  # float32 subnormals (bf16: ties of 0)
    return as_dtype(np.stack(rows)[None], dtype)


@pytest.mark.parametrize("dtype", ["bf16", "float32"])
@pytest.mark.parametrize("v", [40000, 3000])
def test_extreme_finite_rows(ks, spec, seed, dtype, v):
    """Finite logits give finite log-probs within the bar at every accepted temperature (contract 5a; issue 37: NaN
    at a maximum of 1e10 / 1e30 at T = 1, 3.0 at T = 1e-9, T = 1e-20 and 1e-37): V = 40000 (several chunks: the
    merge, and the rows path in the streaming runs) and 3000 (one chunk)."""
    rng = np.random.default_rng(seed)
    x = extreme_rows(rng, v, dtype)
    k = min(16, spec.max_tree_size - 1)
    for t in EXTREME_T:
        ids, lps = run(ks, x, k, t)
        msg = f"{spec.name} {dtype} V={v} extreme rows T={t:g}, {where(seed)}"
        assert np.all(np.isfinite(lps)), f"{msg}: non-finite log-probs at rows {np.argwhere(~np.isfinite(lps))[:4]}"
        check(ids, lps, x, k, t, msg)
    if dtype == "float32":   # the tied maxima share: -log 2 each at a tiny temperature
        ids, lps = run(ks, x, k, 1e-20)
        assert abs(float(lps[0, 4, 0]) + np.log(2)) <= 1e-5 and abs(float(lps[0, 4, 1]) + np.log(2)) <= 1e-5


def test_allocates_outputs_and_empty_batch(ks, spec, seed):
    import cupy
    rng = np.random.default_rng(seed)
    x = bf16.to_bits(rng.standard_normal((2, 2, 70000)))
    got = ks.draft_topk(cupy.asarray(x), 5)
    assert got.topk_ids.shape == (2, 2, 5) and got.topk_ids.dtype == np.int32
    assert got.topk_logprobs.dtype == np.float32
    check(cupy.asnumpy(got.topk_ids), cupy.asnumpy(got.topk_logprobs), x, 5, 1.0, f"allocated, {where(seed)}")
    empty = ks.draft_topk(cupy.zeros((0, 2, 70000), np.uint16), 5)
    assert empty.topk_ids.shape == (0, 2, 5)


def test_cuda_graph_capture(ks, spec, seed):
    """Captured with given outputs and workspace, replayed on new logits copied into the same buffer."""
    import cupy
    from ddtree_gen.ops.draft_topk.launch import workspace_elems
    rng = np.random.default_rng(seed)
    k = spec.max_tree_size - 1
    shape = (3, min(4, spec.max_depth), 129280)
    first = bf16.to_bits(rng.standard_normal(shape) * 3)
    logits = cupy.asarray(first)
    out = DraftTopkOutput(cupy.empty(shape[:2] + (k,), np.int32), cupy.empty(shape[:2] + (k,), np.float32))
    ws = cupy.empty(workspace_elems(*shape, k), np.int32)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        ks.draft_topk(logits, k, 0.9, out=out, workspace=ws)     # prepares outside the capture
        stream.begin_capture()
        ks.draft_topk(logits, k, 0.9, out=out, workspace=ws)
        graph = stream.end_capture()
        second = bf16.to_bits(rng.standard_normal(shape) * 2)
        logits.set(second, stream=stream)
        out.topk_ids.fill(POISON & 0x7fffffff)
        out.topk_logprobs.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
    check(cupy.asnumpy(out.topk_ids), cupy.asnumpy(out.topk_logprobs), second, k, 0.9, f"graph replay, {where(seed)}")


def test_torch_tensors(ks, spec, seed):
    """torch.bfloat16 and float32 logits; torch outputs on torch's current stream."""
    torch = need("torch")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 100000)) * 3
    for dt in (torch.bfloat16, torch.float32):
        t = torch.tensor(x, dtype=torch.float32).to(dt).cuda()
        got = ks.draft_topk(t, 9)
        assert isinstance(got.topk_ids, torch.Tensor) and got.topk_ids.dtype == torch.int32
        host = t.cpu().view(torch.int16).numpy().view(np.uint16) if dt == torch.bfloat16 else t.cpu().numpy()
        check(got.topk_ids.cpu().numpy(), got.topk_logprobs.cpu().numpy(), host, 9, 1.0, f"torch {dt}, {where(seed)}")


def test_against_torch_topk(ks, spec, seed):
    """What engines do today (torch.topk + logsumexp) on rows without ties: the same tokens and log-probs."""
    torch = need("torch")
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.permutation(129280 * 2).reshape(1, 2, 129280) / 1000.0, dtype=torch.float32).cuda()
    vals, idx = torch.topk(x, 64, dim=-1)
    lp = vals - torch.logsumexp(x, dim=-1, keepdim=True)
    got = ks.draft_topk(x, min(64, spec.max_tree_size - 1))
    kk = got.topk_ids.shape[-1]
    assert torch.equal(got.topk_ids.long(), idx[..., :kk])
    assert torch.allclose(got.topk_logprobs, lp[..., :kk], atol=2e-5, rtol=0)


def test_schedules_agree_on_a_large_batch(spec, seed, monkeypatch):
    """Every run (chunks, rows, rows streaming) on the bench's shape class (B x D' rows of V = 129280 bf16), a
    misaligned copy of it (plain loads), and float32 V = 262144 (32 chunks a row): the ids bitwise equal, the
    log-probs of chunks and rows (its chunks path at these batches) bitwise equal and those of rows streaming within
    twice the bar of them, and rows of each against the reference."""
    import cupy
    rng = np.random.default_rng(seed)
    from ddtree_gen.ops.draft_topk import launch as mod
    sets = {s: load_schedule(spec, s.split()[0]) for s in RUNS}
    default_switch, default_chunks = mod.ROWS_PER_SM, mod.ROWS_MIN_CHUNKS
    k = spec.max_tree_size - 1
    dp = min(15, spec.max_depth)
    cases = [("bf16", bf16.to_bits(rng.standard_normal((8, dp, 129280)) * 3), False),
             ("bf16 misaligned", bf16.to_bits(rng.standard_normal((2, dp, 129280)) * 3), True),
             ("float32 V=262144", np.asarray(rng.standard_normal((2, 2, 262144)) * 3, np.float32), False)]
    for name, x, shift in cases:
        if shift:   # the logits 2 or 4 bytes past a 16-byte boundary: vec_ok = 0
            flat = cupy.empty(x.size + 1, x.dtype)
            flat[1:] = cupy.asarray(x.ravel())
            dev = flat[1:].reshape(x.shape)
            assert dev.data.ptr % 16 != 0
        else:
            dev = cupy.asarray(x)
        got = {}
        for s, kset in sets.items():
            # the switch is the launcher's (module-wide), and "rows" and "rows streaming" may be one kernel set:
            # on for the streaming runs alone, and off again for the next
            monkeypatch.setattr(mod, "ROWS_PER_SM", 0 if s in STREAMING else default_switch)
            monkeypatch.setattr(mod, "ROWS_MIN_CHUNKS", 0 if s in STREAMING else default_chunks)
            kset.prepared_calls.clear()
            ids = cupy.full(x.shape[:2] + (k,), POISON, dtype=np.uint32).view(np.int32)
            lps = cupy.full(x.shape[:2] + (k,), np.nan, dtype=np.float32)
            kset.draft_topk(dev, k, 0.9, out=DraftTopkOutput(ids, lps))
            got[s] = (cupy.asnumpy(ids), cupy.asnumpy(lps))
        a = got["chunks"]
        for s, b in got.items():
            assert np.array_equal(a[0], b[0]), f"{name}: the ids of chunks and {s} differ, {where(seed)}"
            if s in STREAMING:   # their sums add in another order: the log-probs agree within twice the bar
                fin = np.isfinite(a[1])
                assert np.array_equal(fin, np.isfinite(b[1])), f"{name}: rows' non-finite log-probs, {where(seed)}"
                err = np.abs(b[1][fin].astype(np.float64) - a[1][fin])
                assert np.all(err <= 2e-5 + 2.0**-21 * np.abs(a[1][fin])), f"{name}: rows' log-probs, {where(seed)}"
            else:             # the same sums: the same bits
                assert np.array_equal(a[1].view(np.uint32), b[1].view(np.uint32)), \
                    f"{name}: the log-probs of chunks and {s} differ, {where(seed)}"
        rows = rng.choice(x.shape[0] * x.shape[1], 3, replace=False)
        flat_x = x.reshape(-1, x.shape[2])[rows][None]
        for s, (ids, lps) in got.items():
            check(ids.reshape(-1, k)[rows][None], lps.reshape(-1, k)[rows][None], flat_x, k, 0.9,
                  f"{spec.name} {name} {s}, {where(seed)}")

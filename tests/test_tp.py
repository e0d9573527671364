"""Tensor parallelism over the attention heads (ddtree_gen.model.tensor_parallel,
examples/tp_speculative_decode.py).

CPU: TP = T is emulated in one process, one thread per rank. Each rank holds its slice of the
heads (shard_weights: wq_b, w_uk_t, w_uv, wo) and the full latent cache, runs the whole decoding
loop (rollout drafter, tree_build, tree_verify over its heads in every layer, tree_accept on its
own cache) and hands its o_proj partial to an emulated all-reduce (a barrier; every rank adds
the partials in rank order, so every rank gets the same bits, as from NCCL). The tokens must
equal the unsharded (TP = 1) run's under the near-tie rule (tensor_parallel.compare_tokens),
and the ranks must agree exactly. This proves the sharding math on the float64 numpy model and
on the device loop's orchestration (float32 numpy emulation, the GPU loop's code).

GPU (marked gpu): the example's main with 2 processes (torch.multiprocessing, NCCL).
"""
from __future__ import annotations

import functools
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import random_prompts
from ddtree_gen import model as M
from ddtree_gen.model import tensor_parallel as TP
from ddtree_gen.model.cache import make_block_table
from ddtree_gen.spec import find_spec, parse_spec

SMALL = parse_spec({"name": "tp-small", "num_heads": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                    "page_size": 16, "max_tree_size": 17, "max_depth": 6}, "tests/test_tp.py")
NEW_TOKENS = 48
NEAR_TIE = 5e-3          # the single-GPU bar (tests/test_gpu_e2e.py)
SAMPLED = M.Sampling(temperature=1.0, seed=7)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def prompts_for(batch: int, vocab: int, max_len: int = 40, seed: int = 5) -> list[list[int]]:
    return random_prompts(batch, vocab, max_len, seed)


# ------------------------------------------------------------ the emulated process group

class ThreadAllReduce:
    """all_reduce (SUM) among `world` threads: each rank hands its partial and gets
    parts[0] + parts[1] + ... (rank order, so the same bits on every rank)."""

    def __init__(self, world: int):
        self.world = world
        self.parts = [None] * world
        self.barrier = threading.Barrier(world, timeout=300)
        self.calls = [0] * world

    def hook(self, rank: int):
        def all_reduce(x):
            self.parts[rank] = x
            self.barrier.wait()
            total = self.parts[0].copy()
            for p in self.parts[1:]:
                total = total + p
            self.barrier.wait()        # every rank has read the parts before any overwrites its own
            self.calls[rank] += 1
            return total
        return all_reduce


def run_ranks(world: int, fn):
    """[fn(rank, all_reduce) for each rank], the ranks running concurrently in threads."""
    group = ThreadAllReduce(world)
    results, errors = [None] * world, []

    def target(rank):
        try:
            results[rank] = fn(rank, group.hook(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            group.barrier.abort()      # release the other ranks

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(set(group.calls)) == 1, f"ranks made different numbers of all-reduces: {group.calls}"
    return results


# ------------------------------------------------------------------------------- models

@functools.lru_cache(maxsize=None)
def _full(spec_name: str):
    spec = SMALL if spec_name == SMALL.name else find_spec(spec_name)
    cfg = M.ModelConfig.from_spec(spec)
    return spec, cfg, M.init_weights(cfg)


def _rank_setup(spec_name: str, tp: int, rank: int):
    spec, cfg, weights = _full(spec_name)
    # the full weights are generated identically on every rank (same seed), then sliced
    np.testing.assert_array_equal(M.init_weights(cfg)["layers"][0]["wo"], weights["layers"][0]["wo"])
    return (TP.rank_spec(spec, tp, specs=None if spec is not SMALL else []), TP.shard_config(cfg, tp),
            TP.shard_weights(weights, cfg, rank, tp))


def numpy_margin(spec_name: str, prompts, sampling: M.Sampling):
    """(b, i) -> (token, top-2 margin) of the float64 TP=1 model choosing request b's token i
    after prompts[b] + tokens[:i] (plain decoding's scores), computed on demand."""
    spec, cfg, weights = _full(spec_name)
    model = M.NumpyMLA(cfg, weights)

    def at(b, tokens_before):
        seq = list(prompts[b]) + [int(t) for t in tokens_before]
        table, pages = make_block_table(1, len(seq) + 1, cfg.page_size)
        kv = model.new_cache(pages)
        model.prefill(kv, table, [seq], spec.max_tree_size, spec.mask_words)
        pos = len(seq) - 1
        mask = np.zeros((1, 1, spec.mask_words), np.uint32)
        mask[0, 0, 0] = 1
        scores = model.forward(kv, table, [[seq[-1]]], [[pos]], [[pos]], np.array([pos]), np.array([1]),
                               mask)[0, 0]
        if not sampling.greedy:
            scores = scores * sampling.inv_temp + M.gumbel(sampling.seed, b, pos + 1, np.arange(cfg.vocab_size))
        top = np.sort(scores)
        return int(np.argmax(scores)), float(top[-1] - top[-2])
    return at


def _numpy_tp(spec_name, tp, prompts, new_tokens, sampling, **kwargs):
    """Per rank: (plain, speculative) Generations of the float64 model with TP = tp."""
    def rank_fn(rank, all_reduce):
        spec_r, cfg_r, w_r = _rank_setup(spec_name, tp, rank)
        model = M.NumpyMLA(cfg_r, w_r, all_reduce=all_reduce)
        plain = M.generate_numpy(model, spec_r, prompts, new_tokens, speculative=False, sampling=sampling)
        spec = M.generate_numpy(model, spec_r, prompts, new_tokens, speculative=True, sampling=sampling, **kwargs)
        return plain, spec
    return run_ranks(tp, rank_fn)


def _assert_ranks_agree(gens):
    for g in gens[1:]:
        np.testing.assert_array_equal(g.tokens, gens[0].tokens)
        assert (g.steps, g.accepted) == (gens[0].steps, gens[0].accepted)


# ------------------------------------------------------------------------ unit checks

def test_sharded_projections_sum_to_the_full_ones():
    """Column-parallel q (wq_b, w_uk_t) gives each rank its heads' queries; row-parallel wo:
    the partials of the ranks sum to the full o_proj."""
    spec, cfg, w = _full(SMALL.name)
    lw = w["layers"][0]
    rng = np.random.default_rng(0)
    h, dn, p, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    qa = rng.standard_normal((5, cfg.q_lora_rank))
    o = rng.standard_normal((5, h * dv))
    q_full = (qa @ lw["wq_b"]).reshape(5, h, dn + p)
    for tp in (1, 2, 4):
        parts = []
        for rank in range(tp):
            lo, hi = TP.head_range(h, rank, tp)
            s = TP.shard_weights(w, cfg, rank, tp)["layers"][0]
            np.testing.assert_array_equal((qa @ s["wq_b"]).reshape(5, hi - lo, dn + p), q_full[:, lo:hi])
            np.testing.assert_array_equal(s["w_uk_t"], lw["w_uk_t"][lo:hi])
            np.testing.assert_array_equal(s["w_uv"], lw["w_uv"][lo:hi])
            for k in M.LAYER_WEIGHTS:
                if k not in TP.SHARDED:
                    assert s[k] is lw[k], k                      # replicated, not copied
            parts.append(o[:, lo * dv:hi * dv] @ s["wo"])
        np.testing.assert_allclose(sum(parts), o @ lw["wo"], rtol=1e-12, atol=1e-12)
        assert TP.shard_config(cfg, tp).num_heads == h // tp


def test_rank_spec_picks_the_matching_spec():
    ds, kimi = find_spec("deepseek-v3-tp8"), find_spec("kimi-k2.6-tp8")
    # the GPU example's pair: every field but num_heads agrees
    assert {k: v for k, v in ds.as_dict().items() if k not in ("name", "num_heads")} == \
           {k: v for k, v in kimi.as_dict().items() if k not in ("name", "num_heads")}
    assert TP.rank_spec(ds, 2) == kimi
    assert TP.rank_spec(find_spec("deepseek-v3"), 2) == find_spec("kimi-k2.6")
    assert TP.rank_spec(ds, 1) is ds
    made = TP.rank_spec(find_spec("kimi-k2.6"), 2)           # no 32-head spec: one is made
    assert made.num_heads == 32 and made.max_tree_size == 65 and made.name == "kimi-k2.6-tp2-rank"
    with pytest.raises(ValueError):
        TP.rank_spec(ds, 3)
    with pytest.raises(ValueError):
        TP.head_range(16, 2, 2)


def test_compare_tokens_near_tie_rule():
    ref = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]])
    got = np.array([[1, 2, 3, 4], [5, 9, 0, 0], [1, 1, 2, 2]])
    margins = np.full((3, 4), 1.0)
    margins[1, 1] = 1e-4
    c = TP.compare_tokens(ref, got, margins, NEAR_TIE)
    assert not c.identical and not c.ok
    assert c.near_ties == [(1, 1, 1e-4)] and c.violations == [(2, 2, 1.0)]
    assert TP.compare_tokens(ref, ref, None, NEAR_TIE).identical
    assert not TP.compare_tokens(ref, got, None, NEAR_TIE).ok
    assert TP.compare_tokens(ref[:2], got[:2], lambda b, i: 1e-4, NEAR_TIE).ok


def test_numpy_margin_helper_replays_plain_decoding():
    """The on-demand margin of the near-tie rule recomputes the plain token it is asked about."""
    spec, cfg, _ = _full(SMALL.name)
    prompts = prompts_for(2, cfg.vocab_size)
    for sampling in (M.GREEDY, SAMPLED):
        plain = M.generate_numpy(M.NumpyMLA(cfg, _full(SMALL.name)[2]), spec, prompts, 6, speculative=False,
                                 sampling=sampling)
        at = numpy_margin(SMALL.name, prompts, sampling)
        for b, i in ((0, 0), (1, 5)):
            tok, margin = at(b, plain.tokens[b, :i])
            assert tok == plain.tokens[b, i] and margin >= 0.0


# ------------------------------------------------------------- TP emulated on numpy

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sampling", [M.GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_numpy_tp_equals_tp1(tp, sampling):
    """float64 model, heads split over tp emulated ranks: speculative == plain, == the TP=1 run."""
    spec, cfg, weights = _full(SMALL.name)
    prompts = prompts_for(4, cfg.vocab_size)
    ref = M.generate_numpy(M.NumpyMLA(cfg, weights), spec, prompts, NEW_TOKENS, speculative=False, sampling=sampling)
    results = _numpy_tp(SMALL.name, tp, prompts, NEW_TOKENS, sampling)
    plains, specs = [r[0] for r in results], [r[1] for r in results]
    _assert_ranks_agree(plains)
    _assert_ranks_agree(specs)
    margin = numpy_margin(SMALL.name, prompts, sampling)
    on_demand = lambda tokens: lambda b, i: margin(b, tokens[b, :i])[1]  # noqa: E731
    for name, got, base in (("TP plain vs TP=1 plain", plains[0], ref), ("TP spec vs TP=1 plain", specs[0], ref),
                            ("TP spec vs TP plain", specs[0], plains[0])):
        c = TP.compare_tokens(base.tokens, got.tokens, on_demand(base.tokens), NEAR_TIE)
        print(f"\nTP={tp} {'greedy' if sampling.greedy else 'sampled'} {name}: {c.describe()}")
        assert c.ok, f"{name}: {c.describe()}"
    assert specs[0].mean_accept > 1.0
    print(f"TP={tp}: {specs[0].steps} speculative steps (plain {plains[0].steps}), "
          f"mean accepted {specs[0].mean_accept:.2f}")


def test_numpy_tp2_gpu_spec_pair():
    """The GPU example's configuration: the 16-head model (deepseek-v3-tp8 dims) as two ranks of
    kimi-k2.6-tp8 (8 heads, R=512, P=64, page 64), short run (the CPU attention is the cost)."""
    spec, cfg, weights = _full("deepseek-v3-tp8")
    prompts = prompts_for(2, cfg.vocab_size, max_len=12)
    drafter = M.Drafter(depth=4)
    ref = M.generate_numpy(M.NumpyMLA(cfg, weights), spec, prompts, 12, speculative=False)
    results = _numpy_tp("deepseek-v3-tp8", 2, prompts, 12, M.GREEDY, drafter=drafter, budget=16)
    assert {TP.rank_spec(spec, 2).name} == {"kimi-k2.6-tp8"}
    _assert_ranks_agree([r[1] for r in results])
    margin = numpy_margin("deepseek-v3-tp8", prompts, M.GREEDY)
    for got in results[0]:
        c = TP.compare_tokens(ref.tokens, got.tokens, lambda b, i: margin(b, ref.tokens[b, :i])[1], NEAR_TIE)
        assert c.ok, c.describe()
    assert results[0][1].mean_accept > 0.5


# ------------------------------------------ TP emulated on the device loop (GPU orchestration)

@pytest.mark.parametrize("sampling", [M.GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_device_loop_tp2_emulated(sampling):
    """The device loop (float32 numpy emulation of the GPU model, the references as kernels)
    with DeviceDecoder(all_reduce=...) as the GPU example runs it: TP=2 speculative == TP=2
    plain == TP=1 plain under the near-tie rule (float32: the o_proj sums differ in order)."""
    spec, cfg, weights = _full(SMALL.name)
    prompts = prompts_for(4, cfg.vocab_size)
    kw = dict(ops=M.NumpyOps(), sampling=sampling)
    ref = M.DeviceDecoder(cfg, spec, prompts, NEW_TOKENS, kernels=M.ReferenceKernels(spec), weights=weights,
                          speculative=False, **kw).run(keep_margins=True)

    def rank_fn(rank, all_reduce):
        spec_r, cfg_r, w_r = _rank_setup(SMALL.name, 2, rank)
        dec = lambda speculative: M.DeviceDecoder(  # noqa: E731
            cfg_r, spec_r, prompts, NEW_TOKENS, kernels=M.ReferenceKernels(spec_r), weights=w_r,
            speculative=speculative, all_reduce=all_reduce, **kw)
        return dec(False).run(keep_margins=True), dec(True).run()

    results = run_ranks(2, rank_fn)
    plains, specs = [r[0] for r in results], [r[1] for r in results]
    _assert_ranks_agree(plains)
    _assert_ranks_agree(specs)
    for name, got, base in (("TP spec vs TP plain", specs[0], plains[0]), ("TP plain vs TP=1 plain", plains[0], ref),
                            ("TP spec vs TP=1 plain", specs[0], ref)):
        c = TP.compare_tokens(base.tokens, got.tokens, base.margins, NEAR_TIE)
        print(f"\ndevice loop TP=2 {'greedy' if sampling.greedy else 'sampled'} {name}: {c.describe()}")
        assert c.ok, f"{name}: {c.describe()}"
    # float32 partial sums: not bit-identical to TP=1 in general, but the tokens are
    assert float((plains[0].tokens == ref.tokens).mean()) >= 0.75
    assert specs[0].mean_accept > 1.0


def test_all_reduce_hook_identity_changes_nothing():
    """A hook that returns its input leaves the model bit-identical (the TP=1 path is untouched)."""
    spec, cfg, weights = _full(SMALL.name)
    prompts = prompts_for(2, cfg.vocab_size)
    base = M.generate_numpy(M.NumpyMLA(cfg, weights), spec, prompts, 8, speculative=True)
    hooked = M.generate_numpy(M.NumpyMLA(cfg, weights, all_reduce=lambda x: x), spec, prompts, 8, speculative=True)
    np.testing.assert_array_equal(hooked.tokens, base.tokens)
    a = M.generate_device(cfg, spec, prompts, 8, ops=M.NumpyOps(), weights=weights)
    b = M.generate_device(cfg, spec, prompts, 8, ops=M.NumpyOps(), weights=weights, all_reduce=lambda x: x)
    np.testing.assert_array_equal(a.tokens, b.tokens)


# ------------------------------------------------ the example (torch.distributed, 2 processes)

@pytest.fixture
def example():
    """examples/tp_speculative_decode.py as a module. Its spawned processes import it by this
    name, so examples/ stays on sys.path (which spawn hands to the children) during the test."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import tp_speculative_decode
        yield tp_speculative_decode
    finally:
        sys.path.remove(str(EXAMPLES))


def _check_report(rep, devices):
    assert rep["tp"] == 2 and rep["rank_spec"] == "kimi-k2.6-tp8" and len(rep["ranks"]) == 2
    assert [g["heads"] for g in rep["ranks"]] == [[0, 8], [8, 16]]
    assert {g["device"].split()[0] for g in rep["ranks"]} == devices
    assert rep["ranks_agree"]
    for g in rep["ranks"]:
        assert {"TP spec == TP plain", "TP spec == TP=1 plain", "TP plain == TP=1 plain"} <= set(g["checks"])
        for name, c in g["checks"].items():
            assert c["ok"], f"rank {g['rank']} {name}: {c['detail']}"
        assert g["all_reduces"] > 0 and g["tp_spec"]["mean_accept"] > 0.5
    assert rep["ok"]


def _torch_reason(backend: str):
    from conftest import install_hint
    try:
        import torch
        import torch.distributed as dist
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        return f"torch is not installed ({install_hint('torch')})"
    except Exception as e:  # noqa: BLE001
        return f"torch not importable ({type(e).__name__}: {e})"
    if not dist.is_available():
        return "torch.distributed unavailable"
    if backend == "gloo" and not dist.is_gloo_available():
        return "torch.distributed has no gloo backend"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "torch.distributed has no NCCL backend"
        n = torch.cuda.device_count()
        if n < 2:
            return f"tensor parallelism over GPUs needs 2 GPUs, {n} visible"
    return None


def test_example_distributed_path_on_cpu(example, capfd):
    """The example's own distributed path (spawn, process group, all-reduce hook in every layer,
    all_gather of the report) with gloo and the numpy emulation: 2 processes, tiny sizes."""
    reason = _torch_reason("gloo")
    if reason:
        pytest.skip(reason)
    rep = example.main(["--cpu", "--tp", "2", "--batch", "2", "--new-tokens", "8", "--max-prompt", "8",
                        "--draft-depth", "3", "--budget", "8"])
    _check_report(rep, {"cpu"})
    assert rep["backend"] == "gloo"
    assert "result: PASS" in capfd.readouterr().out


@pytest.mark.gpu
def test_gpu_tp2_example(example):
    """examples/tp_speculative_decode.py main(): 2 processes, one per GPU (NCCL), the 16-head model
    as 2 x kimi-k2.6-tp8; greedy and sampled."""
    reason = _torch_reason("nccl")
    if reason:
        pytest.skip(reason)
    for extra in ([], ["--temperature", "1.0", "--seed", "7"]):
        rep = example.main(["--tp", "2", "--batch", "8", "--new-tokens", "64", *extra])
        _check_report(rep, {"cuda:0", "cuda:1"})
        assert rep["backend"] == "nccl"
        assert all(g["tp_spec"]["mean_accept"] > 1.0 for g in rep["ranks"])

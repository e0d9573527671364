"""The float64 near-tie rule (ddtree_gen.model.near_tie) and examples/speculative_decode.py on the CPU
(--cpu: the device loop's float32 numpy emulation): a correct run exits 0, each planted bug (--control)
exits 1."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ddtree_gen import model as M
from ddtree_gen.model import near_tie as NT
from ddtree_gen.model import tensor_parallel as TP
from ddtree_gen.spec import parse_spec

SMALL = parse_spec({"name": "tie-small", "num_heads": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                    "page_size": 16, "max_tree_size": 17, "max_depth": 6}, "tests/test_near_tie.py")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "speculative_decode.py"


def test_decide_on_numbers():
    assert NT.decide(0.004, 0.01)
    assert NT.decide(-0.01, 0.01)                 # either sign: the other run's choice
    assert not NT.decide(0.0101, 0.01)
    assert not NT.decide(0.001, 0.01, gap=0.02)   # a third token beats both by more than the bound
    assert NT.decide(0.001, 0.01, gap=0.009)
    assert not NT.decide(float("nan"), 0.01) and not NT.decide(0.0, float("nan"))
    assert not NT.decide(0.0, float("inf"))       # an unbounded bound decides nothing


def _model():
    cfg = M.ModelConfig.from_spec(SMALL)
    return cfg, M.NumpyMLA(cfg, M.init_weights(cfg))


def _scores(model, context, sampling, request=0):
    kv, table, one_mask, pos = NT._single(model, SMALL, context)
    logits = model.forward(kv, table, np.array([[context[-1]]]), np.array([[pos]]), np.array([[pos]]),
                           np.array([pos]), np.array([1]), one_mask)[0, 0]
    chosen = M.select_tokens(logits[None], np.array([request]), np.array([pos + 1]), sampling)[0]
    return logits, int(chosen)


@pytest.mark.parametrize("sampling", [M.GREEDY, M.Sampling(temperature=0.7, seed=3)], ids=["greedy", "sampled"])
def test_judge_recomputes_the_loops_scores(sampling):
    """judge's float64 scores are the ones the loops choose from: the chosen token is its best, its margin to
    every other token is positive, and the bound is positive and finite; a token far down the list
    is a violation, the same pair swapped has the opposite margin."""
    cfg, model = _model()
    rng = np.random.default_rng(1)
    context = rng.integers(0, cfg.vocab_size, size=23).tolist()
    logits, chosen = _scores(model, context, sampling, request=2)
    top = NT.judge(model, SMALL, context, chosen, chosen, request=2, sampling=sampling)
    assert top.best == chosen and top.margin == 0.0 and top.bound == 0.0   # a token against itself
    order = [t for t in range(cfg.vocab_size) if t != chosen]
    checks = [NT.judge(model, SMALL, context, chosen, t, request=2, sampling=sampling) for t in order[:6]]
    for ch in checks:
        assert ch.margin > 0.0 and ch.best == chosen and 0.0 < ch.bound < 1.0
        assert ch.near_tie == (ch.margin <= ch.bound)
        swapped = NT.judge(model, SMALL, context, ch.c, ch.a, request=2, sampling=sampling)
        assert swapped.margin == pytest.approx(-ch.margin) and swapped.near_tie == ch.near_tie
    worst = int(np.argmin(logits)) if sampling.greedy else min(checks, key=lambda ch: -ch.margin).c
    far = NT.judge(model, SMALL, context, chosen, worst, request=2, sampling=sampling)
    assert far.margin > 10 * far.bound and not far.near_tie


def test_bound_scales_with_the_bar():
    """The bound is linear in the bar and in Z (first order), and zero without error."""
    cfg, model = _model()
    context = list(range(1, 12))
    a, b = 3, 7
    base = NT.judge(model, SMALL, context, a, b)
    assert NT.judge(model, SMALL, context, a, b, bar=2 * NT.BAR).bound == pytest.approx(2 * base.bound, rel=1e-6)
    assert NT.judge(model, SMALL, context, a, b, z=1.0).bound == pytest.approx(base.bound / NT.Z, rel=1e-6)
    assert NT.judge(model, SMALL, context, a, b, bar=0.0).bound == 0.0


def test_judge_tokens_first_divergence_only():
    ref = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]])
    got = np.array([[1, 2, 3, 4], [5, 9, 0, 0], [1, 1, 2, 2]])
    seen = []

    def judge(b, i, a, c):
        seen.append((b, i, a, c))
        return NT.TieCheck(b, i, a, c, 0.01 if b == 1 else 1.0, 0.05, a, NT.decide(0.01 if b == 1 else 1.0, 0.05))

    comp = TP.judge_tokens(ref, got, judge)
    assert seen == [(1, 1, 6, 9), (2, 2, 1, 2)]
    assert not comp.identical and not comp.ok
    assert [c.request for c in comp.near_ties] == [1] and [c.request for c in comp.violations] == [2]
    assert "DIVERGENCE" in comp.describe() and "token 2: 1 vs 2" in comp.describe()
    assert TP.judge_tokens(ref, ref, judge).identical and len(seen) == 2
    with pytest.raises(ValueError):
        TP.judge_tokens(ref, got[:2], judge)


def _example():
    spec = importlib.util.spec_from_file_location("speculative_decode_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SMALL_RUN = ["--cpu", "--spec", "kimi-k2.6-tp8", "--batch", "4", "--new-tokens", "24", "--max-prompt", "30",
             "--draft-depth", "4", "--budget", "16"]


@pytest.mark.parametrize("control", [None, "mask", "scale"])
def test_example_cpu_exit_status(control, capsys):
    """A correct build exits 0 (PASS); each planted bug in the tree passes exits 1 with a VIOLATION line."""
    status = _example().main(SMALL_RUN + (["--control", control] if control else []))
    out = capsys.readouterr().out
    if control is None:
        assert status == 0 and "PASS (exit 0)" in out, out
    else:
        assert status == 1 and "VIOLATION" in out and "FAILED (exit 1)" in out, out


def test_example_refuses_graph_on_cpu(capsys):
    assert _example().main(["--cpu", "--graph"]) == 2
    assert "--graph" in capsys.readouterr().err

"""The per-signature call cache (runtime.run_call): a cached call is as safe as a fresh one.

Every argument-error case of every launcher runs on a kernel set whose cache already holds the
valid call's signature: the bad call must still raise the same ArgumentError (the pointer checks,
alignment and overlap, are repeated per call; everything else changes the signature). Valid calls
of one signature prepare once and launch with each call's own pointers.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FakeKernelSet, LaunchLog, LaunchReached
from ddtree_gen.errors import ArgumentError
from ddtree_gen.ops.tree_verify import launch as tv
from ddtree_gen.ops.tree_accept.launch import launch as tree_accept
from ddtree_gen.ops.tree_build.launch import launch as tree_build
from ddtree_gen.launch.runtime import Prepared
from test_tree_accept_cpu import BUILD_CASES, accept_args, accept_cases, accept_out, build_args, build_out
from test_tree_verify_cpu import (Arrays, MmaKernelSet, RecordingKernelSet, impl_of, merge_args, merge_cases, ptr_of,
                                  tc, verify_args, verify_cases)


class Counting(LaunchLog, MmaKernelSet):
    """MmaKernelSet's kernels; records every launch in .seen without refusing it (conftest.LaunchLog), so one kernel
    set serves many calls."""


def _signatures(kset) -> list:
    return [v for v in kset.prepared_calls.values() if isinstance(v, Prepared)]


def _warm(kset, launcher, args):
    try:
        launcher(kset, **args)
    except LaunchReached:
        pass
    assert kset.prepared_calls, "the valid call was not cached"


@pytest.mark.parametrize("launcher", [tv.tree_verify, tv.tree_verify_tail], ids=["tree_verify", "tree_verify_tail"])
@pytest.mark.parametrize("impl", ["simple", "mma"])
def test_verify_errors_after_a_cached_valid_call(spec, launcher, impl, fake_device):
    extra = {"impl": impl_of(impl, spec), **({"num_splits": 1} if impl == "mma" else {})}   # (no workspace)
    for case, mutate, word in verify_cases(spec):
        new = Arrays()
        kset = MmaKernelSet(spec) if impl == "mma" else RecordingKernelSet(spec)
        _warm(kset, launcher, dict(verify_args(spec, new), **extra))
        cached = dict(kset.prepared_calls)
        args = verify_args(spec, new)
        mutate(args, new)
        with pytest.raises(ArgumentError) as e:
            launcher(kset, **args, **extra)
        assert word in str(e.value), f"{case}: {e.value}"
        assert kset.prepared_calls.keys() == cached.keys(), f"{case}: a failed call was cached"


def test_merge_errors_after_a_cached_valid_call(spec, fake_device):
    for case, mutate, word in merge_cases(spec.kv_lora_rank):
        new = Arrays()
        kset = RecordingKernelSet(spec)
        _warm(kset, tv.merge_states, merge_args(spec, new))
        args = merge_args(spec, new)
        mutate(args, new)
        with pytest.raises(ArgumentError) as e:
            tv.merge_states(kset, **args)
        assert word in str(e.value), f"{case}: {e.value}"


def test_accept_and_build_errors_after_a_cached_valid_call(spec, fake_device):
    for cases, launcher, make, out in ((accept_cases(spec), tree_accept, accept_args, accept_out),
                                       (BUILD_CASES, tree_build, build_args, build_out)):
        for case, change, word in cases:
            kset = FakeKernelSet(spec)
            _warm(kset, launcher, dict(make(spec), out=out(spec)))
            args = dict(make(spec), out=out(spec))
            change(args, spec)
            with pytest.raises(ArgumentError) as e:
                launcher(kset, **args)
            assert word in str(e.value), f"{case}: {e.value}"


def test_one_signature_prepares_once_and_launches_each_calls_pointers(spec, fake_device, monkeypatch):
    kset = Counting(spec)
    prepared = []
    real = tv._prepare_simple
    monkeypatch.setattr(tv, "_prepare_simple", lambda *a: prepared.append(1) or real(*a))
    new = Arrays()
    calls = [verify_args(spec, new) for _ in range(3)]
    for args in calls:
        tv.tree_verify(kset, **args, impl="simple")
    assert len(prepared) == 1 and len(_signatures(kset)) == 1
    for (name, kw), args in zip(kset.seen, calls):
        assert name == "tree_verify"
        assert kw["args"][:7] == [ptr_of(args[k]) for k in ("q_nope", "q_pe", "kv_cache", "block_table",
                                                            "prefix_lens", "q_lens", "tree_mask")]
        assert kw["args"][12:] == [ptr_of(args["out"]), ptr_of(args["lse"])]
    # another shape, another scale, another impl: another signature
    tv.tree_verify(kset, **dict(calls[0], softmax_scale=0.5), impl="simple")
    tv.tree_verify(kset, **calls[0], impl=tc(spec), num_splits=1)
    assert len(_signatures(kset)) == 3
    if spec.kv_fp8:   # kv_scale is a scalar of the signature, like softmax_scale: its factors are not reused
        tv.tree_verify(kset, **dict(calls[0], kv_scale=0.25), impl="simple")
        tv.tree_verify(kset, **dict(calls[0], kv_scale=0.25), impl=tc(spec), num_splits=1)
        assert len(_signatures(kset)) == 5
        for (name, kw) in kset.seen[-2:]:
            assert kw["args"][8] == np.float32(0.25), name
            assert kw["args"][7] == np.float32(calls[0]["softmax_scale"] * 0.25 * np.log2(np.e)), name


def test_validate_is_never_cached(spec, fake_device, monkeypatch):
    """validate=True reads device values: every such call runs its checks (here: refuses, as the host
    copies are fakes that cannot be read)."""
    kset = Counting(spec)
    new = Arrays()
    tv.tree_verify(kset, **verify_args(spec, new), impl="simple")
    before = dict(kset.prepared_calls)
    monkeypatch.setattr(tv, "validate_attention_values", lambda *a: (_ for _ in ()).throw(ArgumentError("checked")))
    for _ in range(2):
        with pytest.raises(ArgumentError, match="checked"):
            tv.tree_verify(kset, **verify_args(spec, new), impl="simple", validate=True)
    assert kset.prepared_calls.keys() == before.keys()


def test_scalar_types_are_part_of_the_signature(spec, fake_device):
    """budget=True must not reuse the cached budget=1 call (True == 1 in a dict key)."""
    kset = FakeKernelSet(spec)
    _warm(kset, tree_build, dict(build_args(spec), budget=1, out=build_out(spec)))
    with pytest.raises(ArgumentError, match="budget"):
        tree_build(kset, **dict(build_args(spec), budget=True, out=build_out(spec)))
    with pytest.raises(ArgumentError, match="softmax_scale"):
        tv.tree_verify(RecordingKernelSet(spec), **dict(verify_args(spec, Arrays()), softmax_scale=float("nan")))


def test_misaligned_pointer_after_cached_call_names_the_argument(spec, fake_device):
    kset = Counting(spec)
    new = Arrays()
    args = verify_args(spec, new)
    tv.tree_verify(kset, **args, impl=tc(spec), num_splits=1)
    cai = args["q_nope"].__cuda_array_interface__
    bad = dict(args, q_nope=new(cai["shape"], np.uint16, ptr=ptr_of(args["q_nope"]) + 8))
    with pytest.raises(ArgumentError, match=r"^q_nope: data pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        tv.tree_verify(kset, **bad, impl=tc(spec), num_splits=1)
    overlapping = dict(args, lse=new((2, spec.max_tree_size, spec.num_heads), np.float32, ptr=ptr_of(args["q_pe"])))
    with pytest.raises(ArgumentError, match="^lse: overlaps q_pe"):
        tv.tree_verify(kset, **overlapping, impl=tc(spec), num_splits=1)

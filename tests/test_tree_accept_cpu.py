"""Argument checks of the tree_accept and tree_build launchers, without a GPU (CI).

Fake CUDA arrays (conftest.FakeCudaArray) go through the real launchers with a FakeKernelSet:
every bad argument must raise ArgumentError naming it, and a valid call must reach the launch.
The cache is of the spec's kv_dtype: uint16 bf16 bits, or uint8 e4m3 bytes for an fp8 spec.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import FakeCudaArray, FakeKernelSet, LaunchReached
from ddtree_gen import TreeAcceptOutput, TreeBuildOutput
from ddtree_gen.errors import ArgumentError
from ddtree_gen.ops import by_name
from ddtree_gen.ops.tree_accept import launch as tree_accept_mod
from ddtree_gen.ops.tree_accept.launch import launch as tree_accept
from ddtree_gen.ops.tree_build.launch import launch as tree_build

B = 3
DEV1 = 1 << 40  # conftest.fake_device: a pointer >= 1 << 40 lives on device 1


def fake(shape, dtype, **kw):
    return FakeCudaArray(shape, dtype, **kw)


def kvd(spec):
    """The spec's cache dtype on the CuPy side: uint16 (bf16 bits) or uint8 (e4m3 bytes)."""
    return np.uint8 if spec.kv_fp8 else np.uint16


def fortran(shape, dtype):
    """A non-C-contiguous view of `shape` (column-major strides)."""
    item = np.dtype(dtype).itemsize
    strides, acc = [], item
    for dim in shape:
        strides.append(acc)
        acc *= dim
    return fake(shape, dtype, strides=tuple(strides))


def strided(shape, dtype):
    """A non-contiguous view: the last dimension has stride 2 elements."""
    item = np.dtype(dtype).itemsize
    strides, acc = [], 2 * item
    for dim in reversed(shape):
        strides.insert(0, acc)
        acc *= dim
    return fake(shape, dtype, strides=tuple(strides))


# --------------------------------------------------------------------------------- tree_accept

def accept_args(spec, b=B, num_pages=10, max_pages=4):
    n, width = spec.max_tree_size, spec.kv_lora_rank + spec.qk_rope_head_dim
    tree = SimpleNamespace(num_nodes=fake((b,), np.int32), tokens=fake((b, n), np.int32),
                           first_child=fake((b, n), np.int32), next_sibling=fake((b, n), np.int32))
    return {"tree": tree, "target_tokens": fake((b, n), np.int32), "prefix_lens": fake((b,), np.int32),
            "kv_cache": fake((num_pages, spec.page_size, width), kvd(spec)),
            "block_table": fake((b, max_pages), np.int32)}


def accept_out(spec, b=B):
    d1 = spec.max_depth + 1
    return TreeAcceptOutput(fake((b,), np.int32), fake((b, d1), np.int32), fake((b, d1), np.int32),
                            fake((b,), np.int32))


def _tree_field(field, value):
    def change(args, spec):
        tree = SimpleNamespace(**vars(args["tree"]))
        if value is _DELETE:
            delattr(tree, field)
        else:
            setattr(tree, field, value(spec) if callable(value) else value)
        args["tree"] = tree
    return change


def _arg(name, value):
    def change(args, spec):
        args[name] = value(spec) if callable(value) else value
    return change


_DELETE = object()


def _n(spec):
    return spec.max_tree_size


def _w(spec):
    return spec.kv_lora_rank + spec.qk_rope_head_dim


# (case id, change(args, spec), the name the message must contain)
ACCEPT_CASES = [
    # tree fields
    ("tree-missing-field", _tree_field("first_child", _DELETE), "tree"),
    ("tree-not-an-object", _arg("tree", None), "tree"),
    ("num_nodes-dtype", _tree_field("num_nodes", lambda s: fake((B,), np.int64)), "tree.num_nodes"),
    ("num_nodes-rank", _tree_field("num_nodes", lambda s: fake((B, 1), np.int32)), "tree.num_nodes"),
    ("num_nodes-batch", _tree_field("num_nodes", lambda s: fake((B + 1,), np.int32)), "tree.num_nodes"),
    ("num_nodes-noncontig", _tree_field("num_nodes", lambda s: strided((B,), np.int32)), "tree.num_nodes"),
    ("num_nodes-host", _tree_field("num_nodes", np.zeros(B, np.int32)), "tree.num_nodes"),
    ("num_nodes-device", _tree_field("num_nodes", lambda s: fake((B,), np.int32, ptr=DEV1)), "devices"),
    ("tokens-dtype", _tree_field("tokens", lambda s: fake((B, _n(s)), np.float32)), "tree.tokens"),
    ("tokens-rank", _tree_field("tokens", lambda s: fake((B, _n(s), 1), np.int32)), "tree.tokens"),
    ("tokens-N", _tree_field("tokens", lambda s: fake((B, _n(s) - 1), np.int32)), "tree.tokens"),
    ("tokens-noncontig", _tree_field("tokens", lambda s: fortran((B, _n(s)), np.int32)), "tree.tokens"),
    ("tokens-host", _tree_field("tokens", lambda s: np.zeros((B, _n(s)), np.int32)), "tree.tokens"),
    ("first_child-dtype", _tree_field("first_child", lambda s: fake((B, _n(s)), np.uint32)), "tree.first_child"),
    ("first_child-shape", _tree_field("first_child", lambda s: fake((B, _n(s) + 1), np.int32)), "tree.first_child"),
    ("first_child-batch", _tree_field("first_child", lambda s: fake((B - 1, _n(s)), np.int32)), "tree.first_child"),
    ("first_child-noncontig", _tree_field("first_child", lambda s: fortran((B, _n(s)), np.int32)),
     "tree.first_child"),
    ("first_child-device", _tree_field("first_child", lambda s: fake((B, _n(s)), np.int32, ptr=DEV1)), "devices"),
    ("next_sibling-dtype", _tree_field("next_sibling", lambda s: fake((B, _n(s)), np.int16)), "tree.next_sibling"),
    ("next_sibling-rank", _tree_field("next_sibling", lambda s: fake((B * _n(s),), np.int32)), "tree.next_sibling"),
    ("next_sibling-host", _tree_field("next_sibling", lambda s: np.zeros((B, _n(s)), np.int32)),
     "tree.next_sibling"),
    # target_tokens
    ("target-dtype", _arg("target_tokens", lambda s: fake((B, _n(s)), np.int64)), "target_tokens"),
    ("target-shape", _arg("target_tokens", lambda s: fake((B, _n(s) - 1), np.int32)), "target_tokens"),
    ("target-batch", _arg("target_tokens", lambda s: fake((B + 2, _n(s)), np.int32)), "target_tokens"),
    ("target-noncontig", _arg("target_tokens", lambda s: fortran((B, _n(s)), np.int32)), "target_tokens"),
    ("target-host", _arg("target_tokens", lambda s: np.zeros((B, _n(s)), np.int32)), "target_tokens"),
    ("target-device", _arg("target_tokens", lambda s: fake((B, _n(s)), np.int32, ptr=DEV1)), "devices"),
    ("target-none", _arg("target_tokens", None), "target_tokens"),
    # prefix_lens
    ("prefix-dtype", _arg("prefix_lens", lambda s: fake((B,), np.int64)), "prefix_lens"),
    ("prefix-rank", _arg("prefix_lens", lambda s: fake((B, 1), np.int32)), "prefix_lens"),
    ("prefix-batch", _arg("prefix_lens", lambda s: fake((B - 1,), np.int32)), "prefix_lens"),
    ("prefix-noncontig", _arg("prefix_lens", lambda s: strided((B,), np.int32)), "prefix_lens"),
    ("prefix-host", _arg("prefix_lens", np.zeros(B, np.int32)), "prefix_lens"),
    ("prefix-device", _arg("prefix_lens", lambda s: fake((B,), np.int32, ptr=DEV1)), "devices"),
    # kv_cache
    ("kv-dtype-f16", _arg("kv_cache", lambda s: fake((10, s.page_size, _w(s)), np.float16)), "kv_cache"),
    ("kv-dtype-f32", _arg("kv_cache", lambda s: fake((10, s.page_size, _w(s)), np.float32)), "kv_cache"),
    ("kv-other-kv-dtype", _arg("kv_cache", lambda s: fake((10, s.page_size, _w(s)), np.uint16 if s.kv_fp8 else
                                                           np.uint8)), "kv_dtype"),
    ("kv-rank", _arg("kv_cache", lambda s: fake((10 * s.page_size, _w(s)), kvd(s))), "kv_cache"),
    ("kv-page_size", _arg("kv_cache", lambda s: fake((10, s.page_size + 1, _w(s)), kvd(s))), "kv_cache"),
    ("kv-width", _arg("kv_cache", lambda s: fake((10, s.page_size, _w(s) - 64), kvd(s))), "kv_cache"),
    ("kv-noncontig", _arg("kv_cache", lambda s: strided((10, s.page_size, _w(s)), kvd(s))), "kv_cache"),
    ("kv-host", _arg("kv_cache", lambda s: np.zeros((2, s.page_size, _w(s)), kvd(s))), "kv_cache"),
    ("kv-device", _arg("kv_cache", lambda s: fake((10, s.page_size, _w(s)), kvd(s), ptr=DEV1)), "devices"),
    # (bf16 only: an e4m3 cache may start at any byte, test_fp8_cpu.py)
    ("kv-odd-pointer", _arg("kv_cache", lambda s: fake((10, s.page_size, _w(s)), kvd(s), ptr=0x10001)),
     "kv_cache"),
    # block_table
    ("table-dtype", _arg("block_table", lambda s: fake((B, 4), np.int64)), "block_table"),
    ("table-rank", _arg("block_table", lambda s: fake((B * 4,), np.int32)), "block_table"),
    ("table-batch", _arg("block_table", lambda s: fake((B + 1, 4), np.int32)), "block_table"),
    ("table-noncontig", _arg("block_table", lambda s: fortran((B, 4), np.int32)), "block_table"),
    ("table-host", _arg("block_table", np.zeros((B, 4), np.int32)), "block_table"),
    ("table-device", _arg("block_table", lambda s: fake((B, 4), np.int32, ptr=DEV1)), "devices"),
]


def accept_cases(spec) -> list:
    """ACCEPT_CASES that are errors for `spec` (an e4m3 cache at an odd address is not one)."""
    return [c for c in ACCEPT_CASES if not (spec.kv_fp8 and c[0] == "kv-odd-pointer")]


def assert_refused(launcher, spec, args, change, case, name):
    """change(args, spec), then launcher(FakeKernelSet(spec), **args) must raise ArgumentError naming `name`."""
    change(args, spec)
    with pytest.raises(ArgumentError) as e:
        launcher(FakeKernelSet(spec), **args)
    assert name in str(e.value), f"{case}: message does not name {name!r}: {e.value}"


def assert_out_refused(launcher, spec, args, out, field, value):
    """launcher(..., out=out with `field` replaced by value(spec)) must raise ArgumentError naming out.field (or
    the devices, for an output on another device)."""
    out = out._replace(**{field: value(spec)})
    with pytest.raises(ArgumentError) as e:
        launcher(FakeKernelSet(spec), **args, out=out)
    msg = str(e.value)
    assert f"out.{field}" in msg or "devices" in msg, msg


@pytest.mark.parametrize("case,change,name", ACCEPT_CASES, ids=[c[0] for c in ACCEPT_CASES])
def test_tree_accept_argument_errors(spec, fake_device, case, change, name):
    if case not in {c[0] for c in accept_cases(spec)}:
        pytest.skip(f"not an error for kv_dtype {spec.kv_dtype!r} (test_fp8_cpu.py)")
    assert_refused(tree_accept, spec, accept_args(spec), change, case, name)


OUT_CASES = [
    ("accept_lens-dtype", "accept_lens", lambda s: fake((B,), np.uint32)),
    ("accept_lens-shape", "accept_lens", lambda s: fake((B + 1,), np.int32)),
    ("accepted_nodes-shape", "accepted_nodes", lambda s: fake((B, s.max_depth), np.int32)),
    ("accepted_nodes-noncontig", "accepted_nodes", lambda s: fortran((B, s.max_depth + 1), np.int32)),
    ("out_tokens-dtype", "out_tokens", lambda s: fake((B, s.max_depth + 1), np.float32)),
    ("out_tokens-host", "out_tokens", lambda s: np.zeros((B, s.max_depth + 1), np.int32)),
    ("new_prefix_lens-device", "new_prefix_lens", lambda s: fake((B,), np.int32, ptr=DEV1)),
]


@pytest.mark.parametrize("case,field,value", OUT_CASES, ids=[c[0] for c in OUT_CASES])
def test_tree_accept_out_errors(spec, fake_device, case, field, value):
    assert_out_refused(tree_accept, spec, accept_args(spec), accept_out(spec), field, value)


def test_tree_accept_out_missing_field(spec, fake_device):
    out = SimpleNamespace(accept_lens=fake((B,), np.int32))
    with pytest.raises(ArgumentError, match="out"):
        tree_accept(FakeKernelSet(spec), **accept_args(spec), out=out)


def test_tree_accept_valid_call_reaches_launch(spec, fake_device):
    with pytest.raises(LaunchReached, match="tree_accept"):
        tree_accept(FakeKernelSet(spec), **accept_args(spec), out=accept_out(spec))


@pytest.mark.parametrize("ptr", [0x10000, 0x10002, 0x10008], ids=["aligned16", "aligned2", "aligned8"])
def test_tree_accept_launch_arguments(spec, fake_device, ptr):
    """What the launcher passes: grid, pointers in kernel order, sizes, the 16-byte flag."""
    seen = {}

    class Recorder(FakeKernelSet):
        def launch(self, name, **kw):
            seen.update(kw, name=name)

    args = accept_args(spec, num_pages=7, max_pages=5)
    args["kv_cache"] = fake((7, spec.page_size, _w(spec)), kvd(spec), ptr=ptr)
    tree_accept(Recorder(spec), **args, out=accept_out(spec))
    assert seen["name"] == "tree_accept" and seen["grid"] == (B,)
    a = seen["args"]
    assert len(a) == 15
    assert a[6] == ptr
    assert int(a[8]) == 7 and int(a[9]) == 5 and int(a[10]) == (ptr % 16 == 0)


def test_tree_accept_empty_batch_launches_nothing(spec, fake_device):
    # B = 0: nothing to do; the caller's out= comes back untouched
    out = accept_out(spec, b=0)
    got = tree_accept(FakeKernelSet(spec), **accept_args(spec, b=0), out=out)
    assert got.accept_lens is out.accept_lens


def test_tree_accept_tree_build_output_is_a_tree(spec, fake_device):
    n, w = spec.max_tree_size, spec.mask_words
    tree = TreeBuildOutput(fake((B,), np.int32), *(fake((B, n), np.int32) for _ in range(4)),
                           fake((B, n), np.float32), fake((B, n, w), np.uint32), fake((B, n), np.int32),
                           fake((B, n), np.int32))
    args = accept_args(spec)
    args["tree"] = tree
    with pytest.raises(LaunchReached):
        tree_accept(FakeKernelSet(spec), **args, out=accept_out(spec))


# validate=True: device values copied to the host (here: the fakes carry their host values)

class HostFake(FakeCudaArray):
    def __init__(self, values):
        values = np.ascontiguousarray(values)
        super().__init__(values.shape, values.dtype)
        self.host = values


def _validate_args(spec, num_nodes, prefix, table, num_pages=8):
    args = accept_args(spec, b=len(num_nodes), num_pages=num_pages, max_pages=np.shape(table)[1])
    args["tree"].num_nodes = HostFake(np.asarray(num_nodes, np.int32))
    args["prefix_lens"] = HostFake(np.asarray(prefix, np.int32))
    args["block_table"] = HostFake(np.asarray(table, np.int32))
    return args


@pytest.fixture
def host_values(monkeypatch):
    monkeypatch.setattr(tree_accept_mod, "host_copy", lambda a: a.obj.host)


VALIDATE_CASES = [
    # (id, num_nodes, prefix_lens, block_table, expected words in the message or None: valid)
    ("valid", [65, 1, 30], [0, 100, 63], [[0, 1], [2, 3], [4, 5]], None),
    ("num_nodes-0", [65, 0, 30], [0, 100, 63], [[0, 1], [2, 3], [4, 5]], ["tree.num_nodes", "request 1", "0"]),
    ("num_nodes-big", [66, 1, 30], [0, 100, 63], [[0, 1], [2, 3], [4, 5]], ["tree.num_nodes", "request 0", "66"]),
    ("prefix-negative", [65, 1, 30], [0, -5, 63], [[0, 1], [2, 3], [4, 5]], ["prefix_lens", "request 1", "-5"]),
    ("prefix-huge", [65, 1, 30], [0, 0, 2**31 - 1], [[0, 1], [2, 3], [4, 5]], ["prefix_lens", "request 2"]),
    ("page-outside", [65, 1, 30], [0, 100, 63], [[0, 1], [2, 3], [4, 8]], ["block_table", "request 2", "8"]),
    ("page-negative", [65, 1, 30], [0, 100, 63], [[0, -1], [2, 3], [4, 5]], ["block_table", "request 0", "-1"]),
    ("table-too-narrow", [65, 1, 30], [0, 100, 100], [[0, 1], [2, 3], [4, 5]], ["block_table", "request 2"]),
    # one node: nothing moves, so the block table is not needed
    ("one-node-no-pages", [65, 1, 30], [0, 10**6, 63], [[0, 1], [-1, -1], [4, 5]], None),
]


@pytest.mark.parametrize("case,nn,prefix,table,words", VALIDATE_CASES, ids=[c[0] for c in VALIDATE_CASES])
def test_tree_accept_validate(spec, fake_device, host_values, case, nn, prefix, table, words):
    if spec.max_tree_size != 65 or spec.page_size != 64:
        pytest.skip("the table is written for N = 65, page_size = 64")
    args = _validate_args(spec, nn, prefix, table)
    out = accept_out(spec, b=len(nn))
    if words is None:
        with pytest.raises(LaunchReached):
            tree_accept(FakeKernelSet(spec), **args, out=out, validate=True)
        return
    with pytest.raises(ArgumentError) as e:
        tree_accept(FakeKernelSet(spec), **args, out=out, validate=True)
    for w in words:
        assert w in str(e.value), f"{case}: {w!r} not in {e.value}"
    # without validate=True nothing is read on the host: the same call reaches the launch
    with pytest.raises(LaunchReached):
        tree_accept(FakeKernelSet(spec), **_validate_args(spec, nn, prefix, table), out=out)


def test_tree_accept_without_validate_reads_nothing_on_the_host(spec, fake_device, monkeypatch):
    def boom(a):
        raise AssertionError("a device array was copied to the host")
    monkeypatch.setattr(tree_accept_mod, "host_copy", boom)
    with pytest.raises(LaunchReached):
        tree_accept(FakeKernelSet(spec), **accept_args(spec), out=accept_out(spec))


# ---------------------------------------------------------------------------------- tree_build

def build_args(spec, b=B, dp=None, kp=None):
    dp = spec.max_depth if dp is None else dp
    kp = spec.max_tree_size - 1 if kp is None else kp
    return {"topk_ids": fake((b, dp, kp), np.int32), "topk_logprobs": fake((b, dp, kp), np.float32),
            "root_tokens": fake((b,), np.int32), "prefix_lens": fake((b,), np.int32), "budget": 8}


def build_out(spec, b=B):
    n, w = spec.max_tree_size, spec.mask_words
    return TreeBuildOutput(fake((b,), np.int32), *(fake((b, n), np.int32) for _ in range(4)),
                           fake((b, n), np.float32), fake((b, n, w), np.uint32), fake((b, n), np.int32),
                           fake((b, n), np.int32))


def _dk(spec, dp=None, kp=None):
    return (spec.max_depth if dp is None else dp, spec.max_tree_size - 1 if kp is None else kp)


BUILD_CASES = [
    ("ids-dtype", _arg("topk_ids", lambda s: fake((B, *_dk(s)), np.int64)), "topk_ids"),
    ("ids-rank", _arg("topk_ids", lambda s: fake((B, s.max_depth), np.int32)), "topk_ids"),
    ("ids-noncontig", _arg("topk_ids", lambda s: fortran((B, *_dk(s)), np.int32)), "topk_ids"),
    ("ids-host", _arg("topk_ids", lambda s: np.zeros((B, *_dk(s)), np.int32)), "topk_ids"),
    ("lps-dtype", _arg("topk_logprobs", lambda s: fake((B, *_dk(s)), np.float64)), "topk_logprobs"),
    ("lps-bf16", _arg("topk_logprobs", lambda s: fake((B, *_dk(s)), np.uint16)), "topk_logprobs"),
    ("lps-shape", _arg("topk_logprobs", lambda s: fake((B, *_dk(s, kp=3)), np.float32)), "topk_logprobs"),
    ("lps-batch", _arg("topk_logprobs", lambda s: fake((B + 1, *_dk(s)), np.float32)), "topk_logprobs"),
    ("lps-noncontig", _arg("topk_logprobs", lambda s: strided((B, *_dk(s)), np.float32)), "topk_logprobs"),
    ("lps-host", _arg("topk_logprobs", lambda s: np.zeros((B, *_dk(s)), np.float32)), "topk_logprobs"),
    ("lps-device", _arg("topk_logprobs", lambda s: fake((B, *_dk(s)), np.float32, ptr=DEV1)), "devices"),
    ("roots-dtype", _arg("root_tokens", lambda s: fake((B,), np.uint32)), "root_tokens"),
    ("roots-batch", _arg("root_tokens", lambda s: fake((B + 1,), np.int32)), "root_tokens"),
    ("roots-rank", _arg("root_tokens", lambda s: fake((B, 1), np.int32)), "root_tokens"),
    ("roots-noncontig", _arg("root_tokens", lambda s: strided((B,), np.int32)), "root_tokens"),
    ("roots-host", _arg("root_tokens", np.zeros(B, np.int32)), "root_tokens"),
    ("roots-device", _arg("root_tokens", lambda s: fake((B,), np.int32, ptr=DEV1)), "devices"),
    ("prefix-dtype", _arg("prefix_lens", lambda s: fake((B,), np.float32)), "prefix_lens"),
    ("prefix-batch", _arg("prefix_lens", lambda s: fake((B - 1,), np.int32)), "prefix_lens"),
    ("prefix-host", _arg("prefix_lens", np.zeros(B, np.int32)), "prefix_lens"),
    ("prefix-device", _arg("prefix_lens", lambda s: fake((B,), np.int32, ptr=DEV1)), "devices"),
    ("budget-too-big", _arg("budget", lambda s: s.max_tree_size), "budget"),
    ("budget-negative", _arg("budget", -1), "budget"),
    ("budget-float", _arg("budget", 8.0), "budget"),
    ("budget-str", _arg("budget", "8"), "budget"),
    ("budget-bool", _arg("budget", True), "budget"),
    ("budget-none", _arg("budget", None), "budget"),
    ("kp-too-big", lambda a, s: a.update(build_args(s, kp=s.max_tree_size)), "K'"),
    ("kp-zero", lambda a, s: a.update(build_args(s, kp=0)), "K'"),
    ("dp-too-big", lambda a, s: a.update(build_args(s, dp=s.max_depth + 1)), "D'"),
    ("dp-zero", lambda a, s: a.update(build_args(s, dp=0)), "D'"),
]


@pytest.mark.parametrize("case,change,name", BUILD_CASES, ids=[c[0] for c in BUILD_CASES])
def test_tree_build_argument_errors(spec, fake_device, case, change, name):
    assert_refused(tree_build, spec, build_args(spec), change, case, name)


BUILD_OUT_CASES = [
    ("num_nodes-shape", "num_nodes", lambda s: fake((B, 1), np.int32)),
    ("scores-dtype", "scores", lambda s: fake((B, s.max_tree_size), np.int32)),
    ("tree_mask-shape", "tree_mask", lambda s: fake((B, s.max_tree_size, s.mask_words + 1), np.uint32)),
    ("tokens-host", "tokens", lambda s: np.zeros((B, s.max_tree_size), np.int32)),
    ("next_sibling-device", "next_sibling", lambda s: fake((B, s.max_tree_size), np.int32, ptr=DEV1)),
]


@pytest.mark.parametrize("case,field,value", BUILD_OUT_CASES, ids=[c[0] for c in BUILD_OUT_CASES])
def test_tree_build_out_errors(spec, fake_device, case, field, value):
    assert_out_refused(tree_build, spec, build_args(spec), build_out(spec), field, value)


@pytest.mark.parametrize("dp,kp,budget", [(None, None, 0), (None, None, "max"), (1, 1, 1), (15, 1, 15), (1, 64, 64)],
                         ids=["budget0", "budget-max", "k1-d1", "chain", "star"])
def test_tree_build_valid_call_reaches_launch(spec, fake_device, dp, kp, budget):
    dp = min(dp, spec.max_depth) if dp else None
    kp = min(kp, spec.max_tree_size - 1) if kp else None
    args = build_args(spec, dp=dp, kp=kp)
    args["budget"] = spec.max_tree_size - 1 if budget == "max" else min(budget, spec.max_tree_size - 1)
    with pytest.raises(LaunchReached, match="tree_build"):
        tree_build(FakeKernelSet(spec), **args, out=build_out(spec))
    with pytest.raises(LaunchReached, match="tree_build"):
        tree_build(FakeKernelSet(spec), **{**args, "budget": np.int32(args["budget"])}, out=build_out(spec))


# ------------------------------------------------------------------------------------ the plan

def test_tree_accept_plan(spec):
    plan = by_name("tree_accept").plan(spec)
    plan.check_fits()
    c = plan.template_constants()
    width = spec.kv_lora_rank + spec.qk_rope_head_dim
    item = spec.kv_itemsize     # bytes per element: bf16 2, e4m3 1
    assert c["ENTRY"] == width and c["CHUNKS"] * 16 == width * item
    assert c["THREADS"] % 32 == 0 and c["CHUNKS"] <= c["THREADS"] < c["CHUNKS"] + 32
    # the staging buffer holds D whole entries
    assert c["STATIC_SMEM"] >= item * spec.max_depth * width
    assert c["STATIC_SMEM"] % 16 == 0
    # the block-table window covers every position a commit touches, [L+1, L+N-1], for any L
    n, page = spec.max_tree_size, spec.page_size
    worst = max((L + n - 1) // page - (L + 1) // page + 1 for L in range(-1, 3 * page))
    assert c["NPAGES"] >= worst

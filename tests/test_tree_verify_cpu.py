"""tree_verify / tree_verify_tail / merge_states launchers: argument checks before launch (no GPU).

Every bad argument raises ArgumentError naming the argument, before anything is allocated or
launched; a valid call reaches the launch (so the checks are not over-strict). The argument
checks are shared by both implementations: every case runs with impl="simple" (the CUDA-core
kernel) and impl="mma" (the tensor-core kernel, on a stand-in kernel set that has it), and the
impl dispatch itself (auto / mma / simple, workspace and num_splits) is tested at the end.
validate=True needs host copies of device arrays: it is tested in test_gpu_tree_verify.py.

An fp8 spec (kv_dtype "fp8_e4m3") has no mma.sync kernels: there the tensor-core implementation of these
tests (tc(spec)) is wgmma, its cache is uint8 e4m3 bytes and every call passes a kv_scale; the fp8 rules
themselves (kv_scale, the cache's dtype, impl="mma" refused) are tested in test_fp8_cpu.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import FakeArrays as Arrays, FakeKernelSet, LaunchReached, ptr_of
from ddtree_gen.errors import ArgumentError
from ddtree_gen.ops.tree_verify import launch as tv
from ddtree_gen.ops.tree_verify import tensor_core
from ddtree_gen.ops.tree_verify import mma_launch as mma
from ddtree_gen.ops.tree_verify import simple as verify_plans
from ddtree_gen.ops.tree_verify import split as split_kv
from ddtree_gen.ops.tree_verify import mma as mma_plans
from ddtree_gen.ops.tree_verify.wgmma import PARTS_MIN_B
from ddtree_gen.types import AttentionOutput

B, PAGES, MAX_PAGES = 2, 10, 4
DEVICE1 = 1 << 40   # fake_device: a pointer at or above this lives on device 1


class RecordingKernelSet(FakeKernelSet):
    """FakeKernelSet that keeps what the launcher asked for before refusing to run it."""

    def launch(self, name, **kwargs):
        self.launched = (name, kwargs)
        raise LaunchReached(name)


MMA_NAMES = ("tree_verify_mma", "tree_verify_tail_mma", "tree_verify_mma_combine")
WGMMA_NAMES = ("tree_verify_wgmma", "tree_verify_tail_wgmma")
KV_SCALE = 0.5     # the kv_scale of every call on an fp8 spec


def tc(spec) -> str:
    """The tensor-core family these tests drive for `spec`: mma.sync, or wgmma for an fp8 spec (no mma.sync)."""
    return "wgmma" if spec.kv_fp8 else "mma"


def tc_names(spec) -> tuple:
    """The loaded tensor-core kernels of tc(spec), with the combine kernel."""
    return MMA_NAMES if not spec.kv_fp8 else (*WGMMA_NAMES, "tree_verify_mma_combine")


def kv_dtype(spec):
    """The host dtype of the spec's cache: uint16 (bf16 bits), uint8 (e4m3 bytes)."""
    return np.uint8 if spec.kv_fp8 else np.uint16


class MmaKernelSet(RecordingKernelSet):
    """A stand-in with `kernels` (as KernelSet has): the loaded kernel names, by default the CUDA-core ones and
    the tensor-core family of the spec (tc_names)."""

    def __init__(self, spec, kernels=None):
        super().__init__(spec, kernels if kernels is not None else
                         ("tree_verify", "tree_verify_tail", "merge_states", *tc_names(spec)))


def kset_for(impl, spec):
    """A recording kernel set on which `impl` ("simple" or "mma": the tensor-core family of the spec) is available."""
    return MmaKernelSet(spec) if impl == "mma" else RecordingKernelSet(spec)


def impl_of(impl, spec):
    """The impl= value of a test's impl parameter for `spec` ("mma": tc(spec))."""
    return tc(spec) if impl == "mma" else impl


def reversed_strides(shape, itemsize):
    """Strides of a Fortran-ordered (non C-contiguous) array of this shape."""
    out, acc = [], itemsize
    for d in shape:
        out.append(acc)
        acc *= d
    return tuple(out)


# ----------------------------------------------------------------------------- tree_verify

def verify_args(spec, new, b=B, max_pages=None):
    h, r, p, n, w, page = (spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.max_tree_size,
                           spec.mask_words, spec.page_size)
    args = dict(
        q_nope=new((b, n, h, r), np.uint16), q_pe=new((b, n, h, p), np.uint16),
        kv_cache=new((PAGES, page, r + p), kv_dtype(spec)), block_table=new((b, max_pages or MAX_PAGES), np.int32),
        prefix_lens=new((b,), np.int32), q_lens=new((b,), np.int32), tree_mask=new((b, n, w), np.uint32),
        softmax_scale=192 ** -0.5, out=new((b, n, h, r), np.uint16), lse=new((b, n, h), np.float32))
    if spec.kv_fp8:
        args["kv_scale"] = KV_SCALE
    return args


def verify_cases(spec):
    """(id, mutate(args, new, spec), word the message must contain)."""
    h, r, p, n, w, page = (spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.max_tree_size,
                           spec.mask_words, spec.page_size)
    kv, item = kv_dtype(spec), np.dtype(kv_dtype(spec)).itemsize

    def set_(**kw):
        return lambda a, new: a.update({k: v(new) if callable(v) else v for k, v in kw.items()})

    def resize_nq(nq):
        def f(a, new):
            a.update(q_nope=new((B, nq, h, r), np.uint16), q_pe=new((B, nq, h, p), np.uint16),
                     tree_mask=new((B, nq, w), np.uint32), out=new((B, nq, h, r), np.uint16),
                     lse=new((B, nq, h), np.float32))
        return f

    def same_ptr(field, as_field, offset=0):
        def f(a, new):
            src = a[as_field].__cuda_array_interface__
            shape, typestr = a[field].__cuda_array_interface__["shape"], a[field].__cuda_array_interface__["typestr"]
            a[field] = new(shape, np.dtype(typestr), ptr=src["data"][0] + offset)
        return f

    def on_device1(field):
        def f(a, new):
            cai = a[field].__cuda_array_interface__
            a[field] = new(cai["shape"], np.dtype(cai["typestr"]), ptr=DEVICE1 + (ptr_of(a[field]) & 0xffffffff))
        return f

    def misaligned(field, by):
        def f(a, new):
            cai = a[field].__cuda_array_interface__
            a[field] = new(cai["shape"], np.dtype(cai["typestr"]), ptr=ptr_of(a[field]) + by)
        return f

    return [
        # q_nope
        ("q_nope-dtype", set_(q_nope=lambda new: new((B, n, h, r), np.float32)), "q_nope"),
        ("q_nope-float16", set_(q_nope=lambda new: new((B, n, h, r), np.float16)), "q_nope"),
        ("q_nope-rank", set_(q_nope=lambda new: new((B, n, h * r), np.uint16)), "q_nope"),
        ("q_nope-H", set_(q_nope=lambda new: new((B, n, h + 1, r), np.uint16)), "num_heads"),
        ("q_nope-R", set_(q_nope=lambda new: new((B, n, h, r + 16), np.uint16)), "kv_lora_rank"),
        ("q_nope-strides", set_(q_nope=lambda new: new((B, n, h, r), np.uint16,
                                                        strides=reversed_strides((B, n, h, r), 2))), "q_nope"),
        ("q_nope-host", set_(q_nope=np.zeros((B, n, h, r), np.uint16)), "q_nope"),
        ("q_nope-none", set_(q_nope=None), "q_nope"),
        ("q_nope-list", set_(q_nope=[[1]]), "q_nope"),
        ("Nq>N", resize_nq(n + 1), "max_tree_size"),
        ("Nq=0", resize_nq(0), "q_nope"),
        ("q_nope-misaligned", misaligned("q_nope", 2), "q_nope"),
        # q_pe
        ("q_pe-dtype", set_(q_pe=lambda new: new((B, n, h, p), np.float32)), "q_pe"),
        ("q_pe-P", set_(q_pe=lambda new: new((B, n, h, p + 16), np.uint16)), "qk_rope_head_dim"),
        ("q_pe-H", set_(q_pe=lambda new: new((B, n, h + 1, p), np.uint16)), "q_pe"),
        ("q_pe-batch", set_(q_pe=lambda new: new((B + 1, n, h, p), np.uint16)), "q_pe"),
        ("q_pe-rank", set_(q_pe=lambda new: new((B, n, h), np.uint16)), "q_pe"),
        ("q_pe-strides", set_(q_pe=lambda new: new((B, n, h, p), np.uint16,
                                                    strides=reversed_strides((B, n, h, p), 2))), "q_pe"),
        ("q_pe-host", set_(q_pe=np.zeros((B, n, h, p), np.uint16)), "q_pe"),
        # kv_cache
        ("kv-dtype", set_(kv_cache=lambda new: new((PAGES, page, r + p), np.float32)), "kv_cache"),
        ("kv-rank", set_(kv_cache=lambda new: new((PAGES * page, r + p), kv)), "kv_cache"),
        ("kv-page_size", set_(kv_cache=lambda new: new((PAGES, page + 1, r + p), kv)), "page_size"),
        ("kv-row", set_(kv_cache=lambda new: new((PAGES, page, r), kv)), "kv_cache"),
        ("kv-strides", set_(kv_cache=lambda new: new((PAGES, page, r + p), kv,
                                                     strides=reversed_strides((PAGES, page, r + p), item))),
         "kv_cache"),
        ("kv-host", set_(kv_cache=np.zeros((PAGES, page, r + p), kv)), "kv_cache"),
        ("kv-misaligned", misaligned("kv_cache", 8), "kv_cache"),
        # block_table
        ("table-dtype", set_(block_table=lambda new: new((B, MAX_PAGES), np.int64)), "block_table"),
        ("table-rank", set_(block_table=lambda new: new((B * MAX_PAGES,), np.int32)), "block_table"),
        ("table-batch", set_(block_table=lambda new: new((B + 1, MAX_PAGES), np.int32)), "block_table"),
        ("table-strides", set_(block_table=lambda new: new((B, MAX_PAGES), np.int32,
                                                           strides=reversed_strides((B, MAX_PAGES), 4))),
         "block_table"),
        ("table-host", set_(block_table=np.zeros((B, MAX_PAGES), np.int32)), "block_table"),
        # prefix_lens, q_lens
        ("prefix-dtype", set_(prefix_lens=lambda new: new((B,), np.int64)), "prefix_lens"),
        ("prefix-batch", set_(prefix_lens=lambda new: new((B + 1,), np.int32)), "prefix_lens"),
        ("prefix-host", set_(prefix_lens=np.zeros(B, np.int32)), "prefix_lens"),
        ("qlens-dtype", set_(q_lens=lambda new: new((B,), np.float32)), "q_lens"),
        ("qlens-rank", set_(q_lens=lambda new: new((B, 1), np.int32)), "q_lens"),
        ("qlens-host", set_(q_lens=np.ones(B, np.int32)), "q_lens"),
        # tree_mask
        ("mask-dtype", set_(tree_mask=lambda new: new((B, n, w), np.int32)), "tree_mask"),
        ("mask-W", set_(tree_mask=lambda new: new((B, n, w + 1), np.uint32)), "mask_words"),
        ("mask-Nq", set_(tree_mask=lambda new: new((B, n - 1, w), np.uint32)), "tree_mask"),
        ("mask-batch", set_(tree_mask=lambda new: new((B + 1, n, w), np.uint32)), "tree_mask"),
        ("mask-strides", set_(tree_mask=lambda new: new((B, n, w), np.uint32,
                                                        strides=reversed_strides((B, n, w), 4))), "tree_mask"),
        # softmax_scale
        ("scale-nan", set_(softmax_scale=math.nan), "softmax_scale"),
        ("scale-inf", set_(softmax_scale=math.inf), "softmax_scale"),
        ("scale-neginf", set_(softmax_scale=-math.inf), "softmax_scale"),
        ("scale-f32-overflow", set_(softmax_scale=1e300), "softmax_scale"),
        ("scale-str", set_(softmax_scale="0.1"), "softmax_scale"),
        ("scale-none", set_(softmax_scale=None), "softmax_scale"),
        # devices
        ("device-q_pe", on_device1("q_pe"), "q_pe"),
        ("device-kv", on_device1("kv_cache"), "kv_cache"),
        ("device-table", on_device1("block_table"), "block_table"),
        ("device-mask", on_device1("tree_mask"), "tree_mask"),
        ("device-out", on_device1("out"), "out"),
        ("device-lse", on_device1("lse"), "lse"),
        # outputs
        ("out-shape", set_(out=lambda new: new((B, n, h, r + 16), np.uint16)), "out"),
        ("out-Nq", set_(out=lambda new: new((B, n - 1, h, r), np.uint16)), "out"),
        ("out-dtype", set_(out=lambda new: new((B, n, h, r), np.float32)), "out"),
        ("out-strides", set_(out=lambda new: new((B, n, h, r), np.uint16,
                                                 strides=reversed_strides((B, n, h, r), 2))), "out"),
        ("out-host", set_(out=np.zeros((B, n, h, r), np.uint16)), "out"),
        ("out-misaligned", misaligned("out", 2), "out"),
        ("lse-shape", set_(lse=lambda new: new((B, n, h, 1), np.float32)), "lse"),
        ("lse-dtype", set_(lse=lambda new: new((B, n, h), np.float64)), "lse"),
        ("out-is-q_nope", same_ptr("out", "q_nope"), "out"),
        ("out-overlaps-kv", same_ptr("out", "kv_cache", 1024), "out"),
        ("lse-is-prefix", same_ptr("lse", "prefix_lens"), "lse"),
        ("lse-overlaps-out", same_ptr("lse", "out", 256), "lse"),
    ]


LAUNCHERS = [("tree_verify", tv.tree_verify), ("tree_verify_tail", tv.tree_verify_tail)]
CASE_IDS = [c[0] for c in verify_cases(type("S", (), dict(num_heads=8, kv_lora_rank=512, qk_rope_head_dim=64,
                                                             max_tree_size=65, mask_words=3, page_size=64,
                                                             kv_fp8=False))())]


@pytest.mark.parametrize("impl", ["simple", "mma"])
@pytest.mark.parametrize("launcher", [f for _, f in LAUNCHERS], ids=[n for n, _ in LAUNCHERS])
@pytest.mark.parametrize("case", CASE_IDS)
def test_verify_argument_errors(spec, launcher, case, impl, fake_device):
    new = Arrays()
    args = verify_args(spec, new)
    (cid, mutate, word), = [c for c in verify_cases(spec) if c[0] == case]
    mutate(args, new)
    kset = kset_for(impl, spec)
    with pytest.raises(ArgumentError) as e:
        launcher(kset, **args, impl=impl_of(impl, spec))
    assert word in str(e.value), str(e.value)
    assert not hasattr(kset, "launched")


@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
@pytest.mark.parametrize("nq", ["N", 1])
def test_verify_valid_call_reaches_launch(spec, name, launcher, nq, fake_device):
    new = Arrays()
    args = verify_args(spec, new)
    n = spec.max_tree_size if nq == "N" else nq
    h, r, p, w = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.mask_words
    args.update(q_nope=new((B, n, h, r), np.uint16), q_pe=new((B, n, h, p), np.uint16),
                tree_mask=new((B, n, w), np.uint32), out=new((B, n, h, r), np.uint16), lse=new((B, n, h), np.float32))
    kset = RecordingKernelSet(spec)
    with pytest.raises(LaunchReached, match=name):
        launcher(kset, **args, validate=False)
    got, kw = kset.launched
    plan = kset.plan(name)
    groups = plan.value(plan.consts["HEAD_GROUPS"])
    assert got == name and kw["grid"] == (groups * n * B,)
    a = kw["args"]
    assert len(a) == 14
    assert a[:7] == [ptr_of(args[k]) for k in ("q_nope", "q_pe", "kv_cache", "block_table",
                                                               "prefix_lens", "q_lens", "tree_mask")]
    kv_scale = args.get("kv_scale", 1.0)   # v_scale: kv_scale for an fp8 spec, 1 for bf16
    assert a[7] == np.float32(args["softmax_scale"] * kv_scale * math.log2(math.e)) and a[7].dtype == np.float32
    assert a[8] == np.float32(kv_scale) and a[8].dtype == np.float32
    assert (int(a[9]), int(a[10]), int(a[11])) == (n, MAX_PAGES, PAGES)
    assert all(x.dtype == np.int32 for x in a[9:12])
    assert (a[12], a[13]) == (ptr_of(args["out"]), ptr_of(args["lse"]))


def test_verify_int32_scale_and_zero_batch(spec, fake_device):
    """An int softmax_scale is fine; an empty batch returns the given buffers without launching."""
    new = Arrays()
    args = verify_args(spec, new)
    h, r, p, n, w = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.max_tree_size, spec.mask_words
    with pytest.raises(LaunchReached):
        tv.tree_verify(RecordingKernelSet(spec), **{**args, "softmax_scale": 1})
    empty = dict(q_nope=new((0, n, h, r), np.uint16), q_pe=new((0, n, h, p), np.uint16),
                 block_table=new((0, MAX_PAGES), np.int32), prefix_lens=new((0,), np.int32),
                 q_lens=new((0,), np.int32), tree_mask=new((0, n, w), np.uint32),
                 out=new((0, n, h, r), np.uint16), lse=new((0, n, h), np.float32))
    kset = RecordingKernelSet(spec)
    res = tv.tree_verify(kset, **{**args, **empty})
    assert isinstance(res, AttentionOutput) and res.out is empty["out"] and res.lse is empty["lse"]
    assert not hasattr(kset, "launched")


def test_verify_kernel_defs():
    names = {k.name: k for k in verify_plans.KERNELS}
    assert set(names) == {"tree_verify", "tree_verify_tail", "merge_states"}
    assert names["tree_verify"].context == {"tail": False} and names["tree_verify_tail"].context == {"tail": True}
    assert names["tree_verify"].template == names["tree_verify_tail"].template == "tree_verify.cu.j2"
    assert names["merge_states"].entry == "ddtree_merge_states"


def test_verify_plan_fits(spec):
    for k in verify_plans.KERNELS:
        plan = k.plan(spec)
        plan.check_fits()
        consts = plan.template_constants()
        if k.name != "merge_states":
            assert consts["HEADS_PER_WARP"] * consts["TILE_KEYS"] == 32
            assert consts["HEAD_GROUPS"] * consts["HEADS_PER_BLOCK"] >= spec.num_heads
            assert consts["THREADS"] == 32 * consts["WARPS"]


# ---------------------------------------------------------------------------- merge_states

def merge_args(spec, new, lead=(B, 3, 4)):
    r = spec.kv_lora_rank
    return dict(o_a=new((*lead, r), np.uint16), lse_a=new(lead, np.float32), o_b=new((*lead, r), np.uint16),
                lse_b=new(lead, np.float32), out=new((*lead, r), np.uint16), lse=new(lead, np.float32))


def merge_cases(r):
    lead = (B, 3, 4)

    def set_(**kw):
        return lambda a, new: a.update({k: v(new) if callable(v) else v for k, v in kw.items()})

    def at(field, of, offset=0, dev1=False):
        def f(a, new):
            cai = a[field].__cuda_array_interface__
            base = ptr_of(a[of]) if of else ptr_of(a[field])
            a[field] = new(cai["shape"], np.dtype(cai["typestr"]), ptr=base + offset + (DEVICE1 if dev1 else 0))
        return f

    return [
        ("o_a-dtype", set_(o_a=lambda new: new((*lead, r), np.float32)), "o_a"),
        ("o_a-R", set_(o_a=lambda new: new((*lead, r + 16), np.uint16)), "kv_lora_rank"),
        ("o_a-scalar", set_(o_a=lambda new: new((), np.uint16)), "o_a"),
        ("o_a-strides", set_(o_a=lambda new: new((*lead, r), np.uint16,
                                                 strides=reversed_strides((*lead, r), 2))), "o_a"),
        ("o_a-host", set_(o_a=np.zeros((*lead, r), np.uint16)), "o_a"),
        ("lse_a-shape", set_(lse_a=lambda new: new((B, 3), np.float32)), "lse_a"),
        ("lse_a-dtype", set_(lse_a=lambda new: new(lead, np.float64)), "lse_a"),
        ("lse_a-host", set_(lse_a=np.zeros(lead, np.float32)), "lse_a"),
        ("o_b-shape", set_(o_b=lambda new: new((B + 1, 3, 4, r), np.uint16)), "o_b"),
        ("o_b-dtype", set_(o_b=lambda new: new((*lead, r), np.int16)), "o_b"),
        ("o_b-strides", set_(o_b=lambda new: new((*lead, r), np.uint16,
                                                 strides=reversed_strides((*lead, r), 2))), "o_b"),
        ("lse_b-dtype", set_(lse_b=lambda new: new(lead, np.float16)), "lse_b"),
        ("lse_b-shape", set_(lse_b=lambda new: new((*lead, 1), np.float32)), "lse_b"),
        ("lse_b-device", at("lse_b", None, dev1=True), "lse_b"),
        ("o_b-device", at("o_b", None, dev1=True), "o_b"),
        ("out-device", at("out", None, dev1=True), "out"),
        ("out-shape", set_(out=lambda new: new((B, 3, 4, r - 16), np.uint16)), "out"),
        ("out-dtype", set_(out=lambda new: new((*lead, r), np.float32)), "out"),
        ("out-host", set_(out=np.zeros((*lead, r), np.uint16)), "out"),
        ("lse-shape", set_(lse=lambda new: new((B, 3, 5), np.float32)), "lse"),
        ("lse-dtype", set_(lse=lambda new: new(lead, np.int32)), "lse"),
        ("out-shifted-o_a", at("out", "o_a", 64), "out"),
        ("out-is-lse_a", at("out", "lse_a"), "out"),
        ("lse-is-o_b", at("lse", "o_b"), "lse"),
        ("lse-in-out", at("lse", "out", 128), "lse"),
        ("o_a-misaligned", at("o_a", None, 2), "o_a"),
    ]


MERGE_CASE_IDS = [c[0] for c in merge_cases(512)]


@pytest.mark.parametrize("case", MERGE_CASE_IDS)
def test_merge_argument_errors(spec, case, fake_device):
    new = Arrays()
    args = merge_args(spec, new)
    (cid, mutate, word), = [c for c in merge_cases(spec.kv_lora_rank) if c[0] == case]
    mutate(args, new)
    kset = RecordingKernelSet(spec)
    with pytest.raises(ArgumentError) as e:
        tv.merge_states(kset, **args)
    assert word in str(e.value), str(e.value)
    assert not hasattr(kset, "launched")


@pytest.mark.parametrize("lead", [(B, 3, 4), (5,), (), (2, 0, 3)], ids=["BNqH", "1d", "scalar", "empty"])
@pytest.mark.parametrize("inplace", [None, "a", "b"])
def test_merge_valid_call_reaches_launch(spec, lead, inplace, fake_device):
    new = Arrays()
    args = merge_args(spec, new, lead)
    if inplace == "a":
        args.update(out=args["o_a"], lse=args["lse_a"])
    elif inplace == "b":
        args.update(out=args["o_b"], lse=args["lse_b"])
    kset = RecordingKernelSet(spec)
    rows = math.prod(lead)
    if rows == 0:
        res = tv.merge_states(kset, **args)
        assert res.out is args["out"] and not hasattr(kset, "launched")
        return
    with pytest.raises(LaunchReached, match="merge_states"):
        tv.merge_states(kset, **args)
    name, kw = kset.launched
    assert kw["grid"] == (-(-rows // verify_plans.MERGE_WARPS),)
    a = kw["args"]
    assert len(a) == 7 and int(a[6]) == rows and a[6].dtype == np.int64
    assert a[:6] == [ptr_of(args[k]) for k in ("o_a", "lse_a", "o_b", "lse_b", "out", "lse")]


# ------------------------------------------------------------------ impl: auto / mma / simple

def launched(launcher, kset, **args):
    """The (kernel name, launch kwargs) a call reaches."""
    with pytest.raises(LaunchReached):
        launcher(kset, **args)
    return kset.launched


def tma_words(spec, kernel: str) -> int:
    """Words a launch of `kernel` adds for its tensor map: 16 for a TMA build (its record's tma: WgmmaBuild)."""
    from ddtree_gen.ops import by_name
    return 16 if getattr(by_name(kernel).build_record(spec), "tma", False) else 0


@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
def test_impl_auto_picks_mma_when_loaded(spec, name, launcher, fake_device):
    """auto on a set with the spec's tensor-core family (mma.sync; fp8: wgmma) loaded picks it."""
    args = verify_args(spec, Arrays())
    for kw in ({}, {"impl": "auto"}):
        got, k = launched(launcher, MmaKernelSet(spec), **args, num_splits=1, **kw)
        assert got == f"{name}_{tc(spec)}"
        a = k["args"]
        # the tensor-core kernel's arguments (see test_impl_mma_launch_args), + the cache's tensor map for TMA
        assert len(a) == 18 + tma_words(spec, got)
    got, _ = launched(launcher, MmaKernelSet(spec), **args, impl=tc(spec), num_splits=1)
    assert got == f"{name}_{tc(spec)}"


@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
def test_impl_auto_prefers_wgmma(spec, name, launcher, fake_device):
    """With both tensor-core families loaded, auto (and the default) is wgmma, "mma" still picks
    mma; the wgmma launch carries the same arguments as the mma one (same signature, same workspace);
    without the combine kernel neither family is used by auto, and "wgmma" names what is missing."""
    full = ("tree_verify", "tree_verify_tail", "merge_states", *MMA_NAMES, *WGMMA_NAMES)
    new = Arrays()
    args = verify_args(spec, new)
    ws = new((split_kv.workspace_elems(spec, B, spec.max_tree_size, 3),), np.float32)
    launches = {}
    cases = (({}, "wgmma"), ({"impl": "auto"}, "wgmma"), ({"impl": "wgmma"}, "wgmma"), ({"impl": "mma"}, "mma"))
    for kw, want in cases[:3] if spec.kv_fp8 else cases:   # an fp8 spec has no mma.sync (test_fp8_cpu.py)
        got, k = launched(launcher, MmaKernelSet(spec, full), **args, workspace=ws, num_splits=3, **kw)
        assert got == f"{name}_{want}", (kw, got)
        launches[want] = list(k["args"])
    # a seesaw build with the "parts" grid also takes the request spans of its parts, in the workspace after its
    # partials (slots b + part: a smaller partial area than the chunks' [splits, rows])
    from ddtree_gen.ops.tree_verify.wgmma import verify_plan
    seesaw = int(verify_plan(spec, f"{name}_wgmma").consts["PARTS"])   # the default grid is "chunks": 0
    extra = tma_words(spec, f"{name}_wgmma")
    assert len(launches["wgmma"]) == 18 + seesaw + extra
    same = 17 if seesaw else 18   # the arrays and scalars; part_lse's offset is the layout's
    assert launches["wgmma"][:same] == launches.get("mma", launches["wgmma"])[:same]
    if seesaw:
        b, nq, h, r = args["q_nope"].__cuda_array_interface__["shape"]
        slots = (b + 3 - 1) * nq * h
        ws_ptr = launches["wgmma"][16]
        assert launches["wgmma"][17] - ws_ptr == slots * r * 4 and launches["wgmma"][18] - ws_ptr == slots * (r + 1) * 4
    if extra:   # the full kernel of a bf16 spec with 64-key pages: the tensor map of kv_cache, [pages * PAGE, R + P]
        (tag, ptr, tm), *rest = launches["wgmma"][18 + seesaw:]
        assert tag == "tensor map" and rest == [0] * 15 and ptr == launches["wgmma"][2]   # kv_cache's pointer
        assert (tm.index, tm.rows, tm.cols, tm.box_rows, tm.box_cols) == (
            2, args["kv_cache"].__cuda_array_interface__["shape"][0] * spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim, 64, 64)
    no_combine = [k for k in full if k != "tree_verify_mma_combine"]
    got, _ = launched(launcher, MmaKernelSet(spec, no_combine), **args)
    assert got == name
    with pytest.raises(ArgumentError, match="impl: 'wgmma' needs") as e:
        launcher(MmaKernelSet(spec, ("tree_verify", "tree_verify_tail", "merge_states", *MMA_NAMES)), **args,
                 impl="wgmma")
    assert f"{name}_wgmma" in str(e.value)
    from ddtree_gen.ops.tree_verify import wgmma_launch as wg
    direct = wg.tree_verify_tail if name == "tree_verify_tail" else wg.tree_verify
    with pytest.raises(ArgumentError, match="num_splits: 3 key chunks need tree_verify_mma_combine"):
        direct(MmaKernelSet(spec, no_combine), **args, num_splits=3)


@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
@pytest.mark.parametrize("loaded", ["none", "simple-only", "no-combine", "no-this-one"])
def test_impl_auto_picks_simple_when_mma_missing(spec, name, launcher, loaded, fake_device):
    """auto: the CUDA-core kernel unless both the tensor-core kernel and its combine kernel are loaded;
    impl="mma" (fp8: "wgmma") on such a set is an ArgumentError naming impl and what is missing."""
    t = tc(spec)
    other = f"tree_verify_tail_{t}" if name == "tree_verify" else f"tree_verify_{t}"
    kernels = {"simple-only": ("tree_verify", "tree_verify_tail", "merge_states"),
               "no-combine": ("tree_verify", "tree_verify_tail", f"tree_verify_{t}", f"tree_verify_tail_{t}"),
               "no-this-one": ("tree_verify", "tree_verify_tail", other, "tree_verify_mma_combine")}.get(loaded)
    make = (lambda: RecordingKernelSet(spec)) if kernels is None else (lambda: MmaKernelSet(spec, kernels))
    args = verify_args(spec, Arrays())
    got, k = launched(launcher, make(), **args)
    assert got == name and len(k["args"]) == 14
    kset = make()
    with pytest.raises(ArgumentError, match="impl") as e:
        launcher(kset, **args, impl=t)
    assert t in str(e.value) and not hasattr(kset, "launched")
    missing = f"{name}_{t}" if loaded != "no-combine" else "tree_verify_mma_combine"
    assert missing in str(e.value), str(e.value)


@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
def test_impl_simple_forces_cuda_core(spec, name, launcher, fake_device):
    got, k = launched(launcher, MmaKernelSet(spec), **verify_args(spec, Arrays()), impl="simple")
    assert got == name and len(k["args"]) == 14


@pytest.mark.parametrize("launcher", [f for _, f in LAUNCHERS], ids=[n for n, _ in LAUNCHERS])
@pytest.mark.parametrize("impl", ["fast", "MMA", "", None, 1, ("mma",), ["simple"]], ids=repr)
def test_impl_bad_value(spec, launcher, impl, fake_device):
    for kset in (RecordingKernelSet(spec), MmaKernelSet(spec)):
        with pytest.raises(ArgumentError) as e:
            launcher(kset, **verify_args(spec, Arrays()), impl=impl)
        msg = str(e.value)
        assert msg.startswith("impl:") and all(repr(c) in msg for c in ("auto", "mma", "simple")), msg
        assert not hasattr(kset, "launched")


@pytest.mark.parametrize("launcher", [f for _, f in LAUNCHERS], ids=[n for n, _ in LAUNCHERS])
@pytest.mark.parametrize("arg", ["workspace", "num_splits"])
def test_impl_simple_refuses_mma_arguments(spec, launcher, arg, fake_device):
    new = Arrays()
    args = verify_args(spec, new)
    value = new((1 << 20,), np.float32) if arg == "workspace" else 1
    for kset in (RecordingKernelSet(spec), MmaKernelSet(spec)):
        with pytest.raises(ArgumentError) as e:
            launcher(kset, **args, impl="simple", **{arg: value})
        assert str(e.value).startswith(f"{arg}:") and "simple" in str(e.value), str(e.value)
        assert not hasattr(kset, "launched")


@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
def test_impl_auto_fallback_ignores_mma_arguments(spec, name, launcher, fake_device):
    """auto on a kernel set without the tensor-core kernel: workspace / num_splits are not used."""
    new = Arrays()
    got, k = launched(launcher, RecordingKernelSet(spec), **verify_args(spec, new),
                      workspace=new((1 << 20,), np.float32), num_splits=3)
    assert got == name and len(k["args"]) == 14


@pytest.mark.parametrize("name,launcher", LAUNCHERS, ids=[n for n, _ in LAUNCHERS])
@pytest.mark.parametrize("impl", ["auto", "mma"])
def test_impl_mma_launch_args(spec, name, launcher, impl, fake_device):
    """workspace and num_splits reach the tensor-core launcher; the launch is the one
    tree_verify_mma.tree_verify (fp8: tree_verify_wgmma.tree_verify) makes itself."""
    from ddtree_gen.ops.tree_verify import wgmma_launch as wg
    new = Arrays()
    args = verify_args(spec, new)
    impl = impl_of(impl, spec)
    b, n, h, r = B, spec.max_tree_size, spec.num_heads, spec.kv_lora_rank
    need = split_kv.workspace_elems(spec, b, n, 3)
    ws = new((need,), np.float32)
    got, k = launched(launcher, MmaKernelSet(spec), **args, impl=impl, workspace=ws, num_splits=3)
    module = wg if spec.kv_fp8 else mma
    direct = module.tree_verify_tail if name == "tree_verify_tail" else module.tree_verify
    got2, k2 = launched(direct, MmaKernelSet(spec), **args, workspace=ws, num_splits=3)
    assert got == got2 == f"{name}_{tc(spec)}"
    norm = list(k["args"])
    assert norm == list(k2["args"]) and k["grid"] == k2["grid"]
    a = k["args"]
    assert a[:7] == [ptr_of(args[f]) for f in ("q_nope", "q_pe", "kv_cache", "block_table",
                                                               "prefix_lens", "q_lens", "tree_mask")]
    kv_scale = args.get("kv_scale", 1.0)
    assert a[7] == np.float32(args["softmax_scale"] * kv_scale * math.log2(math.e))
    assert a[8] == np.float32(kv_scale) and a[8].dtype == np.float32      # v_scale
    assert (int(a[9]), int(a[10]), int(a[11]), int(a[12]), int(a[13])) == (n, MAX_PAGES, PAGES, 3, b * n * h)
    assert (a[14], a[15]) == (ptr_of(args["out"]), ptr_of(args["lse"]))
    assert int(a[16]) == ptr_of(ws) and int(a[17]) == ptr_of(ws) + 3 * b * n * h * r * 4
    with pytest.raises(ArgumentError, match="workspace"):   # the mma launcher's own workspace check
        launcher(MmaKernelSet(spec), **args, impl=impl, workspace=new((need - 1,), np.float32), num_splits=3)
    with pytest.raises(ArgumentError, match="num_splits"):
        launcher(MmaKernelSet(spec), **args, impl=impl, num_splits=0)


@pytest.mark.parametrize("launcher", [f for _, f in LAUNCHERS], ids=[n for n, _ in LAUNCHERS])
def test_impl_per_kernel_limits(spec, launcher, fake_device):
    """The shared checks differ per kernel in two places: q alignment (4 bytes for the CUDA-core
    kernel, 16 for the tensor cores) and num_pages x page_size < 2**31 (tensor cores only)."""
    new = Arrays()
    args = verify_args(spec, new)
    cai = args["q_pe"].__cuda_array_interface__
    args["q_pe"] = new(cai["shape"], np.uint16, ptr=ptr_of(args["q_pe"]) + 8)   # 8-byte aligned
    with pytest.raises(ArgumentError, match=r"q_pe: .* not 16-byte aligned \(the tensor-core kernel"):
        launcher(MmaKernelSet(spec), **args, num_splits=1)
    launched(launcher, MmaKernelSet(spec), **args, impl="simple")
    args = verify_args(spec, new)
    pages = 2**31 // spec.page_size + 1
    args["kv_cache"] = new((pages, spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim), kv_dtype(spec))
    with pytest.raises(ArgumentError, match="32-bit row indices"):
        launcher(MmaKernelSet(spec), **args, num_splits=1)
    launched(launcher, MmaKernelSet(spec), **args, impl="simple")


def test_impl_device_errors_name_the_argument(spec, fake_device):
    """Both implementations name the argument on the odd device (out, lse, workspace included)."""
    new = Arrays()
    args = verify_args(spec, new)
    need = split_kv.workspace_elems(spec, B, spec.max_tree_size, 3)
    ws = new((need,), np.float32, ptr=DEVICE1 + (1 << 30))
    with pytest.raises(ArgumentError, match="^workspace: on device 1, but q_nope is on device 0"):
        tv.tree_verify(MmaKernelSet(spec), **args, workspace=ws, num_splits=3)
    cai = args["tree_mask"].__cuda_array_interface__
    args["tree_mask"] = new(cai["shape"], np.uint32, ptr=DEVICE1 + 4096)
    for impl in ("simple", "mma"):
        with pytest.raises(ArgumentError, match="^tree_mask: on device 1, but q_nope is on device 0"):
            tv.tree_verify(kset_for(impl, spec), **args, impl=impl_of(impl, spec), num_splits=None)


# ------------------------------------------------------------------ split-KV tables per family

def test_split_table_per_family(monkeypatch):
    """choose_splits reads the mma.sync table for the mma.sync kernels; the wgmma ones take the makespan model at every
    length (their table was fitted at L = 4096 only: at 64k keys its 16 chunks took two waves); never past the useful
    chunks."""
    from ddtree_gen.ops.tree_verify.wgmma import split_rule as wg_rule
    from ddtree_gen.spec import find_spec
    spec = find_spec("kimi-k2.6-tp8")
    base = 32 * -(-65 * spec.num_heads // split_kv.BM)          # 288 blocks: shape class "512"
    fake = {spec.name: {"config": mma_plans.config_for(spec), "splits": {"512": 2}, "wgmma": {"splits": {"512": 5}}}}
    monkeypatch.setattr(split_kv, "tuning", lambda: fake)
    split_kv._choose_splits.cache_clear()
    try:
        assert split_kv.shape_class(base) == "512"
        wgmma, mma = wg_rule(spec, "sm_90a"), mma_plans.split_rule(spec, "sm_90a")
        assert wgmma == ((), split_kv.makespan_model) and mma == ((("512", 2),), split_kv.wave_model)
        assert split_kv.choose_splits(spec, 32, 65, 4161, 64, 132, *wgmma) == split_kv.best_count(base, 132, 66, 32)
        assert split_kv.choose_splits(spec, 32, 65, 4161, 64, 132, *mma) == 2
        # no table off sm_90a: the wave model
        assert mma_plans.split_rule(spec, "sm_80") == ((), split_kv.wave_model)
        assert split_kv.choose_splits(spec, 32, 65, 4161, 64, 132, *wg_rule(spec, "sm_80")) == \
            split_kv.best_count(base, 132, 66, 32)
        # a short context (fewer than LONG_TILES key tiles): the fixed-cost model, whatever the table
        assert split_kv.choose_splits(spec, 32, 65, 64 * 4, 64, 132, *wgmma) == 1
        assert split_kv.choose_splits(spec, 1, 65, 64 * 4, 64, 132, *wgmma) == 2  # 4 tiles: 2 useful
        assert split_kv.choose_splits(spec, 32, 65, 64 * 4, 64, 132, *mma) == 2   # the mma.sync table
        assert split_kv.choose_splits(spec, 1, 65, 4161, 64, 132, *wgmma) == split_kv.best_count(9, 132, 66, 32)
        assert split_kv.choose_splits(spec, 1, 65, 65600, 64, 132, *wgmma) == 14   # one wave (was 16: two)
    finally:
        split_kv._choose_splits.cache_clear()


def test_launch_asks_its_family(spec, fake_device, monkeypatch):
    """Without num_splits, the wgmma launch takes the wgmma split rule (its makespan model) and the mma.sync launch the
    mma.sync one (its table, then the wave model): each as values (KernelDef.split_rule)."""
    seen = []
    real = split_kv.choose_splits

    def spy(*args):
        seen.append(args[-1])
        return real(*args)
    monkeypatch.setattr(tensor_core, "choose_splits", spy)
    monkeypatch.setattr(tensor_core, "sm_count", lambda device: 132)   # no GPU here
    full = ("tree_verify", "tree_verify_tail", "merge_states", *MMA_NAMES, *WGMMA_NAMES)
    new = Arrays()
    args = verify_args(spec, new)
    ws = new((split_kv.workspace_elems(spec, B, spec.max_tree_size, split_kv.MAX_SPLITS),), np.float32)
    from ddtree_gen.ops.tree_verify import wgmma as wg_plans
    parts = []
    monkeypatch.setattr(tensor_core, "parts_for", lambda *a: parts.append(a) or wg_plans.parts_for(*a))
    for impl in ("wgmma",) if spec.kv_fp8 else ("wgmma", "mma"):
        seen.clear()
        parts.clear()
        got, k = launched(tv.tree_verify, MmaKernelSet(spec, full), **args, workspace=ws, impl=impl)
        # a "parts" grid takes its part count from parts_for (one wave of row tiles x parts), not a table
        seesaw = impl == "wgmma" and bool(wg_plans.verify_plan(spec).consts["PARTS"])
        model = {"wgmma": split_kv.makespan_model, "mma": split_kv.wave_model}[impl]
        assert got == f"tree_verify_{impl}" and seen == ([] if seesaw else [model]), (impl, got, seen)
        assert len(parts) == (1 if seesaw else 0)
        if seesaw:   # one block per (row tile, part)
            b, nq = args["q_nope"].__cuda_array_interface__["shape"][:2]
            row_tiles = -(-nq * spec.num_heads // 64)
            assert k["grid"] == (row_tiles * wg_plans.parts_for(*parts[0]),)


def test_parts_for():
    """The seesaw kernel's parts: the makespan model's count (one wave where the row tiles leave room, more where they
    fill the SMs alone), never more parts than the batch's units, at most MAX_PARTS."""
    from ddtree_gen.ops.tree_verify.wgmma import parts_for
    from ddtree_gen.spec import find_spec
    kimi8, ds128 = find_spec("kimi-k2.6-tp8"), find_spec("deepseek-v3")
    assert parts_for(kimi8, 8, 65, 4224, 132) == 14          # 9 row tiles x 14 = 126 blocks: one wave
    assert parts_for(kimi8, 1, 65, 65600, 132) == 14         # the same at 64k keys (16: two waves)
    assert parts_for(ds128, 8, 65, 4224, 132) == 1           # 130 row tiles: one wave already
    assert parts_for(ds128, 1, 35, 85824, 132) == 9          # 70 row tiles (53 % of the SMs): 5 waves beat 1
    assert parts_for(kimi8, 1, 65, 64, 132, seg_cost=0) == 1   # one key tile in the batch
    assert parts_for(kimi8, 64, 1, 4224, 132) == 132         # 1 row tile: one wave of 132 parts
    for b, nq, keys in ((1, 16, 1024), (3, 40, 9000), (64, 65, 131072)):   # never past the cap, never 0
        for spec in (kimi8, ds128):
            assert 1 <= parts_for(spec, b, nq, keys, 132) <= split_kv.MAX_PARTS


def test_makespan_model():
    """The makespan model that picks both grids' counts: waves x (the piece's tiles + the fixed cost), plus the combine
    of several pieces; the fewest pieces on a tie."""
    assert split_kv.makespan(9, 14, 132, 1026) == 1 * (74 + split_kv.BLOCK_FIXED_TILES) + split_kv.COMBINE_TILES
    assert split_kv.makespan(9, 16, 132, 1026) == 2 * (65 + split_kv.BLOCK_FIXED_TILES) + split_kv.COMBINE_TILES * 144 / 132
    assert split_kv.best_count(9, 132, 1026, 32) == 14       # B = 1, H = 8, Nq = 65, 64k keys
    assert split_kv.best_count(9, 132, 1, 32) == 1           # one tile: nothing to split
    assert split_kv.best_count(200, 132, 1000, 32) >= 1


def test_short_context_splits():
    """Short contexts: the fixed-cost model's split count at the shapes it was fitted to (scripts/sweep_splits.py,
    H200; docs/perf/journal-tree-verify.md "Short contexts"): no split where one wave holds the blocks and the keys are few, the most
    chunks one wave holds where the batch is small."""
    ss = split_kv.short_splits
    assert ss(72, 132, 3, 2) == 1 and ss(72, 132, 5, 3) == 1 and ss(72, 132, 9, 5) == 1 and ss(72, 132, 17, 9) == 1
    assert ss(144, 132, 3, 2) == 1 and ss(288, 132, 17, 9) == 1 and ss(1040, 132, 17, 9) == 1
    assert ss(9, 132, 17, 9) == 9 and ss(18, 132, 9, 5) == 5 and ss(9, 132, 3, 2) == 2
    assert ss(144, 132, 17, 9) == 1 and ss(66, 132, 31, 16) == 1   # half the SMs filled: one chunk
    assert split_kv.LONG_TILES * 64 == 2048


def test_wave_model_of_untuned_shapes():
    """Without a table entry the split count comes from the wave model: one wave of base x s blocks beats
    two; never past `most`; no split at 4 waves of blocks or more; one chunk when nothing is gained."""
    ws = split_kv.wave_splits
    assert ws(9, 132, 32) == 14            # 126 blocks: one wave; 16 would take two
    assert ws(72, 132, 32) == 5 and ws(136, 132, 32) == 5
    assert ws(9, 132, 4) == 4              # capped by the useful chunks
    assert ws(4 * 132, 132, 32) == 1 and ws(10_000, 132, 32) == 1
    for base in range(1, 4 * 132):
        s = ws(base, 132, 32)
        assert 1 <= s <= 32 and (s == 1 or -(-base * s // 132) / s < -(-base // 132))   # a split gains waves


# ------------------------------------------------------------------ the parts grid (tree_verify_wgmma/parts)

@pytest.mark.parametrize("b,kw,loaded,want", [
    (PARTS_MIN_B, {}, True, "parts"), (64, {"impl": "wgmma"}, True, "parts"), (PARTS_MIN_B - 1, {}, True, "chunks"),
    (PARTS_MIN_B, {"num_splits": 3}, True, "chunks"), (PARTS_MIN_B, {}, False, "chunks"),
    (64, {"workspace": "chunks-sized"}, True, "chunks"), (PARTS_MIN_B, {"short": True}, True, "chunks")],
    ids=["B=min", "B=64 wgmma", "B=min-1", "num_splits given", "not loaded", "a workspace sized for the chunks",
         "a block table of fewer than PARTS_MIN_KEYS keys"])
def test_parts_grid_taken_where_measured_faster(b, kw, loaded, want, fake_device):
    """tree_verify on a spec with the parts build (bf16): the parts grid at B >= PARTS_MIN_B
    and a block table of at least PARTS_MIN_KEYS keys a request, with the launcher's own part count (one block per
    (row tile, part): parts_for), else the chunks grid; an explicit num_splits keeps the chunks grid (its meaning
    there); not loaded: the chunks grid; a caller's workspace too small for the parts (sized for the chunks grid's
    split count: B = 64 takes one chunk, no workspace): the chunks grid."""
    from ddtree_gen.ops.tree_verify.wgmma import PARTS_KERNEL, PARTS_MIN_KEYS, parts_for
    from ddtree_gen.spec import find_spec
    spec = find_spec("kimi-k2.6-tp8")
    names = ("tree_verify", "tree_verify_tail", "merge_states", *WGMMA_NAMES, "tree_verify_mma_combine",
             *((PARTS_KERNEL,) if loaded else ()))
    new, n = Arrays(), spec.max_tree_size
    ws = new((max(split_kv.workspace_elems(spec, b, n, split_kv.MAX_SPLITS),
                  split_kv.parts_workspace_elems(spec, b, n, split_kv.MAX_PARTS)),), np.float32)
    if kw.get("workspace") == "chunks-sized":
        kw = dict(kw, workspace=new((1,), np.float32))
    # "short": 4096 keys, where the makespan model keeps the chunks grid at B = 2 (parts_pay)
    pages = 4096 // spec.page_size if kw.pop("short", False) else PARTS_MIN_KEYS // spec.page_size
    got, k = launched(tv.tree_verify, MmaKernelSet(spec, names), **verify_args(spec, new, b, pages),
                      **{"workspace": ws, **kw})
    row_tiles = -(-spec.max_tree_size * spec.num_heads // split_kv.BM)
    if want == "parts":
        parts = parts_for(spec, b, spec.max_tree_size, pages * spec.page_size, 132)
        assert got == PARTS_KERNEL and k["grid"] == (parts * row_tiles,), (got, k["grid"])
    else:
        assert got == "tree_verify_wgmma" and k["grid"][0] % (b * row_tiles) == 0, (got, k["grid"])


def test_parts_grid_built_where_it_serves():
    """The parts build exists for every bf16 seesaw spec (any H), for no fp8 one (its dequantize path has its own)."""
    from ddtree_gen.ops import by_name
    from ddtree_gen.ops.tree_verify.wgmma import PARTS_KERNEL
    from ddtree_gen.spec import all_specs
    k = by_name(PARTS_KERNEL)
    for spec in all_specs():
        assert k.builds_for(spec) == (not spec.kv_fp8), spec.name


def test_one_wave_of_chunks_within_the_engines_workspace(monkeypatch):
    """With ONE_WAVE on, the automatic chunk count passes MAX_SPLITS only up to one wave of blocks (B = 1, H = 8,
    Nq = 22, 193k keys: 3 row tiles x 44 chunks = 132 blocks on 132 SMs, not 32 chunks = 96 blocks), and never needs
    more workspace than an engine sizes for MAX_SPLITS chunks of max_tree_size rows, at every Nq <= N and B; off (the
    default until it is measured), MAX_SPLITS as before."""
    from ddtree_gen.ops.tree_verify import split as split_kv
    from ddtree_gen.ops.tree_verify.wgmma import split_rule
    from ddtree_gen.spec import all_specs, find_spec
    spec = find_spec("kimi-k2.6-tp8")
    assert not split_kv.ONE_WAVE and split_kv.choose_splits(spec, 1, 22, 193484, 64, 132, *split_rule(spec)) == 32
    monkeypatch.setattr(split_kv, "ONE_WAVE", True)
    assert split_kv.choose_splits(spec, 1, 22, 193484, 64, 132, *split_rule(spec)) == 44
    assert split_kv.choose_splits(spec, 1, 65, 65536, 64, 132, *split_rule(spec)) == 14      # 9 row tiles: as before
    for spec in all_specs():
        n = spec.max_tree_size
        for b in (1, 2, 8):
            for nq in range(1, n + 1):
                for keys in (4096, 65536, 262144):
                    s = split_kv.choose_splits(spec, b, nq, keys, 64, 132, *split_rule(spec))
                    rows = b * -(-nq * spec.num_heads // 64)
                    assert s <= split_kv.MAX_SPLITS or rows * s <= 132, (spec.name, b, nq, keys, s)
                    assert split_kv.workspace_elems(spec, b, nq, s) <= \
                        split_kv.workspace_elems(spec, b, n, split_kv.MAX_SPLITS), (spec.name, b, nq, keys, s)

"""The per-call host path (issue 23 part 2) without a GPU: the caches it keeps and the work it skips.

* kv_commit's layer list is read in one pass (runtime._group_signature): a hit for the same caches, a
  miss (or the full checks) on each component of a layer's signature, the alignment of a new pointer
  checked again, each call's pointers in the launch.
* StepPlan.values (the parameter values of a step, compiled once) equals _values (walking the arguments).
* OutputPlan: the outputs of a call carved out of one buffer: offsets, shapes, dtypes, pointers, the
  workspace made as a pointer only, one torch.empty per output where that is cheaper.
* The launch bound to a kernel set's modules (runtime._bind): function, geometry and each call's pointers
  and stream, on a real KernelSet of stand-in binaries (ddtree_gen.bench.stand_in, scripts/profile_launch.py's).
* scripts/profile_launch.py answers --help and runs without a GPU.
"""
from __future__ import annotations

import ctypes
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FakeCudaArray, LaunchLog, need
from ddtree_gen.launch import hostcode, runtime
from ddtree_gen.bench import launch, stand_in
from ddtree_gen.bench.specs import LAYERS
from ddtree_gen.errors import ArgumentError
from ddtree_gen.ops.kv_commit.launch import launch as kv_commit
from ddtree_gen.ops.kv_commit.plan import MAX_LAYERS
from ddtree_gen.launch.runtime import IsAligned, OutputPlan, ParamStruct, Prepared, Step, StepPlan, TensorMap

torch = need("torch")
ROOT = Path(__file__).resolve().parent.parent

SPEC = "kimi-k2.6-tp8"


@pytest.fixture
def cpu_torch(monkeypatch):
    """torch CPU tensors stand for CUDA tensors of device runtime.HOST_DEVICE (0), undone after the test."""
    stand_in.torch_cpu_as_device0(monkeypatch.setattr, monkeypatch.setitem)


def _spec():
    from ddtree_gen.spec import find_spec
    return find_spec(SPEC)


def _commit(spec, layers=61, b=2):
    d1 = spec.max_depth + 1
    acc = type("Acc", (), {})()
    acc.accept_lens = torch.zeros(b, dtype=torch.int32)
    acc.accepted_nodes = torch.zeros((b, d1), dtype=torch.int32)
    caches = [torch.zeros((3, spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim), dtype=torch.bfloat16)
              for _ in range(layers)]
    return acc, torch.zeros(b, dtype=torch.int32), caches, torch.zeros((b, 4), dtype=torch.int32)


def _prepared(kset) -> list:
    return [v for v in kset.prepared_calls.values() if isinstance(v, Prepared)]


def _committed_twice():
    """A LaunchLog kernel set after two kv_commit calls of the same 61 layers, and their arguments."""
    spec = _spec()
    kset = LaunchLog(spec)
    acc, prefix, caches, table = _commit(spec)
    kv_commit(kset, acc, prefix, caches, table)
    kv_commit(kset, acc, prefix, caches, table)
    return kset, acc, prefix, caches, table


def test_layer_list_hit_and_each_calls_pointers(cpu_torch):
    kset, acc, prefix, caches, table = _committed_twice()
    assert len(_prepared(kset)) == 1
    other = [c.clone() for c in caches]    # the same signatures, new pointers: the same entry, their pointers
    kv_commit(kset, acc, prefix, other, table)
    assert len(_prepared(kset)) == 1
    for (_, kw), layers in zip(kset.seen, (caches, caches, other)):
        assert kw["args"][4:4 + 61] == [c.data_ptr() for c in layers]
        assert all(int(x) == 0 for x in kw["args"][4 + 61:4 + MAX_LAYERS])
    key = next(k for k, v in kset.prepared_calls.items() if isinstance(v, Prepared))
    assert ("group", 61, caches[0].shape, caches[0].dtype, 0) in key[2]


def test_layer_list_misses_on_each_component(cpu_torch, monkeypatch):
    spec = _spec()
    acc, prefix, caches, table = _commit(spec)

    def fresh():
        kset = LaunchLog(spec)
        kv_commit(kset, acc, prefix, caches, table)
        return kset
    # shape (another num_pages): another signature, its own entry
    kset = fresh()
    kv_commit(kset, acc, prefix, [torch.zeros((5, *c.shape[1:]), dtype=c.dtype) for c in caches], table)
    assert len(_prepared(kset)) == 2 and kset.seen[-1][1]["args"][-2] == 5
    # dtype, shape of one layer, stride (not contiguous): the full checks name the layer
    for k, bad, word in ((7, torch.zeros(caches[0].shape, dtype=torch.float32), "kv_caches[7]: dtype"),
                         (3, torch.zeros((4, *caches[0].shape[1:]), dtype=torch.bfloat16), "kv_caches[3]: shape"),
                         (5, torch.zeros((caches[0].shape[0], caches[0].shape[2], caches[0].shape[1]),
                                         dtype=torch.bfloat16).transpose(1, 2), "kv_caches[5]: not C-contiguous")):
        kset = fresh()
        layers = list(caches)
        layers[k] = bad
        with pytest.raises(ArgumentError, match=word.replace("[", r"\[").replace("]", r"\]")):
            kv_commit(kset, acc, prefix, layers, table)
        assert len(_prepared(kset)) == 1
    # device: the layers on another device are another signature (and launch there)
    kset = fresh()
    monkeypatch.setattr(runtime, "HOST_DEVICE", 1)
    acc1 = type("Acc", (), {"accept_lens": acc.accept_lens, "accepted_nodes": acc.accepted_nodes})()
    kv_commit(kset, acc1, prefix, caches, table)
    assert len(_prepared(kset)) == 2 and kset.seen[-1][1]["device"] == 1


def test_layer_list_misaligned_pointer_after_a_hit(cpu_torch):
    """The alignment of the layers is skipped only for the pointers that passed it last time."""
    kset, acc, prefix, caches, table = _committed_twice()
    shape = caches[0].shape
    big = torch.zeros(int(np.prod(shape)) + 8, dtype=torch.bfloat16)
    layers = list(caches)
    layers[9] = big[1:].as_strided(shape, (shape[1] * shape[2], shape[2], 1))   # 2 bytes past a 16-byte boundary
    with pytest.raises(ArgumentError, match=r"kv_caches\[9\]: data pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        kv_commit(kset, acc, prefix, layers, table)
    kv_commit(kset, acc, prefix, caches, table)   # back to the checked pointers
    assert len(kset.seen) == 3


def test_layer_list_of_other_arrays_is_read_one_by_one(fake_device):
    """Not torch tensors (here __cuda_array_interface__ stand-ins): the layers' own signatures, as before."""
    spec = _spec()
    kset = LaunchLog(spec)
    d1 = spec.max_depth + 1
    acc = type("Acc", (), {"accept_lens": FakeCudaArray((2,), np.int32),
                           "accepted_nodes": FakeCudaArray((2, d1), np.int32)})()
    shape = (3, spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim)
    step = int(np.prod(shape)) * 2
    caches = [FakeCudaArray(shape, np.uint16, ptr=(1 << 32) + k * step) for k in range(4)]
    args = (acc, FakeCudaArray((2,), np.int32), caches, FakeCudaArray((2, 4), np.int32))
    kv_commit(kset, *args)
    kv_commit(kset, *args)
    assert len(_prepared(kset)) == 1
    key = next(k for k, v in kset.prepared_calls.items() if isinstance(v, Prepared))
    assert not any(isinstance(s, tuple) and s[:1] == ("group",) for s in key[2])


@pytest.mark.parametrize("seed", range(5))
def test_step_plan_values_equal_walking_the_arguments(seed, fake_device):
    rng = np.random.default_rng(seed)
    ptrs = [int(x) * 16 + int(rng.integers(0, 16)) for x in rng.integers(1 << 20, 1 << 40, 12)]
    tm = TensorMap(2, 128, 576, 64, 64)
    args = (0, 1, 2, (3, 4096), np.float32(0.5), IsAligned(4, 16), ParamStruct((5, 6, (7, 64), np.uint64(0))),
            np.int32(3), 8, 9, tm, np.int64(7), 10, 11)
    step = Prepared(device=0, kind="cai", steps=(Step("k", (1,), args),), result=lambda a: None).steps[0]
    got = StepPlan(step).values(ptrs)
    want = runtime._values(step.args, ptrs)
    assert got == want and [type(x) for x in got] == [type(x) for x in want]
    assert struct.calcsize(step.fmt.replace("[", "").replace("]", "")) >= 8 * len([a for a in got if type(a) is int])


def test_output_plan_one_buffer(cpu_torch):
    new = ((4, (2,), "int32"), (5, (2, 65), "int32"), (6, (2, 65), "int32"), (7, (2, 65), "float32"),
           (8, (2, 65, 3), "uint32"), (9, (2, 65), "int32"), (10, (2, 65, 8, 512), "bf16"))
    plan = OutputPlan(new)
    offsets = [e[3] for e in plan.entries]
    assert all(o % runtime.OUTPUT_ALIGN == 0 for o in offsets) and len(set(offsets)) == len(offsets)
    assert not plan.separate
    arrays, ptrs = [None] * 11, [0] * 11
    plan.allocate("torch", 0, arrays, ptrs)
    for i, shape, dtype in new:
        a = arrays[i]
        assert tuple(a.shape) == shape and a.is_contiguous() and a.data_ptr() == ptrs[i], i
        assert a.dtype == {"int32": torch.int32, "float32": torch.float32, "uint32": torch.uint32,
                           "bf16": torch.bfloat16}[dtype]
    spans = sorted((ptrs[i], ptrs[i] + int(np.prod(s)) * {"bf16": 2}.get(d, 4)) for i, s, d in new)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "outputs overlap"
    # each call its own buffer
    again = [None] * 11
    plan.allocate("torch", 0, again, [0] * 11)
    assert again[5].data_ptr() != arrays[5].data_ptr()


def test_output_plan_scratch_and_separate(cpu_torch):
    plan = OutputPlan(((7, (1, 65, 8, 512), "bf16"), (8, (1, 65, 8), "float32"), (9, (4096,), "float32")),
                      scratch=(9,))
    arrays, ptrs = [None] * 10, [0] * 10
    plan.allocate("torch", 0, arrays, ptrs)
    base = min(ptrs[7], ptrs[8])
    assert arrays[9] is None and ptrs[9] >= max(ptrs[7] + 65 * 8 * 512 * 2, ptrs[8] + 65 * 8 * 4)
    assert all((p - base) % runtime.OUTPUT_ALIGN == 0 for p in ptrs[7:10])
    assert ptrs[7] == arrays[7].data_ptr() and ptrs[8] == arrays[8].data_ptr()
    # two outputs of two dtypes: one torch.empty each costs less than a buffer and its views
    assert OutputPlan(((4, (1, 65, 8, 512), "bf16"), (5, (1, 65, 8), "float32"))).separate


def test_bound_launch_packs_each_calls_pointers_and_stream(monkeypatch):
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    streams = iter(range(100, 200))
    monkeypatch.setitem(runtime.cuda_entries(), "torch_stream", lambda d: next(streams))
    outs = [kset.tree_build(*build, spec.max_tree_size - 1) for _ in range(2)]
    prep = next(p for p in _prepared(kset) if p.steps and p.steps[0].kernel == "tree_build")
    assert prep.bound and len(launches) == 2
    (fn, grid, block, smem, stream0, params0), (_, _, _, _, stream1, _) = launches
    assert grid == (1, 1, 1) and stream0 == 100 and stream1 == 101
    assert fn == prep.bound[0][0] and block[0] == prep.bound[0][4]
    storage, plan, last = prep.bound[0][6], prep.bound[0][10], prep.bound[0][11]
    flat = plan.fmt.replace("[", "").replace("]", "")
    packed = struct.unpack_from(flat, storage, 0)   # the last call's parameters
    ptrs = [a.data_ptr() for a in build] + [o.data_ptr() for o in outs[1]]
    assert list(packed) == [int(x) if not isinstance(x, np.floating) else float(x) for x in plan.values(ptrs)]
    assert last[0] == ptrs
    # the same pointers again (given outputs): the buffer is not packed again (a zeroed buffer stays zero), new
    # pointers pack it again
    kset.tree_build(*build, spec.max_tree_size - 1, out=outs[1])
    given = next(p for p in _prepared(kset) if p.steps and p.steps[0].kernel == "tree_build" and p is not prep)
    gstorage = given.bound[0][6]
    ptrs1 = [a.data_ptr() for a in build] + [o.data_ptr() for o in outs[1]]
    assert list(struct.unpack_from(flat, gstorage, 0)) == [
        int(x) if not isinstance(x, np.floating) else float(x) for x in plan.values(ptrs1)]
    ctypes.memset(gstorage, 0, ctypes.sizeof(gstorage))
    kset.tree_build(*build, spec.max_tree_size - 1, out=outs[1])
    assert not any(gstorage.raw) and len(launches) == 4
    kset.tree_build(*build, spec.max_tree_size - 1, out=outs[0])
    ptrs0 = [a.data_ptr() for a in build] + [o.data_ptr() for o in outs[0]]
    assert list(struct.unpack_from(flat, gstorage, 0)) == [
        int(x) if not isinstance(x, np.floating) else float(x) for x in plan.values(ptrs0)]
    assert len(launches) == 5 and given.bound[0][11][0] == ptrs0
    # outputs of one call are views of one buffer, each call its own
    assert outs[0].tokens.untyped_storage().data_ptr() == outs[0].scores.untyped_storage().data_ptr()
    assert outs[0].tokens.data_ptr() != outs[1].tokens.data_ptr()


def test_bound_launch_not_used_when_launch_is_replaced(monkeypatch):
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    seen = []
    kset.launch = lambda name, **kw: seen.append(name)
    kset.merge_states(v["q_nope"][:, :, :, :].clone(), torch.zeros(v["q_nope"].shape[:3]),
                      v["q_nope"].clone(), torch.zeros(v["q_nope"].shape[:3]))
    assert seen == ["merge_states"] and not launches
    assert all(p.bound is False for p in _prepared(kset))


def test_profile_launch_script_without_a_gpu():
    script = ROOT / "scripts" / "profile_launch.py"
    help_ = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "--calls" in help_.stdout
    run = subprocess.run([sys.executable, str(script), "--calls", "20"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    for row in ("tree_build", "tree_verify (auto)", "merge_states", "tree_accept", "kv_commit, 61 layers"):
        assert row in run.stdout
    stacked = next(line for line in run.stdout.splitlines() if line.startswith("kv_commit, 61 stacked"))
    assert "nan" not in stacked, stacked   # the stacked form's torch op is timed too


def test_probe_launch_gpu_without_a_gpu():
    """scripts/probe_launch_gpu.py (the H200 probe): --help, its arguments checked, one line and exit 2 without a
    CUDA device; its stage split (bench.launch.stage_split) sums a call's compiled functions per stage."""
    script = ROOT / "scripts" / "probe_launch_gpu.py"
    help_ = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "--stage-calls" in help_.stdout and "--calls" in help_.stdout, help_.stderr
    bad = subprocess.run([sys.executable, str(script), "--calls", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--calls: 0, must be >= 1" in bad.stderr, bad.stderr
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout.startswith("probe_launch_gpu.py needs a CUDA device") and len(run.stdout.splitlines()) == 1
    got = launch.stage_split([("checks   (call a)", 0.5), ("outputs  (call a)", 2.0), ("launch   (call a)", 1.0),
                                ("checks   (call b)", 0.25), ("launcher, signature, cache lookup", 4.0)])
    assert got == {"launcher, signature, lookup": 4.0, "checks": 0.75, "outputs": 2.0, "launch": 1.0, "result": 0.0}


def test_ab_launch_script_help_and_refusals():
    """scripts/ab_launch.sh (bench launch of an old commit and of this tree, alternately): --help says what it runs;
    a bad option, round count or commit is refused (exit 2) before anything is exported or run."""
    script = ROOT / "scripts" / "ab_launch.sh"
    help_ = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0, help_.stderr
    assert "git archive COMMIT ddtree_gen generated specs templates" in help_.stdout and "--rounds" in help_.stdout
    assert "default cd3eca8" in help_.stdout and "DDTREE_GEN_CACHE" in help_.stdout
    for args, word in ((["--bogus"], "unknown option --bogus"), (["--rounds", "0"], "--rounds 0"),
                       (["no-such-commit-here"], "no commit no-such-commit-here")):
        r = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and word in r.stderr, (args, r.stderr)


def test_bench_launch_times_both_kv_commit_ops(monkeypatch):
    """`bench launch`'s op column of the kv_commit rows: the list op for the 61 layers, kv_commit_stacked for the
    stacked array; each one launch of grid (B, 61) (the ops' CUDA implementations registered for the CPU key).
    Every row of the one call table runs in each of its forms on the stand-in."""
    spec, kset, launches, _ = _stand_in(monkeypatch)
    lib = stand_in.cpu_torch_ops(kset, patch=monkeypatch.setattr)
    table = launch.call_table(kset, spec, launch.tiny_inputs(spec, "cpu"), ops=True)
    for row in (launch.KV_COMMIT, launch.KV_STACKED):
        launches.clear()
        assert table[row].op() is None
        assert [grid for _, grid, *_ in launches] == [(1, 61, 1)], row
    assert {"tree_build", "tree_verify (auto)", "tree_verify_tail", "merge_states", "tree_accept", "tree_walk",
            launch.KV_COMMIT, launch.KV_STACKED} <= set(table)
    for row, call in table.items():
        for form in call:
            if form is not None:
                form()
        assert call.op is not None and call.direct is not None, row
    del lib


def test_probe_op_dispatch_script_without_a_gpu():
    """scripts/probe_op_dispatch.py (op - plain taken apart) runs on the CPU and prints a row per torch op."""
    script = ROOT / "scripts" / "probe_op_dispatch.py"
    run = subprocess.run([sys.executable, str(script), "--calls", "20"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "dispatcher" in run.stdout and "penalty" in run.stdout
    rows = {line.split("  ")[0].strip(): line.split()[-5:] for line in run.stdout.splitlines()[2:]}
    for row in ("tree_build", "tree_verify (auto)", "merge_states", "tree_accept", "kv_commit, 61 layers"):
        assert row in rows and all(float(x) == float(x) for x in rows[row]), run.stdout   # five numbers, no NaN


def _stand_in(monkeypatch):
    """The stand-in kernel set of SPEC, its launches, and `bench launch`'s tiny problem as torch CPU tensors:
    (tree_verify's arguments, tree_build's, 61 layers' caches, target tokens)."""
    spec = _spec()
    kset, launches = stand_in.stand_in_kset(spec, monkeypatch.setattr, monkeypatch.setitem)
    x = launch.tiny_inputs(spec, "cpu")
    caches = [x["verify"]["kv_cache"].clone() for _ in range(LAYERS)]
    return spec, kset, launches, (x["verify"], x["build"], caches, x["target"])


def _runner_of(kset, kernel):
    return [p for p in _prepared(kset) if p.steps and p.steps[0].kernel == kernel]


def test_runner_compiled_once_per_signature(monkeypatch):
    """A cached call signature is compiled into one function on its first call (hostcode.compile_runner) and
    reused; another signature (a new shape) gets its own; a call that is not cached never compiles one."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    compiled = []
    real = hostcode.compile_runner
    monkeypatch.setattr(runtime, "compile_runner", lambda *a, **k: compiled.append(a[0]) or real(*a, **k))
    for _ in range(3):
        kset.merge_states(v["q_nope"], torch.zeros(v["q_nope"].shape[:3]), v["q_nope"].clone(),
                          torch.zeros(v["q_nope"].shape[:3]))
    assert len(compiled) == 1 and len(launches) == 3
    (prep,) = _runner_of(kset, "merge_states")
    assert prep.run is not None and "for " not in prep.run.source   # straight-line code
    q2 = v["q_nope"][:, :7].clone()   # another shape: another signature, its own runner
    kset.merge_states(q2, torch.zeros(q2.shape[:3]), q2.clone(), torch.zeros(q2.shape[:3]))
    kset.merge_states(q2, torch.zeros(q2.shape[:3]), q2.clone(), torch.zeros(q2.shape[:3]))
    assert len(compiled) == 2 and len(_runner_of(kset, "merge_states")) == 2 and len(launches) == 5
    # validate=True is never cached: checked in full each time, no runner
    accept = _accept_args(spec, kset, build, target, v)
    before = len(compiled)
    kset.tree_accept(*accept, validate=True)
    kset.tree_accept(*accept, validate=True)
    assert len(compiled) == before


def test_a_runner_cut_at_its_stages(monkeypatch):
    """hostcode.stages: a compiled call cut where each stage ends (what `bench launch`'s stage times time): the
    stages in the runner's order, each cut a function of the same arguments that returns None before the result
    (the last: the whole call, its record), the ones from "launch" launching, the real runner untouched;
    bench launch's stage_times runs them."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    call = lambda: kset.tree_build(*build, spec.max_tree_size - 1)
    call()
    from ddtree_gen.reference import TreeBuildOutput
    (prep,) = _runner_of(kset, "tree_build")
    real, source, seen = prep.run, prep.run.source, []
    prep.run = lambda arrays, ptrs: seen.append((arrays, list(ptrs))) or real(arrays, ptrs)
    call()
    prep.run = real
    (arrays, ptrs), = seen
    cuts = hostcode.stages(real)
    assert [name for name, _ in cuts] == ["checks", "outputs", "launch", "result"]
    for k, (name, part) in enumerate(cuts):
        before = len(launches)
        got = part(arrays, list(ptrs))
        assert (got is None) == (name != "result") and (name != "result" or type(got) is TreeBuildOutput), name
        assert len(launches) - before == (k >= 2), name
        assert part.source.endswith("    return None\n") and part is not real
    assert prep.run is real and real.source == source
    rows = launch.stage_times(kset, call, 5)
    assert [r[0].split()[0] for r in rows] == ["the", "checks", "outputs", "launch", "result", "launcher,"]


def _accept_args(spec, kset, build, target, v):
    tree = kset.tree_build(*build, spec.max_tree_size - 1)
    tree.num_nodes.fill_(1)   # (the stand-in launches nothing: a valid tree for validate=True's host checks)
    return tree, target, v["prefix_lens"]


def test_runner_checks_before_any_allocation_or_launch(monkeypatch):
    """After a cached hit, a misaligned pointer or an overlapping out= raises the first call's ArgumentError
    before anything is allocated or launched (the checks come first in the compiled call)."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    kset.tree_verify(**v)
    kset.tree_verify(**v)
    n = len(launches)
    (prep,) = _runner_of(kset, "tree_verify_wgmma")
    src = prep.run.source
    assert src.rindex("raise ArgumentError") < src.index("b = ") < src.index("launch(")
    q = v["q_nope"]
    big = torch.zeros(q.numel() + 8, dtype=torch.bfloat16)
    odd = big[1:].as_strided(q.shape, q.stride())   # 2 bytes past a 16-byte boundary, same signature
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    with pytest.raises(ArgumentError, match=r"q_nope: data pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        kset.tree_verify(**{**v, "q_nope": odd})
    assert len(launches) == n and not allocated
    # merge_states in place into o_a is allowed, into a part of o_a is not: the same message as a first call
    o, lse = v["q_nope"].clone(), torch.zeros(v["q_nope"].shape[:3])
    args = (o, lse, v["q_nope"].clone(), torch.zeros(lse.shape))
    kset.merge_states(*args, out=o, lse=lse)
    kset.merge_states(*args, out=o, lse=lse)
    n = len(launches)
    part = torch.zeros(o.numel() * 2, dtype=o.dtype)   # two views of one buffer with o's signature
    a0, a1 = part[:o.numel()].view(o.shape), part[256:256 + o.numel()].view(o.shape)
    kset.merge_states(a0, lse, args[2], args[3], out=a0, lse=lse)   # in place: the cached signature
    with pytest.raises(ArgumentError, match=r"out: overlaps o_a in memory \(only o_a or o_b may be passed"):
        kset.merge_states(a0, lse, args[2], args[3], out=a1, lse=lse)
    assert len(launches) == n + 1 and len(_runner_of(kset, "merge_states")) == 1


def test_runner_parameters_follow_each_calls_pointers(monkeypatch):
    """The compiled call packs the parameter buffer only when the call's pointers differ from its last
    launch's: a zeroed buffer stays zero for the same pointers, and holds the new pointers after a change (a
    new input tensor of the same signature, new outputs)."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    o_b = v["q_nope"].clone()
    lse_a, lse_b = torch.zeros(v["q_nope"].shape[:3]), torch.zeros(v["q_nope"].shape[:3])
    out, lse = v["q_nope"].clone(), torch.zeros(lse_a.shape)
    kset.merge_states(v["q_nope"], lse_a, o_b, lse_b, out=out, lse=lse)
    (prep,) = _runner_of(kset, "merge_states")
    storage, plan = prep.bound[0][6], prep.bound[0][10]
    flat = plan.fmt.replace("[", "").replace("]", "")

    def packed_pointers():
        return list(struct.unpack_from(flat, storage, 0))[:6]
    assert packed_pointers() == [t.data_ptr() for t in (v["q_nope"], lse_a, o_b, lse_b, out, lse)]
    ctypes.memset(storage, 0, ctypes.sizeof(storage))
    kset.merge_states(v["q_nope"], lse_a, o_b, lse_b, out=out, lse=lse)
    assert not any(storage.raw)
    o_b2 = o_b.clone()   # a new pointer, the same signature
    kset.merge_states(v["q_nope"], lse_a, o_b2, lse_b, out=out, lse=lse)
    assert packed_pointers() == [t.data_ptr() for t in (v["q_nope"], lse_a, o_b2, lse_b, out, lse)]
    assert len(_runner_of(kset, "merge_states")) == 1 and len(launches) == 3


def test_layer_table_cached_per_list_of_caches(monkeypatch):
    """kv_commit's 61-layer pointer table (a struct parameter) is packed once per list of caches: the same list
    again leaves it as it is, a new list (new pointers) or a layer's new pointer packs it again, a new shape is
    another signature (its own table), and each launch's table holds that call's layers."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    acc = kset.tree_accept(kset.tree_build(*build, spec.max_tree_size - 1), target, v["prefix_lens"])
    args = (acc, v["prefix_lens"])
    kset.kv_commit(*args, caches, v["block_table"])
    (prep,) = _runner_of(kset, "kv_commit")
    storage, plan = prep.bound[0][6], prep.bound[0][10]
    flat = plan.fmt.replace("[", "").replace("]", "")

    def table():
        return list(struct.unpack_from(flat, storage, 0))[4:4 + MAX_LAYERS]
    assert table() == [c.data_ptr() for c in caches] + [0] * (MAX_LAYERS - len(caches))
    ctypes.memset(storage, 0, ctypes.sizeof(storage))
    kset.kv_commit(*args, list(caches), v["block_table"])   # another list object, the same caches
    assert not any(storage.raw)
    other = [c.clone() for c in caches]
    kset.kv_commit(*args, other, v["block_table"])
    assert table() == [c.data_ptr() for c in other] + [0] * (MAX_LAYERS - len(caches))
    one = list(other)
    one[17] = other[17].clone()
    kset.kv_commit(*args, one, v["block_table"])
    assert table()[17] == one[17].data_ptr() and table()[16] == other[16].data_ptr()
    bigger = [torch.zeros((c.shape[0] + 1, *c.shape[1:]), dtype=c.dtype) for c in caches]
    kset.kv_commit(*args, bigger, v["block_table"])
    assert len(_runner_of(kset, "kv_commit")) == 2 and len(launches) == 2 + 5


def test_signature_contiguity_stands_for_strides(monkeypatch):
    """A torch tensor's signature holds its contiguity in place of its strides: a non-contiguous tensor of a cached
    call's dtype and shape is another signature, refused by the full checks with the first call's message; a
    contiguous one with other strides on a size-1 dimension is the cached signature."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    q = v["q_nope"]
    lse = torch.zeros(q.shape[:3])
    kset.merge_states(q, lse, q.clone(), lse.clone())
    kset.merge_states(q, lse, q.clone(), lse.clone())
    odd = torch.zeros((1, 65, 512, 8), dtype=q.dtype).transpose(2, 3)   # q's shape, not contiguous
    assert odd.shape == q.shape and not odd.is_contiguous()
    with pytest.raises(ArgumentError, match="o_b: not C-contiguous"):
        kset.merge_states(q, lse, odd, lse.clone())
    size1 = q.clone().as_strided(q.shape, (7, *q.stride()[1:]))   # batch dimension 1 with another stride
    assert size1.is_contiguous() and size1.stride() != q.stride()
    kset.merge_states(q, lse, size1, lse.clone())
    assert len(_runner_of(kset, "merge_states")) == 1 and len(launches) == 3


def test_compiled_call_packs_the_caches_tensor_map(monkeypatch):
    """The TMA tree_verify's compiled call packs the CUtensorMap encoded for the call's cache pointer (memoized per
    pointer: encoded once per cache) at the parameter's place in the buffer, and the one of a new cache."""
    from ddtree_gen.launch import callplan
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    encoded = []

    def encode(out, dtype, rank, ptr, dims, strides, box, step, *rest):
        encoded.append(ptr.value)
        out[0], out[1], out[15] = ptr.value, dims[1], 0x7E57
        return 0
    monkeypatch.setattr(callplan, "_encode_tiled", lambda: encode)
    monkeypatch.setattr(callplan, "_TENSOR_MAPS", {})
    for _ in range(3):
        kset.tree_verify(**v)
    (prep,) = _runner_of(kset, "tree_verify_wgmma")
    storage, plan = prep.bound[0][6], prep.bound[0][10]
    offsets = runtime.param_offsets(plan.fmt)
    tm_index = next(k for k, f in enumerate(plan.fmt[1:].replace("[" + "Q" * 16 + "]", "T")) if f == "T")
    words = struct.unpack_from("16Q", storage, offsets[tm_index])
    ptr = v["kv_cache"].data_ptr()
    assert encoded == [ptr] and words[0] == ptr and words[1] == v["kv_cache"].shape[0] * spec.page_size
    assert words[15] == 0x7E57 and offsets[tm_index] % 8 == 0
    other = dict(v, kv_cache=v["kv_cache"].clone())
    kset.tree_verify(**other)
    words = struct.unpack_from("16Q", storage, offsets[tm_index])
    assert encoded == [ptr, other["kv_cache"].data_ptr()] and words[0] == other["kv_cache"].data_ptr()


def _guarded(kset) -> list:
    """The guarded entries of a kernel set (runtime._guard), each (key, host device, tensors, Nones' types, zeros,
    TensorGuards, alias, the compiled test (hostcode.matcher), Prepared), all launchers together."""
    return [e for k, v in kset.prepared_calls.items() if not isinstance(k, tuple) for e in v]


def _count_guards(monkeypatch):
    """Calls that went through the signature dict (each ends in runtime._guard), counted."""
    seen = []
    real = runtime._guard
    monkeypatch.setattr(runtime, "_guard", lambda *a: seen.append(a[1]) or real(*a))
    return seen


def test_guards_probe_finds_torchs_tensor_guards(monkeypatch):
    """This torch has the TensorGuards run_call relies on, and it refuses what a signature tells apart."""
    monkeypatch.setattr(runtime, "_GUARDS", [])
    assert runtime._tensor_guards() is not None
    g = runtime._tensor_guards()(torch.zeros((2, 3)), dynamic_dims_sizes=None, dynamic_dims_strides=None)
    assert g.check(torch.ones((2, 3))) and not g.check(torch.ones((2, 3), dtype=torch.float64))
    assert not g.check(torch.ones((3, 2)).t()) and not g.check(torch.ones((2, 3), requires_grad=True))


def test_guarded_entry_serves_the_same_signature_and_each_calls_pointers(monkeypatch):
    """After a signature's first call, its later calls (new tensors of the same dtype, shape, strides and device)
    go through the guarded entry (no signature read, no dict lookup) and launch their own pointers."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    kset.tree_verify(**v)
    assert len(_guarded(kset)) == 1
    through_dict = _count_guards(monkeypatch)
    other = {k: (x.clone() if isinstance(x, torch.Tensor) else x) for k, x in v.items()}
    n = len(launches)
    res = kset.tree_verify(**other)
    assert not through_dict and len(launches) == n + 2 and len(_guarded(kset)) == 1
    assert launches[n][5] == launches[n - 2][5]   # the same bound parameter buffer, repacked
    (prep,) = _runner_of(kset, "tree_verify_wgmma")
    flat = prep.bound[0][10].fmt.replace("[", "").replace("]", "")
    packed = struct.unpack_from(flat, prep.bound[0][6], 0)
    assert list(packed[:7]) == [other[k].data_ptr() for k in ("q_nope", "q_pe", "kv_cache", "block_table",
                                                              "prefix_lens", "q_lens", "tree_mask")]
    assert packed[14] == res.out.data_ptr() and packed[15] == res.lse.data_ptr()   # after 7 constants


def test_guarded_entry_misses_on_each_component(monkeypatch):
    """Any change a signature holds misses the guarded entry: the full checks run (and refuse with the first call's
    message), or another signature is prepared; given outputs, or a tensor passed twice, are entries of their own."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    kset.tree_verify(**v)
    q = v["q_nope"]
    for bad, word in ((q.float(), "q_nope: dtype"), (q[:, :7].clone(), "q_pe"),
                      (torch.zeros((1, 65, 512, 8), dtype=q.dtype).transpose(2, 3), "q_nope: not C-contiguous")):
        with pytest.raises(ArgumentError, match=word):
            kset.tree_verify(**{**v, "q_nope": bad})
    assert len(_guarded(kset)) == 1 and len(_runner_of(kset, "tree_verify_wgmma")) == 1
    # the device a tensor stands for (here: runtime.HOST_DEVICE) is part of the entry
    monkeypatch.setattr(runtime, "HOST_DEVICE", 1)
    kset.tree_verify(**v)
    assert len(_runner_of(kset, "tree_verify_wgmma")) == 2 and launches[-1][0] == launches[-3][0]
    monkeypatch.setattr(runtime, "HOST_DEVICE", 0)
    # outputs given: not the entry of the call without them (its own signature and entry)
    through_dict = _count_guards(monkeypatch)
    res = kset.tree_verify(**v)
    assert not through_dict
    kset.tree_verify(**v, out=res.out.clone(), lse=res.lse.clone())
    assert len(through_dict) == 1 and len(_guarded(kset)) == 3   # (device 0, device 1, outputs given)
    # one tensor passed twice (merge_states in place): an entry of its own that tests the repeats by identity; the
    # same signature with distinct tensors, or with another tensor passed twice, is not served by it
    o, lse = q.clone(), torch.zeros(q.shape[:3])
    for _ in range(3):
        kset.merge_states(o, lse, q.clone(), lse.clone(), out=o, lse=lse)
    merges = [e for e in _guarded(kset) if e[-1].steps[0].kernel == "merge_states"]
    assert len(merges) == 1 and merges[0][6][1] == ((4, 0), (5, 1)) and len(through_dict) == 1 + 1
    o_b, lse_b = q.clone(), lse.clone()
    kset.merge_states(o, lse, o_b, lse_b, out=o_b, lse=lse_b)   # in place into the other side
    kset.merge_states(o, lse, o_b, lse_b, out=o.clone(), lse=lse.clone())   # distinct tensors
    assert len(through_dict) == 1 + 3 and len(_runner_of(kset, "merge_states")) == 1
    part = torch.zeros(o.numel() * 2, dtype=o.dtype)   # out overlapping o_a, not o_a: refused after the hits
    a0, a1 = part[:o.numel()].view(o.shape), part[256:256 + o.numel()].view(o.shape)
    kset.merge_states(a0, lse, o_b, lse_b, out=a0, lse=lse)
    with pytest.raises(ArgumentError, match=r"out: overlaps o_a in memory"):
        kset.merge_states(a0, lse, o_b, lse_b, out=a1, lse=lse)


@pytest.mark.parametrize("m", [3, hostcode.MATCH_INLINE + 4])   # tensors named one by one, or read by C-level maps
def test_guarded_entry_test_is_exact(m):
    """A guarded entry's compiled test (hostcode.matcher) gives the pointers of the tensors and a zero per None
    only for the entry's layout: m tensors that pass the guard, the repeats the same objects, then exactly the
    Nones; any other arrays (a tensor for a None, one None more or less, another object for a repeat, a tensor the
    guard refuses) get None, and the dict's path then decides."""
    ts = [torch.zeros(4, dtype=torch.int32) for _ in range(m - 1)]
    head = (*ts, ts[1])   # the last tensor is the second passed again (merge_states in place)
    unique = tuple(range(m - 1))
    g = runtime._tensor_guards()(*ts, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    match = hostcode.matcher(m, 2, g.check, ((m - 1, 1),), unique, torch.Tensor.data_ptr)
    assert match((*head, None, None)) == [t.data_ptr() for t in head] + [0, 0]
    fresh = [torch.zeros(4, dtype=torch.int32) for _ in range(m - 1)]   # new tensors of the same signature
    assert match((*fresh, fresh[1], None, None)) == [t.data_ptr() for t in (*fresh, fresh[1])] + [0, 0]
    for other in ((*head, None, ts[0]), (*head, None), (*head, None, None, None), (*ts, ts[0], None, None),
                  (*ts, ts[1].clone(), None, None), (ts[0].float(), *head[1:], None, None),
                  (ts[0][:2], *head[1:], None, None)):
        assert match(other) is None
    plain = hostcode.matcher(m - 1, 0, g.check, (), unique, torch.Tensor.data_ptr)   # no repeats, no Nones
    assert plain(tuple(ts)) == [t.data_ptr() for t in ts] and plain((*ts, None)) is None


def test_guarded_layer_list_refuses_a_layer_changed_in_place(monkeypatch):
    """kv_commit's guarded entry checks every layer's metadata, not its pointer: a layer resized in place (the same
    object and pointer, another shape) or made non-contiguous by as_strided_ is refused with the full checks'
    message; the same list again goes through the entry."""
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    acc = kset.tree_accept(kset.tree_build(*build, spec.max_tree_size - 1), target, v["prefix_lens"])
    layers = [c.clone() for c in caches]
    kset.kv_commit(acc, v["prefix_lens"], layers, v["block_table"])
    through_dict = _count_guards(monkeypatch)
    kset.kv_commit(acc, v["prefix_lens"], layers, v["block_table"])
    assert not through_dict
    shape = layers[0].shape
    ptr = layers[30].data_ptr()
    layers[30].resize_((shape[0] - 1, *shape[1:]))
    assert layers[30].data_ptr() == ptr
    with pytest.raises(ArgumentError, match=r"kv_caches\[30\]: shape"):
        kset.kv_commit(acc, v["prefix_lens"], layers, v["block_table"])
    layers[30].resize_(shape)
    layers[44].as_strided_(shape, (shape[1] * shape[2], 1, shape[1]))
    with pytest.raises(ArgumentError, match=r"kv_caches\[44\]: not C-contiguous"):
        kset.kv_commit(acc, v["prefix_lens"], layers, v["block_table"])
    layers[44] = caches[44].clone()
    n = len(launches)
    kset.kv_commit(acc, v["prefix_lens"], layers, v["block_table"])
    assert len(launches) == n + 1 and len(_runner_of(kset, "kv_commit")) == 1


def test_without_tensor_guards_the_dict_serves_every_call(monkeypatch):
    """Where torch has no usable TensorGuards (the probe fails), no entry is made and every call takes the
    signature dict, with the same launches."""
    monkeypatch.setattr(runtime, "_GUARDS", [None])
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    for _ in range(3):
        kset.tree_verify(**v)
        kset.tree_build(*build, spec.max_tree_size - 1)
    assert not _guarded(kset) and len(launches) == 9 and len(_runner_of(kset, "tree_verify_wgmma")) == 1


def test_guarded_entries_per_launcher_are_bounded(monkeypatch):
    """At most GUARDED_ENTRIES per launcher, the newest first (a new signature pushes the oldest out, which the dict
    still serves); after GUARDED_MADE entries made, the launcher keeps the dict alone; every call launches right."""
    monkeypatch.setattr(runtime, "GUARDED_ENTRIES", 2)
    monkeypatch.setattr(runtime, "GUARDED_MADE", 5)
    spec, kset, launches, (v, build, caches, target) = _stand_in(monkeypatch)
    q = v["q_nope"]
    args = []
    for k in range(1, 5):
        o, lse = q[:, :k].clone(), torch.zeros((1, k, q.shape[2]))
        args.append((o, lse, o.clone(), lse.clone()))
        kset.merge_states(*args[-1])
        res = kset.merge_states(*args[-1])
        assert res.out.shape == o.shape
    entries = _guarded(kset)
    assert [e[-1] for e in entries] == [_runner_of(kset, "merge_states")[k] for k in (3, 2)]
    assert len(_runner_of(kset, "merge_states")) == 4 and len(launches) == 8
    through_dict = _count_guards(monkeypatch)
    kset.merge_states(*args[0])   # pushed out: the dict, and an entry again (the fifth made)
    assert len(through_dict) == 1 and len(_guarded(kset)) == 0   # (GUARDED_MADE reached: none kept)
    for a in args:
        assert kset.merge_states(*a).out.shape == a[0].shape
    assert len(through_dict) == 1 + 4 and len(_guarded(kset)) == 0 and len(launches) == 8 + 5


@pytest.mark.parametrize("swizzle,mode", [(128, 3), (64, 2), (0, 0)])
def test_tensor_map_swizzle_modes(swizzle, mode, monkeypatch):
    """A TensorMap's swizzle in bytes -> cuTensorMapEncodeTiled's CU_TENSOR_MAP_SWIZZLE_* (128B 3, 64B 2, none 0), its
    element type (UINT16 1 / UINT8 0), box and row stride; another swizzle is a KeyError before the driver is called
    (the launchers make the maps: a programming error, not a user's)."""
    from ddtree_gen.launch import callplan
    seen = []

    def fake(out, dtype, rank, ptr, dims, strides, box, step, interleave, swz, promo, fill):
        seen.append((dtype, rank, list(dims), list(strides), list(box), swz))
        return 0
    monkeypatch.setattr(callplan, "_ENCODE", [fake])
    callplan._TENSOR_MAPS.clear()
    callplan.tensor_map_words(4096, TensorMap(2, 128, 576, 64, 128 if swizzle == 128 else 64, 1, swizzle))
    assert seen == [(0, 2, [576, 128], [576], [128 if swizzle == 128 else 64, 64], mode)]
    assert TensorMap(2, 128, 576, 64, 64).swizzle == 128   # the default: a wgmma operand tile
    with pytest.raises(KeyError):
        callplan.tensor_map_words(8192, TensorMap(2, 128, 576, 64, 64, 1, 32))

"""Programmatic dependent launch of tree_verify's split-KV combine (split.PDL_COMBINE; launch/pdl.py) without a GPU.

* The ctypes structs are cuda.h's: sizes, alignment and offsets as the header lays them out (numbers, and the
  header itself compiled where a C compiler and a cuda.h are found); the config of a launch holds the one attribute.
* pdl.launch passes the config, function and parameters to cuLaunchKernelEx and names the kernel when it fails.
* The switch, off by default: off, no step asks for PDL and no launch goes through launch_pdl (the bound launch, the
  compiled call and kset.launch are the plain ones); on, the combine (and only it) does, on each of those paths, and
  only where its sm_90a build runs (its sm_80 PTX has no griddepcontrol.wait); toggling it takes effect on a cached
  call signature (a key of the call cache).
* The combine's template waits (griddepcontrol.wait) in its sm_90+ code only.
* scripts/compare_pdl.py imports, parses its options and refuses to run without a GPU.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from conftest import FakeArrays, LaunchLog
from ddtree_gen.launch import hostcode, pdl, runtime
from ddtree_gen.launch.runtime import Binary, DeviceInfo, DeviceModules, Prepared, Step
from ddtree_gen.ops.tree_verify import launch as tv
from ddtree_gen.ops.tree_verify import split as split_kv
from ddtree_gen.ops.tree_verify.split import COMBINE

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compare_pdl.py"
SPEC = "kimi-k2.6-tp8"

# cuda.h (CUDA 12.0 and later): CUlaunchAttribute {id; char pad[4]; CUlaunchAttributeValue value (a 64-byte union)},
# CUlaunchConfig {7 x unsigned int; CUstream; CUlaunchAttribute *; unsigned int}, on a 64-bit host
ATTRIBUTE = {"size": 72, "align": 8, "id": 0, "value": 8, "value_size": 64}
CONFIG = {"size": 56, "gridDimX": 0, "gridDimY": 4, "gridDimZ": 8, "blockDimX": 12, "blockDimY": 16, "blockDimZ": 20,
          "sharedMemBytes": 24, "hStream": 32, "attrs": 40, "numAttrs": 48}


def _layout() -> dict:
    a, c = pdl.CUlaunchAttribute, pdl.CUlaunchConfig
    return {"attribute": {"size": ctypes.sizeof(a), "align": ctypes.alignment(a), "id": a.id.offset,
                          "value": a.value.offset, "value_size": ctypes.sizeof(pdl.CUlaunchAttributeValue)},
            "config": {"size": ctypes.sizeof(c), **{name: getattr(c, name).offset for name, _ in c._fields_}},
            "id": pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            "flag": pdl.CUlaunchAttributeValue.programmaticStreamSerializationAllowed.offset}


def test_structs_are_cuda_h_layouts():
    got = _layout()
    assert got["attribute"] == ATTRIBUTE and got["config"] == CONFIG
    assert got["id"] == 6 and got["flag"] == 0
    assert ctypes.sizeof(ctypes.c_void_p) == 8   # (the offsets above are a 64-bit host's)


def _cuda_headers() -> list:
    """The driver API headers (cuda.h with CUlaunchConfig) of the CUDA toolkits and pip wheels here."""
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda",
             *glob.glob("/usr/local/cuda-*")]
    found = [Path(r) / "include" / "cuda.h" for r in roots if r]
    site = Path(sysconfig.get_paths()["purelib"])
    found += [Path(p) for p in glob.glob(str(site / "nvidia" / "*" / "include" / "cuda.h"))]
    return [h for h in dict.fromkeys(found) if h.is_file() and "CUlaunchConfig_st" in h.read_text(errors="replace")]


C_PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include <cuda.h>
#define F(s, m) printf(" %zu", offsetof(s, m))
int main(void) {
    printf("%zu %zu", sizeof(CUlaunchAttribute), _Alignof(CUlaunchAttribute));
    F(CUlaunchAttribute, id); F(CUlaunchAttribute, value);
    printf(" %zu %zu", sizeof(CUlaunchAttributeValue), sizeof(CUlaunchConfig));
    F(CUlaunchConfig, gridDimX); F(CUlaunchConfig, gridDimY); F(CUlaunchConfig, gridDimZ);
    F(CUlaunchConfig, blockDimX); F(CUlaunchConfig, blockDimY); F(CUlaunchConfig, blockDimZ);
    F(CUlaunchConfig, sharedMemBytes); F(CUlaunchConfig, hStream); F(CUlaunchConfig, attrs);
    F(CUlaunchConfig, numAttrs);
    printf(" %d", (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    F(CUlaunchAttributeValue, programmaticStreamSerializationAllowed);
    printf("\n");
    return 0;
}
"""


def test_structs_match_the_header_compiled(tmp_path):
    """The same numbers from cuda.h itself, compiled with the host's C compiler, for each header found."""
    cc = shutil.which("cc") or shutil.which("gcc")
    headers = _cuda_headers()
    if cc is None or not headers:
        pytest.skip(f"needs a C compiler ({cc or 'none found'}) and a CUDA toolkit's or wheel's cuda.h (none found)")
    src = tmp_path / "layout.c"
    src.write_text(C_PROGRAM)
    got = _layout()
    want = [got["attribute"][k] for k in ("size", "align", "id", "value")]
    want += [got["attribute"]["value_size"], got["config"]["size"]]
    want += [got["config"][n] for n, _ in pdl.CUlaunchConfig._fields_] + [got["id"], got["flag"]]
    for header in headers:
        exe = tmp_path / "layout"
        subprocess.run([cc, "-std=c11", f"-I{header.parent}", str(src), "-o", str(exe)], check=True,
                       capture_output=True)
        numbers = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True,
                                                  text=True).stdout.split()]
        assert numbers == want, f"{header}: {numbers} != ctypes' {want}"


def test_config_holds_the_one_attribute(monkeypatch):
    monkeypatch.setattr(pdl, "_CONFIGS", {})
    c = pdl.config(7, 1, 1, 128, 1, 1, 96, 0xABC0)
    assert (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ, c.sharedMemBytes) == \
        (7, 1, 1, 128, 1, 1, 96)
    assert c.hStream == 0xABC0 and c.numAttrs == 1
    raw = bytes((ctypes.c_char * 72).from_address(ctypes.addressof(c.attrs.contents)))
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")
    assert pdl.config(7, 1, 1, 128, 1, 1, 96, 0xABC0) is c                       # made once per geometry and stream
    assert pdl.config(7, 1, 1, 128, 1, 1, 96, 0).hStream is None                 # the legacy default stream: NULL


def test_launch_calls_cuLaunchKernelEx_and_names_the_kernel(monkeypatch):
    calls = []

    def launch_ex(cfg, fn, params, extra):
        c = cfg._obj   # (ctypes.byref's object)
        calls.append((c.gridDimX, c.blockDimX, c.sharedMemBytes, c.hStream, c.attrs[0].id,
                      c.attrs[0].value.programmaticStreamSerializationAllowed, fn, params, extra))
        return rc[0]

    def error_name(code, out):
        out._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0

    rc = [0]
    monkeypatch.setattr(pdl, "_DRIVER", [launch_ex, error_name])
    monkeypatch.setattr(pdl, "_CONFIGS", {})
    pdl.launch(COMBINE, 0x1234, 5, 1, 1, 128, 1, 1, 0, 0x77, 0x5000)
    assert calls == [(5, 128, 0, 0x77, 6, 1, 0x1234, 0x5000, None)]
    rc[0] = 1
    with pytest.raises(RuntimeError, match=rf"{COMBINE}: cuLaunchKernelEx .*CUDA_ERROR_INVALID_VALUE \(CUresult 1\)"):
        pdl.launch(COMBINE, 0x1234, 5, 1, 1, 128, 1, 1, 0, 0x77, 0x5000)


def test_template_waits_on_sm90_only():
    """griddepcontrol.wait is at the top of the combine, inside #if __CUDA_ARCH__ >= 900 (the sm_80 PTX has none:
    tests/test_builds.py's test_sm80_build_is_ptx checks the compiled PTX), before any load."""
    text = (ROOT / "templates" / "tree_verify_combine.cu.j2").read_text()
    body = text[text.index("{{ entry }}("):]
    guard, wait, end = body.index("#if __CUDA_ARCH__ >= 900"), body.index("griddepcontrol.wait;"), body.index("#endif")
    assert guard < wait < end and body.count("griddepcontrol") == 1
    assert "launch_dependents" not in text
    first_load = min(body.index(w) for w in ("q_lens[", "prefix_lens[", "part_lse[", "spans["))
    assert wait < first_load


# ----------------------------------------------------------------------------- the switch and the launch paths

def _spec():
    from ddtree_gen.spec import find_spec
    return find_spec(SPEC)


def _verify_args(spec, new, b=1, max_pages=64):
    h, r, p, n, w, page = (spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.max_tree_size,
                           spec.mask_words, spec.page_size)
    return dict(q_nope=new((b, n, h, r), np.uint16), q_pe=new((b, n, h, p), np.uint16),
                kv_cache=new((b * max_pages, page, r + p), np.uint16), block_table=new((b, max_pages), np.int32),
                prefix_lens=new((b,), np.int32), q_lens=new((b,), np.int32), tree_mask=new((b, n, w), np.uint32),
                softmax_scale=192 ** -0.5, out=new((b, n, h, r), np.uint16), lse=new((b, n, h), np.float32))


def test_switch_is_off_by_default():
    assert split_kv.PDL_COMBINE is False
    assert not split_kv.pdl_combine("sm_90a") and not split_kv.pdl_combine("sm_80")


def test_switch_on_the_combine_alone_asks_for_pdl(monkeypatch, fake_alloc):
    """Through a kernel set's own launch (kset.launch: LaunchLog records its keywords): off, no launch gets pdl=;
    on, the combine's and only it, the attention kernel's launch as before; the cached call signature follows the
    switch both ways (its key); the low-level combine launcher too."""
    spec = _spec()
    ks = LaunchLog(spec, ["tree_verify", "tree_verify_tail", "merge_states", "tree_verify_wgmma",
                          "tree_verify_tail_wgmma", COMBINE])
    args = _verify_args(spec, FakeArrays())
    for on in (False, True, False, True):
        monkeypatch.setattr(split_kv, "PDL_COMBINE", on)
        ks.seen.clear()
        tv.tree_verify(ks, **args, num_splits=5)
        tv.tree_verify_tail(ks, **args, num_splits=3)
        names = [name for name, _ in ks.seen]
        assert names == ["tree_verify_wgmma", COMBINE, "tree_verify_tail_wgmma", COMBINE], names
        assert [kw.get("pdl", False) for _, kw in ks.seen] == [False, on, False, on], (on, ks.seen)
        assert all("pdl" not in kw for _, kw in ks.seen if not on)   # off: kset.launch called as before
    # one split: no combine, nothing asks for PDL
    ks.seen.clear()
    tv.tree_verify(ks, **args, num_splits=1)
    assert [(name, "pdl" in kw) for name, kw in ks.seen] == [("tree_verify_wgmma", False)]
    # the low-level combine launcher (not cached: the switch read per call)
    from ddtree_gen.ops.tree_verify.tensor_core import combine
    new = FakeArrays()
    b, n, h, r = 1, spec.max_tree_size, spec.num_heads, spec.kv_lora_rank
    ws = new((split_kv.workspace_elems(spec, b, n, 4),), np.float32)
    for on in (False, True):
        monkeypatch.setattr(split_kv, "PDL_COMBINE", on)
        ks.seen.clear()
        combine(ks, ws, new((b,), np.int32), new((b,), np.int32), 4, new((b, n, h, r), np.uint16),
                new((b, n, h), np.float32))
        assert [(name, kw.get("pdl", False)) for name, kw in ks.seen] == [(COMBINE, on)]


def test_sm80_combine_is_launched_plainly(monkeypatch, fake_alloc):
    """Where the combine runs as its sm_80 PTX (no griddepcontrol.wait in it), the switch leaves its launch plain."""
    spec = _spec()
    ks = LaunchLog(spec, ["tree_verify", "tree_verify_tail", "merge_states", "tree_verify_mma",
                          "tree_verify_tail_mma", COMBINE])
    real = ks.arch_for   # the combine's build that runs: the sm_80 PTX (a GPU other than H100 / H200)
    monkeypatch.setattr(ks, "arch_for", lambda name, device: "sm_80" if name == COMBINE else real(name, device))
    monkeypatch.setattr(split_kv, "PDL_COMBINE", True)
    tv.tree_verify(ks, **_verify_args(spec, FakeArrays()), impl="mma", num_splits=4)
    assert [(name, "pdl" in kw) for name, kw in ks.seen] == [("tree_verify_mma", False), (COMBINE, False)]


class _Driver:
    """The driver entries of runtime._CUDA, recording which launch each step went through."""

    def __init__(self):
        self.calls = []
        self.entries = {"launch": self.launch, "launch_pdl": self.launch_pdl, "get_device": lambda: 0,
                        "set_device": lambda d: None, "cupy_stream": lambda d: type("S", (), {"ptr": 0x51})()}

    def launch(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append(("launch", fn, gx, bx, smem, stream))

    def launch_pdl(self, name, fn, gx, gy, gz, bx, by, bz, smem, stream, params):
        self.calls.append(("launch_pdl", name, fn, gx, bx, smem, stream))


@pytest.fixture
def modules(monkeypatch):
    """DeviceModules of two stand-in kernels ("attn": 256 threads, "comb": 128) on a stand-in Hopper device 0, and
    runtime._CUDA's entries replaced by a recording _Driver (no CuPy, no driver)."""
    info = DeviceInfo("stand-in H200", (9, 0), 232448)
    monkeypatch.setattr(runtime, "device_info", lambda device: info)
    monkeypatch.setattr(DeviceModules, "_load",
                        lambda self, name, device: (None, {"attn": 0xA000, "comb": 0xC000}[name],
                                                    *{"attn": (256, 1024), "comb": (128, 0)}[name]))
    driver = _Driver()
    for k, v in driver.entries.items():
        monkeypatch.setitem(runtime._CUDA, k, v)
    mods = DeviceModules({"attn": Binary(b"", "attn", 256, 1024), "comb": Binary(b"", "comb", 128, 0)})
    return mods, driver


def _prepared(pdl_step: bool) -> Prepared:
    steps = (Step("attn", (6,), (0, 1, np.int32(3))), Step("comb", (2,), (1, 0, np.int64(9)), pdl=pdl_step))
    return Prepared(device=0, kind="cai", steps=steps, returns=(None, ()))


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_bound_and_compiled_launches(modules, on):
    """A call's bound launches (runtime._launch_bound), its compiled per-call function (hostcode.compile_runner) and
    DeviceModules.launch: a step with pdl through launch_pdl (naming its kernel), every other through launch; with no
    such step the compiled source does not name launch_pdl at all."""
    mods, driver = modules
    prep = _prepared(on)
    assert [s.pdl for s in prep.steps] == [False, on] and [p.pdl for p in prep.plans] == [False, on]
    bound = tuple(mods.bind(plan, 0) for plan in prep.plans)
    ptrs = [0x10000, 0x20000]
    comb = ("launch_pdl", "comb", 0xC000, 2, 128, 0, 0x51) if on else ("launch", 0xC000, 2, 128, 0, 0x51)
    want = [("launch", 0xA000, 6, 256, 1024, 0x51), comb]
    runtime._launch_bound(bound, ptrs, 0, "cai")
    assert driver.calls == want
    driver.calls.clear()
    run = hostcode.compile_runner(prep, bound, runtime._CUDA, (object(), object()))
    run((object(), object()), list(ptrs))
    assert driver.calls == want
    assert ("launch_pdl" in run.source) == on
    driver.calls.clear()
    mods.launch("comb", (2,), [0x20000, 0x10000, np.int64(9)], 0, "cai", prep.plans[1].fmt, pdl=on)
    mods.launch("comb", (2,), [0x20000, 0x10000, np.int64(9)], 0, "cai", prep.plans[1].fmt)
    assert driver.calls == [comb, ("launch", 0xC000, 2, 128, 0, 0x51)]


def test_stand_in_kernel_set(monkeypatch):
    """A real KernelSet of stand-in binaries on a stand-in H200 (bench/stand_in.py): tree_verify with 5 chunks, cached
    (the compiled call) and with validate=True (not cached: the bound launch): off, both launches plain; on, the
    combine a programmatic dependent launch (stand_in.PdlLaunch), the attention kernel's as before."""
    from conftest import need
    need("torch")
    from ddtree_gen.bench import launch, stand_in
    spec = _spec()
    kset, launches = stand_in.stand_in_kset(spec, monkeypatch.setattr, monkeypatch.setitem)
    v = launch.tiny_inputs(spec, "cpu")["verify"]
    kinds = lambda: [type(rec) is stand_in.PdlLaunch for rec in launches]
    for on in (False, True, False):
        monkeypatch.setattr(split_kv, "PDL_COMBINE", on)
        for validate in (False, False, True):
            launches.clear()
            kset.tree_verify(**v, num_splits=5, validate=validate)
            assert kinds() == [False, on], (on, validate)
            assert launches[1][1][0] == -(-spec.max_tree_size * spec.num_heads // split_kv.COMBINE_ROWS_PER_BLOCK)
        launches.clear()
        kset.tree_verify(**v, num_splits=1)
        assert kinds() == [False]


# ----------------------------------------------------------------------------- scripts/compare_pdl.py

@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_pdl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_script_parses_its_options(compare):
    assert compare.SHAPES == [(1, 8, 65, 4096), (1, 8, 22, 65536), (4, 8, 32, 8192), (1, 64, 30, 16384)]
    a = compare.parse_args([])
    assert (a.per_graph, a.reps, a.no_flashmla) == (10, 20, False)
    a = compare.parse_args(["--per-graph", "5", "--reps", "7", "--no-flashmla"])
    assert (a.per_graph, a.reps, a.no_flashmla) == (5, 7, True)
    with pytest.raises(SystemExit):
        compare.parse_args(["--reps", "0"])
    assert compare.label(4, 8, 32, 8192) == "B=4 H=8 Nq=32 L=8192"


def test_compare_script_help_and_no_gpu():
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0 and "PDL_COMBINE" in run.stdout, run.stderr
    from conftest import gpu_reason
    if gpu_reason() is None:
        return   # (a GPU here: the script would run)
    from ddtree_gen.needs import EXIT_MISSING
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == EXIT_MISSING and "needs a CUDA GPU" in run.stderr, (run.returncode, run.stderr)

"""Build targets (sm_90a cubins, sm_80 PTX) and the choice of a build per device (CPU: no GPU needed).

* archs.select, the pure rule: compute capability 9.0 -> the sm_90a cubin, any other of 8.0 or
  later -> the sm_80 PTX; a forced target (DDTREE_GEN_ARCH / load(arch=)) wins where it runs;
* the spec's `archs` field, the cache key per target, load() forcing one target;
* a kernel set on fake devices (runtime.device_info patched): which build each kernel gets, the
  clear ArgumentError of a kernel that cannot run on a device (the wgmma kernels off Hopper, the
  mma.sync kernels where their shared memory does not fit), and tree_verify's impl="auto" falling
  back to mma.sync, then to the CUDA-core kernel.
"""
from __future__ import annotations

import json

import pytest

from conftest import LaunchReached
from ddtree_gen import archs
from ddtree_gen.build import artifacts
from ddtree_gen.launch import callplan, runtime
from ddtree_gen.build.compile import OPTIONS, options
from ddtree_gen.errors import ArgumentError, DdtreeError, SpecError
from ddtree_gen.kernel_set import KernelSet, load
from ddtree_gen.ops import all_builds, all_kernels, by_name
from ddtree_gen.ops.tree_verify import mma as mma_plans
from ddtree_gen.build.variant import default_config, variant
from ddtree_gen.build.resources import PtxasReport
from ddtree_gen.launch.runtime import DeviceInfo, DeviceModules
from ddtree_gen.spec import all_specs, find_spec, parse_spec
from test_tree_verify_cpu import Arrays, verify_args

BOTH = ("sm_90a", "sm_80")
HOPPER_ONLY = ("sm_90a",)

# ------------------------------------------------------------------------- the pure rule

SELECT = [   # (compute capability, built, forced) -> target
    ((9, 0), BOTH, None, "sm_90a"),            # H100 / H200
    ((8, 0), BOTH, None, "sm_80"),             # A100
    ((8, 6), BOTH, None, "sm_80"),             # A10, RTX 30xx
    ((8, 9), BOTH, None, "sm_80"),             # L4, L40S, RTX 40xx
    ((10, 0), BOTH, None, "sm_80"),            # B200
    ((10, 3), BOTH, None, "sm_80"),            # B300
    ((12, 0), BOTH, None, "sm_80"),            # RTX 50xx
    ((7, 5), BOTH, None, None),                # T4: too old
    ((9, 0), BOTH, "sm_80", "sm_80"),          # forced PTX on Hopper
    ((8, 0), BOTH, "sm_80", "sm_80"),
    ((9, 0), BOTH, "sm_90a", "sm_90a"),
    ((8, 9), BOTH, "sm_90a", None),            # an sm_90a cubin never runs off 9.0
    ((9, 0), HOPPER_ONLY, None, "sm_90a"),     # wgmma
    ((8, 0), HOPPER_ONLY, None, None),
    ((10, 0), HOPPER_ONLY, None, None),
    ((12, 0), HOPPER_ONLY, None, None),
    ((9, 0), HOPPER_ONLY, "sm_80", None),
    ((9, 0), ("sm_80",), None, "sm_80"),       # a spec built for sm_80 only runs its PTX on Hopper too
    ((9, 0), (), None, None),
]


@pytest.mark.parametrize("cc,built,forced,want", SELECT,
                         ids=[f"cc{c[0]}{c[1]}-{'+'.join(b) or 'none'}-{f or 'auto'}" for c, b, f, _ in SELECT])
def test_select(cc, built, forced, want):
    assert archs.select(cc, built, forced) == want
    if want is None:
        why = archs.why_not(cc, built, forced)
        if cc < (8, 0):
            assert "8.0 or later" in why
        elif forced:
            assert f"forced to {forced}" in why and archs.ENV in why
        else:
            assert "sm_90a only" in why or "no target" in why


def test_select_prefers_in_archs_order_whatever_the_order_given():
    assert archs.select((9, 0), ("sm_80", "sm_90a")) == "sm_90a"
    assert archs.ordered(["sm_80", "sm_90a", "sm_80"]) == ("sm_90a", "sm_80")


def test_forced_from_argument_and_environment(monkeypatch):
    monkeypatch.delenv(archs.ENV, raising=False)
    assert archs.forced() is None
    for value, want in (("sm_80", "sm_80"), ("sm_90a", "sm_90a"), ("auto", None), ("", None)):
        monkeypatch.setenv(archs.ENV, value)
        assert archs.forced() == want
    monkeypatch.setenv(archs.ENV, "sm_80")
    assert archs.forced("sm_90a") == "sm_90a" and archs.forced("auto") is None   # the argument wins
    monkeypatch.setenv(archs.ENV, "sm_70")
    with pytest.raises(DdtreeError, match=f"\\${archs.ENV}: unknown target 'sm_70'"):
        archs.forced()
    with pytest.raises(ArgumentError, match="arch: unknown target 'sm_100'"):
        archs.forced("sm_100")


def test_every_kernel_declares_targets():
    """sm_80 (PTX) for every kernel that needs no Hopper-only instruction; the wgmma kernels sm_90a only."""
    for k in all_kernels():
        assert set(k.archs) <= set(archs.ARCHS) and "sm_90a" in k.archs, k.name
        want = HOPPER_ONLY if "wgmma" in k.name else BOTH
        assert k.archs == want, k.name


# ----------------------------------------------------------------------- spec field, cache

VALID = dict(name="t", num_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, page_size=64, max_tree_size=65,
             max_depth=15)


def test_spec_archs_field():
    assert parse_spec(VALID, "t.toml").archs == BOTH          # optional: both by default
    assert parse_spec(dict(VALID, archs=["sm_80", "sm_90a"]), "t.toml").archs == BOTH   # preference order
    assert parse_spec(dict(VALID, archs=["sm_80"]), "t.toml").archs == ("sm_80",)
    s = parse_spec(dict(VALID, archs=["sm_90a"]), "t.toml")
    assert s.archs == HOPPER_ONLY and s.digest() != parse_spec(VALID, "t.toml").digest()
    assert parse_spec(s.as_dict(), "again") == s                    # as_dict round-trips (tensor_parallel)
    assert json.loads(json.dumps(s.as_dict()))["archs"] == ["sm_90a"]
    for bad, word in (([], "at least one"), (["sm_70"], "unknown target 'sm_70'"), (["sm_80", "sm_80"], "twice"),
                      ("sm_80", "must be a list"), ([80], "unknown target 80")):
        with pytest.raises(SpecError, match=word) as e:
            parse_spec(dict(VALID, archs=bad), "specs/t.toml")
        assert "specs/t.toml" in str(e.value) and "'archs'" in str(e.value)


def test_spec_archs_limit_what_is_built():
    s = parse_spec(dict(VALID, archs=["sm_80"]), "t.toml")
    pairs = artifacts.variants(s, all_builds())
    assert {v.target for v in pairs} == {"sm_80"}
    assert not any("wgmma" in v.kernel.name for v in pairs)        # wgmma has no sm_80 build: not built at all
    bf16 = parse_spec(VALID, "t.toml")   # every build but the fp8 spec's own (the declarations' kv_dtypes) and the unfit
    fp8_only = [k for k in all_builds() if "bf16" not in k.kv_dtypes]
    unfit = [k for k in all_builds() if "bf16" in k.kv_dtypes and k.unfit(bf16)]
    built = [k for k in all_builds() if k.builds_for(bf16)]
    assert fp8_only and len(built) == len(all_builds()) - len(fp8_only) - len(unfit)
    one_target = [k for k in built if k.archs == ("sm_90a",)]   # the wgmma kernels and their builds
    assert one_target and all("wgmma" in k.name for k in one_target)
    assert len(artifacts.variants(bf16, all_builds())) == 2 * len(built) - len(one_target)


def test_cache_key_differs_by_target():
    spec = find_spec("kimi-k2.6-tp8")
    kdef = by_name("tree_build")
    src = artifacts.render(variant(kdef, spec))
    keys = {a: artifacts.cache_key(src, variant(kdef, spec, a), "13.0") for a in archs.ARCHS}
    assert len(set(keys.values())) == len(archs.ARCHS)
    # the key of the variant's name, its source, its target's options, the NVRTC and the entry
    want = artifacts.sha256(json.dumps({"source": artifacts.sha256(src), "options": list(OPTIONS), "nvrtc": "13.0",
                                        "entry": kdef.entry, "variant": "tree_build"}, sort_keys=True))
    assert keys["sm_90a"] == want
    assert options("sm_80")[0] == "--gpu-architecture=sm_80" and options("sm_90a") == OPTIONS


def test_generated_manifests_list_targets():
    """The committed manifests: per kernel its targets, per target the source, binary kind and size."""
    for spec in all_specs():
        m = json.loads((artifacts.paths.generated_dir() / spec.name / artifacts.MANIFEST).read_text())
        assert set(m["targets"]) == set(spec.archs)
        assert m["targets"]["sm_80"]["binary"] == "ptx" and m["targets"]["sm_90a"]["binary"] == "cubin"
        assert set(m["kernels"]) == {k.name for k in all_builds() if k.archs_for(spec)}   # fp8: no mma.sync
        for k in all_builds():
            if not k.builds_for(spec):
                continue
            entry = m["kernels"][k.name]
            assert entry["archs"] == list(k.archs_for(spec)), k.name
            for a, b in entry["builds"].items():
                assert b["binary"] == archs.BINARY[a] and b["binary_bytes"] > 0 and len(b["binary_sha256"]) == 64
                v = variant(k, spec, a)   # the source file is named by the default variant's procedural name
                assert b["variant"] == v.name and b["source"] == f"{v.name}.cu" and b["config"] == v.config
                assert "ptxas" in b and "model_vs_ptxas" in b
            per_target = default_config(k, spec, "sm_80") != default_config(k, spec, "sm_90a")
            assert (len({b["source"] for b in entry["builds"].values()}) > 1) == (per_target and "sm_80" in entry["builds"])


def test_load_forces_one_target(tmp_path, monkeypatch):
    """load(arch=) / $DDTREE_GEN_ARCH build and use one target only; the sets are cached apart."""
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(archs.ENV, raising=False)
    built = []
    real = artifacts.compile_variant
    monkeypatch.setattr(artifacts, "compile_variant",
                        lambda v, source=None: built.append((v.kernel.name, v.target)) or real(v, source))
    kernels = ["tree_build", "tree_verify_wgmma"]
    forced = load("kimi-k2.6-tp8", kernels=kernels, arch="sm_80")
    assert forced.forced_arch == "sm_80" and forced.archs == ("sm_80",)
    assert built == [("tree_build", "sm_80")]
    assert forced.kernels == ["tree_build"]                        # wgmma has no sm_80 build ...
    assert callable(forced.tree_verify_wgmma)                      # ... but its launcher says why (below)
    monkeypatch.setenv(archs.ENV, "sm_80")
    assert load("kimi-k2.6-tp8", kernels=kernels) is forced
    monkeypatch.delenv(archs.ENV)
    auto = load("kimi-k2.6-tp8", kernels=kernels)
    assert auto is not forced and auto.forced_arch is None and auto.archs == BOTH
    wgmma_builds = [(b.name, "sm_90a") for b in by_name("tree_verify_wgmma").build_defs()   # each build it ships
                    if b.builds_for(find_spec("kimi-k2.6-tp8"))]                          # for a bf16 cache
    assert sorted(built) == sorted([("tree_build", "sm_80"), ("tree_build", "sm_90a"), ("tree_build", "sm_80"),
                                    *wgmma_builds])
    with pytest.raises(ArgumentError, match="arch: unknown target"):
        load("kimi-k2.6-tp8", kernels=kernels, arch="sm_75")
    only90 = parse_spec(dict(VALID, archs=["sm_90a"]), "t.toml")
    with pytest.raises(ArgumentError, match="not built for it"):
        load(only90, kernels=["tree_build"], arch="sm_80")


# -------------------------------------------------------------------- kernel sets, devices

DEVICES = {   # fake devices by number: name, compute capability, opt-in shared memory per block
    0: DeviceInfo("NVIDIA H200", (9, 0), 232448),
    1: DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 166912),
    2: DeviceInfo("NVIDIA L40S", (8, 9), 101376),
    3: DeviceInfo("NVIDIA B200", (10, 0), 232448),
    4: DeviceInfo("NVIDIA GeForce RTX 5090", (12, 0), 101376),
    5: DeviceInfo("Tesla T4", (7, 5), 65536),
}


@pytest.fixture
def fake_devices(monkeypatch):
    """runtime.device_info answers from DEVICES; a fake array at pointer p lives on device p >> 40."""
    from conftest import fake_tensor_map
    from ddtree_gen.launch import arrays
    monkeypatch.setattr(runtime, "device_info", lambda device: DEVICES[device])
    monkeypatch.setattr(arrays, "_pointer_device", lambda ptr: ptr >> 40)
    monkeypatch.setattr(callplan, "tensor_map_words", fake_tensor_map)


class RecordingSet(KernelSet):
    """A real KernelSet (fake binaries) whose launch records the kernel and stops."""

    def launch(self, name, **kwargs):
        self.launched = (name, kwargs)
        raise LaunchReached(name)


def fake_set(spec, names=None, arch=None) -> RecordingSet:
    """A kernel set of every target of `names` (default: all kernels; a kernel's name: each of its builds, a build's
    key: that one) with fake binaries (nothing is compiled)."""
    report = PtxasReport(registers=32, smem=0, stack=0, spill_stores=0, spill_loads=0)
    kdefs = [k for k in all_builds() if names is None or k.name in names or k.kernel in names]
    built = {k.name: {a: artifacts.Built(variant(k, spec, a), "", "key", b"fake", report, "cached")
                      for a in k.archs_for(spec) if arch is None or a == arch} for k in kdefs}
    return RecordingSet(spec, built, arch=arch)


@pytest.fixture
def kimi():
    """One spec is enough: the kernel-set tests do not depend on its shape (conftest parametrizes `spec`)."""
    return find_spec("kimi-k2.6")


WHERE = [   # device -> (target of tree_verify_mma or None, of tree_verify_wgmma, of tree_verify)
    (0, "sm_90a", "sm_90a", "sm_90a"),
    (1, "sm_80", None, "sm_80"),      # A100: mma's sm_80 build fits 163 KB
    (2, None, None, "sm_80"),         # L40S: 99 KB, the mma.sync kernels do not fit
    (3, "sm_80", None, "sm_80"),      # B200
    (4, None, None, "sm_80"),         # RTX 5090
    (5, None, None, None),            # T4
]


@pytest.mark.parametrize("device,mma,wgmma,simple", WHERE, ids=[DEVICES[w[0]].name for w in WHERE])
def test_build_per_device(kimi, fake_devices, device, mma, wgmma, simple):
    ks = fake_set(kimi)
    for name, want in (("tree_verify_mma", mma), ("tree_verify_wgmma", wgmma), ("tree_verify", simple),
                       ("tree_build", simple), ("tree_accept", simple), ("tree_verify_mma_combine", simple)):
        assert ks.arch_for(name, device) == want, name
        why = ks.unavailable(name, device)
        assert (why is None) == (want is not None), (name, why)
        if why:
            info = DEVICES[device]
            assert why.startswith(f"{name}: not available on device {device} ({info.name}, compute capability "
                                  f"{info.cc[0]}.{info.cc[1]})"), why
            with pytest.raises(ArgumentError) as e:
                ks.require(name, device)
            assert str(e.value) == why
    if mma is None and simple is not None:
        assert "needs 153600 bytes of shared memory per block, the device allows 101376" in \
            ks.unavailable("tree_verify_mma", device)
    if wgmma is None and simple is not None:
        assert "built for sm_90a only" in ks.unavailable("tree_verify_wgmma", device)
    if simple is None:
        assert "8.0 or later" in ks.unavailable("tree_build", device)
    assert set(ks.kernels_on(device)) == {k for k in ks.kernels if ks.arch_for(k, device)}


def test_constants_per_device(kimi, fake_devices):
    """tree_verify_mma's sm_80 build has BN = 32 (150 KB of shared memory), the sm_90a one the tuned BN."""
    ks = fake_set(kimi)
    assert ks.constants("tree_verify_mma", 0)["BN"] == mma_plans.config_for(kimi)["BN"] == 64
    assert ks.constants("tree_verify_mma", 1)["BN"] == 32
    assert ks.plan("tree_verify_mma", 1).value(ks.plan("tree_verify_mma", 1).dynamic_smem) == 153600
    assert ks.constants("tree_verify_mma")["BN"] == 64             # no device: the first target's


def test_forced_sm80_on_hopper(kimi, fake_devices):
    ks = fake_set(kimi, arch="sm_80")
    assert ks.arch_for("tree_verify_mma", 0) == "sm_80" and ks.constants("tree_verify_mma", 0)["BN"] == 32
    assert "tree_verify_wgmma" not in ks.kernels
    why = ks.unavailable("tree_verify_wgmma", 0)
    assert "tree_verify_wgmma: not available on device 0 (NVIDIA H200, compute capability 9.0)" in why
    assert "forced to sm_80" in why and "sm_90a only" in why


def _call(ks, launcher, device=0, **kw):
    """Run a tree_verify launcher on fake arrays of `device`; the kernel it reached (or the error it raised)."""
    new = Arrays()
    new.next = (device << 40) + (1 << 32)
    args = verify_args(ks.spec, new)
    with pytest.raises(LaunchReached):
        getattr(ks, launcher)(**args, **kw)
    return ks.launched[0]


@pytest.mark.parametrize("launcher", ["tree_verify", "tree_verify_tail"])
def test_auto_falls_back_per_device(kimi, fake_devices, launcher):
    """impl="auto": wgmma on Hopper, mma.sync on A100 / B200 (and on Hopper forced to sm_80), the CUDA-core
    kernel where neither runs (L40S, RTX 5090); one kernel set serves every device."""
    ks = fake_set(kimi)
    for device, want in ((0, "wgmma"), (1, "mma"), (2, None), (3, "mma"), (4, None), (0, "wgmma")):
        assert _call(ks, launcher, device, num_splits=1) == (f"{launcher}_{want}" if want else launcher), device
    assert _call(fake_set(kimi, arch="sm_80"), launcher, 0, num_splits=1) == f"{launcher}_mma"
    assert _call(ks, launcher, 1, impl="mma", num_splits=1) == f"{launcher}_mma"
    with pytest.raises(ArgumentError, match=f"{launcher}_mma: not available on device 2 \\(NVIDIA L40S"):
        _call(ks, launcher, 2, impl="mma")


@pytest.mark.parametrize("launcher", ["tree_verify", "tree_verify_tail"])
def test_wgmma_off_hopper_is_a_clear_error(kimi, fake_devices, launcher):
    ks = fake_set(kimi)
    for device in (1, 2, 3, 4):
        info = DEVICES[device]
        for call in (lambda: _call(ks, f"{launcher}_wgmma", device),
                     lambda: _call(ks, launcher, device, impl="wgmma")):
            with pytest.raises(ArgumentError) as e:
                call()
            msg = str(e.value)
            assert f"{launcher}_wgmma: not available on device {device} ({info.name}, compute capability " \
                   f"{info.cc[0]}.{info.cc[1]})" in msg and "sm_90a only" in msg, msg
            assert not hasattr(ks, "launched")
    forced = fake_set(kimi, arch="sm_80")
    with pytest.raises(ArgumentError, match="forced to sm_80") as e:
        _call(forced, f"{launcher}_wgmma", 0)
    assert f"{launcher}_wgmma" in str(e.value) and "compute capability 9.0" in str(e.value)
    with pytest.raises(ArgumentError, match=f"{launcher}_wgmma: not available on device 0 .*forced to sm_80"):
        _call(forced, launcher, 0, impl="wgmma")
    assert not hasattr(forced, "launched")


def test_device_modules_refuse_before_loading(fake_devices):
    """function() raises the ArgumentError itself (no module is loaded, no GPU is touched)."""
    mods = DeviceModules({"k": {"sm_90a": runtime.Binary(b"x", "k", 32, 0)},
                          "big": {"sm_80": runtime.Binary(b"x", "big", 256, 150000, 4096)}})
    assert mods.archs("k") == ("sm_90a",) and mods.arch_for("k", 0) == "sm_90a"
    with pytest.raises(ArgumentError, match="k: not available on device 1 .*sm_90a only"):
        mods.function("k", 1)
    assert mods.arch_for("big", 0) == "sm_80" and mods.arch_for("big", 1) == "sm_80"
    with pytest.raises(ArgumentError, match="big: not available on device 2 .*needs 154096 bytes"):
        mods.function("big", 2)
    old = DeviceModules({"k": (b"x", "k", 32, 0)})                 # the form before targets: an sm_90a build
    assert old.archs("k") == ("sm_90a",)


def test_ptx_load_error_names_versions(fake_devices, monkeypatch):
    ptx = b"//\n// Cuda compilation tools, release 13.5, V13.5.37\n//\n\n.version 9.5\n.target sm_80\n"
    msg = runtime._load_error("tree_build", "sm_80", ptx, 0, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
    assert "tree_build" in msg and "ISA 9.5" in msg and "NVRTC 13.5" in msg and "nvidia-cuda-nvrtc" in msg
    assert runtime._ptx_header(ptx) == ("9.5", "13.5")
    assert "PTX" not in runtime._load_error("tree_build", "sm_90a", b"\x7fELF", 0, "CUDA_ERROR_X")

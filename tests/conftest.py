"""Shared test machinery: spec parametrization (ids = spec names), the gpu marker (a GPU test skips with one line
saying why there is no GPU), optional packages (need(): a skip naming the extra to install), the user's binary
cache (what `ddtree-gen build` filled; the tests compile only what it lacks) and copies of it, the concurrent
builds of tests/test_builds.py, fakes."""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ddtree_gen import paths
from ddtree_gen.kernel_set import StandInKernelSet
from ddtree_gen.spec import all_specs, spec_paths


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with a reason where none is present)")


@functools.lru_cache(maxsize=None)
def gpu_reason() -> str | None:
    """None when a CUDA GPU is usable, else why not, in one line: the check the command line makes
    (needs.gpu_problem: "no NVIDIA driver here ..." where libcuda does not load, not CuPy's misleading
    "driver version is insufficient")."""
    from ddtree_gen.needs import gpu_problem
    return gpu_problem()


def pytest_collection_modifyitems(config, items):
    reason = gpu_reason() if any("gpu" in it.keywords for it in items) else None
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for it in items:
            if "gpu" in it.keywords:
                it.add_marker(skip)


SPECS = all_specs()
REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------- optional packages: a skip names the extra that installs them

@functools.lru_cache(maxsize=None)
def extras() -> dict:
    """{extra: the packages it installs that are no dependency of the package itself}, from pyproject.toml
    (torch: {torch}, hf: {torch, transformers}, ...), in its order."""
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[ <>=!~;\[]", req, maxsplit=1)[0].strip().lower().replace("-", "_")
    base = {name(r) for r in project["dependencies"]}
    return {extra: {name(r) for r in reqs} - base for extra, reqs in project["optional-dependencies"].items()}


def optional_packages() -> set:
    """Every package an extra installs (torch, transformers, ...)."""
    return set().union(*extras().values())


def install_hint(*packages: str) -> str:
    """What to run for optional packages: the first extra that installs them all."""
    extra = next(e for e, have in extras().items() if set(packages) <= have)
    return f'pip install -e ".[{extra}]"'


def need(*packages: str):
    """The optional packages (torch, transformers, ...), imported (one: the module; several: a tuple); else the
    test (or, at module level, the file) is skipped with a reason naming what is missing and the extra that
    installs them all."""
    __tracebackhide__ = True   # the skip's location: the caller's line, not this one
    import importlib
    modules, missing = [], []
    for package in packages:
        try:
            modules.append(importlib.import_module(package))
        except ImportError:
            missing.append(package)
    if missing:
        pytest.skip(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
                    f"({install_hint(*packages)})", allow_module_level=True)
    return modules[0] if len(modules) == 1 else tuple(modules)


def cuda_torch():
    """torch, where it sees a CUDA device; else the test is skipped (torch missing, or without CUDA)."""
    torch = need("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA (a CUDA build of torch and a GPU)")
    return torch


# ------------------------------------------------- the binary cache `ddtree-gen build` filled

USER_CACHE = paths.cache_dir()   # $DDTREE_GEN_CACHE, else ~/.cache/ddtree-gen: what the README's build filled


@pytest.fixture
def user_cache(monkeypatch) -> Path:
    """DDTREE_GEN_CACHE set to the user's binary cache: a shipped default variant is a cache hit there after
    `ddtree-gen build`; what it lacks is compiled into it, as load() would. Tests that compile anything but the
    shipped variants use a cache of their own (seeded_cache) and leave this one as the user's build made it."""
    monkeypatch.setenv("DDTREE_GEN_CACHE", str(USER_CACHE))
    return USER_CACHE


def seeded_cache(dest: Path, leave_out=()) -> Path:
    """A private binary cache at `dest`: the entries of the user's cache copied (what a test compiles there,
    a spec of its own, an edited template, stays out of the user's cache), less those of the variants named in
    `leave_out` (procedural names: "tree_build", ...), which a test then compiles. An entry is its .json and
    its binary; a broken one is not copied (compile_variant would rebuild it anyway)."""
    dest.mkdir(parents=True, exist_ok=True)
    if USER_CACHE.is_dir():
        for meta in USER_CACHE.glob("*.json"):
            try:
                entry = json.loads(meta.read_text())
                binary = meta.with_suffix(f".{entry['binary']}")
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if entry.get("variant") in leave_out or not binary.is_file():
                continue
            shutil.copyfile(binary, dest / binary.name)   # the binary first: an entry is whole once its .json is there
            shutil.copyfile(meta, dest / meta.name)
    return dest


# ------------------------------------------------- concurrent builds on one cache (tests/test_builds.py)

SMALL_KERNELS = ("tree_build", "merge_states", "tree_accept")   # ~0.2 s each to compile

@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """The concurrent build's binary cache: the user's cache copied, less every build of SMALL_KERNELS, which the
    four processes then compile (each exactly once) while the rest are cache hits. (Without a prior `ddtree-gen
    build` the copy holds less, and the concurrent build compiles the rest: slower, not wrong.)"""
    return seeded_cache(tmp_path_factory.mktemp("ddtree-cache"), leave_out=SMALL_KERNELS)


@pytest.fixture(scope="session")
def session_root(tmp_path_factory) -> Path:
    """specs/ and templates/ of the repository, copied (a snapshot: other work may edit them), as a
    DDTREE_GEN_ROOT whose generated/ the concurrent build writes."""
    dest = tmp_path_factory.mktemp("ddtree-root") / "project"
    dest.mkdir(parents=True)
    for sub in ("specs", "templates"):
        shutil.copytree(REPO / sub, dest / sub)
    return dest


def _overlapping_pairs(names: list[str]) -> list[list[str]]:
    """Four processes, each building ceil(2n / 4) consecutive specs (wrapping around), starting n / 4 apart:
    every spec is built by two processes at once (the same cache keys, the same generated/<spec>/), and the
    four start on four different specs (both cores busy). With four specs, process i builds specs i, i+1."""
    n = len(names)
    per = -(-2 * n // 4)
    return [[names[(i * n // 4 + j) % n] for j in range(per)] for i in range(4)]


@pytest.fixture(scope="session")
def concurrent_build(session_root, session_cache):
    """Four `build` processes started at once on one cache (session_cache: every shipped variant but those of
    SMALL_KERNELS) and one empty generated/ tree, each compiling on its default threads: (root, [(exit, stdout,
    stderr)], seconds, the cache's file names before, and right after). Each writes generated/ of every spec it
    builds, and the variants missing from the cache are compiled with two processes asking for each at once."""
    names = [p.stem for p in spec_paths(REPO / "specs")]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               DDTREE_GEN_CACHE=str(session_cache), DDTREE_GEN_ROOT=str(session_root))
    before = sorted(p.name for p in session_cache.iterdir())
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "ddtree_gen", "build", *group], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for group in _overlapping_pairs(names)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        results.append((p.returncode, out, err))
    seconds = time.perf_counter() - t0
    return session_root, results, seconds, before, sorted(p.name for p in session_cache.iterdir())


def pytest_generate_tests(metafunc):
    if "spec" in metafunc.fixturenames:
        metafunc.parametrize("spec", SPECS, ids=[s.name for s in SPECS])


def random_prompts(batch: int, vocab: int, max_len: int, seed: int) -> list[list[int]]:
    """`batch` prompts of 1 .. max_len random tokens below `vocab` (seeded by seed + batch); with two or more, the
    first is 1 token long and the second max_len (the end-to-end tests' decoders)."""
    import numpy as np
    rng = np.random.default_rng(seed + batch)
    lens = rng.integers(1, max_len + 1, size=batch)
    if batch > 1:
        lens[0], lens[1] = 1, max_len
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lens]


def skip_unless_runs(kset, *names):
    """Skip the test, with the kernel set's reason, when a kernel of `names` cannot run on the current
    device: the wgmma kernels off Hopper or under DDTREE_GEN_ARCH=sm_80 (they have no sm_80 PTX build),
    the mma.sync kernels where the device's shared memory per block is too small (L4, L40S, RTX)."""
    import cupy
    device = cupy.cuda.Device().id
    for name in names:
        why = kset.unavailable(name, device)
        if why:
            pytest.skip(why)


@pytest.fixture
def kset(spec):
    """The compiled kernel set of the spec (GPU tests only)."""
    import ddtree_gen
    return ddtree_gen.load(spec)


class FakeCudaArray:
    """A stand-in CUDA array (only __cuda_array_interface__) for argument checks without a GPU."""

    def __init__(self, shape, dtype, strides=None, ptr=0x10000):
        dt = np.dtype(dtype)
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dt.str, "strides": strides,
                                         "data": (ptr, False), "version": 3}


class FakeArrays:
    """A maker of fake CUDA arrays at distinct, 256-byte aligned, non-overlapping addresses on device 0."""

    def __init__(self):
        self.next = 1 << 32

    def __call__(self, shape, dtype, strides=None, ptr=None):
        if ptr is None:
            ptr, self.next = self.next, self.next + (1 << 32)
        return FakeCudaArray(shape, dtype, strides=strides, ptr=ptr)


def ptr_of(a) -> int:
    """The data pointer of a (fake) CUDA array."""
    return a.__cuda_array_interface__["data"][0]


class LaunchReached(AssertionError):
    """Raised by FakeKernelSet.launch: the launcher passed every check and tried to launch."""


def cuda_core_kernels(spec) -> list:
    """The kernels the spec gets, without the tensor-core tree_verify kernels (the combine kernel stays; their builds
    go with them, an fp8 spec's dequantize path's too): FakeKernelSet's default, so that impl="auto" (and an fp8
    spec's fp8_path=None) is the CUDA-core kernel."""
    from ddtree_gen import registry
    return [d.name for d in registry.declarations()
            if d.build.archs_for(spec) and not (d.serves and d.serves[1] in ("mma", "wgmma"))]


class FakeKernelSet(StandInKernelSet):
    """The package's CPU stand-in (kernel_set.StandInKernelSet) with a launch that refuses to run (CPU tests
    of the checks: LaunchReached). Loaded kernels: by default cuda_core_kernels(spec)."""

    def __init__(self, spec, kernels=None):
        super().__init__(spec, cuda_core_kernels(spec) if kernels is None else kernels)

    def launch(self, name, **kwargs):
        raise LaunchReached(name)


class LaunchLog(FakeKernelSet):
    """A FakeKernelSet that records every launch, (name, keyword arguments), in .seen without refusing it (so one
    kernel set serves many calls) and runs none."""

    def __init__(self, spec, kernels=None):
        super().__init__(spec, kernels)
        self.seen = []

    def launch(self, name, **kwargs):
        self.seen.append((name, kwargs))


def fake_tensor_map(ptr, tm):
    """Fake pointers get fake tensor maps (the driver, which encodes real ones, may be absent): the first of
    the 16 words names the map, so a test can check which array and shape a launch's map describes."""
    return (("tensor map", ptr, tm),) + (0,) * 15


@pytest.fixture
def fake_device(monkeypatch):
    """Every fake array lives on device 0 unless its pointer says otherwise (ptr >= 1<<40: device 1)."""
    from ddtree_gen.launch import arrays, callplan
    monkeypatch.setattr(arrays, "_pointer_device", lambda ptr: 1 if ptr >= 1 << 40 else 0)
    monkeypatch.setattr(callplan, "tensor_map_words", fake_tensor_map)


@pytest.fixture
def fake_alloc(monkeypatch, fake_device):
    """A launcher's own allocations (outputs not given, a workspace) as fake arrays at distinct addresses on
    device 0, and pointer_of reading a fake's address: the list of (shape, dtype) it allocated, in order. What a
    CPU test of a launcher that allocates needs (docs/adding-a-kernel.md, step 5)."""
    from ddtree_gen.launch import runtime
    made = []

    def allocate(kind, device, shape, dtype):
        a = FakeCudaArray(shape, {"bf16": np.uint16}.get(dtype, dtype), ptr=(1 << 36) + (len(made) << 28))
        made.append((shape, dtype))
        return a
    monkeypatch.setattr(runtime, "allocate", allocate)
    monkeypatch.setattr(runtime, "pointer_of", lambda a: a.__cuda_array_interface__["data"][0])
    return made

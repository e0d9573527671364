"""The route of a tree_verify call, by areas of the house (issue 40 item 2, issue 44; CPU, fake binaries, a fake
H200): from the kernel set's method to the launch, the call crosses few areas (an operation's folder, a wing) and
climbs back up the layers of tests/test_imports.py only twice: to ask the kernel set once what it offers on the device (KernelSet.offer) and
where the runtime calls the launcher's prepare step back on a new call signature (runtime.run_call)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import FakeCudaArray, LaunchReached
from ddtree_gen.launch import runtime
from ddtree_gen.spec import find_spec
from test_archs import fake_devices, fake_set  # noqa: F401  (fake_devices: a fixture)
from test_imports import _layer
from test_tree_verify_cpu import Arrays, verify_args


def _rank(module: str) -> int:
    return _layer(module)


def _crossings(call) -> set:
    """The distinct calls from one ddtree_gen module into another while `call` runs to its launch:
    (caller module, caller function, callee module, callee function)."""
    edges = set()

    def profile(frame, event, arg):
        back = frame.f_back
        if event != "call" or back is None:
            return
        m, bm = frame.f_globals.get("__name__", ""), back.f_globals.get("__name__", "")
        if m.startswith("ddtree_gen") and bm.startswith("ddtree_gen") and m != bm:
            edges.add((bm, back.f_code.co_name, m, frame.f_code.co_name))
    sys.setprofile(profile)
    try:
        call()
    except LaunchReached:
        pass
    finally:
        sys.setprofile(None)
    return edges


def area(module: str) -> str:
    """The area of the house a module is in: an operation's folder (ops/<op>), a wing (build, launch), or a top-level
    module of its own (kernel_set, spec, archs, ...). Modules inside one area may come and go (issue 44 split the
    route out of the launcher, the host code out of callplan) without the route crossing more of the house."""
    parts = module.split(".")[1:]
    if parts and parts[0] == "ops" and len(parts) >= 2:
        return "ops/" + parts[1]
    return parts[0] if parts else "__init__"


# spec -> the areas its first call crosses, exactly: the kernel set, its targets (archs) and spec, the launch wing
# (arrays, checks, callplan, hostcode, runtime), tree_verify's folder (launch, route, tensor_core, split, wgmma);
# an fp8 spec: and kv_dequant's folder (the dequantize pre-pass)
AREAS = {"kimi-k2.6-tp8": {"kernel_set", "archs", "spec", "launch", "ops/tree_verify"},
         "kimi-k2.6-tp8-fp8": {"kernel_set", "archs", "spec", "launch", "ops/tree_verify", "ops/kv_dequant"}}


@pytest.mark.parametrize("name", sorted(AREAS))
def test_a_tree_verify_call_asks_the_kernel_set_once(name, fake_devices, monkeypatch):   # noqa: F811
    made = []
    monkeypatch.setattr(runtime, "allocate", lambda kind, device, shape, dtype: made.append(shape) or FakeCudaArray(
        shape, {"bf16": np.uint16}.get(dtype, dtype), ptr=(1 << 36) + (len(made) << 28)))
    monkeypatch.setattr(runtime, "pointer_of", lambda a: a.__cuda_array_interface__["data"][0])
    spec = find_spec(name)
    ks = fake_set(spec)
    args = verify_args(spec, Arrays())
    edges = _crossings(lambda: ks.tree_verify(**args))
    assert ks.launched[0] in ("tree_verify_wgmma", "kv_dequant"), ks.launched[0]   # it reached the launch
    areas = {area(e[0]) for e in edges} | {area(e[2]) for e in edges}
    assert areas == AREAS[name], sorted(areas)
    # the climbs back up the layers between areas: the runtime calls the launcher's prepare step back on a new call
    # signature, and the launcher asks the kernel set once what it offers on the device
    up = sorted({(area(e[0]), area(e[2])) for e in edges if area(e[0]) != area(e[2]) and _rank(e[2]) > _rank(e[0])})
    assert up == [("launch", "ops/tree_verify"), ("ops/tree_verify", "kernel_set")], up
    within = sorted((e[0], e[1], e[2], e[3]) for e in edges if _rank(e[2]) > _rank(e[0]))
    assert within == [("ddtree_gen.launch.runtime", "run_call", "ddtree_gen.ops.tree_verify.launch", "<lambda>"),
                      ("ddtree_gen.ops.tree_verify.launch", "prepare", "ddtree_gen.kernel_set", "offer")], within

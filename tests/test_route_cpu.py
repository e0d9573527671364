"""The route of a tree_verify call, as modules (issue 40 item 2; CPU, fake binaries, a fake H200): from the kernel
set's method to the launch, the call crosses few modules ("rooms") and climbs back up the layers of
tests/test_imports.py only twice: to ask the kernel set once what it offers on the device (KernelSet.offer) and
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


# spec -> the most modules its first call may cross (bf16: the kernel set, its runtime and archs, the launcher, the
# route (ops/tree_verify/route.py: fp8 path, backend, build in one module since issue 44), the checks, the tensor-core
# plan, two build-data modules, arrays, callplan, hostcode (where the first call of a signature compiles its runner:
# issue 44 moved that out of callplan), spec; fp8: and the dequantize pre-pass's two)
ROOMS = {"kimi-k2.6-tp8": 13, "kimi-k2.6-tp8-fp8": 15}


@pytest.mark.parametrize("name", sorted(ROOMS))
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
    rooms = {e[0] for e in edges} | {e[2] for e in edges}
    assert len(rooms) <= ROOMS[name], sorted(rooms)
    up = sorted((e[0], e[1], e[2], e[3]) for e in edges if _rank(e[2]) > _rank(e[0]))
    assert up == [("ddtree_gen.launch.runtime", "run_call", "ddtree_gen.ops.tree_verify.launch", "<lambda>"),
                  ("ddtree_gen.ops.tree_verify.launch", "prepare", "ddtree_gen.kernel_set", "offer")], up

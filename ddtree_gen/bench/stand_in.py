"""A kernel set without a GPU: the CPU harness of the host path (scripts/profile_launch.py, probe_op_dispatch.py and
tests/test_host_path_cpu.py; no `ddtree-gen bench NAME`: it uses bench launch's call table, and no benchmark
imports it).

stand_in_kset(spec) is a real KernelSet of the spec (its plans, constants and launchers) whose binaries are
stand-ins, on a stand-in device 0 (compute capability 9.0, so impl="auto" picks wgmma as on an H200), with the
driver's cuLaunchKernel, stream and device calls replaced by no-ops that count the launches. torch CPU tensors
stand for CUDA tensors of device 0 (torch_cpu_as_device0: their views say device 0, outputs are allocated on the
CPU), so the torch path is the engine's path minus the driver and the CUDA caching allocator; cpu_torch_ops(ks)
registers the torch ops' CUDA implementations for the CPU key, on that kernel set. Each replacement is made by
`patch` / `patch_item` (setattr / setitem; a test passes monkeypatch.setattr / monkeypatch.setitem, which undo
them). Besides runtime.cuda_entries() (the driver entries, public) the replacements reach into the package's own
private names (runtime.DeviceModules._load, callplan._encode_tiled, arrays' fast views and output allocators,
torch_ops' kernel-set lookup): this module is their one user outside those modules, so that scripts/ need none.
"""
from __future__ import annotations

import operator
from typing import NamedTuple


class PdlLaunch(tuple):
    """stand_in_kset's record of a programmatic dependent launch: the fields of a plain launch's record."""


class _Built:
    """An artifacts.Built stand-in: KernelSet reads .binary, .arch and .variant (its plan)."""

    def __init__(self, v):
        self.binary, self.arch, self.variant = b"", v.target, v


def stand_in_kset(spec, patch=setattr, patch_item=operator.setitem):
    """A real KernelSet of `spec` with stand-in binaries, on a stand-in Hopper device 0 whose launches are
    counted, not run, and torch CPU tensors standing for device 0's (torch_cpu_as_device0). Returns (kset,
    launches: a list of (function, grid, block, shared memory, stream, the parameter buffer's address) per
    cuLaunchKernel call; a programmatic dependent launch's (cuLaunchKernelEx: launch/pdl.py) the same as a PdlLaunch)."""
    from ..launch import callplan, runtime
    from ..kernel_set import KernelSet
    from ..ops import all_kernels
    from ..build.variant import variant

    info = runtime.DeviceInfo("stand-in H200", (9, 0), 232448)
    patch(runtime, "device_info", lambda device: info)
    patch(runtime, "sm_count", lambda device: 132)
    launches = []

    def launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        launches.append((fn, (gx, gy, gz), (bx, by, bz), smem, stream, params))

    def launch_pdl(name, fn, gx, gy, gz, bx, by, bz, smem, stream, params):
        launches.append(PdlLaunch((fn, (gx, gy, gz), (bx, by, bz), smem, stream, params)))

    cuda = runtime.cuda_entries()   # the real entry points first (a torch or CuPy import), then the stand-ins over them
    for key, value in (("launch", launch), ("launch_pdl", launch_pdl), ("get_device", lambda: 0),
                       ("set_device", lambda d: None),
                       ("cupy_stream", lambda d: type("S", (), {"ptr": 0})()), ("torch_stream", lambda d: 0)):
        patch_item(cuda, key, value)

    def fake_load(self, name, device):
        arch, why = self.choose(name, device)
        if arch is None:
            raise runtime.ArgumentError(why)
        b = self._kernels[name][arch]
        return None, 0x1000 + len(name), b.threads, b.dynamic_smem

    patch(runtime.DeviceModules, "_load", fake_load)

    def encode(out, *args):   # cuTensorMapEncodeTiled: 16 words of zeros
        return 0

    patch(callplan, "_encode_tiled", lambda: encode)
    torch_cpu_as_device0(patch, patch_item)
    built = {k.name: {a: _Built(variant(k, spec, a)) for a in k.archs_for(spec)}
             for k in all_kernels() if k.archs_for(spec)}
    return KernelSet(spec, built), launches


def torch_cpu_as_device0(patch=setattr, patch_item=operator.setitem) -> None:
    """torch CPU tensors stand for CUDA tensors of device 0: their view (the checks) and fast view (the
    signature) say device 0 (runtime.HOST_DEVICE), and new outputs are CPU tensors."""
    import torch

    from ..launch import arrays, runtime
    real_view = arrays.view

    def view(x, name):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            dt = arrays._TORCH_DTYPES.get(str(x.dtype), str(x.dtype))
            return (arrays.DevArray(x, x.data_ptr(), tuple(x.shape), dt, "torch", runtime.HOST_DEVICE),
                    x.is_contiguous())
        return real_view(x, name)
    patch(arrays, "view", view)

    def torch_fast(x):   # arrays._torch_fast with the device index of a CUDA tensor
        return x.data_ptr(), (x.dtype, x.shape, x.stride(), runtime.HOST_DEVICE)
    patch_item(arrays._FAST, torch.Tensor, torch_fast)
    arrays.TORCH_TENSOR[0] = torch.Tensor   # (what the first torch array sets)
    cpu = torch.device("cpu")
    patch(arrays, "torch_device", lambda device: cpu)
    patch(runtime, "HOST_DEVICE", 0)   # run_call's inline view of a torch tensor: a CPU tensor stands for device 0
    for name, dt in (("bf16", torch.bfloat16), ("int32", torch.int32), ("float32", torch.float32),
                     ("uint32", torch.uint32), ("uint8", torch.uint8)):
        for device in (0, 1):
            patch_item(arrays._TORCH_NEW, (name, device), (torch.empty, {"dtype": dt, "device": cpu}))


def cpu_torch_ops(ks, names=None, patch=setattr):
    """The torch ops (`names`, default every registered one) through their CUDA implementations, registered for
    the CPU key, on kernel set `ks` (torch_ops' kernel-set lookup replaced). Returns the torch.library.Library
    that holds the registrations (keep it alive while the ops are called)."""
    import warnings

    import torch

    from .. import registry, torch_ops
    patch(torch_ops, "_kset", lambda name: ks)
    lib = torch.library.Library("ddtree", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Overriding a previously registered kernel" where another call did
        for name in names or [op.name for _, op in registry.torch_ops()]:
            lib.impl(name, torch_ops.implementation(name), "CPU")
    return lib


class Harness(NamedTuple):
    """The CPU harness of scripts/profile_launch.py and probe_op_dispatch.py."""
    kset: object       # stand_in_kset's kernel set
    launches: list     # its counted launches
    calls: dict        # `bench launch`'s call table (bench.launch.call_table, ops=True) on torch CPU tensors
    library: object    # cpu_torch_ops' registrations (keep it alive while the ops are called)


def harness(spec, patch=setattr, patch_item=operator.setitem) -> Harness:
    """stand_in_kset(spec), the torch ops registered for the CPU key on it, and `bench launch`'s call table on its
    tiny problem (bench.launch.tiny_inputs, kind "cpu")."""
    from .launch import call_table, tiny_inputs
    ks, launches = stand_in_kset(spec, patch, patch_item)
    lib = cpu_torch_ops(ks, patch=patch)
    return Harness(ks, launches, call_table(ks, spec, tiny_inputs(spec, "cpu"), ops=True), lib)

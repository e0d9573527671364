"""Runtime: compiled modules per device, the launch itself, and the per-signature call cache.

A launcher splits its work in two (FlashInfer's plan/run, Triton's specialization cache):
  * prepare(...): every check that depends on the arguments' signatures (kind, dtype, shape,
    strides, device) and on the scalar arguments, and everything derived from them (grid,
    output shapes, the kernel's argument list). It runs once per signature and is cached
    (runtime.run_call); it raises ArgumentError before anything is launched or allocated.
  * per call: the data pointers, the pointer checks (alignment, overlap), the new outputs and
    the launch on the current stream of the arrays' device.
A cached signature of torch tensors is found by a guarded entry first (_guard: torch's TensorGuards checks
every tensor's metadata in one C call), else by its signature in a dict.
Modules are loaded lazily per device, under a lock, so a kernel set works on any GPU of the
process and from any thread; per device, each kernel's build is the one of its targets that runs
there (archs.select: the sm_90a cubin on compute capability 9.0, the sm_80 PTX elsewhere). This
module imports nothing above it (no artifacts, no launchers).
"""
from __future__ import annotations

import ctypes
import functools
import operator
import re
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable

from .. import archs
from . import arrays as _arrays
from . import pdl as _pdl
from .arrays import allocate, dlpack_only, fast_view, from_dlpack, pointer_of
from .callplan import (EMPTY_US, OUTPUT_ALIGN, TENSOR_MAP_WORDS, VIEW_US, IsAligned, OutputPlan,  # noqa: F401
                       ParamStruct, Step, StepPlan, TensorMap, _TENSOR_MAPS, _param_fmt, _values,
                       param_offsets, tensor_map_words)
from ..errors import ArgumentError, BuildError
from .hostcode import compile_runner, matcher

__all__ = ["Step", "IsAligned", "TensorMap", "Prepared", "run_call", "DeviceModules", "Binary", "DeviceInfo",
           "DeviceOffer", "device_info"]


@dataclass
class Prepared:
    """What the checks concluded for one call signature; everything except the pointers.

    arrays: the call's array list is the launcher's array arguments (inputs, then outputs; None
    where not given) in a fixed order; `new` lists (index, shape, dtype) of those to allocate when
    not given. `aligned`: (index, bytes, message); `disjoint`: (a, a_bytes, b, b_bytes, exact_ok,
    message) pairs that must not overlap (exact_ok: the same pointer is allowed, an in-place op).
    `returns` = (record, indices): the launcher's return value is record(*arrays[indices]) (record None:
    None); `result(arrays)` builds it from the final array list (made from `returns` when not given).
    Derived once: `plans` (StepPlan per step), `outputs` (OutputPlan of `new`), `bound` (the launches
    bound to the kernel set's loaded modules) and `run` (the cached call compiled: hostcode.compile_runner),
    both on the first call: run_call."""
    device: int
    kind: str                       # "torch", "cupy" or "cai": the kind of arrays to allocate
    steps: tuple
    result: Callable = None
    new: tuple = ()
    aligned: tuple = ()
    disjoint: tuple = ()
    scratch: tuple = ()             # indices of `new` the result never reads (a workspace): pointers only
    returns: tuple = None                   # (record, indices of the arrays it holds): the return value
    plans: tuple = field(init=False, repr=False, compare=False)
    outputs: object = field(init=False, repr=False, compare=False)
    bound: object = field(init=False, default=None, repr=False, compare=False)
    group_ok: object = field(init=False, default=None, repr=False, compare=False)
    group_checks: object = field(init=False, default=None, repr=False, compare=False)
    run: object = field(init=False, default=None, repr=False, compare=False)
    guarded: object = field(init=False, default=None, repr=False, compare=False)   # False: no guarded entry (_guard)

    def __post_init__(self):
        if self.result is None:
            record, indices = self.returns
            self.result = ((lambda a: record(*(a[i] for i in indices))) if record is not None else
                           (lambda a: None))
        self.steps = tuple(Step(s.kernel, s.grid, s.args, _param_fmt(s.args), s.pdl) for s in self.steps)
        self.plans = tuple(StepPlan(s) for s in self.steps)
        self.outputs = OutputPlan(self.new, self.scratch) if self.new else None

    def check_group_pointers(self, ptrs: list, group: int) -> None:
        """check_pointers when arrays[group:] are a run of one signature (run_call's `group`): the checks of
        the run's pointers are skipped when they are the pointers of the last call that passed them (the
        same list of layer caches), the others always run."""
        layers = ptrs[group:]
        if layers != self.group_ok:
            self.check_pointers(ptrs)
            self.group_ok = layers
            return
        head = self.group_checks
        if head is None or head[0] != group:
            head = self.group_checks = (group, tuple(c for c in self.aligned if c[0] < group),
                                        tuple(c for c in self.disjoint if c[0] < group or c[2] < group))
        Prepared.check_pointers(_Checks(head[1], head[2]), ptrs)

    def check_pointers(self, ptrs: list) -> None:
        for i, alignment, message in self.aligned:
            if ptrs[i] % alignment:
                raise ArgumentError(message.format(ptr=ptrs[i]))
        for a, na, b, nb, exact_ok, message in self.disjoint:
            pa, pb = ptrs[a], ptrs[b]
            if na and nb and pa < pb + nb and pb < pa + na and not (exact_ok and pa == pb):
                raise ArgumentError(message)


@dataclass
class _Checks:
    aligned: tuple
    disjoint: tuple


HOST_DEVICE = -1   # the device index run_call gives a torch CPU tensor: -1 (refused by the checks); the CPU
                   # profile (scripts/profile_launch.py) sets 0, so that CPU tensors stand for CUDA ones
_LAYER_META = operator.attrgetter("shape", "dtype")


def _group_signature(arrays, first: int, ptrs: list, sigs: list) -> bool:
    """The signature and pointers of arrays[first:], a run of torch tensors that must share one signature
    (kv_commit's layer caches), read with one C-level map per attribute: True and ptrs/sigs extended when
    they are all torch tensors of one shape, dtype and device, each C-contiguous (then their strides are
    those of the shape wherever a stride matters); False otherwise (read one by one: run_call)."""
    tensor = _arrays.TORCH_TENSOR[0]
    group = arrays[first:]
    n = len(group)
    if tensor is None or not n:
        return False
    try:
        lp = list(map(tensor.data_ptr, group))
        meta = list(map(_LAYER_META, group))
        contiguous = list(map(tensor.is_contiguous, group))
        devices = list(map(tensor.get_device, group))
    except TypeError:   # not torch tensors
        return False
    d0 = devices[0] if devices[0] >= 0 else HOST_DEVICE
    if d0 < 0 or meta.count(meta[0]) != n or contiguous.count(True) != n or devices.count(devices[0]) != n:
        return False
    ptrs.extend(lp)
    sigs.append(("group", n, *meta[0], d0))
    return True


# guarded entries per launcher (signatures x dispatch contexts), the newest first; a new one pushes the oldest out
# (each entry a call passes over costs it ~0.45 us on the build machine). A launcher that has made GUARDED_MADE
# of them (signatures that come and go faster than the entries hold them: each miss costs the failed tests and a
# new guard) keeps the dict alone.
GUARDED_ENTRIES, GUARDED_MADE = 4, 64
_GUARDS = []          # torch's TensorGuards (or None where it is absent or does not check what a signature holds)
_DATA_PTR = [None]    # torch.Tensor.data_ptr


def _tensor_guards():
    """torch._C._dynamo.guards.TensorGuards, the C++ check behind torch.compile's guards: built from example
    tensors, check(*tensors) is True when each has the same Python type, dispatch keys (device type, the
    thread's dispatch state), dtype, device index, requires_grad, sizes and strides as its example (and no
    tensor is passed twice), i.e. everything run_call's signature of a torch tensor holds, and more. A private
    torch API: probed once on what the signature needs it to refuse; None (run_call's dict alone) if it fails."""
    if not _GUARDS:
        cls = None
        try:
            import torch
            from torch._C._dynamo.guards import TensorGuards as cls
            a = torch.zeros((2, 3), dtype=torch.int32)
            g = cls(a, dynamic_dims_sizes=None, dynamic_dims_strides=None)
            others = (torch.zeros((3, 2), dtype=torch.int32), torch.zeros((2, 3), dtype=torch.float32),
                      torch.zeros((3, 2), dtype=torch.int32).t(), torch.zeros((2, 3), dtype=torch.uint32),
                      torch.zeros((2, 3, 1), dtype=torch.int32), torch.zeros(6, dtype=torch.int32))
            if not g.check(torch.ones((2, 3), dtype=torch.int32)) or any(g.check(x) for x in others):
                cls = None
            _DATA_PTR[0] = torch.Tensor.data_ptr
        except Exception:   # noqa: BLE001 - absent or changed: the dict alone
            cls = None
        _GUARDS.append(cls)
    return _GUARDS[0]


def _guard(kset, code, key, arrays: tuple, prep: Prepared) -> None:
    """Give prep a guarded entry under its launcher's code (run_call's first test): its scalar key, the length of
    its leading run of torch tensors and the Nones after them, a TensorGuards of those tensors and the entry's test
    of a call's arrays compiled from them (hostcode.matcher). Only
    for calls whose arrays are torch.Tensor objects followed by Nones (prep.guarded = False otherwise: that is
    fixed by the signature); a tensor passed twice is guarded once, its repeats tested by identity (`alias`: the
    picker of the distinct tensors and the (repeat, first) positions). GUARDED_ENTRIES / GUARDED_MADE bound them."""
    made = kset.prepared_calls.get(("guarded entries made", code), 0)
    if made >= GUARDED_MADE:   # signatures come and go too often here: the dict alone
        return
    m = len(arrays)
    while m and arrays[m - 1] is None:
        m -= 1
    head, tensor = arrays[:m], _arrays.TORCH_TENSOR[0]
    guards = _tensor_guards() if tensor is not None else None
    if guards is None or not m or any(type(a) is not tensor for a in head):
        prep.guarded = False
        return
    # a tensor passed twice (merge_states in place): the guard holds each tensor once, the entry the repeats
    first, alias = {}, []
    for j, a in enumerate(head):
        i = first.setdefault(id(a), j)
        if i != j:
            alias.append((j, i))
    unique = tuple(first.values())
    if alias:
        pick = operator.itemgetter(*unique) if len(unique) > 1 else (lambda h, i=unique[0]: (h[i],))
        alias, tensors = (pick, tuple(alias)), pick(head)
    else:
        alias, tensors = None, head
    g = guards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    if g.check(*tensors):
        prep.guarded = True
        n = len(arrays) - m
        match = matcher(m, n, g.check, alias[1] if alias else (), unique, _DATA_PTR[0])
        entry = (key, HOST_DEVICE, m, (type(None),) * n, (0,) * n, g, alias, match, prep)
        entries = kset.prepared_calls.get(code, ())
        kset.prepared_calls[code] = (entry, *entries[:GUARDED_ENTRIES - 1])   # the oldest out
        kset.prepared_calls[("guarded entries made", code)] = made + 1
        if made + 1 >= GUARDED_MADE:
            del kset.prepared_calls[code]


def run_call(kset, prepare: Callable, arrays: tuple, key: tuple, *, cache: bool = True, group: int | None = None):
    """Run one launcher call: the cached Prepared of this signature (prepare() on a miss), the
    pointer checks, new outputs, the launches. `prepare()` takes no arguments (a closure over the
    launcher's arguments); `key` holds the launcher's non-array arguments that prepare reads.
    `group`: arrays[group:] must share one signature (kv_commit's layers): read in one pass (_group_signature)."""
    if cache:   # a guarded entry of this launcher (_guard): the signature checked by torch in one C call
        code = prepare.__code__
        entries = kset.prepared_calls.get(code, ())
        for e in entries:
            # (host: the device a CPU tensor stands for, part of its signature, -1 on a GPU; e[7]: the entry's
            # compiled test of the arrays, their pointers or None: hostcode.matcher)
            if e[0] == key and e[1] == HOST_DEVICE:
                ptrs = e[7](arrays)
                if ptrs is not None:
                    return e[8].run(arrays, ptrs)
    n = len(arrays) if group is None else group
    ptrs, sigs = [0] * n, [None] * n
    tensor = _arrays.TORCH_TENSOR[0]
    for i in range(n):
        a = arrays[i]
        if a is None:
            continue
        if type(a) is tensor:   # torch.Tensor, inline (the common case)
            dev = a.get_device()
            if dev >= 0 or (dev := HOST_DEVICE) >= 0:
                ptrs[i] = a.data_ptr()
                # every array argument must be C-contiguous (the checks refuse any other), so its contiguity
                # stands for its strides: equal (dtype, shape, contiguous, device) pass the same checks
                sigs[i] = (a.dtype, a.shape, a.is_contiguous(), dev)
                continue
        p, s = fast_view(a)
        if s is None:   # not cacheable: checked in full by prepare(), which names what is wrong
            cache = False
            if dlpack_only(a):   # launched through its zero-copy CuPy view, returned as that view
                arrays = (*arrays[:i], from_dlpack(a, "argument"), *arrays[i + 1:])
                p, _ = fast_view(arrays[i])
        ptrs[i] = p
        sigs[i] = s
        tensor = _arrays.TORCH_TENSOR[0]
    if group is not None and not _group_signature(arrays, group, ptrs, sigs):
        return run_call(kset, prepare, arrays, key, cache=cache)
    prepared_calls = kset.prepared_calls
    k = (prepare.__code__, key, tuple(sigs)) if cache else None
    try:
        prep = prepared_calls.get(k) if cache else None
    except TypeError:   # an unhashable scalar argument (a list as softmax_scale / kv_scale): prepare() refuses it
        cache, prep = False, None
    if prep is None:
        prep = prepare()
        if cache:
            prepared_calls[k] = prep
    elif prep.run is not None:   # the cached call, compiled (hostcode.compile_runner)
        if prep.guarded is not False:
            _guard(kset, prepare.__code__, key, arrays, prep)
        return prep.run(arrays, ptrs)
    # the first call of this signature (or a call that is not cached): checked and bound here
    if prep.aligned or prep.disjoint:
        if group is None:
            prep.check_pointers(ptrs)
        else:
            prep.check_group_pointers(ptrs, group)
    bound = prep.bound
    if bound is None:
        bound = prep.bound = _bind(kset, prep)
    if cache:
        prep.run = compile_runner(prep, bound, (_CUDA or _cuda()) if bound else {}, arrays, group, kset,
                                  (allocate, pointer_of))
        _guard(kset, prepare.__code__, key, arrays, prep)
        return prep.run(arrays, ptrs)
    if prep.new:
        arrays = list(arrays)
        missing = [n for n in prep.new if arrays[n[0]] is None]
        if len(missing) == len(prep.new) and prep.kind != "cai" and not (prep.kind == "torch" and
                                                                         prep.outputs.separate):
            prep.outputs.allocate(prep.kind, prep.device, arrays, ptrs)
        else:   # some outputs given, or not a torch / CuPy caller: one allocation per output
            for i, shape, dtype in missing:
                arrays[i] = allocate(prep.kind, prep.device, shape, dtype)
                ptrs[i] = pointer_of(arrays[i])
    if bound:
        _launch_bound(bound, ptrs, prep.device, prep.kind)
    else:
        for plan in prep.plans:   # (pdl= only where the step asks for it: a kset's own launch may not take it)
            kset.launch(plan.kernel, grid=plan.grid, args=plan.values(ptrs), device=prep.device, kind=prep.kind,
                        fmt=plan.fmt, **({"pdl": True} if plan.pdl else {}))
    return prep.result(arrays)


def _bind(kset, prep: Prepared):
    """prep's launches bound to kset's loaded modules (function, geometry, parameter buffer per step), or
    False where kset is not a kernel set over DeviceModules with their launch (a test stand-in, a kernel set
    whose launch is replaced): then run_call goes through kset.launch. Loads the modules (an ArgumentError if
    a kernel cannot run on the device) before anything is allocated or launched."""
    attrs = getattr(kset, "__dict__", None) or {}
    modules = attrs.get("_modules")
    if (not isinstance(modules, DeviceModules) or "launch" in attrs
            or not getattr(getattr(type(kset), "launch", None), "direct", False)):
        return False
    return tuple(modules.bind(plan, prep.device) for plan in prep.plans) or False


def _launch_bound(bound, ptrs, device: int, kind: str) -> None:
    cuda = _CUDA or _cuda()
    stream = cuda["torch_stream"](device) if kind == "torch" else cuda["cupy_stream"](device).ptr
    launch = cuda["launch"]
    previous = cuda["get_device"]()
    if previous != device:
        cuda["set_device"](device)
    try:
        for fn, gx, gy, gz, threads, smem, storage, params, lock, pack_into, plan, last, _ in bound:
            with lock:   # the parameter buffer is reused; the driver copies it at launch
                # the values are a function of the pointers alone: the same pointers as the last launch of
                # this step (the caching allocator hands the same blocks back), the buffer holds them already
                if last[0] != ptrs:
                    pack_into(storage, 0, *plan.values(ptrs))
                    last[0] = ptrs
                if plan.pdl:   # a programmatic dependent of the launch before it (launch/pdl.py)
                    cuda["launch_pdl"](plan.kernel, fn, gx, gy, gz, threads, 1, 1, smem, stream, params)
                else:
                    launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, params, 0)
    finally:
        if previous != device:
            cuda["set_device"](previous)



# ----------------------------------------------------------------------- devices, launch

@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    """Streaming multiprocessors of `device` (132 on H100 / H200 SXM when it cannot be asked)."""
    try:
        import cupy
        return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    except Exception:   # no device (argument-check tests)
        return 132


_CUDA = {}   # the driver/runtime entry points a launch uses, looked up once


def _cuda() -> dict:
    if not _CUDA:
        import cupy
        from cupy.cuda import driver, runtime
        _CUDA.update(launch=driver.launchKernel, get_device=runtime.getDevice, set_device=runtime.setDevice,
                     cupy_stream=cupy.cuda.get_current_stream, launch_pdl=_pdl.launch)
        try:
            import torch
            _CUDA["torch_stream"] = torch._C._cuda_getCurrentRawStream
        except (ImportError, AttributeError):
            pass
    return _CUDA


def cuda_entries() -> dict:
    """The driver / runtime entry points a launch uses, looked up on first use: launch (cuLaunchKernel, CuPy's
    binding), launch_pdl (a programmatic dependent launch, cuLaunchKernelEx: pdl.launch, its own arguments), get_device,
    set_device, cupy_stream (the current CuPy stream) and, with torch, torch_stream (its raw current stream). The
    runtime reads this one table per call; a probe may call its entries, a stand-in replace them
    (ddtree_gen.bench.stand_in)."""
    return _CUDA or _cuda()


def current_stream(device: int, kind: str) -> int:
    """The caller's current stream on `device`: torch's for torch inputs, else CuPy's."""
    cuda = _CUDA or _cuda()
    if kind == "torch":
        return cuda["torch_stream"](device)
    return cuda["cupy_stream"](device).ptr


@dataclass(frozen=True)
class DeviceOffer:
    """What a kernel set offers on one device, as data: the one answer a launcher's route asks of the set
    (KernelSet.offer), so that the route and the launch plan read it instead of asking the set again.
    device None: not known (the call's checks will say why); then no build runs."""
    spec: object                 # the set's Spec
    device: int | None
    builds: frozenset            # the builds with a binary in the set (KernelSet.builds)
    requested: frozenset         # the builds it was loaded with (KernelSet.requested)
    spec_builds: frozenset       # every build the spec gets (plans: KernelDef.builds_for), loaded or not
    targets: dict                # build -> the target it runs as on `device` (absent: it does not run there)
    why: dict                    # build -> why it does not run there (KernelSet.unavailable), for each requested one
    consts: dict                 # build -> the template constants of that target's build
    records: dict = field(default_factory=dict)   # build -> its typed record as loaded (plans: KernelDef.record)
    declared: dict = field(default_factory=dict)  # every build the spec gets -> its record as declared (its policy's)

    def record(self, name: str):
        """The typed record of build `name` as the set loaded it (a variant set's knobs included), else as declared."""
        return self.records[name] if name in self.records else self.declared[name]

    def unavailable(self, name: str) -> str | None:
        """None if build `name` runs on the device, else why not (KernelSet.unavailable's message)."""
        if name in self.targets:
            return None
        return self.why.get(name) or f"{name}: not loaded in this kernel set of spec {self.spec.name!r}"

    def runs(self, name: str) -> bool:
        return name in self.targets

    def require(self, name: str) -> str:
        """The target `name` runs as; ArgumentError (unavailable()'s message) if it does not run on the device."""
        if name not in self.targets:
            raise ArgumentError(self.unavailable(name))
        return self.targets[name]

    def constants(self, name: str) -> dict:
        """The template constants of build `name` on the device (a build that does not run: its first target's)."""
        return self.consts[name]


@dataclass(frozen=True)
class DeviceInfo:
    """What the choice of a build needs to know about a device."""
    name: str
    cc: tuple            # compute capability (major, minor)
    smem_optin: int      # shared memory per block a kernel may opt in to, bytes

    def describe(self, device: int) -> str:
        return f"device {device} ({self.name}, compute capability {archs.cc_text(self.cc)})"


@functools.lru_cache(maxsize=None)
def device_info(device: int) -> DeviceInfo:
    """The name, compute capability and opt-in shared memory limit of `device` (asked once)."""
    from cupy.cuda import runtime
    p = runtime.getDeviceProperties(device)
    name = p["name"].decode(errors="replace") if isinstance(p["name"], bytes) else str(p["name"])
    return DeviceInfo(name, (int(p["major"]), int(p["minor"])), int(p["sharedMemPerBlockOptin"]))


@dataclass(frozen=True)
class Binary:
    """One build of a kernel: the shipped binary (a cubin, or PTX text the driver JIT-compiles) and its launch geometry."""
    data: bytes
    entry: str           # extern "C" symbol
    threads: int         # threads per block
    dynamic_smem: int    # dynamic shared memory bytes per block (passed at launch)
    static_smem: int = 0   # static shared memory bytes per block


class DeviceModules:
    """The binaries of a kernel set, one per build target (archs.py), loaded per device on first use
    (thread-safe), and the launch.

    kernels: name -> {target: Binary} (or a bare Binary / (data, entry, threads, dynamic smem) tuple:
    an sm_90a build). Per kernel and device the build is archs.select(): the sm_90a cubin on compute
    capability 9.0, the sm_80 PTX on any other of 8.0 or later; `forced` (a target) makes it that one
    everywhere. A kernel whose builds do not run on a device, or need more shared memory per block
    than it allows, is not available there: unavailable() says why, and function() / launch() raise
    ArgumentError with that text."""

    def __init__(self, kernels: dict, forced: str | None = None):
        self._kernels = {name: _builds(b) for name, b in kernels.items()}
        self.forced = forced
        self._loaded: dict = {}       # (name, device) -> (module, function pointer, threads, dynamic smem)
        self._chosen: dict = {}       # (name, device) -> (target or None, reason or None)
        self._lock = threading.Lock()
        self._params: dict = {}       # parameter format -> (buffer, kernelParams address, lock, flat format, keep-alive)

    @property
    def names(self) -> list:
        return list(self._kernels)

    def archs(self, name: str) -> tuple:
        """The targets `name` is built for in this set, in preference order."""
        return archs.ordered(self._kernels.get(name, {}))

    def choose(self, name: str, device: int) -> tuple:
        """(target, None) of the build of `name` that runs on `device`, or (None, why not)."""
        hit = self._chosen.get((name, device))
        if hit is None:
            hit = self._chosen.setdefault((name, device), self._choose(name, device))
        return hit

    def _choose(self, name, device):
        info = device_info(device)
        builds = self._kernels.get(name, {})
        arch = archs.select(info.cc, builds, self.forced)
        where = f"{name}: not available on {info.describe(device)}"
        if arch is None:
            return None, f"{where}: {archs.why_not(info.cc, builds, self.forced)}"
        b = builds[arch]
        need = b.static_smem + b.dynamic_smem
        if need > info.smem_optin:
            return None, (f"{where}: its {arch} build needs {need} bytes of shared memory per block, the device "
                          f"allows {info.smem_optin}")
        return arch, None

    def arch_for(self, name: str, device: int) -> str | None:
        return self.choose(name, device)[0]

    def unavailable(self, name: str, device: int) -> str | None:
        """None if `name` can run on `device`, else why not (naming the kernel, the device and its
        compute capability)."""
        return self.choose(name, device)[1]

    def function(self, name: str, device: int) -> int:
        return self._entry(name, device)[1]

    def _entry(self, name: str, device: int):
        hit = self._loaded.get((name, device))
        if hit is not None:
            return hit
        with self._lock:
            if (name, device) not in self._loaded:
                self._loaded[(name, device)] = self._load(name, device)
            return self._loaded[(name, device)]

    def _load(self, name: str, device: int):
        import cupy
        arch, why = self.choose(name, device)
        if arch is None:
            raise ArgumentError(why)
        b = self._kernels[name][arch]
        with cupy.cuda.Device(device):
            module = cupy.cuda.function.Module()
            try:
                module.load(b.data)
            except cupy.cuda.driver.CUDADriverError as e:
                raise BuildError(_load_error(name, arch, b.data, device, e)) from None
            fn = module.get_function(b.entry)
            if b.dynamic_smem > 48 * 1024:   # above 48 KB a block gets dynamic shared memory only by opting in, per device
                drv = cupy.cuda.driver
                drv.funcSetAttribute(fn.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, b.dynamic_smem)
        return module, fn.ptr, b.threads, b.dynamic_smem   # the module object keeps the function alive

    def _param_buffer(self, fmt: str):
        """(buffer, kernelParams address, lock, flat struct format, keep-alive) for a parameter layout."""
        buf = self._params.get(fmt)
        if buf is None:
            with self._lock:
                flat = fmt.replace("[", "").replace("]", "")
                storage = ctypes.create_string_buffer(max(struct.calcsize(flat), 8))
                base = ctypes.addressof(storage)
                starts = [base + o for o in param_offsets(fmt)]
                params = (ctypes.c_void_p * max(1, len(starts)))(*starts)
                buf = self._params.setdefault(fmt, (storage, ctypes.addressof(params), threading.Lock(), flat,
                                                    params))
        return buf

    def bind(self, plan: StepPlan, device: int) -> tuple:
        """One step of a call bound to its function on `device` (loaded here) and a parameter buffer of its
        own: what run_call's launch reads per call."""
        _, fn, threads, smem = self._entry(plan.kernel, device)
        fmt = plan.fmt
        flat = fmt.replace("[", "").replace("]", "")
        storage = ctypes.create_string_buffer(max(struct.calcsize(flat), 8))
        base = ctypes.addressof(storage)
        starts = [base + o for o in param_offsets(fmt)]
        params = (ctypes.c_void_p * max(1, len(starts)))(*starts)
        gx, gy, gz = (*plan.grid, 1, 1)[:3]
        return (fn, gx, gy, gz, threads, smem, storage, ctypes.addressof(params), threading.Lock(),
                struct.Struct(flat).pack_into, plan, [None], params)

    def launch(self, name: str, grid: tuple, args: list, device: int, kind: str, fmt: str, pdl: bool = False) -> None:
        """Launch `name` on `device`'s current stream (switching the thread's device for the call only); pdl: as a
        programmatic dependent of the launch before it (launch/pdl.py)."""
        cuda = _CUDA or _cuda()
        _, fn, threads, smem = self._loaded.get((name, device)) or self._entry(name, device)
        stream = current_stream(device, kind)
        storage, params, lock, flat, _ = self._params.get(fmt) or self._param_buffer(fmt)
        gx, gy, gz = (*grid, 1, 1)[:3]
        previous = cuda["get_device"]()
        if previous != device:
            cuda["set_device"](device)
        try:
            with lock:   # the parameter buffer is reused; the driver copies it at launch
                struct.pack_into(flat, storage, 0, *args)
                if pdl:
                    cuda["launch_pdl"](name, fn, gx, gy, gz, threads, 1, 1, smem, stream, params)
                else:
                    cuda["launch"](fn, gx, gy, gz, threads, 1, 1, smem, stream, params, 0)
        finally:
            if previous != device:
                cuda["set_device"](previous)


def _builds(b) -> dict:
    """A kernel's builds as {target: Binary} (DeviceModules' input forms)."""
    if isinstance(b, dict):
        return {a: x if isinstance(x, Binary) else Binary(*x) for a, x in b.items()}
    return {archs.PRIMARY: b if isinstance(b, Binary) else Binary(*b)}


def _ptx_header(data: bytes) -> tuple:
    """(PTX ISA version, the CUDA release that wrote it) from a PTX text's header, '?' where absent."""
    head = data[:1024].decode(errors="replace")
    isa = re.search(r"^\.version\s+(\S+)", head, re.M)
    release = re.search(r"release (\d+\.\d+)", head)
    return (isa.group(1) if isa else "?"), (release.group(1) if release else "?")


def _load_error(name: str, arch: str, data: bytes, device: int, error) -> str:
    """The message of a module that the driver refused to load."""
    where = f"{name}: the driver could not load its {arch} build on {device_info(device).describe(device)}: {error}"
    if archs.BINARY[arch] != "ptx":
        return where
    isa, release = _ptx_header(data)
    try:
        from cupy.cuda import runtime
        v = runtime.driverGetVersion()
        driver = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:   # noqa: BLE001 - only for the message
        driver = "?"
    return (f"{where}. The PTX (ISA {isa}) was written by NVRTC {release}; the driver (CUDA {driver}) JIT-compiles "
            f"only PTX of its own CUDA version or older (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): install an NVRTC no "
            f"newer than the driver (pip install 'nvidia-cuda-nvrtc=={driver}.*') and rebuild, or update the driver")

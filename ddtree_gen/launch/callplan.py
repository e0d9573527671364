"""What one call launches and allocates, compiled once per call signature (runtime.run_call's cache).

  * Step / ParamStruct / IsAligned / TensorMap: a kernel launch and its parameters, as the launchers'
    prepare() describes them (array slots, constants, values computed per call from the pointers);
  * StepPlan: a Step's flat parameter values with the constants in place, the pointers patched per call;
  * OutputPlan: the new outputs of a call as views of one buffer;
  * MapMemo: a TensorMap's words per pointer, for the generated call.
The whole cached call (pointer checks, outputs, parameter packing when the pointers changed, the launches, the
result) is generated from these as one Python function per call signature by hostcode.compile_runner.
This module imports nothing above arrays.
"""
from __future__ import annotations

import ctypes
import math
import struct
from dataclasses import dataclass

import numpy as np

from . import arrays as _arrays
from .arrays import ITEMSIZE
from ..errors import ArgumentError

# ----------------------------------------------------------------------------- one call


@dataclass(frozen=True)
class Step:
    """One kernel launch of a call. `args` are the kernel's parameters: an int is the index of an
    array in the call's array list (its pointer is passed), a (index, byte offset) pair a pointer
    into it, an IsAligned(index, bytes) the int32 flag "that pointer is so aligned", anything else
    (a numpy scalar) a constant. `pdl`: launched as a programmatic dependent of the kernel before it in the stream
    (launch/pdl.py; the kernel itself must wait for that kernel's results: griddepcontrol.wait)."""
    kernel: str
    grid: tuple
    args: tuple
    fmt: str = ""    # struct format of the parameters (filled in by Prepared); "[...]": one struct parameter
    pdl: bool = False


@dataclass(frozen=True)
class ParamStruct:
    """One kernel parameter that is a struct passed by value (e.g. an array of pointers): its
    fields as Step args, laid out contiguously with their natural alignment."""
    items: tuple


@dataclass(frozen=True)
class IsAligned:
    """A kernel parameter computed per call: 1 (int32) if array `index` is `alignment`-byte aligned, else 0."""
    index: int
    alignment: int


@dataclass(frozen=True)
class TensorMap:
    """A kernel parameter computed per call: the CUtensorMap (128 bytes, passed by value) of array `index`
    viewed as a row-major [rows, cols] tensor of `elem_bytes`-byte elements (2: bf16 bits, 1: e4m3 bytes),
    read in boxes of [box_rows, box_cols], with the 128-byte swizzle (`swizzle` 128: what TMA loads into a wgmma
    operand tile), the 64-byte one (64: a box of 64-byte rows for a wgmma operand) or none (0: rows as they are, for
    threads to read). Encoded on the host for the call's pointer
    (cuTensorMapEncodeTiled, no device work) and remembered per pointer."""
    index: int
    rows: int
    cols: int
    box_rows: int
    box_cols: int
    elem_bytes: int = 2
    swizzle: int = 128      # bytes: 128, 64 or 0 (none)


TENSOR_MAP_WORDS = 16   # sizeof(CUtensorMap) / 8
_TENSOR_MAPS: dict = {}  # (pointer, TensorMap) -> its 16 words
_ENCODE = []             # cuTensorMapEncodeTiled, looked up once


def _encode_tiled():
    if not _ENCODE:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _ENCODE.append(fn)
    return _ENCODE[0]


def tensor_map_words(ptr: int, tm: TensorMap) -> tuple:
    """The 16 uint64 words of the CUtensorMap of `tm` at pointer `ptr` (memoized per pointer)."""
    key = (ptr, tm)
    words = _TENSOR_MAPS.get(key)
    if words is None:
        out = (ctypes.c_uint64 * TENSOR_MAP_WORDS)()
        dims = (ctypes.c_uint64 * 2)(tm.cols, tm.rows)          # innermost first
        strides = (ctypes.c_uint64 * 1)(tm.cols * tm.elem_bytes)  # bytes between rows
        box = (ctypes.c_uint32 * 2)(tm.box_cols, tm.box_rows)
        step = (ctypes.c_uint32 * 2)(1, 1)
        # UINT16 (1) or UINT8 (0) elements (bits moved as they are), no interleave, 128-byte swizzle (3), 64-byte (2)
        # or none (0), L2 promotion of 256 bytes, out-of-bound elements read as zeros
        dtype = {2: 1, 1: 0}[tm.elem_bytes]
        swizzle = {0: 0, 64: 2, 128: 3}[tm.swizzle]
        rc = _encode_tiled()(out, dtype, 2, ctypes.c_void_p(ptr), dims, strides, box, step, 0, swizzle, 3, 0)
        if rc != 0:
            raise ArgumentError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for array {tm.index} at {ptr:#x}: "
                                f"[{tm.rows}, {tm.cols}] in boxes of [{tm.box_rows}, {tm.box_cols}]")
        words = tuple(out)
        if len(_TENSOR_MAPS) > 4096:   # many short-lived caches: forget the old ones
            _TENSOR_MAPS.clear()
        _TENSOR_MAPS[key] = words
    return words


def _param_fmt(args) -> str:
    """Native struct format of a kernel's parameters (each aligned to its size, as CUDA lays them out);
    a ParamStruct's fields are bracketed: the driver takes one pointer per kernel parameter."""
    codes = []
    for a in args:
        if isinstance(a, ParamStruct):
            codes.append("[" + _param_fmt(a.items)[1:] + "]")
        elif isinstance(a, TensorMap):
            codes.append("[" + "Q" * TENSOR_MAP_WORDS + "]")
        elif isinstance(a, (int, tuple)):
            codes.append("Q")
        elif isinstance(a, IsAligned):
            codes.append("i")
        else:
            codes.append({np.dtype(np.int32): "i", np.dtype(np.float32): "f", np.dtype(np.int64): "q",
                          np.dtype(np.uint64): "Q"}[np.asarray(a).dtype])
    return "@" + "".join(codes)


class StepPlan:
    """A Step compiled for the per-call path: its flat parameter values with the constants in place
    (`template`), and where this call's pointers go: `runs` (position, first array index, count) of
    consecutive pointers, `singles` (position, array index, byte offset), `special` (position, IsAligned
    or TensorMap). values(ptrs) is _values(step.args, ptrs), without walking the arguments per call. `pdl`: the
    step's (a programmatic dependent launch)."""
    __slots__ = ("kernel", "grid", "fmt", "pdl", "template", "runs", "singles", "special")

    def __init__(self, step: Step):
        self.kernel, self.grid, self.fmt, self.pdl = step.kernel, tuple(step.grid), step.fmt, step.pdl
        template, pointers, special = [], [], []

        def walk(args):
            for a in args:
                t = type(a)
                if t is int:
                    pointers.append((len(template), a, 0))
                    template.append(0)
                elif t is tuple:
                    pointers.append((len(template), a[0], a[1]))
                    template.append(0)
                elif t is ParamStruct:
                    walk(a.items)
                elif t is TensorMap:
                    special.append((len(template), a))
                    template.extend((0,) * TENSOR_MAP_WORDS)
                elif t is IsAligned:
                    special.append((len(template), a))
                    template.append(0)
                else:
                    template.append(a)
        walk(step.args)
        runs, singles = [], []
        for pos, idx, off in pointers:
            if off:
                singles.append((pos, idx, off))
            elif runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == idx:
                runs[-1][2] += 1
            else:
                runs.append([pos, idx, 1])
        self.template = template
        self.runs = tuple((pos, idx, idx + n, pos + n) for pos, idx, n in runs)
        self.singles, self.special = tuple(singles), tuple(special)

    def values(self, ptrs) -> list:
        vals = self.template.copy()
        for pos, lo, hi, end in self.runs:
            vals[pos:end] = ptrs[lo:hi]
        for pos, idx, off in self.singles:
            vals[pos] = ptrs[idx] + off
        for pos, a in self.special:
            if type(a) is IsAligned:
                vals[pos] = np.int32(ptrs[a.index] % a.alignment == 0)
            else:
                vals[pos:pos + TENSOR_MAP_WORDS] = tensor_map_words(ptrs[a.index], a)
        return vals


OUTPUT_ALIGN = 256   # bytes: each output of a call's one buffer starts at such an offset (as cudaMalloc's do)
# the host cost model of torch outputs, in us (an H200 host, docs/perf/journal-host.md "Host cost of a call"): a CUDA
# torch.empty, and any other torch op on the host (a view, as_strided, unbind)
EMPTY_US, VIEW_US = 3.2, 1.6
# what a view op saves below torch's ADInplaceOrView key (torch._C._AutoDispatchBelowADInplaceOrView: no autograd
# view record), and entering and leaving that guard (plus a margin), in us on the build machine's CPU
BELOW_US = {"as_strided": 0.37, "view": 0.17, "unbind": 0.16, "guard": 1.0}


class OutputPlan:
    """The new outputs of one call signature carved out of one buffer: `entries` (array index, shape,
    dtype, byte offset) laid out by element size and shape, `total` bytes. Outputs of one shape and element
    size lie one after the other and are made as one strided view unbound along a new leading dimension
    (one torch op for all of them). `scratch`: indices of outputs the launcher never returns (a workspace):
    only their pointers are made. For torch, `separate` says whether one torch.empty per output is cheaper
    than the buffer and its views (the cost model above: two small outputs)."""
    __slots__ = ("entries", "total", "scratch", "separate", "_torch")

    def __init__(self, new, scratch=()):
        order = sorted(new, key=lambda e: (e[0] in scratch, -ITEMSIZE[e[2]], tuple(e[1])))
        entries, off = [], 0
        for i, shape, dtype in order:
            entries.append((i, tuple(shape), dtype, off))
            off += -(-math.prod(shape) * ITEMSIZE[dtype] // OUTPUT_ALIGN) * OUTPUT_ALIGN
        self.entries, self.total, self.scratch, self._torch = tuple(entries), max(off, OUTPUT_ALIGN), scratch, None
        ops = self._ops()
        self.separate = EMPTY_US * len(new) <= EMPTY_US + VIEW_US * ops

    def _groups(self):
        """Runs of returned outputs of one shape and element size, back to back: [first entry, members]."""
        groups = []
        for e in self.entries:
            i, shape, dtype, off = e
            if i in self.scratch:
                continue
            g = groups[-1] if groups else None
            if (g is not None and math.prod(shape) and g[0][1] == shape and ITEMSIZE[g[0][2]] == ITEMSIZE[dtype]
                    and g[0][3] + len(g[1]) * self._step(g[0]) == off):
                g[1].append(e)
            else:
                groups.append([e, [e]])
        return groups

    @staticmethod
    def _step(e):
        return -(-math.prod(e[1]) * ITEMSIZE[e[2]] // OUTPUT_ALIGN) * OUTPUT_ALIGN

    def _ops(self) -> int:
        """torch ops after the torch.empty: views of the base per dtype, as_strided per group, unbind per group
        of more than one, a dtype view per member of another dtype than its group's."""
        groups = self._groups()
        base = self.entries[0][2]
        typed = {g[0][2] for g in groups} - {base}
        return (len(typed) + len(groups) + sum(len(m) > 1 for _, m in groups)
                + sum(e[2] != g[2] for g, m in groups for e in m))

    def _torch_plan(self):
        """(base dtype, base elements, other dtypes to view the base as, groups, torch.empty): a group is
        (dtype, shape, strides, element offset, index or None, members: None or ((index, cast or None), ...))."""
        import torch
        dt = _arrays.torch_dtype
        plan = []
        for g, members in self._groups():
            _, shape, dtype, off = g
            size = ITEMSIZE[dtype]
            strides = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
            if len(members) == 1:
                plan.append((dt(dtype), shape, strides, off // size, g[0], None))
            else:
                plan.append((dt(dtype), (len(members), *shape), (self._step(g) // size, *strides), off // size, None,
                             tuple((e[0], None if e[2] == dtype else dt(e[2])) for e in members)))
        first = self.entries[0][2]
        others = tuple({p[0] for p in plan} - {dt(first)})
        self._torch = (dt(first), self.total // ITEMSIZE[first], others, tuple(plan), torch.empty)
        return self._torch

    def torch_layout(self):
        """(base dtype, base elements, other dtypes to view the base as, groups, torch.empty): _torch_plan's, made
        once (torch imported on first use)."""
        return self._torch or self._torch_plan()

    def allocate(self, kind: str, device: int, arrays: list, ptrs: list) -> None:
        """Allocate the buffer on `device` and put the outputs (views of it) and their pointers in place."""
        if kind == "torch":
            base_dtype, elems, others, plan, empty = self.torch_layout()
            base = empty(elems, dtype=base_dtype, device=_arrays.torch_device(device))
            typed = {base_dtype: base}
            for d in others:
                typed[d] = base.view(d)
            for d, shape, strides, off, index, members in plan:
                v = typed[d].as_strided(shape, strides, off)
                if members is None:
                    arrays[index] = v
                else:
                    for (index, cast), part in zip(members, v.unbind(0)):
                        arrays[index] = part if cast is None else part.view(cast)
            p0 = base.data_ptr()   # a scratch part lives as long as the returned views of the buffer (stream-ordered)
        else:   # CuPy
            import cupy
            with cupy.cuda.Device(device):
                base = cupy.empty(self.total, dtype=np.uint8)
            mem, p0 = base.data, base.data.ptr
            for index, shape, dtype, off in self.entries:
                if index not in self.scratch:
                    arrays[index] = cupy.ndarray(shape, {"bf16": np.uint16}.get(dtype, dtype), memptr=mem + off)
        for index, _, _, off in self.entries:
            ptrs[index] = p0 + off


def param_offsets(fmt: str) -> list:
    """Byte offset of each kernel parameter in the packed buffer of `fmt` (natural alignment; a
    bracketed struct is one parameter, aligned to its largest field)."""
    offsets, off, i = [], 0, 1
    while i < len(fmt):
        if fmt[i] == "[":
            j = fmt.index("]", i)
            fields = fmt[i + 1:j]
            align = max(struct.calcsize("@" + c) for c in fields)
            off = -(-off // align) * align
            offsets.append(off)
            off += struct.calcsize("@" + fields)
            i = j + 1
        else:
            n = struct.calcsize("@" + fmt[i])
            off = -(-off // n) * n
            offsets.append(off)
            off += n
            i += 1
    return offsets


def _values(args, ptrs) -> list:
    """A step's parameter values for this call's pointers (a ParamStruct's fields inline)."""
    out = []
    for a in args:
        t = type(a)
        if t is int:
            out.append(ptrs[a])
        elif t is tuple:
            out.append(ptrs[a[0]] + a[1])
        elif t is IsAligned:
            out.append(np.int32(ptrs[a.index] % a.alignment == 0))
        elif t is ParamStruct:
            out.extend(_values(a.items, ptrs))
        elif t is TensorMap:
            out.extend(tensor_map_words(ptrs[a.index], a))
        else:
            out.append(a)
    return out


class MapMemo(dict):
    """The 16 words of one TensorMap per pointer (tensor_map_words, which encodes it, memoized by an int key)."""

    def __init__(self, tm: TensorMap):
        super().__init__()
        self.tm = tm

    def encode(self, ptr: int) -> tuple:
        words = tensor_map_words(ptr, self.tm)
        if len(self) > 4096:   # many short-lived caches: forget the old ones
            self.clear()
        self[ptr] = words
        return words

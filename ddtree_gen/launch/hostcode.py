"""Python source made at run time and compiled: the host path's generated functions, and nothing else.

Each is straight-line code for one case known only at run time (a call signature, a guarded entry, a torch op's
schema), because interpreting the same plan per call was a large part of a small call's host time
(docs/decisions.md, "What a cached call still does"). Every function made here keeps its source (`.source`:
scripts/profile_launch.py --source) and names its case in its file name ("<ddtree_gen call tree_build>").
  * compile_runner: one cached call signature's per-call work, run(arrays, ptrs) (runtime.run_call);
  * matcher: a guarded entry's test of a call's arrays (runtime._guard);
  * direct_entry: a torch op's eager entry with the op's signature (torch_ops.direct);
  * stages: a compiled call cut after each of its stages (bench launch's stage times).
The plans they are made from are callplan's and runtime's; this module imports nothing above callplan, and torch
only where a torch call's outputs are made.
"""
from __future__ import annotations

import numpy as np

from . import arrays as _arrays
from .callplan import BELOW_US, TENSOR_MAP_WORDS, IsAligned, MapMemo, OutputPlan, StepPlan
from ..errors import ArgumentError

__all__ = ["compile_runner", "matcher", "MATCH_INLINE", "direct_entry", "stages"]


def _compile(src: str, name: str, filename: str, ns: dict):
    """The function `name` that `src` defines, compiled under `filename` with globals `ns`; its source kept on it."""
    exec(compile(src, filename, "exec"), ns)
    fn = ns[name]
    fn.source = src
    return fn


# ----------------------------------------------------------------------------- the cached call


def compile_runner(prep, bound, env: dict, arrays, group=None, kset=None, alloc=None):
    """The per-call work of one cached call signature as one generated function run(arrays, ptrs) -> result:
    the pointer checks (in prep's order, with its messages), the new outputs (the ones this signature does not
    give: fixed per signature, since a given array is part of it), the parameter packing (only when the
    pointers differ from the last launch's: the values are a function of the pointers alone), the launches
    and the result. `ptrs` holds the call's array pointers (the new outputs' slots are filled here).

    bound: the launches bound to the loaded functions (runtime._bind: per step (function, grid x, y, z,
    threads, shared memory, parameter storage, kernelParams, lock, pack_into, StepPlan, last pointers, ...)),
    or False: each step through kset.launch (a stand-in kernel set). env: the driver / runtime entry points
    (runtime._CUDA, read per call). group: prep's arrays[group:] are a run of one signature (kv_commit's layers): their
    pointer checks run only when their pointers differ from the last ones that passed."""
    ns = {"ArgumentError": ArgumentError}
    body = []

    def name(value, prefix="_c"):
        key = f"{prefix}{len(ns)}"
        ns[key] = value
        return key

    def checks(aligned, disjoint, indent):
        out = []
        for i, alignment, message in aligned:
            out.append(f"{indent}if ptrs[{i}] % {alignment}: "
                       f"raise ArgumentError({name(message)}.format(ptr=ptrs[{i}]))")
        for a, na, b, nb, exact_ok, message in disjoint:
            if na and nb:
                cond = f"ptrs[{a}] < ptrs[{b}] + {nb} and ptrs[{b}] < ptrs[{a}] + {na}"
                out.append(f"{indent}if {cond}{f' and ptrs[{a}] != ptrs[{b}]' if exact_ok else ''}: "
                           f"raise ArgumentError({name(message)})")
        return out

    # pointer checks (the "# ..." lines of the source mark its stages: scripts/profile_launch.py --stages)
    body.append("    # checks")
    if group is not None and (prep.aligned or prep.disjoint):
        ns["_checked"] = [None]
        body += [f"    layers = ptrs[{group}:]", "    if layers != _checked[0]:",
                 *checks(prep.aligned, prep.disjoint, " " * 8), "        _checked[0] = layers"]
        head = checks([c for c in prep.aligned if c[0] < group],
                      [c for c in prep.disjoint if c[0] < group or c[2] < group], " " * 8)
        if head:
            body += ["    else:", *head]
    else:
        body += checks(prep.aligned, prep.disjoint, "    ")
    # new outputs: source[i] is the expression of array i in the result
    source = {}
    body.append("    # outputs")
    missing = [e for e in prep.new if arrays[e[0]] is None]
    device, kind = prep.device, prep.kind
    if missing and len(missing) == len(prep.new) and kind != "cai" and not (kind == "torch" and
                                                                             prep.outputs.separate):
        body += _buffer_lines(prep.outputs, kind, device, name, source)
    else:
        for i, shape, dtype in missing:
            if kind == "torch":
                empty, kw = _arrays._TORCH_NEW.get((dtype, device)) or _arrays._torch_empty_kwargs(dtype, device)
                # (size= rather than a positional tuple: torch parses it ~0.7 us faster on the CPU)
                body += [f"    o{i} = {name(empty)}(size={tuple(shape)!r}, dtype={name(kw['dtype'])}, "
                         f"device={name(kw['device'])})", f"    ptrs[{i}] = o{i}.data_ptr()"]
            else:
                allocate, pointer_of = alloc or (_arrays.allocate, _arrays.pointer_of)
                body += [f"    o{i} = {name(allocate)}({kind!r}, {device}, {tuple(shape)!r}, {dtype!r})",
                         f"    ptrs[{i}] = {name(pointer_of)}(o{i})"]
            source[i] = f"o{i}"
    body.append("    # launch")
    body += _launch_lines(prep, bound, env, kset, name)
    body.append("    # result")
    if prep.returns is not None:
        record, indices = prep.returns
        items = ", ".join(source.get(i, f"arrays[{i}]") for i in indices)
        if record is None:
            body.append("    return None")
        elif issubclass(record, tuple) and hasattr(record, "_fields"):   # a namedtuple, made without its __new__ frame
            body.append(f"    return {name(tuple.__new__)}({name(record)}, ({items},))")
        else:
            body.append(f"    return {name(record)}({items})")
    else:
        body.append("    a = list(arrays)")
        body += [f"    a[{i}] = {s}" for i, s in source.items() if s != f"a[{i}]"]
        body.append(f"    return {name(prep.result)}(a)")
    src = "def run(arrays, ptrs):\n" + "\n".join(body) + "\n"
    return _compile(src, "run", f"<ddtree_gen call {', '.join(s.kernel for s in prep.steps) or 'no launch'}>", ns)


def _buffer_lines(plan: OutputPlan, kind: str, device: int, name, source: dict) -> list:
    """The lines that allocate `plan`'s one buffer and put its outputs (source) and pointers (ptrs) in place."""
    if kind != "torch":   # CuPy: OutputPlan.allocate into a list copy of the arrays
        for i, _, _, _ in plan.entries:
            if i not in plan.scratch:
                source[i] = f"a[{i}]"
        return ["    a = list(arrays)", f"    {name(plan.allocate)}({kind!r}, {device}, a, ptrs)"]
    import torch
    base_dtype, elems, others, groups, empty = plan.torch_layout()
    views = []
    typed = {base_dtype: "b"}
    for k, d in enumerate(others):
        typed[d] = f"b{k}"
        views.append(f"b{k} = b.view({name(d)})")
    for k, (d, shape, strides, off, index, members) in enumerate(groups):
        view = f"{typed[d]}.as_strided({tuple(shape)!r}, {tuple(strides)!r}, {off})"
        if members is None:
            views.append(f"o{index} = {view}")
            source[index] = f"o{index}"
            continue
        views.append(f"{', '.join(f'o{i}' for i, _ in members)}, = {view}.unbind()")
        for i, cast in members:
            if cast is not None:
                views.append(f"o{i} = o{i}.view({name(cast)})")
            source[i] = f"o{i}"
    lines = [f"    b = {name(empty)}({elems}, dtype={name(base_dtype)}, device={name(_arrays.torch_device(device))})"]
    # below torch's ADInplaceOrView key (no autograd view records: each output its own tensor over the buffer,
    # as inference mode makes them), where what that saves per view op outweighs entering the guard
    below = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
    saved = (BELOW_US["as_strided"] * len(groups) + BELOW_US["view"] * sum(v.count(".view(") for v in views)
             + BELOW_US["unbind"] * sum(len(m) for *_, m in groups if m))
    if below is not None and saved > BELOW_US["guard"]:
        lines += [f"    with {name(below)}():", *(f"        {v}" for v in views)]
    else:
        lines += [f"    {v}" for v in views]
    lines.append("    p = b.data_ptr()")
    lines += [f"    ptrs[{i}] = p + {off}" if off else f"    ptrs[{i}] = p" for i, _, _, off in plan.entries]
    return lines


def _launch_lines(prep, bound, env: dict, kset, name) -> list:
    """The lines that launch prep's steps: bound ones directly (one lock for the call, the parameters packed
    when the pointers changed, the device switched for the launches only), else through kset.launch; a step with
    `pdl` through launch_pdl (a programmatic dependent launch: launch/pdl.py), or kset.launch(..., pdl=True)."""
    if not prep.plans:
        return []
    if not bound:
        ks = name(kset)
        return [f"    {ks}.launch({name(p.kernel)}, grid={name(p.grid)}, args={name(p.values)}(ptrs), "
                f"device={prep.device}, kind={prep.kind!r}, fmt={name(p.fmt)}{', pdl=True' if p.pdl else ''})"
                for p in prep.plans]
    lock, last, cuda = bound[0][8], bound[0][11], name(env)
    stream = (f'{cuda}["torch_stream"]({prep.device})' if prep.kind == "torch" else
              f'{cuda}["cupy_stream"]({prep.device}).ptr')
    # (a step launched as a programmatic dependent: through launch_pdl, looked up only where there is one)
    pdl = [f"    launch_pdl = {cuda}['launch_pdl']"] if any(b[10].pdl for b in bound) else []
    lines = [f"    s = {stream}", f"    launch = {cuda}['launch']", *pdl, f"    d = {cuda}['get_device']()",
             f"    if d != {prep.device}:", f"        {cuda}['set_device']({prep.device})", "    try:",
             f"        with {name(lock)}:", f"            if ptrs != {name(last)}[0]:"]
    for fn, gx, gy, gz, threads, smem, storage, params, _, pack_into, plan, _, _ in bound:
        lines.append(f"                {name(pack_into)}({name(storage)}, 0, {_pack_args(plan, name)})")
    lines.append(f"                {name(last)}[0] = ptrs")
    for fn, gx, gy, gz, threads, smem, storage, params, _, pack_into, plan, _, _ in bound:
        if plan.pdl:
            lines.append(f"            launch_pdl({name(plan.kernel)}, {fn}, {gx}, {gy}, {gz}, {threads}, 1, 1, "
                         f"{smem}, s, {params})")
        else:
            lines.append(f"            launch({fn}, {gx}, {gy}, {gz}, {threads}, 1, 1, {smem}, s, {params}, 0)")
    lines += ["    finally:", f"        if d != {prep.device}:", f"            {cuda}['set_device'](d)"]
    return lines


def _pack_args(plan: StepPlan, name) -> str:
    """StepPlan.values(ptrs) as one argument list: constants by name, pointers and computed values inline."""
    items = [None] * len(plan.template)
    for pos, value in enumerate(plan.template):
        items[pos] = name(value)
    for pos, lo, hi, end in plan.runs:
        for k in range(hi - lo):
            items[pos + k] = f"ptrs[{lo + k}]"
    for pos, idx, off in plan.singles:
        items[pos] = f"ptrs[{idx}] + {off}"
    skip = set()
    for pos, a in plan.special:
        if type(a) is IsAligned:
            items[pos] = f"{name(np.int32)}(ptrs[{a.index}] % {a.alignment} == 0)"
        else:   # memoized per pointer for this map (an int key: no hash of the TensorMap per call)
            memo = name(MapMemo(a))
            items[pos] = f"*({memo}.get(ptrs[{a.index}]) or {memo}.encode(ptrs[{a.index}]))"
            skip.update(range(pos + 1, pos + TENSOR_MAP_WORDS))
    return ", ".join(x for k, x in enumerate(items) if k not in skip)


# ----------------------------------------------------------------------------- a guarded entry's test

MATCH_INLINE = 16   # a guarded entry of up to this many tensors names each in its compiled test (matcher)


def matcher(m: int, n: int, check, alias: tuple, unique: tuple, data_ptr):
    """A guarded entry's test of a call's arrays, compiled once (straight-line code, no slices or maps per call for a
    few tensors): the pointers of arrays[:m] followed by n zeros when the arrays are m tensors that pass `check`
    (TensorGuards.check of the distinct ones, `unique`: their positions; `alias`: (repeat, first) positions tested by
    identity) followed by exactly n Nones; else None. (The Nones by identity: == would compare a tensor to None
    through its __eq__.)"""
    total = m + n
    cond = " and ".join([f"len(arrays) == {total}", *(f"arrays[{i}] is None" for i in range(m, total))])
    if m <= MATCH_INLINE:
        names = [f"a{i}" for i in range(m)]
        test = [f"a{j} is a{i}" for j, i in alias] + [f"check({', '.join(names[i] for i in unique)})"]
        body = [f"        {', '.join(names)}, = arrays[:{m}]",
                f"        if {' and '.join(test)}:",
                f"            return [{', '.join([f'dp({x})' for x in names] + ['0'] * n)}]"]
    else:   # many tensors (kv_commit's layers): C-level maps over the slice
        pick = ", ".join(f"head[{i}]" for i in unique) if alias else "*head"
        test = [f"head[{j}] is head[{i}]" for j, i in alias] + [f"check({pick})"]
        body = [f"        head = arrays[:{m}]", f"        if {' and '.join(test)}:",
                f"            return [*map(dp, head){', *zeros' if n else ''}]"]
    src = "\n".join(["def match(arrays):", f"    if {cond}:", *body, "    return None"]) + "\n"
    return _compile(src, "match", "<ddtree_gen guarded entry>", {"check": check, "dp": data_ptr, "zeros": (0,) * n})


# ----------------------------------------------------------------------------- a torch op's direct entry


def direct_entry(name: str, schema, run, op, *, compiling, modes, tensor):
    """def <name>(<the schema's arguments, with its defaults>): run(...) when nothing traces the call (not
    compiling(), no modes(), the first Tensor argument's type exactly `tensor`), else op(...). `schema`: the op's
    torch FunctionSchema (its arguments' names, types and defaults: each default passed by name, its repr need not
    be Python: inf). torch_ops._direct_entry says why."""
    ns = {"_compiling": compiling, "_modes": modes, "_Tensor": tensor, "_run": run, "_op": op}
    params, names = [], []
    for i, a in enumerate(schema.arguments):
        names.append(a.name)
        if a.has_default_value():
            ns[f"_default{i}"] = a.default_value
            params.append(f"{a.name}=_default{i}")
        else:
            params.append(a.name)
    first = next(a.name for a in schema.arguments if str(a.type) == "Tensor")   # every op has one
    args = ", ".join(names)
    src = (f"def {name}({', '.join(params)}):\n"
           f"    if not _compiling() and not _modes() and type({first}) is _Tensor:\n"
           f"        return _run({args})\n"
           f"    return _op({args})\n")
    return _compile(src, name, f"<ddtree_gen direct.{name}>", ns)


# ----------------------------------------------------------------------------- a cached call's stages


def stages(run) -> list:
    """(stage, function) per stage of a function compile_runner made ("    # checks", "    # outputs", "    # launch",
    "    # result" mark them in its source): the function cut where the next stage begins, returning None there (the
    last: the whole function), in a copy of the real one's globals (the real one stays as it is). The time of a cut
    minus that of the one before is the stage's (bench launch's stage times)."""
    lines = run.source.rstrip("\n").split("\n")
    cuts = [k for k, line in enumerate(lines) if line.startswith("    # ")] + [len(lines)]
    return [(lines[k].strip()[2:], _compile("\n".join(lines[:cut] + ["    return None"]) + "\n", "run",
                                           run.__code__.co_filename, dict(run.__globals__)))
            for k, cut in zip(cuts, cuts[1:])]

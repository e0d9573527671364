"""The launchers as torch custom ops (torch.ops.ddtree.*), for torch.compile and CUDA graphs.

    import ddtree_gen.torch_ops   # registers the ops (torch is needed here, nowhere else)
    ids, lps = torch.ops.ddtree.draft_topk("kimi-k2.6-tp8", logits, 64)      # logits [B, D', V] bf16 / float32
    tree = torch.ops.ddtree.tree_build("kimi-k2.6-tp8", topk_ids, topk_logprobs, roots, prefix_lens, 64)
    out, lse = torch.ops.ddtree.tree_verify("kimi-k2.6-tp8", q_nope, q_pe, kv_cache, block_table,
                                            prefix_lens, q_lens, tree[6], softmax_scale, "auto")
    acc = torch.ops.ddtree.tree_accept("kimi-k2.6-tp8", tree[0], tree[1], tree[7], tree[8], target_tokens,
                                       prefix_lens, kv_cache, block_table)   # moves kv_cache in place
    acc = torch.ops.ddtree.tree_walk("kimi-k2.6-tp8", tree[0], tree[1], tree[7], tree[8], target_tokens, prefix_lens)
    torch.ops.ddtree.kv_commit("kimi-k2.6-tp8", acc[0], acc[1], prefix_lens, kv_caches, block_table)  # a list
    torch.ops.ddtree.kv_commit_stacked("kimi-k2.6-tp8", acc[0], acc[1], prefix_lens, kv_stacked, block_table)
    #   kv_stacked: every layer in one [layers, num_pages, page_size, R+P] tensor (the cheaper call)
    # an fp8 spec (kv_dtype "fp8_e4m3"): kv_cache is torch.float8_e4m3fn (or uint8), tree_verify takes kv_scale
    out, lse = torch.ops.ddtree.tree_verify("kimi-k2.6-tp8-fp8", q_nope, q_pe, kv_fp8, block_table, prefix_lens,
                                            q_lens, tree[6], softmax_scale, "auto", kv_scale)

For eager code, `ddtree_gen.torch_ops.direct.<op>` takes the same arguments and calls the op's implementation
without the dispatcher (3-5 us less per call), and the op itself under torch.compile / export, a dispatch mode or a
tensor subclass (_direct_entry; docs/engine.md):

    from ddtree_gen.torch_ops import direct as ops
    out, lse = ops.tree_verify("kimi-k2.6-tp8", q_nope, q_pe, kv_cache, block_table, prefix_lens, q_lens, tree[6],
                               softmax_scale)

The ops are those of the kernels' declarations (ops/<op>/launch.py: Declaration.torch_ops, a schema and a fake
each, the fake and any implementation of its own next to the launcher); an implementation takes the kernel set of
the op's spec first, and an op without one calls the kernel's launcher with its arguments positionally. The first
argument names the spec (as ddtree_gen.load takes it). Each op returns the fields of the
plain launcher's record as a tuple, in the record's order (its declaration's output: DraftTopkOutput,
TreeBuildOutput, AttentionOutput, TreeAcceptOutput). Every op has a fake (meta) implementation, so torch.compile traces it without
running it; tree_accept's and kv_commit_stacked's schemas declare the KV cache they move (Tensor(a!)), kv_commit's
the list of layers' caches (Tensor(a!)[]). The ops call the
plain launchers: same checks, same kernels, on the current stream of the inputs' device.
"""
from __future__ import annotations

import functools

import torch

from .launch import hostcode
from . import registry
from .kernel_set import load


@functools.lru_cache(maxsize=None)
def _kset(spec: str):
    return load(spec)


@functools.lru_cache(maxsize=None)
def _spec(spec: str):
    """The Spec of a name, for the fake implementations (no build needed)."""
    from .spec import find_spec
    return find_spec(spec)


# Defined through torch.library.Library rather than the torch.library.custom_op decorator: the
# decorator adds a Python autograd layer to every call (tens of microseconds), and these ops have
# no gradient. The schemas (the declarations') are what custom_op would infer; "(a!)" marks the
# caches tree_accept and kv_commit write.
_LIB = torch.library.Library("ddtree", "DEF")
_IMPLS: dict = {}      # op name -> its CUDA implementation (implementation())


def _positional(name: str):
    """The op of kernel `name` whose implementation is the launcher, its arguments given positionally. The
    launcher's record (a namedtuple) is returned as it is: the dispatcher takes any tuple for the op's returns."""
    def impl(spec, *args):
        return getattr(_kset(spec), name)(*args)
    impl.__name__ = name
    return impl


def _with_spec(fake):
    """A declared fake, fake(spec: Spec, *args), as torch calls it: with the spec's name first."""
    return lambda spec, *args: fake(_spec(spec), *args)


def implementation(op: str):
    """The CUDA implementation registered for torch.ops.ddtree.<op> (scripts/profile_launch.py registers it
    for the CPU key too)."""
    return _IMPLS[op]


def _bound(impl):
    """A declared implementation, impl(kset, *args), as torch calls it: with the spec's name first (its kernel set:
    _kset, looked up at each call)."""
    def run(spec, *args):
        return impl(_kset(spec), *args)
    run.__name__ = run.__qualname__ = impl.__name__
    run.__doc__ = impl.__doc__
    return run


# --------------------------------------------------------------------- the direct entries

def _direct_entry(name: str, impl):
    """direct.<name>: a function with torch.ops.ddtree.<name>'s signature (its schema's argument names and
    defaults) that calls the op's implementation itself when nothing traces the call, and the op otherwise.
    "Nothing traces it": not under torch.compile / torch.export (torch.compiler.is_compiling), no dispatch mode
    active (FakeTensorMode, make_fx, functionalization: torch._C._len_torch_dispatch_stack), and its first tensor
    argument a plain torch.Tensor (not a subclass, an fx Proxy or a fake tensor). Dynamo traces through it and
    records the op, so a compiled graph is the same as with the op. The eager path skips the dispatcher (3-5 us of
    argument boxing and a Python kernel call: docs/perf.md, host time rounds 4 and 7); it returns what the op's
    implementation returns (the launcher's record, a namedtuple, where the op gives a plain tuple; None for the
    commits)."""
    op = getattr(torch.ops.ddtree, name).default
    schema = op._schema
    fn = hostcode.direct_entry(name, schema, impl, op, compiling=torch.compiler.is_compiling,
                               modes=torch._C._len_torch_dispatch_stack, tensor=torch.Tensor)
    fn.__qualname__ = f"direct.{name}"
    fn.__module__ = __name__
    fn.__doc__ = (f"torch.ops.ddtree.{name} without the dispatcher in eager calls (the op when traced).\n\n"
                  f"    {schema}")
    return fn


class _Direct:
    """The torch ops' direct entries, one attribute per op (direct.tree_verify, ...): see _direct_entry."""

    def __repr__(self):
        return f"<ddtree_gen.torch_ops.direct: {', '.join(sorted(vars(self)))}>"


direct = _Direct()


def _register():
    for decl, op in registry.torch_ops():
        impl = _bound(op.impl) if op.impl else _positional(decl.name)
        _LIB.define(op.schema)
        _LIB.impl(op.name, impl, "CUDA")
        torch.library.register_fake(f"ddtree::{op.name}", lib=_LIB)(_with_spec(op.fake))
        _IMPLS[op.name] = impl
        setattr(direct, op.name, _direct_entry(op.name, impl))


_register()

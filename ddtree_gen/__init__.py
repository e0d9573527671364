"""ddtree-gen: generated GPU kernels for tree-based speculative decoding on MLA models.

    import ddtree_gen
    ks = ddtree_gen.load("kimi-k2.6-tp8")      # compiled kernel set of a spec (built if needed)
    tree = ks.tree_build(topk_ids, topk_logprobs, root_tokens, prefix_lens, budget=64)

`ddtree_gen.reference` holds the numpy reference of every kernel; `ddtree_gen.bf16` and `ddtree_gen.fp8`
convert bf16 bits and e4m3 bytes on the numpy side; `ddtree_gen.trees.pack_tree_mask` packs tree masks from parent
arrays; `ddtree_gen.make_spec` builds a spec in code; `ddtree_gen.hf` maps a transformers DeepSeek-V3 / Kimi-K2 model
onto the kernels (torch and transformers needed there only). They are imported on first use (`import ddtree_gen`
stays light), as attributes or by `import ddtree_gen.reference`. The torch path with the same records:
`import ddtree_gen.torch_api`, then `ddtree_gen.torch_api.load(spec)` (torch.ops.ddtree; torch needed there only).

Errors (ddtree_gen.errors), all raised on purpose with a message naming the wrong thing: DdtreeError, the
base of SpecError (a spec file), ArgumentError (a launch's arguments, before any launch), BuildError
(rendering or NVRTC) and KdtrError (a KDTR bundle). Records (ddtree_gen.types, namedtuples of the launchers'
outputs): TreeBuildOutput, AttentionOutput, TreeAcceptOutput. The command line: `ddtree-gen --help`.
Contract: docs/contract.md of the repository.
"""
from .errors import ArgumentError, BuildError, DdtreeError, KdtrError, SpecError
from .spec import make_spec
from .types import AttentionOutput, TreeAcceptOutput, TreeBuildOutput

__version__ = "0.1.0"


def load(spec, *, kernels=None, arch=None):
    """The compiled kernel set of `spec` (name in specs/, path to a .toml, or Spec). Each kernel runs as
    the build that fits the device (sm_90a cubin on H100 / H200, sm_80 PTX on other GPUs of compute
    capability 8.0+); arch="sm_80" (or $DDTREE_GEN_ARCH) forces one build target everywhere."""
    from .kernel_set import load as _load   # imported on use: `import ddtree_gen` stays light
    return _load(spec, kernels=kernels, arch=arch)


# submodules reachable as attributes after `import ddtree_gen`, imported on first use (PEP 562)
# (attribute -> module below ddtree_gen: artifacts, the build products, lives in the build wing)
_LAZY = {"reference": "reference", "bf16": "bf16", "fp8": "fp8", "kdtr": "kdtr", "artifacts": "build.artifacts",
         "needs": "needs", "trees": "trees", "hf": "hf"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return importlib.import_module(f"{__name__}.{_LAZY[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# what help(ddtree_gen) documents (pydoc follows __all__): load, make_spec and the version. The errors and records
# above stay importable from here (`from ddtree_gen import ArgumentError`); the docstring names them, and their own
# modules document them, without Exception's and tuple's inherited methods filling help() (841 lines before).
__all__ = ["load", "make_spec", "__version__"]

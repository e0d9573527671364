"""End-to-end (CPU): DDTree speculative decoding with the numpy references is lossless.

A tiny MLA model with random weights (ddtree_gen.model) decodes >= 64 new tokens per request
with plain decoding and with the speculative loop (rollout drafter -> tree_build -> tree_verify
in every layer -> tree_accept); the tokens must be identical, greedy and sampled (Gumbel-max
with counter-based noise). The device loop (the GPU loop's orchestration: preallocated buffers,
no host sync in a step) also runs here with the references as the kernel set, on a float32
numpy emulation of the GPU model's kernels and on those CUDA kernels themselves, compiled for
the CPU with a small shim (when a C++ compiler is present).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from ddtree_gen import model as M
from ddtree_gen.spec import find_spec, parse_spec

SMALL = parse_spec({"name": "e2e-small", "num_heads": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                    "page_size": 16, "max_tree_size": 17, "max_depth": 6}, "tests/test_e2e.py")
NEW_TOKENS = 64
SAMPLED = M.Sampling(temperature=1.0, seed=7)


def prompts_for(batch: int, vocab: int, max_len: int = 40, seed: int = 1) -> list[list[int]]:
    """Prompts of different lengths (1 .. max_len): pages of requests start at different offsets."""
    rng = np.random.default_rng(seed + batch)
    lens = rng.integers(1, max_len + 1, size=batch)
    if batch > 1:
        lens[0], lens[1] = 1, max_len  # the extremes, always
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lens]


@functools.lru_cache(maxsize=None)
def _model(spec_name: str) -> tuple:
    spec = SMALL if spec_name == SMALL.name else find_spec(spec_name)
    cfg = M.ModelConfig.from_spec(spec)
    return spec, cfg, M.NumpyMLA(cfg)


@functools.lru_cache(maxsize=None)
def _plain(spec_name: str, batch: int, sampling: M.Sampling, new_tokens: int = NEW_TOKENS,
           max_len: int = 40) -> M.Generation:
    spec, cfg, model = _model(spec_name)
    return M.generate_numpy(model, spec, prompts_for(batch, cfg.vocab_size, max_len), new_tokens,
                            speculative=False, sampling=sampling)


def _speculative(spec_name: str, batch: int, sampling: M.Sampling, new_tokens: int = NEW_TOKENS,
                 max_len: int = 40, **kwargs) -> M.Generation:
    spec, cfg, model = _model(spec_name)
    return M.generate_numpy(model, spec, prompts_for(batch, cfg.vocab_size, max_len), new_tokens,
                            speculative=True, sampling=sampling, **kwargs)


def _report(label: str, gen: M.Generation) -> None:
    print(f"\n{label}: {gen.steps} steps, mean accepted length {gen.mean_accept:.2f} "
          f"(tokens per step {gen.tokens_per_step:.2f})")


def _assert_same(plain: M.Generation, spec: M.Generation) -> None:
    assert plain.tokens.shape == spec.tokens.shape
    for b in range(plain.tokens.shape[0]):
        diff = np.flatnonzero(plain.tokens[b] != spec.tokens[b])
        assert diff.size == 0, (f"request {b}: speculative differs from plain at token {diff[0]}: "
                                f"{spec.tokens[b, :diff[0] + 1]} vs {plain.tokens[b, :diff[0] + 1]}")


# ------------------------------------------------------------------------- numpy, float64

@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculative_equals_plain(batch):
    plain = _plain(SMALL.name, batch, M.GREEDY)
    spec = _speculative(SMALL.name, batch, M.GREEDY)
    _report(f"small B={batch} greedy", spec)
    _assert_same(plain, spec)
    assert spec.mean_accept > 1.0, "the drafter should get more than one token per step accepted"
    assert spec.steps < plain.steps


def test_sampled_speculative_equals_plain():
    plain = _plain(SMALL.name, 4, SAMPLED)
    spec = _speculative(SMALL.name, 4, SAMPLED)
    _report("small B=4 sampled (T=1)", spec)
    _assert_same(plain, spec)
    assert spec.mean_accept > 1.0
    # sampling is not greedy: some tokens differ from the greedy ones
    assert (plain.tokens != _plain(SMALL.name, 4, M.GREEDY).tokens).any()


def test_useless_drafter_and_empty_tree_are_lossless():
    """A drafter of pure noise (almost nothing accepted: the walk stops at the root) and a
    budget of 0 (the tree is the root alone: one token per step) still give the plain tokens."""
    plain = _plain(SMALL.name, 3, M.GREEDY, 24)
    noisy = _speculative(SMALL.name, 3, M.GREEDY, 24, drafter=M.Drafter(noise=1e3, depth=3))
    _report("small B=3 noise drafter", noisy)
    _assert_same(plain, noisy)
    assert noisy.mean_accept < 0.5
    root_only = _speculative(SMALL.name, 3, M.GREEDY, 24, budget=0, drafter=M.Drafter(depth=1))
    _assert_same(plain, root_only)
    assert root_only.accepted == 0 and root_only.steps == plain.steps


def test_kimi_dims_full_tree():
    """The real kimi-k2.6-tp8 attention dims (H=8, R=512, P=64, page 64) with a tiny model, and a
    full tree: budget N-1 = 64 nodes (q_len 65: all three mask words of a row), D' = 8 of D = 15
    (each drafted depth costs a rollout pass on the CPU)."""
    name = "kimi-k2.6-tp8"
    drafter = M.Drafter(depth=8)
    plain = _plain(name, 2, M.GREEDY, max_len=16)    # short prompts: the CPU attention is the cost
    spec = _speculative(name, 2, M.GREEDY, max_len=16, drafter=drafter)
    _report("kimi-k2.6-tp8 B=2 greedy, budget 64, D'=8", spec)
    _assert_same(plain, spec)
    assert spec.mean_accept > 1.0


# --------------------------------------------- device loop (GPU orchestration) on numpy

def _device(spec_name, batch, sampling, speculative, **kwargs):
    spec, cfg, model = _model(spec_name)
    return M.generate_device(cfg, spec, prompts_for(batch, cfg.vocab_size), NEW_TOKENS, ops=M.NumpyOps(),
                             kernels=M.ReferenceKernels(spec), weights=model.w, speculative=speculative,
                             sampling=sampling, **kwargs)


class _DraftTopkKernels(M.ReferenceKernels):
    """ReferenceKernels plus draft_topk (reference.draft_topk behind the launcher's signature): with an exact
    drafter (noise 0) the device loop takes its top-k from kset.draft_topk, as on the GPU."""
    calls = 0

    def draft_topk(self, logits, k, temperature=1.0, out=None, *, workspace=None):
        from ddtree_gen import reference
        type(self).calls += 1
        return self._into(out, reference.draft_topk(logits, k, temperature))


@pytest.mark.parametrize("sampling", [M.GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_device_loop_exact_drafter_uses_kset_draft_topk(sampling):
    """noise 0: kset.draft_topk replaces ops.draft_topk; the same tokens and acceptance as the ops' top-k."""
    spec, cfg, model = _model(SMALL.name)
    kw = dict(ops=M.NumpyOps(), weights=model.w, sampling=sampling, drafter=M.Drafter(noise=0.0))
    prompts = prompts_for(3, cfg.vocab_size)
    before = _DraftTopkKernels.calls
    ours = M.generate_device(cfg, spec, prompts, NEW_TOKENS, kernels=_DraftTopkKernels(spec), **kw)
    assert _DraftTopkKernels.calls > before
    theirs = M.generate_device(cfg, spec, prompts, NEW_TOKENS, kernels=M.ReferenceKernels(spec), **kw)
    np.testing.assert_array_equal(ours.tokens, theirs.tokens)
    assert (ours.steps, ours.accepted) == (theirs.steps, theirs.accepted)


@pytest.mark.parametrize("sampling", [M.GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_device_loop_emulated_is_lossless(sampling):
    batch = 4
    plain = _device(SMALL.name, batch, sampling, False)
    spec = _device(SMALL.name, batch, sampling, True)
    _report(f"device loop (numpy emulation) B={batch} {'greedy' if sampling.greedy else 'sampled'}", spec)
    _assert_same(plain, spec)
    assert spec.mean_accept > 1.0
    # float32 emulation vs the float64 oracle: equal but for near-ties (reported, loosely checked)
    agree = float((plain.tokens == _plain(SMALL.name, batch, sampling).tokens).mean())
    print(f"agreement with the float64 numpy tokens: {agree:.3f}")
    assert agree >= 0.75


def test_select_and_noise_are_counter_based():
    g1 = M.gumbel(7, np.arange(3)[:, None], 11, np.arange(5))
    g2 = M.gumbel(7, np.arange(3)[:, None], 11, np.arange(5))
    np.testing.assert_array_equal(g1, g2)
    assert np.isfinite(g1).all() and len(np.unique(g1)) == g1.size
    assert not np.array_equal(g1, M.gumbel(8, np.arange(3)[:, None], 11, np.arange(5)))
    # the same draw whatever the batch shape it is drawn in
    np.testing.assert_array_equal(M.gumbel(7, 2, 11, np.arange(5)), g1[2])
    logits = np.zeros((2, 4))
    logits[:, 1] = logits[:, 3] = 1.0
    np.testing.assert_array_equal(M.select_tokens(logits, np.arange(2), np.arange(2), M.GREEDY), [1, 1])


def test_device_kernels_compile():
    """The CUDA source of the GPU model ops compiles for sm_90 with NVRTC (no GPU needed)."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # no CuPy / NVRTC library here
        pytest.skip(f"NVRTC unavailable: {e}")
    from ddtree_gen.build.compile import compile_source
    result = compile_source(M.CUDA_SOURCE, "model_ops.cu", list(M.KERNEL_NAMES),
                            options=("--gpu-architecture=sm_90", "--std=c++17", "-Xptxas=-v"))
    for name in M.KERNEL_NAMES:
        assert result.reports[name].spill_stores == 0, name


# ------------------------------ the CUDA kernels of the GPU model, emulated on the CPU

# CUDA_SOURCE compiled as C++ with a shim: the threads of a block that synchronises run as
# cooperative lanes (ucontext; __syncthreads and warp shuffles switch lanes), the others as plain
# loops. It runs the GPU loop's own CupyOps code (grids, blocks, argument order) on numpy
# arrays, without a GPU.
_SHIM_PRE = r"""#include <ucontext.h>
#include <vector>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;
// Cooperative lanes (ucontext): a block's threads run in one OS thread; barriers switch lanes.
struct Lane { ucontext_t ctx; int state; };  // 0 runnable, 1 at a warp barrier, 2 at a block barrier, 3 done
static std::vector<Lane> g_lanes;
static std::vector<char> g_stacks;
static ucontext_t g_sched;
static int g_cur;
static float* g_smem;
static float g_wf[1024];
static int g_wi[1024];
static const std::function<void()>* g_body;
static void dd_wait(int kind) {
  g_lanes[g_cur].state = kind;
  swapcontext(&g_lanes[g_cur].ctx, &g_sched);
  threadIdx.x = (unsigned)g_cur;
}
#define __global__
#define __device__
#define __forceinline__ inline
inline void __syncthreads() { dd_wait(2); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  int t = (int)threadIdx.x; g_wf[t] = v; dd_wait(1); float r = g_wf[t ^ o]; dd_wait(1); return r; }
inline int __shfl_xor_sync(unsigned, int v, int o) {
  int t = (int)threadIdx.x; g_wi[t] = v; dd_wait(1); int r = g_wi[t ^ o]; dd_wait(1); return r; }
inline float __int_as_float(long long x) { int32_t y = (int32_t)(uint32_t)x; float f; std::memcpy(&f, &y, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int max(int a, int b) { return a > b ? a : b; }
"""

_SHIM_POST = r"""static void dd_trampoline() {
  (*g_body)();
  g_lanes[g_cur].state = 3;   // uc_link returns to the scheduler
}
static void dd_run_block(unsigned nthreads, size_t smem) {
  const size_t stack = 1 << 16;
  g_lanes.assign(nthreads, Lane{});
  if (g_stacks.size() < nthreads * stack) g_stacks.resize(nthreads * stack);
  std::vector<float> sm(smem / 4 + 1);
  g_smem = sm.data();
  for (unsigned t = 0; t < nthreads; ++t) {
    getcontext(&g_lanes[t].ctx);
    g_lanes[t].ctx.uc_stack.ss_sp = g_stacks.data() + t * stack;
    g_lanes[t].ctx.uc_stack.ss_size = stack;
    g_lanes[t].ctx.uc_link = &g_sched;
    makecontext(&g_lanes[t].ctx, dd_trampoline, 0);
    g_lanes[t].state = 0;
  }
  for (;;) {
    bool ran = false;
    for (unsigned t = 0; t < nthreads; ++t) {
      if (g_lanes[t].state != 0) continue;
      g_cur = (int)t; threadIdx.x = t;
      swapcontext(&g_sched, &g_lanes[t].ctx);
      ran = true;
    }
    bool released = false, live = false;
    for (unsigned w = 0; w < (nthreads + 31) / 32; ++w) {     // a warp barrier opens when its live lanes all wait
      bool any = false, all = true;
      for (unsigned t = w * 32; t < nthreads && t < w * 32 + 32; ++t) {
        if (g_lanes[t].state == 3) continue;
        any = true; live = true;
        if (g_lanes[t].state != 1) all = false;
      }
      if (any && all) { for (unsigned t = w * 32; t < nthreads && t < w * 32 + 32; ++t) if (g_lanes[t].state == 1) g_lanes[t].state = 0; released = true; }
    }
    bool all_block = live;
    for (unsigned t = 0; t < nthreads; ++t) if (g_lanes[t].state != 3 && g_lanes[t].state != 2) all_block = false;
    if (all_block) { for (unsigned t = 0; t < nthreads; ++t) if (g_lanes[t].state == 2) g_lanes[t].state = 0; released = true; }
    if (!live) return;
    if (!ran && !released) { std::fprintf(stderr, "emulation: deadlock\n"); std::abort(); }
  }
}
template <class F> void launch(dim3 grid, dim3 block, size_t smem, bool cooperative, F f) {
  gridDim = grid; blockDim = block;
  std::function<void()> body = f;
  g_body = &body;
  for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
    blockIdx = {bx, by, 0};
    if (!cooperative) { for (unsigned tx = 0; tx < block.x; ++tx) { threadIdx = {tx, 0, 0}; f(); } continue; }
    dd_run_block(block.x, smem);
  }
}
extern "C" {
void L_mm(unsigned gx, unsigned gy, const float* x, const float* w, float* out, int MH, int H, int K, int Nn) {
  launch({gx, gy, 1}, {128, 1, 1}, 0, false, [=] { dd_mm(x, w, out, MH, H, K, Nn); }); }
void L_rmsnorm(unsigned gx, const float* x, const float* w, float* out, int M, int K, float eps) {
  launch({gx, 1, 1}, {128, 1, 1}, 0, true, [=] { dd_rmsnorm(x, w, out, M, K, eps); }); }
void L_q_rope(unsigned gx, const float* q, const int* pos, const float* inv, float* qn, unsigned short* qp, int M, int H, int Dn, int P) {
  launch({gx, 1, 1}, {256, 1, 1}, 0, false, [=] { dd_q_rope(q, pos, inv, qn, qp, M, H, Dn, P); }); }
void L_write_kv(unsigned gx, const float* kv, const float* nw, const int* rp, const float* inv, const int* sb, int so, int Nq,
                const int* bt, int mp, unsigned short* cache, int np_, int ps, int M, int R, int P, float eps) {
  launch({gx, 1, 1}, {128, 1, 1}, 0, true, [=] { dd_write_kv(kv, nw, rp, inv, sb, so, Nq, bt, mp, cache, np_, ps, M, R, P, eps); }); }
void L_to_bf16(unsigned gx, const float* x, unsigned short* y, long long n) {
  launch({gx, 1, 1}, {256, 1, 1}, 0, false, [=] { dd_to_bf16(x, y, n); }); }
void L_from_bf16(unsigned gx, const unsigned short* x, float* y, long long n) {
  launch({gx, 1, 1}, {256, 1, 1}, 0, false, [=] { dd_from_bf16(x, y, n); }); }
void L_silu_mul(unsigned gx, const float* g, const float* u, float* y, long long n) {
  launch({gx, 1, 1}, {256, 1, 1}, 0, false, [=] { dd_silu_mul(g, u, y, n); }); }
void L_select(unsigned gx, const float* lg, const int* pos, int pa, int M, int V, int Nq, unsigned key, float it, int s, int* out) {
  launch({gx, 1, 1}, {128, 1, 1}, 0, true, [=] { dd_select(lg, pos, pa, M, V, Nq, key, it, s, out); }); }
void L_draft_topk(unsigned gx, const float* lg, int V, int Dp, int K, const int* bp, unsigned key, float noise, float it, int* ids, float* lps) {
  launch({gx, 1, 1}, {128, 1, 1}, 4 * (V + 1), true, [=] { dd_draft_topk(lg, V, Dp, K, bp, key, noise, it, ids, lps); }); }
void L_commit(unsigned gx, int B, const int* al, const int* ot, int oc, const int* np_, int un, int* prefix, int* root, int* gen, int cap,
              int* count, int target, int* steps, int* acc) {
  launch({gx, 1, 1}, {128, 1, 1}, 0, false, [=] { dd_commit(B, al, ot, oc, np_, un, prefix, root, gen, cap, count, target, steps, acc); }); }
}
"""

_BLOCKS = {"dd_mm": 128, "dd_rmsnorm": 128, "dd_q_rope": 256, "dd_write_kv": 128, "dd_to_bf16": 256,
           "dd_from_bf16": 256, "dd_silu_mul": 256, "dd_select": 128, "dd_draft_topk": 128, "dd_commit": 128}


@pytest.fixture(scope="module")
def emulated_cuda(tmp_path_factory):
    import ctypes
    import shutil
    import subprocess
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler for the CUDA emulation")
    src = _SHIM_PRE + M.CUDA_SOURCE.replace("extern __shared__ float dd_sm[];", "float* dd_sm = g_smem;") + _SHIM_POST
    d = tmp_path_factory.mktemp("cuda_emu")
    (d / "emu.cpp").write_text(src)
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-ffp-contract=off",
                        "-o", str(d / "emu.so"), str(d / "emu.cpp")], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot build the CUDA emulation: {r.stderr[-300:]}")
    return ctypes.CDLL(str(d / "emu.so"))


class _EmulatedKernel:
    def __init__(self, lib, name):
        self.name, self.fn = name, getattr(lib, "L_" + name[3:])

    def __call__(self, grid, block, args, shared_mem=0):
        import ctypes
        assert tuple(block) == (_BLOCKS[self.name],), (self.name, block)
        assert len(grid) == (2 if self.name == "dd_mm" else 1), (self.name, grid)
        if self.name == "dd_draft_topk":
            assert shared_mem == 4 * (int(args[1]) + 1)
        conv = {np.int32: ctypes.c_int, np.int64: ctypes.c_longlong, np.uint32: ctypes.c_uint,
                np.float32: ctypes.c_float}
        cargs = [ctypes.c_uint(int(g)) for g in grid]
        for a in args:
            cargs.append(ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else conv[type(a)](a.item()))
        self.fn(*cargs)


class _EmulatedCupyOps(M.CupyOps):
    """CupyOps' own code on numpy arrays, its kernels run by the emulation."""

    def __init__(self, lib):  # no CuPy: numpy arrays and the emulated kernels
        self.xp = np
        self._k = {name: _EmulatedKernel(lib, name) for name in M.KERNEL_NAMES}


def test_cuda_kernels_emulated_on_cpu_are_lossless(emulated_cuda):
    """The GPU model's kernels (CUDA_SOURCE) through CupyOps: speculative == plain, and the same
    tokens as the numpy emulation of the device loop (greedy and sampled)."""
    spec, cfg, model = _model(SMALL.name)
    prompts = prompts_for(2, cfg.vocab_size, max_len=20)
    for sampling in (M.GREEDY, SAMPLED):
        kw = dict(kernels=M.ReferenceKernels(spec), weights=model.w, sampling=sampling)
        plain = M.generate_device(cfg, spec, prompts, 12, ops=_EmulatedCupyOps(emulated_cuda), speculative=False,
                                  **kw)
        spec_gen = M.generate_device(cfg, spec, prompts, 12, ops=_EmulatedCupyOps(emulated_cuda),
                                     speculative=True, **kw)
        _assert_same(plain, spec_gen)
        ref = M.generate_device(cfg, spec, prompts, 12, ops=M.NumpyOps(), speculative=False, **kw)
        np.testing.assert_array_equal(plain.tokens, ref.tokens)

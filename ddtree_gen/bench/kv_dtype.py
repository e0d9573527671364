"""`ddtree-gen bench kv-dtype`: tree_verify (impl="auto") with a bf16 and with an fp8 (e4m3) KV cache on the
same shapes, side by side in one process; the fp8 cache by both of its paths: the fused kernel (fp8_path="fused": its
converter warpgroup) and the dequantize pre-pass (fp8_path="dequant": kv_dequant, then the bf16-cache seesaw), whose
outputs are checked against the fused ones bit for bit; and which of the two the default (fp8_path=None) takes on
each shape (ops.tree_verify.launch.fp8_default)."""
from __future__ import annotations

import time

import numpy as np

from ..inputs import verify_inputs
from ..ops.tree_verify.launch import auto_impl, fp8_default
from ..ops.tree_verify.which import which_kernel
from ..ops.tree_verify.wgmma import DEQUANT_PARTS
from .specs import VERIFY_KERNELS, spec_variant
from .timing import checked_graph_time_ms, measured_peak_tflops, print_table, verify_flops

# issue 22's table
KV_DTYPE_CONFIGS = [(1, 8, 4096), (8, 8, 4096), (32, 8, 4096), (64, 16, 2048), (8, 64, 4096), (8, 128, 4096),
                    (8, 64, 16384)]
KV_DTYPE_KERNELS = VERIFY_KERNELS
# an fp8 spec's fp8_path="dequant": the pre-pass (tree_verify_wgmma, in VERIFY_KERNELS, brings its dequantize builds)
DEQUANT_KERNELS = ("kv_dequant",)


def run(args) -> None:
    """tree_verify (impl="auto") of a spec with a bf16 and with an fp8 (e4m3) KV cache on the same shapes, in one
    process: H comes from the config (variants of the spec with other H are built as needed), the fp8 cache holds
    the e4m3 bytes of the bf16 cache's samples. A table: config, impl, the path the fp8 default (fp8_path=None, no
    kv_workspace) takes there (fp8_default: "dequant" or "fused"), bf16 ms, fp8 ms of the fused kernel
    (fp8_path="fused"), bf16/fused speed ratio, fp8 ms by the dequantize path (fp8_path="dequant", its kv_workspace
    given: the pre-pass and the kernel, both in the graph), its speed ratio to bf16, whether its outputs are the fused
    ones' bits, and TFLOP/s and % of the measured bf16 matmul peak of bf16 and fused fp8."""
    from ..spec import find_spec
    from ..kernel_set import load
    base = find_spec((args.spec or ["kimi-k2.6-tp8"])[0])
    peak = measured_peak_tflops()
    nq = 65
    rows = []
    for b, h, l in KV_DTYPE_CONFIGS:
        lens = np.full(b, l)
        flops, times, impls, same, default = None, {}, {}, "-", "-"
        for kv_dtype in ("bf16", "fp8_e4m3"):
            spec = spec_variant(base, h, kv_dtype)
            t0 = time.perf_counter()
            ks = load(spec, kernels=list(KV_DTYPE_KERNELS) + (list(DEQUANT_KERNELS) if spec.kv_fp8 else []))
            x = verify_inputs(spec, b, lens, nq)
            impls[kv_dtype] = auto_impl(ks, x["q_nope"].device.id)
            fused = {"fp8_path": "fused"} if spec.kv_fp8 else {}   # the fp8 column: the fused kernel, named
            if spec.kv_fp8:
                default = fp8_default(ks, "auto", x["q_nope"].device.id, *x["block_table"].shape)[0]
            res = ks.tree_verify(**x, **fused)
            fn = lambda ks=ks, x=x, res=res, kw=fused: ks.tree_verify(**x, out=res.out, lse=res.lse, **kw)  # noqa: E731
            flops = verify_flops(spec, lens, nq)
            times[kv_dtype] = checked_graph_time_ms(fn, f"{kv_dtype} at B={b} H={h} L={l}", flops / (peak * 1e12) * 1e3)
            paths = f", fp8_path='fused'; fp8_path=None takes {default!r}" if spec.kv_fp8 else ""
            print(f"B={b} H={h} L={l} {spec.name} ({kv_dtype}, impl={impls[kv_dtype]}{paths}): "
                  f"{times[kv_dtype]:.3f} ms "
                  f"(load + inputs + timing {time.perf_counter() - t0:.1f} s)", flush=True)
            if spec.kv_fp8 and impls[kv_dtype] == "wgmma":   # the dequantize path, same inputs, same process
                same, times["dequant"] = _dequant(ks, spec, x, res, flops / (peak * 1e12) * 1e3, f"B={b} H={h} L={l}")
                against = {"yes": "bit-identical to the fused kernel's", "NO": "DIFFERENT from the fused kernel's"}
                print(f"B={b} H={h} L={l} {spec.name} (fp8_path='dequant'): {times['dequant']:.3f} ms, outputs "
                      f"{against.get(same, f'of the parts grid: {same[6:]} from the fused ones (relative)')}",
                      flush=True)
        cells = []
        for kv_dtype in ("bf16", "fp8_e4m3"):
            tf = flops / (times[kv_dtype] * 1e-3) / 1e12
            cells += [f"{tf:.1f}", f"{100 * tf / peak:.1f}%"]
        dq = times.get("dequant")
        rows.append([f"B={b} H={h} L={l}", f"{impls['bf16']}/{impls['fp8_e4m3']}", default, f"{times['bf16']:.3f}",
                     f"{times['fp8_e4m3']:.3f}", f"{times['bf16'] / times['fp8_e4m3']:.2f}x",
                     f"{dq:.3f}" if dq else "-", f"{times['bf16'] / dq:.2f}x" if dq else "-", same, *cells])
    print_table(f"tree_verify (impl auto) of {base.name}: bf16 vs fp8 (e4m3) KV cache, Nq={nq}; CUDA-graph replay "
                f"medians; FLOPs = 2*H*Nq*(L+Nq)*(2R+P) summed over requests; measured bf16 matmul peak in this run: "
                f"{peak:.0f} TFLOP/s; speedup = bf16 ms / fp8 ms; fp8 default = the path fp8_path=None takes "
                f"(ops.tree_verify.launch.fp8_default); fp8 = the fused kernel (fp8_path='fused'), dequant = "
                f"fp8_path='dequant' (kv_dequant pre-pass + bf16-cache seesaw; 'same bits' = its out and lse equal the "
                f"fused kernel's; 'parts' = its parts-grid build ran, bits of its own: the worst row's relative "
                f"difference from the fused output)",
                ["config", "impl bf16/fp8", "fp8 default", "bf16 ms", "fp8 ms", "speedup", "dequant ms",
                 "dequant speedup", "same bits", "bf16 TFLOP/s", "bf16 % peak", "fp8 TFLOP/s", "fp8 % peak"], rows,
                args.out, "bench_kv_dtype")


def _dequant(ks, spec, x, fused, floor_ms, where) -> tuple:
    """The dequantize path on the fused call's inputs: ("yes": its out and lse are the fused ones' bits; on the parts
    grid, which has bits of its own, "parts" and the worst ||out - fused|| / ||fused|| of a row; "NO" otherwise, ms by
    CUDA-graph replay) with its kv_workspace given (allocated once, as an engine would)."""
    import cupy
    from ..ops.kv_dequant.plan import workspace_elems
    b, max_pages = x["block_table"].shape
    kvw = cupy.empty(workspace_elems(spec, b, max_pages), np.uint16)
    res = ks.tree_verify(**x, fp8_path="dequant", kv_workspace=kvw)
    rows = np.arange(x["q_nope"].shape[1])[None, :] < cupy.asnumpy(x["q_lens"])[:, None]   # rows < q_len
    same = all(np.array_equal(cupy.asnumpy(a)[rows].view(np.uint8), cupy.asnumpy(f)[rows].view(np.uint8))
               for a, f in ((res.out, fused.out), (res.lse, fused.lse)))
    verdict = "yes" if same else "NO"
    if not same and which_kernel(ks, b, x["q_nope"].shape[1], max_pages, device=x["q_nope"].device.id,
                                 fp8_path="dequant", kv_workspace=True).kernel == DEQUANT_PARTS:
        from .. import bf16
        o, f = (bf16.from_bits(cupy.asnumpy(a)[rows]).astype(np.float64) for a in (res.out, fused.out))
        rel = np.linalg.norm(o - f, axis=-1) / np.maximum(np.linalg.norm(f, axis=-1), 1e-30)
        verdict = f"parts {rel.max():.1e}" if np.isfinite(rel).all() else "NO (NaN)"
    fn = lambda: ks.tree_verify(**x, out=res.out, lse=res.lse, fp8_path="dequant", kv_workspace=kvw)  # noqa: E731
    return verdict, checked_graph_time_ms(fn, f"fp8 dequant at {where}", floor_ms)


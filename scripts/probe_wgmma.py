"""Probe: the wgmma building blocks of tree_verify_wgmma, in isolation, on the GPU.

One 64-row Q tile and one 64-key K tile (576 wide) in the kernel's swizzled slab layout:
S = Q K^T with 36 x m64n32k16 per warpgroup (keys split in halves), S again with m64n64k16 and Q's
fragments in registers (the A-from-registers layout), one k-step with A in the no-swizzle K-major layout, and O = P V with
4 x m64n256k16 per warpgroup (P: 64 x 64 K-major, V: the K tile read MN-major), for both
orders of the V descriptor's strides. Prints the relative error of each against numpy.
When: on a GPU, before changing an operand layout of templates/tree_verify_wgmma.cu.j2 (smem
descriptors, swizzle, register-A fragments; e.g. the TMA step of docs/perf/journal-tree-verify.md), to settle the new
layout in isolation (SOURCE below is self-contained, not rendered from the template).
Run: PYTHONPATH=. python scripts/probe_wgmma.py
"""
from __future__ import annotations

import numpy as np

SOURCE = r'''
typedef unsigned short bf16_t; typedef unsigned int uint32_t; typedef unsigned long long uint64_t;
#define SLAB_BYTES 8192
__device__ __forceinline__ uint32_t swz(int r, int c) { return (uint32_t)((c >> 3) * SLAB_BYTES + r * 128 + (((c & 7) ^ (r & 7)) << 4)); }
__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint64_t dk(uint32_t a) { return (uint64_t)((a & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)64 << 32) | (1ull << 62); }
__device__ __forceinline__ uint64_t dmn(uint32_t a) { return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(V_LBO >> 4) << 16) | ((uint64_t)(V_SBO >> 4) << 32) | (1ull << 62); }
__device__ __forceinline__ void ws(float (&d)[16], uint64_t a, uint64_t b, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
  : "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]),"+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15])
  : "l"(a), "l"(b), "r"(acc));
}
PV_DECL
__device__ __forceinline__ void wrs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
  : "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]),"+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15]),
    "+f"(d[16]),"+f"(d[17]),"+f"(d[18]),"+f"(d[19]),"+f"(d[20]),"+f"(d[21]),"+f"(d[22]),"+f"(d[23]),"+f"(d[24]),"+f"(d[25]),"+f"(d[26]),"+f"(d[27]),"+f"(d[28]),"+f"(d[29]),"+f"(d[30]),"+f"(d[31])
  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
__device__ __forceinline__ void wss(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
  : "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]),"+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15]),
    "+f"(d[16]),"+f"(d[17]),"+f"(d[18]),"+f"(d[19]),"+f"(d[20]),"+f"(d[21]),"+f"(d[22]),"+f"(d[23]),"+f"(d[24]),"+f"(d[25]),"+f"(d[26]),"+f"(d[27]),"+f"(d[28]),"+f"(d[29]),"+f"(d[30]),"+f"(d[31])
  : "l"(a), "l"(b), "r"(0));
}
extern "C" __global__ void __launch_bounds__(256, 1) probe(const bf16_t* q, const bf16_t* k, const bf16_t* p, float* s_out, float* o_out, float* rs_out, float* x_out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sQ = smem; unsigned char* sK = smem + 9 * SLAB_BYTES; unsigned char* sP = smem + 18 * SLAB_BYTES;
  int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = warp & 3, kh = warp >> 2, grp = lane >> 2, qd = lane & 3;
  for (int i = tid; i < 64 * 72; i += 256) { int r = i / 72, c = i % 72;
    *(uint4*)(sQ + swz(r, c)) = *(const uint4*)(q + r * 576 + c * 8);
    *(uint4*)(sK + swz(r, c)) = *(const uint4*)(k + r * 576 + c * 8); }
  for (int i = tid; i < 64 * 8; i += 256) { int r = i / 8, c = i % 8; *(uint4*)(sP + swz(r, c)) = *(const uint4*)(p + r * 64 + c * 8); }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  float s[16];
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  for (int ks = 0; ks < 36; ++ks) { uint64_t off = (uint64_t)(((ks >> 2) * SLAB_BYTES + (ks & 3) * 32) >> 4);
    ws(s, dk(sa(sQ)) + off, dk(sa(sK) + kh * 32 * 128) + off, ks > 0); }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  for (int i = 0; i < 16; ++i) asm volatile("" : "+f"(s[i]) :: "memory");
  for (int j = 0; j < 4; ++j) for (int h = 0; h < 2; ++h) for (int e = 0; e < 2; ++e)
    s_out[(16 * g + grp + 8 * h) * 64 + kh * 32 + 8 * j + 2 * qd + e] = s[4 * j + 2 * h + e];
  if (kh == 0) {   // S = Q K^T with Q's fragments in registers (m64n64k16, A from registers)
    float d[32];
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    for (int ks = 0; ks < 36; ++ks) {
      const bf16_t* q0 = q + (16 * g + grp) * 576 + 16 * ks + 2 * qd;
      const bf16_t* q1 = q0 + 8 * 576;
      uint32_t a[4] = {*(const uint32_t*)q0, *(const uint32_t*)q1, *(const uint32_t*)(q0 + 8), *(const uint32_t*)(q1 + 8)};
      wrs(d, a, dk(sa(sK)) + (uint64_t)(((ks >> 2) * SLAB_BYTES + (ks & 3) * 32) >> 4), ks > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
    for (int j = 0; j < 8; ++j) for (int h = 0; h < 2; ++h) for (int e = 0; e < 2; ++e)
      rs_out[(16 * g + grp + 8 * h) * 64 + 8 * j + 2 * qd + e] = d[4 * j + 2 * h + e];
  }
  if (kh == 1) {   // Q[:, :16] K[:, :16]^T with Q's 16 columns in the no-swizzle K-major layout (one k-step)
    unsigned char* sX = smem + 19 * SLAB_BYTES;
    for (int i = tid - 128; i < 128; i += 128) { int r = i >> 1, c = i & 1;
      *(uint4*)(sX + (r >> 3) * 256 + c * 128 + (r & 7) * 16) = *(const uint4*)(q + r * 576 + 8 * c); }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
    uint64_t xd = (uint64_t)((sa(sX) & 0x3FFFF) >> 4) | ((uint64_t)8 << 16) | ((uint64_t)16 << 32);
    float d[32];
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    wss(d, xd, dk(sa(sK)));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
    for (int j = 0; j < 8; ++j) for (int h = 0; h < 2; ++h) for (int e = 0; e < 2; ++e)
      x_out[(16 * g + grp + 8 * h) * 64 + 8 * j + 2 * qd + e] = d[4 * j + 2 * h + e];
  }
  float o[128];
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  for (int ks = 0; ks < 4; ++ks) wpv(o, dk(sa(sP)) + (uint64_t)(ks * 2), dmn(sa(sK) + kh * 4 * SLAB_BYTES) + (uint64_t)((ks * 2048) >> 4));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(o[i]) :: "memory");
  for (int j = 0; j < 32; ++j) for (int h = 0; h < 2; ++h) for (int e = 0; e < 2; ++e)
    o_out[(16 * g + grp + 8 * h) * 512 + kh * 256 + 8 * j + 2 * qd + e] = o[4 * j + 2 * h + e];
}
'''


def pv_decl():
    regs = ",".join(f"%{i}" for i in range(128))
    ops = ",".join(f'"+f"(d[{i}])' for i in range(128))
    return ("__device__ __forceinline__ void wpv(float (&d)[128], uint64_t a, uint64_t b) {\n"
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %130, 0;\\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {{{regs}}}, %128, %129, p, 1, 1, 0, 1;\\n}}\\n"\n'
            f'  : {ops} : "l"(a), "l"(b), "r"(1));\n}}\n')


def main():
    import cupy
    from ddtree_gen import bf16
    from ddtree_gen.build.compile import compile_source
    rng = np.random.default_rng(0)
    q = bf16.to_bits(rng.standard_normal((64, 576)))
    k = bf16.to_bits(rng.standard_normal((64, 576)))
    p = bf16.to_bits(rng.random((64, 64)))
    qf, kf, pf = (bf16.from_bits(x).astype(np.float64) for x in (q, k, p))
    s_ref, o_ref = qf @ kf.T, pf @ kf[:, :512]
    for lbo, sbo in ((8192, 1024), (1024, 8192)):
        src = SOURCE.replace("PV_DECL", pv_decl())
        src = f"#define V_LBO {lbo}\n#define V_SBO {sbo}\n" + src
        res = compile_source(src, "probe.cu", ["probe"])
        mod = cupy.cuda.function.Module()
        mod.load(res.cubin)
        fn = mod.get_function("probe")
        smem = 18 * 8192 + 8192 + 2048
        cupy.cuda.driver.funcSetAttribute(fn.ptr, cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        s_out = cupy.full((64, 64), np.nan, np.float32)
        o_out = cupy.full((64, 512), np.nan, np.float32)
        rs_out = cupy.full((64, 64), np.nan, np.float32)
        x_out = cupy.full((64, 64), np.nan, np.float32)
        fn((1,), (256,), (cupy.asarray(q), cupy.asarray(k), cupy.asarray(p), s_out, o_out, rs_out, x_out),
           shared_mem=smem)
        cupy.cuda.Device().synchronize()
        s, o = s_out.get().astype(np.float64), o_out.get().astype(np.float64)
        es = np.linalg.norm(s - s_ref) / np.linalg.norm(s_ref)
        eo = np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref)
        rs = rs_out.get().astype(np.float64)
        ers = np.linalg.norm(rs - s_ref) / np.linalg.norm(s_ref)
        x_ref = qf[:, :16] @ kf[:, :16].T
        ex = np.linalg.norm(x_out.get().astype(np.float64) - x_ref) / np.linalg.norm(x_ref)
        print(f"probe_wgmma V_LBO={lbo} V_SBO={sbo}: S rel err {es:.3g}  S (A from registers) {ers:.3g}  k-step with A no-swizzle {ex:.3g}  PV rel err {eo:.3g}  "
              f"regs {res.reports['probe'].registers}")


if __name__ == "__main__":
    from ddtree_gen import needs
    needs.script_without_options(__file__, __doc__)
    main()

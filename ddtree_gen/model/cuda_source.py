"""CUDA C source of CupyOps' own kernels (row-deterministic matmul, norms, RoPE, KV write, token
choice, draft top-k, commit) and their names."""


CUDA_SOURCE = r"""
#define DD_FULL 0xffffffffu
#define DD_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned int dd_mix32(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

// Gumbel noise of (key, request, position, index); key = mix32(seed ^ 0x9e3779b9) (host side).
__device__ __forceinline__ float dd_gumbel(unsigned int key, int r, int p, int v) {
    unsigned int h = dd_mix32(key ^ (unsigned int)r);
    h = dd_mix32(h ^ (unsigned int)p);
    h = dd_mix32(h ^ (unsigned int)v);
    float u = ((float)(h >> 9) + 0.5f) * 1.1920928955078125e-07f;   // 2^-23, exact
    return -logf(-logf(u));
}

// float32 -> bf16 bits, round to nearest even; NaN -> quiet NaN with the sign (as ddtree_gen.bf16)
__device__ __forceinline__ unsigned short dd_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float dd_warp_sum(float s) {
    // xor butterfly: every lane ends with the same value (each step adds the same two operands)
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(DD_FULL, s, o);
    return s;
}

extern "C" {

// out[mh, n] = sum_k x[mh, k] * w[mh % H, k, n], k in order: a row's result does not depend on
// how many rows the call has (unlike a BLAS GEMM), so a token's numbers are the same in a
// q_len 1 pass and in a tree pass. grid (M*H, ceil(Nn / 128)), block 128.
__global__ void dd_mm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                      int MH, int H, int K, int Nn) {
    int mh = blockIdx.x;
    int n = blockIdx.y * blockDim.x + threadIdx.x;
    if (mh >= MH || n >= Nn) return;
    const float* xr = x + (size_t)mh * K;
    const float* wc = w + (size_t)(mh % H) * K * Nn + n;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc = fmaf(xr[k], wc[(size_t)k * Nn], acc);
    out[(size_t)mh * Nn + n] = acc;
}

// one warp per row: out = x * rsqrt(mean(x^2) + eps) * w
__global__ void dd_rmsnorm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                           int M, int K, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= M) return;                                   // warp-uniform
    const float* xr = x + (size_t)row * K;
    float s = 0.f;
    for (int k = lane; k < K; k += 32) s = fmaf(xr[k], xr[k], s);
    s = dd_warp_sum(s);
    float r = rsqrtf(s / (float)K + eps);
    for (int k = lane; k < K; k += 32) out[(size_t)row * K + k] = xr[k] * r * w[k];
}

// q [M, H, Dn + P] -> q_nope [M, H, Dn] float32 and q_pe [M, H, P] bf16 bits (rotate-half RoPE at
// rope_pos[m], negative positions taken as 0). One thread per (m, h, i), i < Dn + P/2.
__global__ void dd_q_rope(const float* __restrict__ q, const int* __restrict__ rope_pos,
                          const float* __restrict__ inv_freq, float* __restrict__ q_nope,
                          unsigned short* __restrict__ q_pe, int M, int H, int Dn, int P) {
    int half = P >> 1, per = Dn + half;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)M * H * per) return;
    int mh = (int)(t / per);
    int i = (int)(t - (long long)mh * per);
    const float* src = q + (size_t)mh * (Dn + P);
    if (i < Dn) { q_nope[(size_t)mh * Dn + i] = src[i]; return; }
    i -= Dn;
    float a = (float)max(rope_pos[mh / H], 0) * inv_freq[i];
    float c = cosf(a), s = sinf(a);
    float x1 = src[Dn + i], x2 = src[Dn + half + i];
    q_pe[(size_t)mh * P + i] = dd_bf16(x1 * c - x2 * s);
    q_pe[(size_t)mh * P + half + i] = dd_bf16(x2 * c + x1 * s);
}

// One warp per row m = b * Nq + j of kv [M, R + P]: c_kv = rmsnorm(kv[:R]) * norm_w, k_pe =
// rope(kv[R:], rope_pos[m]), rounded to bf16 and written to cache position
// slot_base[b] + slot_offset + j through the block table. Positions outside the table are skipped.
__global__ void dd_write_kv(const float* __restrict__ kv, const float* __restrict__ norm_w,
                            const int* __restrict__ rope_pos, const float* __restrict__ inv_freq,
                            const int* __restrict__ slot_base, int slot_offset, int Nq,
                            const int* __restrict__ block_table, int max_pages,
                            unsigned short* __restrict__ cache, int num_pages, int page_size,
                            int M, int R, int P, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= M) return;                                   // warp-uniform
    int b = row / Nq, j = row - b * Nq;
    long long pos = (long long)slot_base[b] + slot_offset + j;
    if (pos < 0) return;
    long long pidx = pos / page_size;
    if (pidx >= max_pages) return;
    int page = block_table[(size_t)b * max_pages + pidx];
    if (page < 0 || page >= num_pages) return;
    unsigned short* dst = cache + ((size_t)page * page_size + (size_t)(pos % page_size)) * (size_t)(R + P);
    const float* src = kv + (size_t)row * (R + P);
    float s = 0.f;
    for (int k = lane; k < R; k += 32) s = fmaf(src[k], src[k], s);
    s = dd_warp_sum(s);
    float r = rsqrtf(s / (float)R + eps);
    for (int k = lane; k < R; k += 32) dst[k] = dd_bf16(src[k] * r * norm_w[k]);
    int half = P >> 1;
    float fp = (float)max(rope_pos[row], 0);
    for (int i = lane; i < half; i += 32) {
        float a = fp * inv_freq[i];
        float c = cosf(a), sn = sinf(a);
        float x1 = src[R + i], x2 = src[R + half + i];
        dst[R + i] = dd_bf16(x1 * c - x2 * sn);
        dst[R + half + i] = dd_bf16(x2 * c + x1 * sn);
    }
}

__global__ void dd_to_bf16(const float* __restrict__ x, unsigned short* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = dd_bf16(x[i]);
}

__global__ void dd_from_bf16(const unsigned short* __restrict__ x, float* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __uint_as_float(((unsigned int)x[i]) << 16);
}

__global__ void dd_silu_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
                            long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float a = g[i]; y[i] = a / (1.f + expf(-a)) * u[i]; }
}

// One warp per row m = b * Nq + j: out[m] = argmax_v score (lowest v among equal maxima), score =
// logits (greedy) or logits * inv_temp + gumbel(key, b, pos[m] + pos_add, v) (sampled).
__global__ void dd_select(const float* __restrict__ logits, const int* __restrict__ pos, int pos_add,
                          int M, int V, int Nq, unsigned int key, float inv_temp, int sampled,
                          int* __restrict__ out) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= M) return;                                   // warp-uniform
    int b = row / Nq;
    int p = pos[row] + pos_add;
    float best = DD_NEG_INF;
    int bi = 0x7fffffff;
    for (int v = lane; v < V; v += 32) {
        float s = logits[(size_t)row * V + v];
        if (sampled) s = s * inv_temp + dd_gumbel(key, b, p, v);
        if (s > best) { best = s; bi = v; }                 // v ascending: the first maximum stays
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(DD_FULL, best, o);
        int oi = __shfl_xor_sync(DD_FULL, bi, o);
        if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
    }
    if (lane == 0) out[row] = (bi == 0x7fffffff) ? 0 : bi;
}

// One block per row (b, d) of logits [B * Dp, V]: s = logits * inv_temp + noise * gumbel(key, b,
// base_pos[b] + d + 1, v); the K best (descending, ties: lower v) with their log-softmax.
// Dynamic shared memory: (V + 1) floats. Needs K <= V.
__global__ void dd_draft_topk(const float* __restrict__ logits, int V, int Dp, int K,
                              const int* __restrict__ base_pos, unsigned int key, float noise,
                              float inv_temp, int* __restrict__ ids, float* __restrict__ lps) {
    extern __shared__ float dd_sm[];
    float* s = dd_sm;
    int row = blockIdx.x;
    int b = row / Dp, d = row - b * Dp;
    int p = base_pos[b] + d + 1;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        s[v] = logits[(size_t)row * V + v] * inv_temp + noise * dd_gumbel(key, b, p, v);
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = DD_NEG_INF;
        for (int v = 0; v < V; ++v) m = fmaxf(m, s[v]);
        float z = 0.f;
        for (int v = 0; v < V; ++v) z += expf(s[v] - m);
        s[V] = m + logf(z);
    }
    __syncthreads();
    float lse = s[V];
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float sv = s[v];
        int rank = 0;
        for (int u = 0; u < V; ++u) {
            float su = s[u];
            rank += (su > sv) || (su == sv && u < v);
        }
        if (rank < K) {
            ids[(size_t)row * K + rank] = v;
            lps[(size_t)row * K + rank] = sv - lse;
        }
    }
}

// One thread per request: append out_tokens[b, :a+1] (a = accept_lens[b]) to gen[b], advance the
// prefix (new_prefix[b], or prefix + a + 1 when use_new_prefix is 0) and the root (the bonus
// token). A request that already has `target` tokens keeps its state (its step is redone).
__global__ void dd_commit(int B, const int* __restrict__ accept_lens, const int* __restrict__ out_tokens,
                          int out_cols, const int* new_prefix, int use_new_prefix,
                          int* prefix, int* __restrict__ root, int* __restrict__ gen, int cap,
                          int* __restrict__ count, int target, int* __restrict__ steps,
                          int* __restrict__ accepted) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    int c = count[b];
    if (c >= target) return;
    int a = accept_lens[b];
    a = a < 0 ? 0 : (a > out_cols - 1 ? out_cols - 1 : a);
    for (int i = 0; i <= a; ++i)
        if (c + i < cap) gen[(size_t)b * cap + c + i] = out_tokens[(size_t)b * out_cols + i];
    count[b] = c + a + 1;
    prefix[b] = use_new_prefix ? new_prefix[b] : prefix[b] + a + 1;
    root[b] = out_tokens[(size_t)b * out_cols + a];
    steps[b] += 1;
    accepted[b] += a;
}

}  // extern "C"
"""

KERNEL_NAMES = ("dd_mm", "dd_rmsnorm", "dd_q_rope", "dd_write_kv", "dd_to_bf16", "dd_from_bf16",
                "dd_silu_mul", "dd_select", "dd_draft_topk", "dd_commit")

// A part of kernels.cu (one NVRTC program; the -D defines it needs are listed there).
#pragma once
#include "common.cuh"

// ---- attention over the paged KV store, read in place through the block tables -------
// kc, vc: one layer's store [NB, G, BT, D] (BT positions a block, a -D define) of T = float16
// (unsigned short, converted exactly by cvt) or float32; the row's sequence seq[r] has the
// block table tab[seq[r] * nb .. + nb): key t lies in block tab[.. + t / BT] at offset
// t % BT. The arithmetic is the contiguous kernels' (docs: attention), key for key.
__device__ __forceinline__ float kv_ld(const float* p, size_t i) { return __ldg(p + i); }
__device__ __forceinline__ float kv_ld(const unsigned short* p, size_t i) { return h2f(__ldg(p + i)); }

// pass 1: scores. grid (rows * H, KSPLIT); warp wg = blockIdx.y * WARPS + warp handles keys
// t = t0 + wg, t0 + wg + WARPS * KSPLIT, ...
// sc[(rr * H + h) * C + t] = dot(q[r, h], k[t]) * scale   (r = r0 + rr, C = nb * BT)
template <class T>
__device__ __forceinline__ void attn_scores_t(
        const float* __restrict__ q, const T* __restrict__ kc, const int* __restrict__ tab, int nb,
        const int* __restrict__ seq, const int* __restrict__ pos, float* __restrict__ sc,
        int H, int G, int D, float scale, int r0, int window) {
    const int rh = blockIdx.x;
    const int rr = rh / H, h = rh - rr * H, r = r0 + rr;
    const int P = pos[r] + 1;
    const int t0 = window > 0 ? max(0, P - window) : 0;  // sliding window: keys t0 .. P-1
    const int g = h / (H / G);
    const int lane = threadIdx.x & 31;
    const float* qr = q + ((size_t)r * H + h) * D;
    const int* tr = tab + (size_t)seq[r] * nb;
    float* out = sc + (size_t)rh * nb * BT;
    float qv[MAX_HEAD_DIM / 32];
#pragma unroll
    for (int i = 0; i < MAX_HEAD_DIM / 32; ++i) qv[i] = (lane + 32 * i < D) ? qr[lane + 32 * i] : 0.0f;
    for (int t = t0 + blockIdx.y * WARPS + (threadIdx.x >> 5); t < P; t += WARPS * KSPLIT) {
        const size_t kt = (((size_t)tr[t / BT] * G + g) * BT + t % BT) * D;
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_HEAD_DIM / 32; ++i)
            if (lane + 32 * i < D) acc = __fmaf_rn(qv[i], kv_ld(kc, kt + lane + 32 * i), acc);
        acc = warp_sum(acc);
        if (lane == 0) out[t] = __fmul_rn(acc, scale);
    }
}

// pass 2: softmax and the weighted V sum; one block per (row, head)
template <class T>
__device__ __forceinline__ void attn_softmax_v_t(
        float* sc, const T* __restrict__ vc, const int* __restrict__ tab, int nb,
        const int* __restrict__ seq, const int* __restrict__ pos, float* __restrict__ o,
        int H, int G, int D, int r0, int window) {
    __shared__ float red[WARPS];
    __shared__ float part[NT];
    const int rh = blockIdx.x;
    const int rr = rh / H, h = rh - rr * H, r = r0 + rr;
    const int P = pos[r] + 1;
    const int t0 = window > 0 ? max(0, P - window) : 0;  // sliding window: keys t0 .. P-1
    const int g = h / (H / G);
    const int tid = threadIdx.x;
    const int* tr = tab + (size_t)seq[r] * nb;
    float* e = sc + (size_t)rh * nb * BT;
    float mx = __int_as_float(0xff800000);  // -inf
    for (int t = t0 + tid; t < P; t += NT) mx = fmaxf(mx, e[t]);
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (int t = t0 + tid; t < P; t += NT) {
        const float v = expf_pc(__fsub_rn(e[t], mx));
        e[t] = v;
        sum = __fadd_rn(sum, v);
    }
    sum = block_sum(sum, red);  // its __syncthreads also publishes e[] to the block
    const int S = NT / D;       // key subsets (D <= 256)
    if (tid < S * D) {
        const int s = tid / D, d = tid - s * D;
        float acc = 0.0f;
        for (int t = t0 + s; t < P; t += S)
            acc = __fmaf_rn(e[t], kv_ld(vc, (((size_t)tr[t / BT] * G + g) * BT + t % BT) * D + d), acc);
        part[tid] = acc;
    }
    __syncthreads();
    if (tid < D) {
        float a = part[tid];
        for (int s = 1; s < S; ++s) a = __fadd_rn(a, part[s * D + tid]);
        o[((size_t)r * H + h) * D + tid] = __fmul_rn(a, __fdiv_rn(1.0f, sum));
    }
}

extern "C" __global__ void __launch_bounds__(NT) attn_scores_f16(
        const float* __restrict__ q, const unsigned short* __restrict__ kc, const int* __restrict__ tab, int nb,
        const int* __restrict__ seq, const int* __restrict__ pos, float* __restrict__ sc,
        int H, int G, int D, float scale, int r0, int window) {
    attn_scores_t(q, kc, tab, nb, seq, pos, sc, H, G, D, scale, r0, window);
}

extern "C" __global__ void __launch_bounds__(NT) attn_softmax_v_f16(
        float* sc, const unsigned short* __restrict__ vc, const int* __restrict__ tab, int nb,
        const int* __restrict__ seq, const int* __restrict__ pos, float* __restrict__ o,
        int H, int G, int D, int r0, int window) {
    attn_softmax_v_t(sc, vc, tab, nb, seq, pos, o, H, G, D, r0, window);
}

extern "C" __global__ void __launch_bounds__(NT) attn_scores_f32(
        const float* __restrict__ q, const float* __restrict__ kc, const int* __restrict__ tab, int nb,
        const int* __restrict__ seq, const int* __restrict__ pos, float* __restrict__ sc,
        int H, int G, int D, float scale, int r0, int window) {
    attn_scores_t(q, kc, tab, nb, seq, pos, sc, H, G, D, scale, r0, window);
}

extern "C" __global__ void __launch_bounds__(NT) attn_softmax_v_f32(
        float* sc, const float* __restrict__ vc, const int* __restrict__ tab, int nb,
        const int* __restrict__ seq, const int* __restrict__ pos, float* __restrict__ o,
        int H, int G, int D, int r0, int window) {
    attn_softmax_v_t(sc, vc, tab, nb, seq, pos, o, H, G, D, r0, window);
}

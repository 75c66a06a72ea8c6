// A part of kernels.cu (one NVRTC program; the -D defines it needs are listed there).
#pragma once
#include "common.cuh"

// ---- linear: out[M, N] = x[M, K] @ w[N, K]^T ------------------------------------------
// Block: 8 warps; warp w computes columns n0 .. n0+NC-1 (n0 = (blockIdx.y*8 + w) * NC) for
// rows m0 .. m0+TM-1 (m0 = blockIdx.x * TM). Lane l owns the octets g = l, l+32, ... and
// runs one fma chain per output element over them in increasing k.
// VEC (K % 8 == 0, every row 16-byte aligned): whole octets with vector loads, PF octets
// per lane loaded before the first of them is used (PF * 32 octets of each column in
// flight per warp, PF = W::PF1 -- about 128 bytes a lane -- at one row and one column a
// warp, fewer for larger tiles; the chains still take the octets one by one in increasing k). Columns
// past N (the last warp of a ragged N) load column N - 1 and never store.
// add_mode 1: out = sum + add[m, n] (a residual), 2: out = sum + add[n] (a bias), the add
// rounded once after the reduction: what a separate `y + add` computes, one launch fewer.
// norm 1 (the fused RMS norm): the product's input is rms_norm(x, nw, eps), each element
// (x * inv) * nw[k] formed in registers as the rms_norm kernel forms it, inv per row from
// rms_inv by the whole block before any warp leaves -- one launch instead of two.
template <int TM, int NC, class W>
__device__ __forceinline__ void linear_vec(const float* __restrict__ x, const W& w,
                                           float* __restrict__ out, int M, int N, int K,
                                           const float* __restrict__ add, int add_mode,
                                           const float* __restrict__ nw, float eps, int norm) {
    // fewer octets in flight where a loaded octet serves several rows or columns (registers)
    constexpr int PF0 = W::PF1 / NC / (TM >= 8 ? 4 : TM >= 4 ? 2 : 1);
    constexpr int PF = PF0 > 1 ? PF0 : 1;
    __shared__ float red[WARPS];
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.y * WARPS + (threadIdx.x >> 5)) * NC;
    const int m0 = blockIdx.x * TM;
    float inv[TM];
#pragma unroll
    for (int r = 0; r < TM; ++r) inv[r] = (norm && m0 + r < M) ? rms_inv(x + (size_t)(m0 + r) * K, K, eps, red) : 1.0f;
    if (n0 >= N) return;  // whole warp
    float acc[TM][NC];
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;
    const int G = K >> 3;
    for (int g0 = lane; g0 < G; g0 += 32 * PF) {
        typename W::Raw raw[PF][NC];
#pragma unroll
        for (int p = 0; p < PF; ++p)
            if (g0 + 32 * p < G)
#pragma unroll
                for (int c = 0; c < NC; ++c) raw[p][c] = w.load(min(n0 + c, N - 1), g0 + 32 * p);
#pragma unroll
        for (int p = 0; p < PF; ++p) {
            const int g = g0 + 32 * p;
            if (g < G) {
                float wv[NC][8];
#pragma unroll
                for (int c = 0; c < NC; ++c) w.decode(raw[p][c], g, wv[c]);
#pragma unroll
                for (int r = 0; r < TM; ++r) {
                    if (m0 + r < M) {
                        const float4* xr = reinterpret_cast<const float4*>(x + (size_t)(m0 + r) * K + 8 * g);
                        const float4 a = __ldg(xr), b = __ldg(xr + 1);
                        float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                        if (norm) {
                            const float4* nr = reinterpret_cast<const float4*>(nw + 8 * g);
                            const float4 c = __ldg(nr), d = __ldg(nr + 1);
                            const float nv[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
                            for (int j = 0; j < 8; ++j) xv[j] = __fmul_rn(__fmul_rn(xv[j], inv[r]), nv[j]);
                        }
#pragma unroll
                        for (int c = 0; c < NC; ++c)
#pragma unroll
                            for (int j = 0; j < 8; ++j) acc[r][c] = __fmaf_rn(xv[j], wv[c][j], acc[r][c]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float s = warp_sum(acc[r][c]);
            if (lane == 0 && m0 + r < M && n0 + c < N) {
                const size_t o = (size_t)(m0 + r) * N + n0 + c;
                out[o] = add_mode ? __fadd_rn(s, add[add_mode == 1 ? o : (size_t)(n0 + c)]) : s;
            }
        }
}

// Any K (scalar loads), one row and one column per warp: the same order as linear_vec --
// lane l takes k with (k / 8) % 32 == l in increasing k, the partial octet last.
template <class W>
__device__ __forceinline__ void linear_scalar(const float* __restrict__ x, const W& w,
                                              float* __restrict__ out, int M, int N, int K,
                                              const float* __restrict__ add, int add_mode,
                                              const float* __restrict__ nw, float eps, int norm) {
    __shared__ float red[WARPS];
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.y * WARPS + (threadIdx.x >> 5);
    const int m = blockIdx.x;
    const float* xr = x + (size_t)m * K;
    const float inv = norm ? rms_inv(xr, K, eps, red) : 1.0f;
    if (n >= N) return;
    float acc = 0.0f;
    for (int g = lane; 8 * g < K; g += 32) {
        const int j1 = min(8, K - 8 * g);
        for (int j = 0; j < j1; ++j) {
            const int k = 8 * g + j;
            const float xv = norm ? __fmul_rn(__fmul_rn(__ldg(xr + k), inv), __ldg(nw + k)) : __ldg(xr + k);
            acc = __fmaf_rn(xv, w.at(n, k), acc);
        }
    }
    const float s = warp_sum(acc);
    if (lane == 0) {
        const size_t o = (size_t)m * N + n;
        out[o] = add_mode ? __fadd_rn(s, add[add_mode == 1 ? o : (size_t)n]) : s;
    }
}

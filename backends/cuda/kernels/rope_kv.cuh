// A part of kernels.cu (one NVRTC program; the -D defines it needs are listed there).
#pragma once
#include "common.cuh"

// ---- rotary embedding: x [R, H, D] at positions pos[r], tables cos/sin [max_pos, half] ----
// neox: element d < half pairs with d + half; normal: 2i with 2i + 1. For a pair (a, b) at
// frequency i: a' = a*cos - b*sin, b' = b*cos + a*sin (each product rounded, then the sum);
// elements past 2*half are copied. One launch for all rows and heads (was ~12 CuPy ops).
// rope_one: element e (at d = e % D) of a row at position p; rope and rope_kv_write_* share it.
__device__ __forceinline__ float rope_one(
        const float* __restrict__ x, long long e, int d, const float* __restrict__ cs,
        const float* __restrict__ sn, int p, int half, int neox) {
    const float v = x[e];
    if (d >= 2 * half) return v;
    int i, other;
    bool first;
    if (neox) { first = d < half; i = first ? d : d - half; other = first ? d + half : d - half; }
    else { first = (d & 1) == 0; i = d >> 1; other = first ? d + 1 : d - 1; }
    const float c = cs[(size_t)p * half + i], s = sn[(size_t)p * half + i];
    const float w = x[e - d + other];
    return first ? __fsub_rn(__fmul_rn(v, c), __fmul_rn(w, s))   // a' = a*cos - b*sin
                 : __fadd_rn(__fmul_rn(v, c), __fmul_rn(w, s));  // b' = b*cos + a*sin
}

extern "C" __global__ void __launch_bounds__(NT) rope(
        const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ cs,
        const float* __restrict__ sn, const int* __restrict__ pos, long long n, int HD, int D,
        int half, int neox) {
    const long long stride = (long long)gridDim.x * NT;
    for (long long e = (long long)blockIdx.x * NT + threadIdx.x; e < n; e += stride)
        y[e] = rope_one(x, e, (int)(e % D), cs, sn, pos[(int)(e / HD)], half, neox);
}

// ---- RoPE + KV write, one launch: q [R, H, D] -> qo turned (rope's arithmetic); k [R, G, D]
// turned and v [R, G, D] stored straight into one layer's paged store kc, vc [NB, G, BT, D]
// at block tab[seq[r] * nb + pos[r] / BT], offset pos[r] % BT (what the CuPy scatter did).
// T = float16 bits (cvt.rn.f16.f32: rounded once, to nearest even, like the scatter's
// float32 -> float16 assignment and numpy's astype) or float32 (stored as is). Elements e < nq are q's,
// the others k's and v's (e - nq); every element is written by one thread from its own
// inputs, so nothing depends on R.
__device__ __forceinline__ void kv_st(float* p, size_t i, float x) { p[i] = x; }
__device__ __forceinline__ void kv_st(unsigned short* p, size_t i, float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    p[i] = h;
}

template <class T>
__device__ __forceinline__ void rope_kv_write_t(
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
        float* __restrict__ qo, T* __restrict__ kc, T* __restrict__ vc, const float* __restrict__ cs,
        const float* __restrict__ sn, const int* __restrict__ tab, int nb, const int* __restrict__ seq,
        const int* __restrict__ pos, long long nq, long long nk, int HD, int G, int D, int half, int neox) {
    const long long stride = (long long)gridDim.x * NT;
    for (long long e = (long long)blockIdx.x * NT + threadIdx.x; e < nq + nk; e += stride) {
        if (e < nq) {
            qo[e] = rope_one(q, e, (int)(e % D), cs, sn, pos[(int)(e / HD)], half, neox);
            continue;
        }
        const long long i = e - nq;
        const int d = (int)(i % D);
        const long long rg = i / D;
        const int g = (int)(rg % G);
        const int r = (int)(rg / G);
        const int p = pos[r];
        const size_t dst = (((size_t)tab[(size_t)seq[r] * nb + p / BT] * G + g) * BT + p % BT) * D + d;
        kv_st(kc, dst, rope_one(k, i, d, cs, sn, p, half, neox));
        kv_st(vc, dst, v[i]);
    }
}

extern "C" __global__ void __launch_bounds__(NT) rope_kv_write_f16(
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
        float* __restrict__ qo, unsigned short* __restrict__ kc, unsigned short* __restrict__ vc,
        const float* __restrict__ cs, const float* __restrict__ sn, const int* __restrict__ tab, int nb,
        const int* __restrict__ seq, const int* __restrict__ pos, long long nq, long long nk, int HD, int G,
        int D, int half, int neox) {
    rope_kv_write_t(q, k, v, qo, kc, vc, cs, sn, tab, nb, seq, pos, nq, nk, HD, G, D, half, neox);
}

extern "C" __global__ void __launch_bounds__(NT) rope_kv_write_f32(
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
        float* __restrict__ qo, float* __restrict__ kc, float* __restrict__ vc,
        const float* __restrict__ cs, const float* __restrict__ sn, const int* __restrict__ tab, int nb,
        const int* __restrict__ seq, const int* __restrict__ pos, long long nq, long long nk, int HD, int G,
        int D, int half, int neox) {
    rope_kv_write_t(q, k, v, qo, kc, vc, cs, sn, tab, nb, seq, pos, nq, nk, HD, G, D, half, neox);
}

// ---- KV store: k, v [R, G, D] -> caches [S, G, C, D] at (slot[r], :, pos[r], :) --------
extern "C" __global__ void __launch_bounds__(NT) kv_write(
        const float* __restrict__ k, const float* __restrict__ v,
        float* __restrict__ kc, float* __restrict__ vc,
        const int* __restrict__ slot, const int* __restrict__ pos,
        int R, int G, int C, int D) {
    const long long total = (long long)R * G * D;
    const long long stride = (long long)gridDim.x * NT;
    for (long long i = (long long)blockIdx.x * NT + threadIdx.x; i < total; i += stride) {
        const int d = (int)(i % D);
        const long long rg = i / D;
        const int g = (int)(rg % G);
        const int r = (int)(rg / G);
        const size_t dst = (((size_t)slot[r] * G + g) * C + pos[r]) * D + d;
        kc[dst] = k[i];
        vc[dst] = v[i];
    }
}

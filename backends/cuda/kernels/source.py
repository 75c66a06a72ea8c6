"""The CUDA C source of the CuPy backend's kernels, as a string, and what describes it:
the NVRTC options it is compiled with (the IEEE flags and the -D defines of the geometry
from constants.py), the kernel names, and their C signatures (which the emulation checks
every launch against). The numerical contract is in the package docstring.
"""

from __future__ import annotations

import re

from panechat.backends.cuda.kernels.constants import BLOCK_KINDS, COL_TILES, CUDA_DEFINES, LINEAR_KINDS, ROW_TILES

_COMMON = r"""
// panechat CuPy backend kernels. The numerical contract is documented in cupy_kernels/__init__.py;
// every reduction below is spelled out with __fmaf_rn / __fadd_rn / __fmul_rn so that no
// compiler flag can contract or reorder it. NT, WARPS, KSPLIT and MAX_HEAD_DIM come in as
// -D defines from constants.py; the 8 of an octet is the width of the vector loads.
static_assert(WARPS == 8 && NT == 32 * WARPS, "block_sum's fixed tree adds 8 warp sums");

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int h = 16; h >= 1; h >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, h));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int h = 16; h >= 1; h >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, h));
    return v;
}

// Sum over the 256 threads of a block: a butterfly per warp, then a fixed tree over warps.
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = __fadd_rn(__fadd_rn(__fadd_rn(red[0], red[1]), __fadd_rn(red[2], red[3])),
                        __fadd_rn(__fadd_rn(red[4], red[5]), __fadd_rn(red[6], red[7])));
    __syncthreads();
    return s;
}

__device__ __forceinline__ float block_max(float v, float* red) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = fmaxf(fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3])),
                    fmaxf(fmaxf(red[4], red[5]), fmaxf(red[6], red[7])));
    __syncthreads();
    return s;
}

// exp(x) for x <= ~88 (Cephes expf, ~1 ulp) from plain IEEE operations: the same formula
// as numpy_kernels._expf, so the host can reproduce it bit for bit.
__device__ __forceinline__ float expf_pc(float x) {
    x = fmaxf(x, -87.33654f);
    const float n = floorf(__fadd_rn(__fmul_rn(x, 1.44269504088896341f), 0.5f));
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, 0.693359375f)), __fmul_rn(n, -2.12194440e-4f));
    float p = __fadd_rn(__fmul_rn(1.9875691500e-4f, r), 1.3981999507e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.3334519073e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665795894e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665459e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 5.0000001201e-1f);
    p = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
}

// RMS norm's 1 / sqrt(mean(x^2) + eps) of the row xr [D], computed by the whole block (every
// thread gets it): thread t's fma chain of x*x over k = t, t + NT, ..., then block_sum. The
// rms_norm kernel and the linear kernels' fused norm both call this, so they agree bit for bit.
__device__ __forceinline__ float rms_inv(const float* __restrict__ xr, int D, float eps, float* red) {
    float acc = 0.0f;
    for (int k = threadIdx.x; k < D; k += NT) {
        const float v = xr[k];
        acc = __fmaf_rn(v, v, acc);
    }
    const float ss = block_sum(acc, red);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D), eps)));
}

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// ---- weight formats: octet(n, g, o) = w[n, 8g .. 8g+8) as exact floats ----------------
// load(n, g) fetches what octet g of row n needs from memory (vector loads, rows 16-byte
// aligned: K % 8 == 0) and decode(raw, g, o) turns it into the 8 exact floats, so that the
// linear kernel can issue several octets' loads before their first use (bytes in flight);
// at() is the scalar load of the any-K kernel.

struct WF32 {
    static constexpr int PF1 = 4;  // octets in flight per lane with one column a warp (32 bytes each)
    const float* w;
    int K;
    struct Raw { float4 a, b; };
    __device__ __forceinline__ Raw load(int n, int g) const {
        const float4* p = reinterpret_cast<const float4*>(w + (size_t)n * K + 8 * g);
        return Raw{__ldg(p), __ldg(p + 1)};
    }
    __device__ __forceinline__ void decode(const Raw& r, int g, float* o) const {
        o[0] = r.a.x; o[1] = r.a.y; o[2] = r.a.z; o[3] = r.a.w;
        o[4] = r.b.x; o[5] = r.b.y; o[6] = r.b.z; o[7] = r.b.w;
    }
    __device__ __forceinline__ float at(int n, int k) const { return __ldg(w + (size_t)n * K + k); }
};

struct WF16 {
    static constexpr int PF1 = 8;  // 16 bytes an octet
    const unsigned short* w;
    int K;
    using Raw = uint4;
    __device__ __forceinline__ Raw load(int n, int g) const {
        return __ldg(reinterpret_cast<const uint4*>(w + (size_t)n * K + 8 * g));
    }
    __device__ __forceinline__ void decode(const Raw& u, int g, float* o) const {
        o[0] = h2f((unsigned short)(u.x & 0xffffu)); o[1] = h2f((unsigned short)(u.x >> 16));
        o[2] = h2f((unsigned short)(u.y & 0xffffu)); o[3] = h2f((unsigned short)(u.y >> 16));
        o[4] = h2f((unsigned short)(u.z & 0xffffu)); o[5] = h2f((unsigned short)(u.z >> 16));
        o[6] = h2f((unsigned short)(u.w & 0xffffu)); o[7] = h2f((unsigned short)(u.w >> 16));
    }
    __device__ __forceinline__ float at(int n, int k) const { return h2f(__ldg(w + (size_t)n * K + k)); }
};

// bfloat16 as stored (uint16): the float32 with these 16 high bits, exactly.
struct WBF16 {
    static constexpr int PF1 = 8;
    const unsigned short* w;
    int K;
    using Raw = uint4;
    __device__ __forceinline__ static float b2f(unsigned int b) { return __uint_as_float(b << 16); }
    __device__ __forceinline__ Raw load(int n, int g) const {
        return __ldg(reinterpret_cast<const uint4*>(w + (size_t)n * K + 8 * g));
    }
    __device__ __forceinline__ void decode(const Raw& u, int g, float* o) const {
        o[0] = b2f(u.x & 0xffffu); o[1] = b2f(u.x >> 16);
        o[2] = b2f(u.y & 0xffffu); o[3] = b2f(u.y >> 16);
        o[4] = b2f(u.z & 0xffffu); o[5] = b2f(u.z >> 16);
        o[6] = b2f(u.w & 0xffffu); o[7] = b2f(u.w >> 16);
    }
    __device__ __forceinline__ float at(int n, int k) const { return b2f(__ldg(w + (size_t)n * K + k)); }
};

// int8 q [N, K] with float32 d (and m) [N, K/G], G = 1 << gs (32, or 16 for Q6_K):
// w = q * d [+ m, rounded once]. An octet never straddles two groups.
struct WQ8 {
    static constexpr int PF1 = 16;  // 8 bytes of codes an octet: twice as many in flight
    const signed char* q;
    const float* d;
    const float* m;
    int K;
    int has_m;
    int gs;
    struct Raw { uint2 u; float d, m; };
    __device__ __forceinline__ float deq(int qv, float dd, float mm) const {
        const float w = __fmul_rn((float)qv, dd);
        return has_m ? __fadd_rn(w, mm) : w;
    }
    __device__ __forceinline__ Raw load(int n, int g) const {
        const size_t b = (size_t)n * (K >> gs) + ((8 * g) >> gs);
        return Raw{__ldg(reinterpret_cast<const uint2*>(q + (size_t)n * K + 8 * g)), __ldg(d + b),
                   has_m ? __ldg(m + b) : 0.0f};
    }
    __device__ __forceinline__ void decode(const Raw& r, int g, float* o) const {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[j] = deq((int)(signed char)((r.u.x >> (8 * j)) & 0xffu), r.d, r.m);
            o[4 + j] = deq((int)(signed char)((r.u.y >> (8 * j)) & 0xffu), r.d, r.m);
        }
    }
    __device__ __forceinline__ float at(int n, int k) const {
        const size_t b = (size_t)n * (K >> gs) + (k >> gs);
        return deq((int)__ldg(q + (size_t)n * K + k), __ldg(d + b), has_m ? __ldg(m + b) : 0.0f);
    }
};

// Q8_0 in GGUF's block form: the int8 codes [N, K] as stored, d [N, K/32] float16 as stored
// (split off the 34-byte blocks so that rows stay aligned): w = q * d, exact.
struct WQ80 {
    static constexpr int PF1 = 16;
    const signed char* q;
    const unsigned short* d;
    int K;
    struct Raw { uint2 u; unsigned short d; };
    __device__ __forceinline__ Raw load(int n, int g) const {
        return Raw{__ldg(reinterpret_cast<const uint2*>(q + (size_t)n * K + 8 * g)),
                   __ldg(d + (size_t)n * (K >> 5) + (g >> 2))};
    }
    __device__ __forceinline__ void decode(const Raw& r, int g, float* o) const {
        const float dd = h2f(r.d);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[j] = __fmul_rn((float)(int)(signed char)((r.u.x >> (8 * j)) & 0xffu), dd);
            o[4 + j] = __fmul_rn((float)(int)(signed char)((r.u.y >> (8 * j)) & 0xffu), dd);
        }
    }
};

// Q4_0 / Q4_1 in GGUF's block form: qs [N, K/32, 16] bytes exactly as stored (byte j of a
// block holds weight j in its low nibble and weight j + 16 in its high nibble), d (and m)
// [N, K/32] float16 as stored, split off the 18/20-byte blocks so that qs rows stay 16-byte
// aligned. Octet g = part p = g % 4 of block g / 4: weights 8p' .. 8p'+7 of the block are the
// low (p < 2) or high (p >= 2) nibbles of bytes 8 (p & 1) .. 8 (p & 1) + 7, one 8-byte load.
// w = (q - 8) * d (Q4_0, exact) or q * d + m (Q4_1, the product exact, + m rounded once):
// gguf's float32 expressions, as the CPU kernels and the widened q8 form compute them.
struct WQ4 {
    static constexpr int PF1 = 16;  // 8 bytes loaded an octet (4 of them its nibbles)
    const unsigned char* qs;
    const unsigned short* d;
    const unsigned short* m;
    int K;
    int has_m;
    struct Raw { uint2 u; unsigned short d, m; };
    __device__ __forceinline__ Raw load(int n, int g) const {
        const size_t b = (size_t)n * (K >> 5) + (g >> 2);
        return Raw{__ldg(reinterpret_cast<const uint2*>(qs + 16 * b + 8 * (g & 1))), __ldg(d + b),
                   has_m ? __ldg(m + b) : (unsigned short)0};
    }
    __device__ __forceinline__ void decode(const Raw& r, int g, float* o) const {
        const int sh = (g & 2) ? 4 : 0;  // parts 2, 3: the high nibbles
        const float dd = h2f(r.d), mm = h2f(r.m);
        const int off = has_m ? 0 : 8;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q0 = (int)((r.u.x >> (8 * j + sh)) & 0xfu) - off;
            const int q1 = (int)((r.u.y >> (8 * j + sh)) & 0xfu) - off;
            const float w0 = __fmul_rn((float)q0, dd), w1 = __fmul_rn((float)q1, dd);
            o[j] = has_m ? __fadd_rn(w0, mm) : w0;
            o[4 + j] = has_m ? __fadd_rn(w1, mm) : w1;
        }
    }
};

// Q5_0 / Q5_1 in GGUF's block form: qs [N, K/32, 16] bytes exactly as stored (nibbles as
// Q4_x: byte j = weight j low, weight j + 16 high), and the block's fifth bits qh [N, K/32]
// (uint32 as stored: bit i is weight i's), d (and m) [N, K/32] float16 as stored -- split off
// the 22/24-byte blocks so that qs rows stay 16-byte aligned; the file's bytes. Octet g =
// part p = g % 4 of block g / 4 (as WQ4), weight 8p + i's fifth bit is bit 8p + i of qh.
// w = (q - 16) * d (Q5_0, exact) or q * d + m (Q5_1, the product exact, + m rounded once):
// gguf's float32 expressions, as the widened q8 form computes them.
struct WQ5 {
    static constexpr int PF1 = 16;
    const unsigned char* qs;
    const unsigned short* d;
    const unsigned short* m;
    const unsigned int* qh;
    int K;
    int has_m;
    struct Raw { uint2 u; unsigned int h; unsigned short d, m; };
    __device__ __forceinline__ Raw load(int n, int g) const {
        const size_t b = (size_t)n * (K >> 5) + (g >> 2);
        return Raw{__ldg(reinterpret_cast<const uint2*>(qs + 16 * b + 8 * (g & 1))), __ldg(qh + b), __ldg(d + b),
                   has_m ? __ldg(m + b) : (unsigned short)0};
    }
    __device__ __forceinline__ void decode(const Raw& r, int g, float* o) const {
        const int sh = (g & 2) ? 4 : 0;  // parts 2, 3: the high nibbles
        const int hb = 8 * (g & 3);  // the part's first bit in qh
        const float dd = h2f(r.d), mm = h2f(r.m);
        const int off = has_m ? 0 : 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q0 = (int)(((r.u.x >> (8 * j + sh)) & 0xfu) | (((r.h >> (hb + j)) & 1u) << 4)) - off;
            const int q1 = (int)(((r.u.y >> (8 * j + sh)) & 0xfu) | (((r.h >> (hb + 4 + j)) & 1u) << 4)) - off;
            const float w0 = __fmul_rn((float)q0, dd), w1 = __fmul_rn((float)q1, dd);
            o[j] = has_m ? __fadd_rn(w0, mm) : w0;
            o[4 + j] = has_m ? __fadd_rn(w1, mm) : w1;
        }
    }
};

// Q4_K exactly as stored: 144-byte super-blocks of 256 weights [N, K/256, 144] (16-byte
// aligned: 144 = 9 * 16): f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins, then
// qs[128] -- pair p (weights 64p .. 64p+63) in qs[32p .. 32p+31], low nibbles the first 32,
// high the next. Octet g: weights j = 8 (g % 32) .. of super-block g / 32, group is = j / 32
// (sc, m: ggml's get_scale_min_k4), one 16-byte header load and one 8-byte code load.
// w = q * (d * sc) + (-(dmin * m)): d * sc and dmin * m are exact (11 x 6 bits), q * S exact,
// the add rounds once -- gguf's (d * sc) * q - dmin * m, as the widened q8 form computes it.
struct WQ4K {
    static constexpr int PF1 = 8;
    const unsigned char* b;
    int K;
    struct Raw { uint2 u; uint4 h; };
    __device__ __forceinline__ Raw load(int n, int g) const {
        const unsigned char* blk = b + ((size_t)n * (K >> 8) + (g >> 5)) * 144;
        const int j = (g & 31) * 8;
        return Raw{__ldg(reinterpret_cast<const uint2*>(blk + 16 + 32 * (j >> 6) + (j & 31))),
                   __ldg(reinterpret_cast<const uint4*>(blk))};
    }
    __device__ __forceinline__ static unsigned int sbyte(const uint4& h, int i) {  // scales[i]
        const unsigned int w = i < 4 ? h.y : (i < 8 ? h.z : h.w);
        return (w >> (8 * (i & 3))) & 0xffu;
    }
    __device__ __forceinline__ void decode(const Raw& r, int g, float* o) const {
        const int is = (g & 31) >> 2;  // the 32-weight group
        unsigned int sc, mn;
        if (is < 4) {
            sc = sbyte(r.h, is) & 63u;
            mn = sbyte(r.h, is + 4) & 63u;
        } else {
            sc = (sbyte(r.h, is + 4) & 0xfu) | ((sbyte(r.h, is - 4) >> 6) << 4);
            mn = (sbyte(r.h, is + 4) >> 4) | ((sbyte(r.h, is) >> 6) << 4);
        }
        const float S = __fmul_rn(h2f((unsigned short)(r.h.x & 0xffffu)), (float)sc);
        const float Mn = -__fmul_rn(h2f((unsigned short)(r.h.x >> 16)), (float)mn);
        const int sh = (is & 1) ? 4 : 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[j] = __fadd_rn(__fmul_rn((float)(int)((r.u.x >> (8 * j + sh)) & 0xfu), S), Mn);
            o[4 + j] = __fadd_rn(__fmul_rn((float)(int)((r.u.y >> (8 * j + sh)) & 0xfu), S), Mn);
        }
    }
};

// Q5_K exactly as stored: 176-byte super-blocks of 256 weights [N, K/256, 176] (16-byte
// aligned: 176 = 11 * 16): f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins (as
// Q4_K), qh[32], qs[128] -- pair p (weights 64p .. 64p+63) in qs[48 + 32p ..], low nibbles
// the first 32, high the next; the fifth bit of weight 32 is + l (group is) is bit is of
// qh[l]. Octet g: weights j = 8 (g % 32) .. of super-block g / 32, group is = j / 32: one
// 16-byte header load, one 8-byte code load, one 8-byte qh load.
// w = q * (d * sc) + (-(dmin * m)), as Q4_K: gguf's (d * sc) * q - dmin * m.
struct WQ5K {
    static constexpr int PF1 = 8;
    const unsigned char* b;
    int K;
    struct Raw { uint2 u, hb; uint4 h; };
    __device__ __forceinline__ Raw load(int n, int g) const {
        const unsigned char* blk = b + ((size_t)n * (K >> 8) + (g >> 5)) * 176;
        const int j = (g & 31) * 8;
        return Raw{__ldg(reinterpret_cast<const uint2*>(blk + 48 + 32 * (j >> 6) + (j & 31))),
                   __ldg(reinterpret_cast<const uint2*>(blk + 16 + (j & 31))),
                   __ldg(reinterpret_cast<const uint4*>(blk))};
    }
    __device__ __forceinline__ void decode(const Raw& r, int g, float* o) const {
        const int is = (g & 31) >> 2;  // the 32-weight group
        unsigned int sc, mn;
        if (is < 4) {
            sc = WQ4K::sbyte(r.h, is) & 63u;
            mn = WQ4K::sbyte(r.h, is + 4) & 63u;
        } else {
            sc = (WQ4K::sbyte(r.h, is + 4) & 0xfu) | ((WQ4K::sbyte(r.h, is - 4) >> 6) << 4);
            mn = (WQ4K::sbyte(r.h, is + 4) >> 4) | ((WQ4K::sbyte(r.h, is) >> 6) << 4);
        }
        const float S = __fmul_rn(h2f((unsigned short)(r.h.x & 0xffffu)), (float)sc);
        const float Mn = -__fmul_rn(h2f((unsigned short)(r.h.x >> 16)), (float)mn);
        const int sh = (is & 1) ? 4 : 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned int q0 = ((r.u.x >> (8 * j + sh)) & 0xfu) | (((r.hb.x >> (8 * j + is)) & 1u) << 4);
            const unsigned int q1 = ((r.u.y >> (8 * j + sh)) & 0xfu) | (((r.hb.y >> (8 * j + is)) & 1u) << 4);
            o[j] = __fadd_rn(__fmul_rn((float)(int)q0, S), Mn);
            o[4 + j] = __fadd_rn(__fmul_rn((float)(int)q1, S), Mn);
        }
    }
};

// Q6_K as stored with its f16 d split off: the first 208 bytes of every 210-byte
// super-block exactly as stored -- ql[128], qh[64], int8 scales[16] -- [N, K/256, 208]
// (16-byte aligned: 208 = 13 * 16; a 210-byte block would not be), d [N, K/256] float16 as
// stored: the file's bytes. Half h (weights 128h ..) has ql[64h ..], qh[32h ..],
// scales[8h ..]; quarter r of a half (32 weights, l = 0..31): low (r < 2) or high nibbles of
// ql[64h + 32 (r & 1) + l], bits 2r, 2r+1 of qh[32h + l], scale scales[8h + l / 16 + 2r].
// Octet g: weights j = 8 (g % 32) .. of super-block g / 32 (one 16-weight group): one
// 8-byte ql load, one 8-byte qh load, one scale byte and d.
// w = (q - 32) * (d * sc): gguf's (d * sc) * q, as the widened q8 form computes it.
struct WQ6K {
    static constexpr int PF1 = 8;
    const unsigned char* b;
    const unsigned short* d;
    int K;
    struct Raw { uint2 l, h; int sc; unsigned short d; };
    __device__ __forceinline__ Raw load(int n, int g) const {
        const size_t s = (size_t)n * (K >> 8) + (g >> 5);
        const unsigned char* blk = b + s * 208;
        const int j = (g & 31) * 8, hf = j >> 7, r = (j >> 5) & 3, l0 = j & 31;
        return Raw{__ldg(reinterpret_cast<const uint2*>(blk + 64 * hf + 32 * (r & 1) + l0)),
                   __ldg(reinterpret_cast<const uint2*>(blk + 128 + 32 * hf + l0)),
                   (int)(signed char)__ldg(blk + 192 + 8 * hf + (l0 >> 4) + 2 * r), __ldg(d + s)};
    }
    __device__ __forceinline__ void decode(const Raw& r, int g, float* o) const {
        const int q4 = ((g & 31) >> 2) & 3;  // the quarter of the half
        const int shl = q4 >= 2 ? 4 : 0, shh = 2 * q4;
        const float S = __fmul_rn(h2f(r.d), (float)r.sc);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q0 = (int)(((r.l.x >> (8 * j + shl)) & 0xfu) | (((r.h.x >> (8 * j + shh)) & 3u) << 4)) - 32;
            const int q1 = (int)(((r.l.y >> (8 * j + shl)) & 0xfu) | (((r.h.y >> (8 * j + shh)) & 3u) << 4)) - 32;
            o[j] = __fmul_rn((float)q0, S);
            o[4 + j] = __fmul_rn((float)q1, S);
        }
    }
};

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

// ---- RMS norm: one block per row ------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NT) rms_norm(
        const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
        int D, float eps) {
    __shared__ float red[WARPS];
    const float* xr = x + (size_t)blockIdx.x * D;
    float* yr = y + (size_t)blockIdx.x * D;
    const float inv = rms_inv(xr, D, eps, red);
    for (int k = threadIdx.x; k < D; k += NT) yr[k] = __fmul_rn(__fmul_rn(xr[k], inv), w[k]);
}

// ---- silu(g) * u, elementwise ---------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NT) silu_mul(
        const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
        long long n) {
    const long long stride = (long long)gridDim.x * NT;
    for (long long i = (long long)blockIdx.x * NT + threadIdx.x; i < n; i += stride) {
        const float a = g[i];
        const float e = expf_pc(fminf(-a, 88.0f));
        y[i] = __fmul_rn(__fdiv_rn(a, __fadd_rn(1.0f, e)), u[i]);
    }
}

// ---- gelu(g) * u, elementwise (GELU's tanh form, gemma's FFN) ---------------------------
// i = 0.7978845608028654 * (g + ((0.044715 * g) * g) * g); tanh(i) = 1 - 2 / (expf_pc(min(2i, 88)) + 1);
// y = ((0.5 * g) * (1 + tanh(i))) * u
extern "C" __global__ void __launch_bounds__(NT) gelu_mul(
        const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
        long long n) {
    const long long stride = (long long)gridDim.x * NT;
    for (long long i = (long long)blockIdx.x * NT + threadIdx.x; i < n; i += stride) {
        const float a = g[i];
        const float c = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, a), a), a);
        const float in = __fmul_rn(0.7978845608028654f, __fadd_rn(a, c));
        const float e = expf_pc(fminf(__fmul_rn(2.0f, in), 88.0f));
        const float t = __fsub_rn(1.0f, __fdiv_rn(2.0f, __fadd_rn(e, 1.0f)));
        y[i] = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, a), __fadd_rn(1.0f, t)), u[i]);
    }
}

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

// ---- sampling on the device: one block per row; only token ids go back to the host -------
// The contract (cupy_kernels/sampling.py emulates it bit for bit):
//  tok = argmax (NaN beats everything, then the larger value, then the lower index: numpy's
//  argmax); bad = logits[tok] is not finite. Greedy rows (temp == 0) stop there. Otherwise
//  p[i] = d < -87 ? 0 : expf_pc(d), d = x[i]/temp - x[tok]/temp (so p[tok] == 1); p[i] < min_p
//  -> 0; top_k: p[i] < tau_k -> 0 with tau_k the k-th largest p (binary search over the float
//  bits); top_p: p[i] < tau_p -> 0 with tau_p the largest float t such that S(t) >= top_p *
//  S(0), S(t) = block_sum over threads of (thread's chunk sum of p[i] >= t); then u = Philox
//  uniform (key = seed, counter = (step, 0, 0, 0)), target = u * total (total: thread 0's
//  sequential sum of the 256 chunk sums), tok = first i, in index order, whose running sum
//  (chunk sums, then within the chunk) exceeds target with p[i] > 0. Thread t's chunk is
//  i in [t * CH, (t + 1) * CH), CH = ceil(V / NT), summed sequentially from +0.

__device__ __forceinline__ bool arg_better(float v, int i, float bv, int bi) {
    const bool vn = v != v, bn = bv != bv;
    if (vn != bn) return vn;
    if (!vn && v != bv) return v > bv;
    return i < bi;
}

__device__ __forceinline__ unsigned int mulhilo(unsigned int a, unsigned int b, unsigned int* hi) {
    const unsigned long long p = (unsigned long long)a * b;
    *hi = (unsigned int)(p >> 32);
    return (unsigned int)p;
}

// Philox4x32-10 (Salmon et al. 2011), word 0 of the output block.
__device__ __forceinline__ unsigned int philox_word0(unsigned int c0, unsigned int c1, unsigned int c2,
                                                     unsigned int c3, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        unsigned int hi0, hi1;
        const unsigned int lo0 = mulhilo(0xD2511F53u, c0, &hi0);
        const unsigned int lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
        const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return c0;
}

__device__ __forceinline__ int block_count(int v, int* ired) {
#pragma unroll
    for (int h = 16; h >= 1; h >>= 1) v += __shfl_xor_sync(0xffffffffu, v, h);
    if ((threadIdx.x & 31) == 0) ired[threadIdx.x >> 5] = v;
    __syncthreads();
    int s = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += ired[w];
    __syncthreads();
    return s;
}

// the thread's chunk sum of p[i] >= t (sequential, from +0)
__device__ __forceinline__ float chunk_sum(const float* p, int lo, int hi, float t) {
    float s = 0.0f;
    for (int i = lo; i < hi; ++i) {
        const float v = p[i];
        if (v >= t) s = __fadd_rn(s, v);
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(NT) sample_rows(
        const float* __restrict__ logits, float* __restrict__ prob, const float* __restrict__ fparams,
        const int* __restrict__ top_k, const unsigned int* __restrict__ seed_step,
        int* __restrict__ out, int V) {
    __shared__ float red[WARPS];
    __shared__ int ired[WARPS];
    __shared__ float bvs[WARPS];
    __shared__ int bis[WARPS];
    __shared__ float csum[NT];
    const int r = blockIdx.x, tid = threadIdx.x;
    const float* x = logits + (size_t)r * V;
    float* p = prob + (size_t)r * V;
    float bv = __int_as_float(0xff800000);
    int bi = V;
    for (int i = tid; i < V; i += NT) {
        const float v = x[i];
        if (bi == V || arg_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int h = 16; h >= 1; h >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, h);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, h);
        if (oi != V && (bi == V || arg_better(ov, oi, bv, bi))) { bv = ov; bi = oi; }
    }
    if ((tid & 31) == 0) { bvs[tid >> 5] = bv; bis[tid >> 5] = bi; }
    __syncthreads();
    bv = bvs[0]; bi = bis[0];
    for (int w = 1; w < WARPS; ++w)
        if (bis[w] != V && (bi == V || arg_better(bvs[w], bis[w], bv, bi))) { bv = bvs[w]; bi = bis[w]; }
    const float temp = fparams[4 * r], top_p = fparams[4 * r + 1], min_p = fparams[4 * r + 2];
    const bool bad = !isfinite(bv);
    if (bad || temp == 0.0f) {
        if (tid == 0) { out[2 * r] = bi; out[2 * r + 1] = bad; }
        return;
    }
    const float mt = __fdiv_rn(bv, temp);
    for (int i = tid; i < V; i += NT) {
        const float d = __fsub_rn(__fdiv_rn(x[i], temp), mt);
        float e = d < -87.0f ? 0.0f : expf_pc(d);
        if (e < min_p) e = 0.0f;
        p[i] = e;
    }
    __syncthreads();
    const int k = top_k[r];
    if (k > 0 && k < V) {  // the largest bits b with count(p >= b) >= k: the k-th largest p
        unsigned int lo = 0u, hi = 0x3f800000u;
        while (lo < hi) {
            const unsigned int mid = lo + (hi - lo + 1) / 2;
            const float t = __uint_as_float(mid);
            int c = 0;
            for (int i = tid; i < V; i += NT) c += p[i] >= t;
            if (block_count(c, ired) >= k) lo = mid; else hi = mid - 1;
        }
        const float t = __uint_as_float(lo);
        for (int i = tid; i < V; i += NT) if (p[i] < t) p[i] = 0.0f;
        __syncthreads();
    }
    const int CH = (V + NT - 1) / NT;
    const int c0 = min(V, tid * CH), c1 = min(V, c0 + CH);
    if (top_p < 1.0f) {
        const float target = __fmul_rn(top_p, block_sum(chunk_sum(p, c0, c1, 0.0f), red));
        unsigned int lo = 0u, hi = 0x3f800000u;
        while (lo < hi) {
            const unsigned int mid = lo + (hi - lo + 1) / 2;
            if (block_sum(chunk_sum(p, c0, c1, __uint_as_float(mid)), red) >= target) lo = mid; else hi = mid - 1;
        }
        const float t = __uint_as_float(lo);
        for (int i = c0; i < c1; ++i) if (p[i] < t) p[i] = 0.0f;
    }
    csum[tid] = chunk_sum(p, c0, c1, 0.0f);
    __syncthreads();
    if (tid == 0) {
        float total = 0.0f;
        for (int t = 0; t < NT; ++t) total = __fadd_rn(total, csum[t]);
        const unsigned int* ss = seed_step + 3 * r;
        const unsigned int w = philox_word0(ss[2], 0u, 0u, 0u, ss[0], ss[1]);
        const float target = __fmul_rn(__fmul_rn((float)(w >> 8), 5.9604644775390625e-8f), total);
        float run = 0.0f;
        int tok = -1;
        for (int c = 0; c < NT && tok < 0; ++c) {
            const float next = __fadd_rn(run, csum[c]);
            if (next > target) {  // in this chunk: the element whose running sum passes target
                const int a = min(V, c * CH), b = min(V, a + CH);
                int last = -1;
                for (int i = a; i < b && tok < 0; ++i) {
                    if (p[i] > 0.0f) {
                        last = i;
                        run = __fadd_rn(run, p[i]);
                        if (run > target) tok = i;
                    }
                }
                if (tok < 0) tok = last >= 0 ? last : bi;  // rounding: the chunk's last candidate
            } else {
                run = next;
            }
        }
        out[2 * r] = tok < 0 ? bi : tok;  // target >= total by rounding: the argmax
        out[2 * r + 1] = 0;
    }
}
"""

_LINEAR_SIGNATURES = {
    "f32": ("const float* __restrict__ w", "WF32 ww{w, K};"),
    "f16": ("const unsigned short* __restrict__ w", "WF16 ww{w, K};"),
    "bf16": ("const unsigned short* __restrict__ w", "WBF16 ww{w, K};"),
    "q8": ("const signed char* __restrict__ q, const float* __restrict__ d, const float* __restrict__ m",
           "WQ8 ww{q, d, m, K, has_m, gshift};"),
    "q80": ("const signed char* __restrict__ q, const unsigned short* __restrict__ d", "WQ80 ww{q, d, K};"),
    "q4k": ("const unsigned char* __restrict__ b", "WQ4K ww{b, K};"),
    "q5k": ("const unsigned char* __restrict__ b", "WQ5K ww{b, K};"),
    "q6k": ("const unsigned char* __restrict__ b, const unsigned short* __restrict__ d", "WQ6K ww{b, d, K};"),
    "q4": ("const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d, "
           "const unsigned short* __restrict__ m", "WQ4 ww{qs, d, m, K, has_m};"),
    "q5": ("const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d, "
           "const unsigned short* __restrict__ m, const unsigned int* __restrict__ qh", "WQ5 ww{qs, d, m, qh, K, has_m};"),
}


def linear_kernel_name(kind: str, tm: int, nc: int) -> str:
    """Vector kernels linear_{kind}_{TM}_{NC}; the any-K scalar kernel is linear_{kind}_s."""
    return f"linear_{kind}_{tm}_{nc}" if tm else f"linear_{kind}_s"


def _linear_wrappers() -> str:
    out = []
    for kind, (wparams, make) in _LINEAR_SIGNATURES.items():
        extra = {"q8": ", int has_m, int gshift", "q4": ", int has_m", "q5": ", int has_m"}.get(kind, "")
        variants = [(tm, nc) for tm in ROW_TILES for nc in COL_TILES]
        if kind not in BLOCK_KINDS:  # q8, q4 need K % 32 == 0: always the vector kernels
            variants.append((0, 0))
        for tm, nc in variants:
            call = (f"linear_vec<{tm}, {nc}>(x, ww, out, M, N, K, add, add_mode, nw, eps, norm);" if tm
                    else "linear_scalar(x, ww, out, M, N, K, add, add_mode, nw, eps, norm);")
            out.append(
                f'extern "C" __global__ void __launch_bounds__(NT) {linear_kernel_name(kind, tm, nc)}(\n'
                f"        const float* __restrict__ x, {wparams}, float* __restrict__ out,\n"
                f"        int M, int N, int K{extra}, const float* __restrict__ add, int add_mode,\n"
                f"        const float* __restrict__ nw, float eps, int norm) {{\n"
                f"    {make}\n"
                f"    {call}\n"
                f"}}\n"
            )
    return "\n".join(out)


SOURCE = _COMMON + "\n" + _linear_wrappers()

#: NVRTC options: no FMA contraction, no flush-to-zero, IEEE division and square root
#: (build_module passes exactly these: CuPy's own compile path would add -ftz=true), and
#: the geometry the source uses, from constants.py.
OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true",
           *(f"-D{name}={value}" for name, value in CUDA_DEFINES.items()))

KERNEL_NAMES = tuple(
    [linear_kernel_name(k, tm, nc) for k in LINEAR_KINDS for tm in ROW_TILES for nc in COL_TILES]
    + [linear_kernel_name(k, 0, 0) for k in LINEAR_KINDS if k not in BLOCK_KINDS]
    + ["rms_norm", "silu_mul", "gelu_mul", "rope", "rope_kv_write_f16", "rope_kv_write_f32", "kv_write",
       "attn_scores_f16", "attn_scores_f32", "attn_softmax_v_f16",
       "attn_softmax_v_f32", "sample_rows"]
)


def kernel_signatures(source: str = SOURCE) -> dict[str, list[tuple[str, bool]]]:
    """{kernel name: [(C type without qualifiers, is_pointer), ...]} of the extern "C"
    kernels in `source` (used to check every launch's arguments in the emulation)."""
    sigs = {}
    pat = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\w+\)\s*)?(\w+)\(([^)]*)\)')
    for name, params in pat.findall(source):
        plist = []
        for p in params.split(","):
            p = " ".join(p.replace("__restrict__", " ").replace("const ", " ").split())
            is_ptr = "*" in p
            ctype = p.replace("*", " ").rsplit(None, 1)[0].strip()  # drop the parameter name
            plist.append((ctype, is_ptr))
        sigs[name] = plist
    return sigs

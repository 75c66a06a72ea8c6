// A part of kernels.cu (one NVRTC program; the -D defines it needs are listed there).
#pragma once
#include "common.cuh"

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

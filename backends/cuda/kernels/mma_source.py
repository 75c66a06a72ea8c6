"""The CUDA C source of the tensor-core (MMA) products, opt-in (`PANECHAT_CUPY_MMA=1`), as
its own NVRTC module: `mma_split_x` and the `mma_linear_*` kernels, their names and
compile options. The contract (what `mma_emulation.py` models) is:

x split (bit-specified, IEEE only): per row r, mx = max_k |x[r, k]|; s = 141 - (biased
exponent of mx), clamped to [-120, 120] (s = 120 for mx = 0 or subnormal, 0 for inf/NaN),
so that |v| = |x * 2^s| < 2^15; hi = f16_rn(v), lo = f16_rn(v - hi) (the subtraction is
exact); for bf16 weights three bf16 parts: hi = bf16_rn(v), mid = bf16_rn(v - hi), lo =
bf16_rn(v - hi - mid); xinv[r] = 2^-s. With mins, xsum[r, b] = the sequential float32
sum (from +0) of v over weight group b. Rows M .. Mpad - 1 (padding to the token tile)
are zeros, xinv 1. The parts are one buffer [2 or 3, Mpad, K].

Product (swap-AB: weights are the 16-row A side of mma.m16n8k16, tokens the 8-column B
side; f16 x f16 -> f32, or bf16 x bf16 -> f32 for BF16 weights, whose bits are used as
stored): K in chunks of 32; chunk c belongs to warp c % 8 of the block.
Within a chunk, mma j (0, 1) covers k = 32c + 16j .. + 15 (thread t of a quad holds the 4
consecutive k 16j + 4t .. + 3 in the fragment slots {2t, 2t+1, 2t+8, 2t+9}). Per weight
group g (32 k, or 16 for Q6_K): P = 0; for each mma j of the group: P = mma(W_j, hi_j, P);
P = mma(W_j, lo_j, P) (bf16: hi, mid, lo). Then acc_w = acc_w + P (f16 weights), or acc_w = fma(d, P, acc_w)
and, with mins, acc_w = fma(m, xsum, acc_w) (q8 codes, exact in f16;
bf16 weights: acc_w + P). The 8 warp sums
are added ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7)), times xinv[r], then + add.
A token's arithmetic depends on K alone: never on M, on the tile, or on its column in the
tile (the mma computes each output element from its own row and column). Only the
summation inside one mma instruction is the hardware's (not IEEE-specified).
"""

from __future__ import annotations

from panechat.backends.cuda.kernels.constants import CUDA_DEFINES

MMA_KINDS = ("f16", "bf16", "q8", "q80", "q4")  # q80, q4: Q8_0 / Q4_x in GGUF block form
MMA_TILES = ((1, 1), (1, 2), (2, 4))  # (WT weight tiles of 16 rows, TT token tiles of 8) per block
MMA_CHUNK = 32  # k per chunk; chunk c -> warp c % MMA_WARPS
MMA_WARPS = 8

_COMMON = r"""
// panechat tensor-core products (contract: cupy_kernels/mma_source.py docstring).
static_assert(NT == 256 && WARPS == 8, "the MMA kernels split K over exactly 8 warps");

__device__ __forceinline__ unsigned short mma_f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float mma_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short mma_f2bf(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float mma_bf2f(unsigned short h) { return __uint_as_float((unsigned)h << 16); }

// D = A * B + C, m16n8k16, f16 (BF: bf16) inputs, f32 accumulate.
template <bool BF>
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    if constexpr (BF) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// ---- x split: one block per padded row; parts [2 or 3 (bf16), Mpad, K] ---------------------
extern "C" __global__ void __launch_bounds__(NT) mma_split_x(
        const float* __restrict__ x, unsigned short* __restrict__ xp, float* __restrict__ xinv,
        float* __restrict__ xsum, int M, int K, int gshift, int want_sums, int bf16) {
    __shared__ float red[WARPS];
    const int r = blockIdx.x;
    const int tid = threadIdx.x;
    const size_t ps = (size_t)gridDim.x * K;  // one part
    unsigned short* hr = xp + (size_t)r * K;
    unsigned short* lr = hr + ps;
    unsigned short* mr = bf16 ? lr + ps : lr;  // bf16: hi, mid, lo = parts 0, 1, 2
    const int NG = K >> gshift;
    if (r >= M) {  // a padding row: zeros (uniform per block)
        for (int k = tid; k < K; k += NT) { hr[k] = 0; lr[k] = 0; mr[k] = 0; }
        if (want_sums) for (int b = tid; b < NG; b += NT) xsum[(size_t)r * NG + b] = 0.0f;
        if (tid == 0) xinv[r] = 1.0f;
        return;
    }
    const float* xr = x + (size_t)r * K;
    float mx = 0.0f;
    for (int k = tid; k < K; k += NT) mx = fmaxf(mx, fabsf(xr[k]));
#pragma unroll
    for (int h = 16; h >= 1; h >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, h));
    if ((tid & 31) == 0) red[tid >> 5] = mx;
    __syncthreads();
    mx = fmaxf(fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3])),
               fmaxf(fmaxf(red[4], red[5]), fmaxf(red[6], red[7])));
    const int eb = (__float_as_int(mx) >> 23) & 0xff;
    const int s = eb == 255 ? 0 : eb == 0 ? 120 : max(-120, min(120, 141 - eb));
    const float sc = __int_as_float((127 + s) << 23);
    for (int k = tid; k < K; k += NT) {
        const float v = __fmul_rn(xr[k], sc);
        if (bf16) {  // v = hi + mid + lo, each subtraction exact
            const unsigned short h = mma_f2bf(v);
            const float r1 = __fsub_rn(v, mma_bf2f(h));
            const unsigned short m = mma_f2bf(r1);
            hr[k] = h;
            lr[k] = m;
            mr[k] = mma_f2bf(__fsub_rn(r1, mma_bf2f(m)));
        } else {
            const unsigned short h = mma_f2h(v);
            hr[k] = h;
            lr[k] = mma_f2h(__fsub_rn(v, mma_h2f(h)));
        }
    }
    if (want_sums) {
        const int G = 1 << gshift;
        for (int b = tid; b < NG; b += NT) {
            float acc = 0.0f;
            for (int j = 0; j < G; ++j) acc = __fadd_rn(acc, __fmul_rn(xr[b * G + j], sc));
            xsum[(size_t)r * NG + b] = acc;
        }
    }
    if (tid == 0) xinv[r] = __int_as_float((127 - s) << 23);
}

// ---- weight fragments: w[row, k .. k+3] as two f16x2 words (k % 4 == 0), zeros past N ----
struct MF16 {
    const unsigned short* w;
    int N, K;
    static constexpr int gs = 5, has_m = 0;
    __device__ __forceinline__ float scale(int, int) const { return 1.0f; }
    __device__ __forceinline__ float min_(int, int) const { return 0.0f; }
    __device__ __forceinline__ void frag(int row, int k, unsigned& lo, unsigned& hi) const {
        // rows past N read row N - 1 and become zeros by a select (no branch between loads)
        const uint2 u = __ldg(reinterpret_cast<const uint2*>(w + (size_t)min(row, N - 1) * K + k));
        lo = row < N ? u.x : 0u;
        hi = row < N ? u.y : 0u;
    }
};

// int8 codes -> f16 exactly: byte b = q + 128 as the mantissa of 1024 + b (0x6400 | b),
// then (1024 + b) - 1152 = q, an exact f16 subtraction.
__device__ __forceinline__ unsigned mma_i8x2_to_h2(unsigned u, unsigned sel) {
    const unsigned h = __byte_perm(u ^ 0x80808080u, 0x64646464u, sel);
    unsigned r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x64806480u));
    return r;
}

// nibble codes (bytes 0..15) -> f16 exactly: 0x6400 | c is 1024 + c; minus 1024 (Q4_1: q)
// or 1032 (Q4_0: q - 8), exact f16 subtractions.
__device__ __forceinline__ unsigned mma_u4x2_to_h2(unsigned c, unsigned sel, int has_m) {
    const unsigned h = __byte_perm(c, 0x64646464u, sel);
    unsigned r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(has_m ? 0x64006400u : 0x64086408u));
    return r;
}

// Scaled codes, FORM 0 'q8': int8 q [N, K] + float32 d, m [N, K >> gs]; 1 'q80' (Q8_0 in
// block form): int8 q [N, K] + float16 d; 2 'q4' (Q4_0 / Q4_1 in block form): per 32
// weights 16 bytes, byte j = weight j (low nibble) and j + 16 (high), codes q - 8 (Q4_0)
// or q with a float16 min (Q4_1), float16 d. w = code * d (+ m), applied per group.
template <int FORM>
struct MQ {
    const void* q;
    const void* d;
    const void* m;
    int N, K, has_m, gs;
    __device__ __forceinline__ void frag(int row, int k, unsigned& lo, unsigned& hi) const {
        const size_t rr = (size_t)min(row, N - 1);
        if constexpr (FORM == 2) {
            const int kb = k & 31;  // k .. k+3 lie in one block, one half of it
            const unsigned char* p = static_cast<const unsigned char*>(q) + rr * (K >> 1) + ((k >> 5) << 4) + (kb & 15);
            const unsigned u = __ldg(reinterpret_cast<const unsigned*>(p));
            const unsigned c = (kb >= 16 ? u >> 4 : u) & 0x0f0f0f0fu;
            lo = row < N ? mma_u4x2_to_h2(c, 0x4140u, has_m) : 0u;  // codes k, k+1
            hi = row < N ? mma_u4x2_to_h2(c, 0x4342u, has_m) : 0u;  // codes k+2, k+3
        } else {
            const unsigned u = __ldg(reinterpret_cast<const unsigned*>(static_cast<const signed char*>(q) + rr * K + k));
            lo = row < N ? mma_i8x2_to_h2(u, 0x4140u) : 0u;  // codes k, k+1
            hi = row < N ? mma_i8x2_to_h2(u, 0x4342u) : 0u;  // codes k+2, k+3
        }
    }
    __device__ __forceinline__ float load(const void* a, int row, int b) const {
        const size_t i = (size_t)min(row, N - 1) * (K >> gs) + b;
        float v;
        if constexpr (FORM == 0) v = __ldg(static_cast<const float*>(a) + i);
        else v = mma_h2f(__ldg(static_cast<const unsigned short*>(a) + i));
        return row < N ? v : 0.0f;
    }
    __device__ __forceinline__ float scale(int row, int b) const { return load(d, row, b); }
    __device__ __forceinline__ float min_(int row, int b) const { return load(m, row, b); }
};

// ---- out[M, N] = x[M, K] @ w[N, K]^T on tensor cores -----------------------------------
// Block: weight rows n0 .. n0 + 16 WT - 1, tokens m0 .. m0 + 8 TT - 1 (x padded to whole
// token tiles by mma_split_x); warp w takes the chunks c = w, w + 8, ... of 32 k.
template <int WT, int TT, bool Q8, bool BF, class W>
__device__ __forceinline__ void mma_linear(
        const unsigned short* __restrict__ xp, const float* __restrict__ xinv, const float* __restrict__ xsum,
        const W& w, float* __restrict__ out, int M, int N, int K, const float* __restrict__ add, int add_mode) {
    constexpr int RW = 16 * WT, CT = 8 * TT, E = RW * CT, P = BF ? 3 : 2;  // x parts: hi, (mid,) lo
    const size_t ps = (size_t)gridDim.x * CT * K;  // one part of the padded rows
    __shared__ float red[WARPS * E];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.y * RW, m0 = blockIdx.x * CT;
    float acc[WT][TT][4];
#pragma unroll
    for (int i = 0; i < WT; ++i)
#pragma unroll
        for (int j = 0; j < TT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    const int C = K >> 5;
    const int NG = Q8 ? (K >> w.gs) : 0;
#pragma unroll (WT * TT <= 2 ? 2 : 1)
    for (int c = warp; c < C; c += WARPS) {
        unsigned bx[TT][2][P][2];  // [token tile][mma j][part][b0, b1]
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            const size_t o = (size_t)(m0 + 8 * tt + g) * K + 32 * c + 4 * t;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int q = 0; q < P; ++q) {
                    const uint2 h = __ldg(reinterpret_cast<const uint2*>(xp + q * ps + o + 16 * j));
                    bx[tt][j][q][0] = h.x; bx[tt][j][q][1] = h.y;
                }
        }
#pragma unroll
        for (int wt = 0; wt < WT; ++wt) {
            const int r0 = n0 + 16 * wt + g, r1 = r0 + 8;
            unsigned a[2][4];  // [mma j][a0..a3]: a0 (r0, k 4t, 4t+1), a1 (r1, ..), a2 (r0, 4t+2, 4t+3), a3 (r1, ..)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                w.frag(r0, 32 * c + 16 * j + 4 * t, a[j][0], a[j][2]);
                w.frag(r1, 32 * c + 16 * j + 4 * t, a[j][1], a[j][3]);
            }
            const bool g16 = Q8 && w.gs == 4;
#pragma unroll
            for (int grp = 0; grp < 2; ++grp) {
                if (grp == 1 && !g16) break;
                float p[TT][4];
#pragma unroll
                for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) p[tt][e] = 0.0f;
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    if (g16 && j != grp) continue;
#pragma unroll
                    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                        for (int q = 0; q < P; ++q) mma16816<BF>(p[tt], a[j], bx[tt][j][q][0], bx[tt][j][q][1]);
                }
                if constexpr (Q8) {
                    const int b = g16 ? 2 * c + grp : c;
                    const float d0 = w.scale(r0, b), d1 = w.scale(r1, b);
                    const float mm0 = w.has_m ? w.min_(r0, b) : 0.0f, mm1 = w.has_m ? w.min_(r1, b) : 0.0f;
#pragma unroll
                    for (int tt = 0; tt < TT; ++tt) {
                        acc[wt][tt][0] = __fmaf_rn(d0, p[tt][0], acc[wt][tt][0]);
                        acc[wt][tt][1] = __fmaf_rn(d0, p[tt][1], acc[wt][tt][1]);
                        acc[wt][tt][2] = __fmaf_rn(d1, p[tt][2], acc[wt][tt][2]);
                        acc[wt][tt][3] = __fmaf_rn(d1, p[tt][3], acc[wt][tt][3]);
                        if (w.has_m) {
                            const int tk = m0 + 8 * tt + 2 * t;
                            const float s0 = __ldg(xsum + (size_t)tk * NG + b);
                            const float s1 = __ldg(xsum + (size_t)(tk + 1) * NG + b);
                            acc[wt][tt][0] = __fmaf_rn(mm0, s0, acc[wt][tt][0]);
                            acc[wt][tt][1] = __fmaf_rn(mm0, s1, acc[wt][tt][1]);
                            acc[wt][tt][2] = __fmaf_rn(mm1, s0, acc[wt][tt][2]);
                            acc[wt][tt][3] = __fmaf_rn(mm1, s1, acc[wt][tt][3]);
                        }
                    }
                } else {
#pragma unroll
                    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[wt][tt][e] = __fadd_rn(acc[wt][tt][e], p[tt][e]);
                }
            }
        }
    }
    // each warp's sums to shared memory, element (row i, token j) at j * RW + i
#pragma unroll
    for (int wt = 0; wt < WT; ++wt)
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = 16 * wt + g + 8 * (e >> 1), j = 8 * tt + 2 * t + (e & 1);
                red[warp * E + j * RW + i] = acc[wt][tt][e];
            }
    __syncthreads();
    for (int el = threadIdx.x; el < E; el += NT) {
        const int i = el % RW, j = el / RW;
        const int n = n0 + i, m = m0 + j;
        if (n >= N || m >= M) continue;
        const float* v = red + el;
        const float s = __fadd_rn(__fadd_rn(__fadd_rn(v[0], v[E]), __fadd_rn(v[2 * E], v[3 * E])),
                                  __fadd_rn(__fadd_rn(v[4 * E], v[5 * E]), __fadd_rn(v[6 * E], v[7 * E])));
        const float y = __fmul_rn(s, __ldg(xinv + m));
        const size_t o = (size_t)m * N + n;
        out[o] = add_mode ? __fadd_rn(y, __ldg(add + (add_mode == 1 ? o : (size_t)n))) : y;
    }
}
"""


def mma_kernel_name(kind: str, wt: int, tt: int) -> str:
    return f"mma_linear_{kind}_{wt}_{tt}"


def _wrappers() -> str:
    out = []
    heads = {  # bf16 weights: their bits are the A fragment as they are (MF16 loads 16-bit words)
        "f16": ("const unsigned short* __restrict__ w", "", "MF16 ww{w, N, K};", "false, false"),
        "bf16": ("const unsigned short* __restrict__ w", "", "MF16 ww{w, N, K};", "false, true"),
        "q8": ("const signed char* __restrict__ q, const float* __restrict__ d, const float* __restrict__ m",
               ", int has_m, int gshift", "MQ<0> ww{q, d, m, N, K, has_m, gshift};", "true, false"),
        "q80": ("const signed char* __restrict__ q, const unsigned short* __restrict__ d, "
                "const unsigned short* __restrict__ m", ", int has_m, int gshift",
                "MQ<1> ww{q, d, m, N, K, has_m, gshift};", "true, false"),
        "q4": ("const unsigned char* __restrict__ q, const unsigned short* __restrict__ d, "
               "const unsigned short* __restrict__ m", ", int has_m, int gshift",
               "MQ<2> ww{q, d, m, N, K, has_m, gshift};", "true, false"),
    }
    for kind in MMA_KINDS:
        wparams, extra, make, flags = heads[kind]
        for wt, tt in MMA_TILES:
            out.append(
                f'extern "C" __global__ void __launch_bounds__(NT) {mma_kernel_name(kind, wt, tt)}(\n'
                f"        const unsigned short* __restrict__ xp, const float* __restrict__ xinv,\n"
                f"        const float* __restrict__ xsum, {wparams},\n"
                f"        float* __restrict__ out, int M, int N, int K{extra}, const float* __restrict__ add,\n"
                f"        int add_mode) {{\n"
                f"    {make}\n"
                f"    mma_linear<{wt}, {tt}, {flags}>(xp, xinv, xsum, ww, out, M, N, K, add, add_mode);\n"
                f"}}\n")
    return "\n".join(out)


MMA_SOURCE = _COMMON + "\n" + _wrappers()

#: the same IEEE flags as the CUDA-core module (source.OPTIONS); mma.sync needs sm_80+.
MMA_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true",
               *(f"-D{name}={value}" for name, value in CUDA_DEFINES.items()))
MMA_MIN_CC = 80

MMA_KERNEL_NAMES = tuple(["mma_split_x"] + [mma_kernel_name(k, wt, tt) for k in MMA_KINDS for wt, tt in MMA_TILES])

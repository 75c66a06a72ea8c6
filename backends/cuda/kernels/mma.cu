// The CuPy backend's tensor-core products (mma.sync, sm_80 and newer): a second NVRTC program,
// built like kernels.cu; mma_source.py appends the mma_linear_* entry points, one per weight
// format and tile. The contract is the mma_source.py docstring (mma_emulation.py models it).
//
// Defines (from constants.py, passed as -D by mma_source.MMA_OPTIONS; none has a default):
//   NT     threads per block (256)
//   WARPS  warps per block (8)
// Standalone (mma_split_x and the templates; no mma_linear_* entry point):
//   nvcc -ptx -arch=sm_80 --fmad=false --ftz=false --prec-div=true --prec-sqrt=true -DNT=256 -DWARPS=8 -DKSPLIT=4 -DMAX_HEAD_DIM=256 -DBT=16 mma.cu
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

// What every kernel shares: warp and block reductions, expf_pc, rms_inv, h2f. The numerical
// contract is documented in backends/cuda/kernels/__init__.py; every reduction below is
// spelled out with __fmaf_rn / __fadd_rn / __fmul_rn so that no compiler flag can contract
// or reorder it. NT and WARPS come in as -D defines from constants.py (kernels.cu lists them);
// the 8 of an octet (weights.cuh, linear.cuh) is the width of the vector loads.
#pragma once

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

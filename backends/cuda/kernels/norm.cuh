// A part of kernels.cu (one NVRTC program; the -D defines it needs are listed there).
#pragma once
#include "common.cuh"

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

// A part of kernels.cu (one NVRTC program; the -D defines it needs are listed there).
#pragma once
#include "common.cuh"

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

// A part of kernels.cu (one NVRTC program; the -D defines it needs are listed there).
#pragma once
#include "common.cuh"

// ---- sampling on the device: one block per row; only token ids go back to the host -------
// The contract (backends/cuda/kernels/sampling.py emulates it bit for bit):
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

"""CUDA kernels of the CuPy backend: source, launch wrappers, and a numpy emulation.

Importing this module needs neither cupy nor a GPU: the CUDA C source is a string, the
launch wrappers take any object with CuPy's ``RawModule.get_function`` interface, and
the emulation is plain numpy.

Why own kernels
---------------
panechat promises that batching never changes an answer: a row's logits are bit-identical
whether it is decoded alone or beside other rows, at any row position. cuBLAS chooses its
algorithm (tile shapes, split-K, tensor-core paths) by problem shape, so an output row's
summation order -- and its last bits -- changes with the number of rows M. The kernels
below fix each output element's arithmetic in the source, independent of M and of the
row's position; only the *tiling* (which elements one block computes together) may vary
with the shapes, and tiling never changes how one element is computed.

The numerical contract (what ``emulate_*`` below reproduce bit for bit)
------------------------------------------------------------------------
Every product-sum is an explicit ``__fmaf_rn`` chain and every other addition an explicit
``__fadd_rn`` (the compiler may neither contract nor reorder them; the module is also
compiled with ``--fmad=false``, ``--ftz=false``, IEEE division and square root, by NVRTC
directly -- see ``build_module``). Float32 throughout, subnormals kept.

* ``linear`` out[m, n] = sum_k x[m, k] * w[n, k]: element k belongs to *lane*
  ``(k // 8) % 32`` (octets of 8 consecutive k, dealt round-robin to the 32 lanes of a
  warp); each lane runs one fma chain from +0 over its k in increasing order; the 32 lane
  sums are combined by the xor butterfly ``v += shfl_xor(v, h)`` for h = 16, 8, 4, 2, 1.
  The weight is dequantized exactly in registers (f16 -> f32 by cvt; q8: ``q * d`` is
  exact, then ``+ m`` rounded once, as numpy_kernels.dequantize_q8 does). The order
  depends on K alone. A warp computes NC in {1, 4} columns x TM in {1, 2, 4, 8, 16} rows
  with vector loads (K % 8 == 0); TM is picked from M and NC from N, which only regroups
  elements. Any other K runs ``linear_*_s`` (scalar loads, one row and column per warp)
  with the same order.
* ``rms_norm`` per row of D: thread t (of 256) runs an fma chain of x*x over k = t,
  t+256, ...; a block sum (butterfly within each warp, then ((w0+w1)+(w2+w3)) +
  ((w4+w5)+(w6+w7)) over the 8 warps); inv = 1 / sqrt(sum / D + eps);
  y = (x * inv) * weight.
* ``attention`` per (row, head), keys t = 0..pos of the row's slot, kv head h // (H/G):
  score[t] = (fma chain over d = lane + 32 i, butterfly) * scale; m = max; e[t] =
  expf_pc(score[t] - m) (``expf_pc`` is a Cephes expf from plain IEEE operations, the same
  formula as numpy_kernels._expf); sum = block sum of per-thread chains over t = thread,
  thread+256, ...; out[d] = (((p_0 + p_1) + p_2) ...) * (1 / sum) where p_s[d] is an fma
  chain of e[t] * v[t, d] over t = s, s+S, s+2S, ... with S = 256 // D.
* ``silu_mul`` y = (g / (1 + expf_pc(min(-g, 88)))) * u, elementwise.

Rows, the row's position in the batch, other rows' slots and positions, and the number of
rows never enter an element's arithmetic, so every kernel is batch-invariant by
construction; ``CupyBackend.self_check`` and ``scripts/gpu_check.py`` verify it on the
device, and the latter also compares every kernel with ``EmulatedModule`` bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

NT = 256  # threads per block of every kernel (8 warps); part of the rms/attention contract
WARP = 32
OCTET = 8  # consecutive k per lane step in linear
ROW_TILES = (1, 2, 4, 8, 16)  # TM: rows per warp tile in linear
COL_TILES = (1, 4)  # NC: output columns per warp in linear
WIDE_N = 8192  # linear uses NC = 4 when N > WIDE_N (enough blocks either way)
KSPLIT = 4  # blocks per (row, head) that share the score computation
MAX_HEAD_DIM = 256
SCRATCH_FLOATS = 1 << 24  # attention score scratch per launch group (64 MiB); rows are chunked
LINEAR_KINDS = ("f32", "f16", "q8")
QBLOCK = 32  # weights per quantisation block (q8 scales)

# --------------------------------------------------------------------------------------
# CUDA C source
# --------------------------------------------------------------------------------------

_COMMON = r"""
// panechat CuPy backend kernels. The numerical contract is documented in cupy_kernels.py;
// every reduction below is spelled out with __fmaf_rn / __fadd_rn / __fmul_rn so that no
// compiler flag can contract or reorder it.
#define NT 256
#define KSPLIT 4

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

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// ---- weight formats: octet(n, g, o) = w[n, 8g .. 8g+8) as exact floats ----------------
// octet() uses vector loads (rows 16-byte aligned: K % 8 == 0); at() is the scalar load.

struct WF32 {
    const float* w;
    int K;
    __device__ __forceinline__ void octet(int n, int g, float* o) const {
        const float4* p = reinterpret_cast<const float4*>(w + (size_t)n * K + 8 * g);
        const float4 a = __ldg(p), b = __ldg(p + 1);
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
        o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    }
    __device__ __forceinline__ float at(int n, int k) const { return __ldg(w + (size_t)n * K + k); }
};

struct WF16 {
    const unsigned short* w;
    int K;
    __device__ __forceinline__ void octet(int n, int g, float* o) const {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(w + (size_t)n * K + 8 * g));
        o[0] = h2f((unsigned short)(u.x & 0xffffu)); o[1] = h2f((unsigned short)(u.x >> 16));
        o[2] = h2f((unsigned short)(u.y & 0xffffu)); o[3] = h2f((unsigned short)(u.y >> 16));
        o[4] = h2f((unsigned short)(u.z & 0xffffu)); o[5] = h2f((unsigned short)(u.z >> 16));
        o[6] = h2f((unsigned short)(u.w & 0xffffu)); o[7] = h2f((unsigned short)(u.w >> 16));
    }
    __device__ __forceinline__ float at(int n, int k) const { return h2f(__ldg(w + (size_t)n * K + k)); }
};

// int8 q [N, K] with float32 d (and m) [N, K/32]: w = q * d (exact) [+ m, rounded once].
struct WQ8 {
    const signed char* q;
    const float* d;
    const float* m;
    int K;
    int has_m;
    __device__ __forceinline__ float deq(int qv, float dd, float mm) const {
        const float w = __fmul_rn((float)qv, dd);
        return has_m ? __fadd_rn(w, mm) : w;
    }
    __device__ __forceinline__ void octet(int n, int g, float* o) const {
        const uint2 u = __ldg(reinterpret_cast<const uint2*>(q + (size_t)n * K + 8 * g));
        const size_t b = (size_t)n * (K >> 5) + (g >> 2);
        const float dd = __ldg(d + b);
        const float mm = has_m ? __ldg(m + b) : 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[j] = deq((int)(signed char)((u.x >> (8 * j)) & 0xffu), dd, mm);
            o[4 + j] = deq((int)(signed char)((u.y >> (8 * j)) & 0xffu), dd, mm);
        }
    }
    __device__ __forceinline__ float at(int n, int k) const {
        const size_t b = (size_t)n * (K >> 5) + (k >> 5);
        return deq((int)__ldg(q + (size_t)n * K + k), __ldg(d + b), has_m ? __ldg(m + b) : 0.0f);
    }
};

// ---- linear: out[M, N] = x[M, K] @ w[N, K]^T ------------------------------------------
// Block: 8 warps; warp w computes columns n0 .. n0+NC-1 (n0 = (blockIdx.y*8 + w) * NC) for
// rows m0 .. m0+TM-1 (m0 = blockIdx.x * TM). Lane l owns the octets g = l, l+32, ... and
// runs one fma chain per output element over them in increasing k.
// VEC (K % 8 == 0, every row 16-byte aligned): whole octets with vector loads.
template <int TM, int NC, class W>
__device__ __forceinline__ void linear_vec(const float* __restrict__ x, const W& w,
                                           float* __restrict__ out, int M, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * NC;
    const int m0 = blockIdx.x * TM;
    if (n0 >= N) return;  // whole warp
    float acc[TM][NC];
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;
    const int G = K >> 3;
    for (int g = lane; g < G; g += 32) {
        float wv[NC][8];
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (n0 + c < N) {
                w.octet(n0 + c, g, wv[c]);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) wv[c][j] = 0.0f;
            }
        }
#pragma unroll
        for (int r = 0; r < TM; ++r) {
            if (m0 + r < M) {
                const float4* xr = reinterpret_cast<const float4*>(x + (size_t)(m0 + r) * K + 8 * g);
                const float4 a = __ldg(xr), b = __ldg(xr + 1);
                const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int c = 0; c < NC; ++c)
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[r][c] = __fmaf_rn(xv[j], wv[c][j], acc[r][c]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float s = warp_sum(acc[r][c]);
            if (lane == 0 && m0 + r < M && n0 + c < N) out[(size_t)(m0 + r) * N + n0 + c] = s;
        }
}

// Any K (scalar loads), one row and one column per warp: the same order as linear_vec --
// lane l takes k with (k / 8) % 32 == l in increasing k, the partial octet last.
template <class W>
__device__ __forceinline__ void linear_scalar(const float* __restrict__ x, const W& w,
                                              float* __restrict__ out, int M, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.y * 8 + (threadIdx.x >> 5);
    const int m = blockIdx.x;
    if (n >= N) return;
    const float* xr = x + (size_t)m * K;
    float acc = 0.0f;
    for (int g = lane; 8 * g < K; g += 32) {
        const int j1 = min(8, K - 8 * g);
        for (int j = 0; j < j1; ++j) acc = __fmaf_rn(__ldg(xr + 8 * g + j), w.at(n, 8 * g + j), acc);
    }
    const float s = warp_sum(acc);
    if (lane == 0) out[(size_t)m * N + n] = s;
}

// ---- RMS norm: one block per row ------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NT) rms_norm(
        const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
        int D, float eps) {
    __shared__ float red[8];
    const float* xr = x + (size_t)blockIdx.x * D;
    float* yr = y + (size_t)blockIdx.x * D;
    float acc = 0.0f;
    for (int k = threadIdx.x; k < D; k += NT) {
        const float v = xr[k];
        acc = __fmaf_rn(v, v, acc);
    }
    const float ss = block_sum(acc, red);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D), eps)));
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

// ---- attention, pass 1: scores -------------------------------------------------------
// grid (rows * H, KSPLIT); warp wg = blockIdx.y * 8 + warp handles keys t = wg, wg + 32, ...
// sc[(rr * H + h) * C + t] = dot(q[r, h], k[slot, g, t]) * scale   (r = r0 + rr)
extern "C" __global__ void __launch_bounds__(NT) attn_scores(
        const float* __restrict__ q, const float* __restrict__ kc,
        const int* __restrict__ slot, const int* __restrict__ pos, float* __restrict__ sc,
        int H, int G, int C, int D, float scale, int r0) {
    const int rh = blockIdx.x;
    const int rr = rh / H, h = rh - rr * H, r = r0 + rr;
    const int P = pos[r] + 1;
    const int g = h / (H / G);
    const int lane = threadIdx.x & 31;
    const float* qr = q + ((size_t)r * H + h) * D;
    const float* kb = kc + ((size_t)slot[r] * G + g) * (size_t)C * D;
    float* out = sc + (size_t)rh * C;
    float qv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) qv[i] = (lane + 32 * i < D) ? qr[lane + 32 * i] : 0.0f;
    for (int t = blockIdx.y * 8 + (threadIdx.x >> 5); t < P; t += 8 * KSPLIT) {
        const float* kt = kb + (size_t)t * D;
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (lane + 32 * i < D) acc = __fmaf_rn(qv[i], kt[lane + 32 * i], acc);
        acc = warp_sum(acc);
        if (lane == 0) out[t] = __fmul_rn(acc, scale);
    }
}

// ---- attention, pass 2: softmax and the weighted V sum; one block per (row, head) -----
extern "C" __global__ void __launch_bounds__(NT) attn_softmax_v(
        float* sc, const float* __restrict__ vc,
        const int* __restrict__ slot, const int* __restrict__ pos, float* __restrict__ o,
        int H, int G, int C, int D, int r0) {
    __shared__ float red[8];
    __shared__ float part[NT];
    const int rh = blockIdx.x;
    const int rr = rh / H, h = rh - rr * H, r = r0 + rr;
    const int P = pos[r] + 1;
    const int g = h / (H / G);
    const int tid = threadIdx.x;
    float* e = sc + (size_t)rh * C;
    float mx = __int_as_float(0xff800000);  // -inf
    for (int t = tid; t < P; t += NT) mx = fmaxf(mx, e[t]);
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (int t = tid; t < P; t += NT) {
        const float v = expf_pc(__fsub_rn(e[t], mx));
        e[t] = v;
        sum = __fadd_rn(sum, v);
    }
    sum = block_sum(sum, red);  // its __syncthreads also publishes e[] to the block
    const int S = NT / D;       // key subsets (D <= 256)
    const float* vb = vc + ((size_t)slot[r] * G + g) * (size_t)C * D;
    if (tid < S * D) {
        const int s = tid / D, d = tid - s * D;
        float acc = 0.0f;
        for (int t = s; t < P; t += S) acc = __fmaf_rn(e[t], vb[(size_t)t * D + d], acc);
        part[tid] = acc;
    }
    __syncthreads();
    if (tid < D) {
        float a = part[tid];
        for (int s = 1; s < S; ++s) a = __fadd_rn(a, part[s * D + tid]);
        o[((size_t)r * H + h) * D + tid] = __fmul_rn(a, __fdiv_rn(1.0f, sum));
    }
}
"""

_LINEAR_SIGNATURES = {
    "f32": ("const float* __restrict__ w", "WF32 ww{w, K};"),
    "f16": ("const unsigned short* __restrict__ w", "WF16 ww{w, K};"),
    "q8": ("const signed char* __restrict__ q, const float* __restrict__ d, const float* __restrict__ m",
           "WQ8 ww{q, d, m, K, has_m};"),
}


def linear_kernel_name(kind: str, tm: int, nc: int) -> str:
    """Vector kernels linear_{kind}_{TM}_{NC}; the any-K scalar kernel is linear_{kind}_s."""
    return f"linear_{kind}_{tm}_{nc}" if tm else f"linear_{kind}_s"


def _linear_wrappers() -> str:
    out = []
    for kind, (wparams, make) in _LINEAR_SIGNATURES.items():
        extra = ", int has_m" if kind == "q8" else ""
        variants = [(tm, nc) for tm in ROW_TILES for nc in COL_TILES]
        if kind != "q8":  # q8 needs K % 32 == 0: always the vector kernels
            variants.append((0, 0))
        for tm, nc in variants:
            call = f"linear_vec<{tm}, {nc}>(x, ww, out, M, N, K);" if tm else "linear_scalar(x, ww, out, M, N, K);"
            out.append(
                f'extern "C" __global__ void __launch_bounds__(NT) {linear_kernel_name(kind, tm, nc)}(\n'
                f"        const float* __restrict__ x, {wparams}, float* __restrict__ out,\n"
                f"        int M, int N, int K{extra}) {{\n"
                f"    {make}\n"
                f"    {call}\n"
                f"}}\n"
            )
    return "\n".join(out)


SOURCE = _COMMON + "\n" + _linear_wrappers()

#: NVRTC options: no FMA contraction, no flush-to-zero, IEEE division and square root.
#: (build_module passes exactly these: CuPy's own compile path would add -ftz=true.)
OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

KERNEL_NAMES = tuple(
    [linear_kernel_name(k, tm, nc) for k in LINEAR_KINDS for tm in ROW_TILES for nc in COL_TILES]
    + [linear_kernel_name(k, 0, 0) for k in ("f32", "f16")]
    + ["rms_norm", "silu_mul", "kv_write", "attn_scores", "attn_softmax_v"]
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


# --------------------------------------------------------------------------------------
# tile choice and launch wrappers (shared by the GPU and the emulation)
# --------------------------------------------------------------------------------------


def row_tile(m: int) -> int:
    """TM: the smallest row tile >= m, at most 16."""
    for tm in ROW_TILES:
        if m <= tm:
            return tm
    return ROW_TILES[-1]


def col_tile(n: int) -> int:
    """NC: 4 columns per warp for wide matrices, else 1 (more blocks for small N)."""
    return 4 if n > WIDE_N else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ptr(a: Any) -> int:
    data = getattr(a, "data", None)
    if hasattr(data, "ptr"):  # cupy
        return int(data.ptr)
    return int(a.ctypes.data)


class Kernels:
    """Launches the kernels of `module` (a cupy.RawModule, or EmulatedModule) on arrays
    of `xp` (cupy, or numpy for the emulation). Arrays must be C-contiguous."""

    def __init__(self, module: Any, xp: Any):
        self.module = module
        self.xp = xp
        self._fns: dict[str, Any] = {}

    def fn(self, name: str) -> Any:
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self.module.get_function(name)
        return f

    def compile_all(self) -> None:
        """Compile and load every kernel now (errors surface at start-up, not mid-answer)."""
        for name in KERNEL_NAMES:
            self.fn(name)

    def launch(self, name: str, grid: tuple, args: tuple) -> None:
        self.fn(name)(grid, (NT,), args)

    # -- the operations ----------------------------------------------------------------
    def linear(self, x: Any, w: Any, out: Any) -> Any:
        """out[M, N] = x[M, K] @ W.T for a prepared weight `w` (kind, n, k, arrays)."""
        M, K = x.shape
        N = w.n
        if K != w.k or out.shape != (M, N):
            raise ValueError(f"linear: x{tuple(x.shape)} w[{w.n}, {w.k}] out{tuple(out.shape)}")
        if M == 0 or N == 0:
            return out
        if K % 8 == 0 and _ptr(x) % 16 == 0:
            tm, nc = row_tile(M), col_tile(N)
            grid = (_cdiv(M, tm), _cdiv(N, 8 * nc))
        elif w.kind == "q8":
            raise ValueError("linear: q8 weights need K % 32 == 0 and a 16-byte aligned x")
        else:  # the any-K kernel: same arithmetic, scalar loads, one row per block
            tm, nc = 0, 0
            grid = (M, _cdiv(N, 8))
        if grid[1] > 65535:
            raise ValueError(f"linear: N={N} too large for one launch")
        i32 = np.int32
        if w.kind == "q8":
            mins = w.mins if w.mins is not None else w.scales
            args = (x, w.w, w.scales, mins, out, i32(M), i32(N), i32(K), i32(w.mins is not None))
        else:
            args = (x, w.w, out, i32(M), i32(N), i32(K))
        self.launch(linear_kernel_name(w.kind, tm, nc), grid, args)
        return out

    def rms_norm(self, x: Any, weight: Any, eps: float, out: Any) -> Any:
        R, D = x.shape
        if R:
            self.launch("rms_norm", (R,), (x, weight, out, np.int32(D), np.float32(eps)))
        return out

    def silu_mul(self, g: Any, u: Any, out: Any) -> Any:
        n = int(g.size)
        if n:
            self.launch("silu_mul", (min(_cdiv(n, NT), 4096),), (g, u, out, np.int64(n)))
        return out

    def kv_write(self, k: Any, v: Any, kc: Any, vc: Any, slots: Any, pos: Any) -> None:
        R, G, D = k.shape
        S, G2, C, D2 = kc.shape
        if (G2, D2) != (G, D) or v.shape != k.shape or vc.shape != kc.shape:
            raise ValueError(f"kv_write: k{tuple(k.shape)} cache{tuple(kc.shape)}")
        n = R * G * D
        if n:
            i32 = np.int32
            self.launch("kv_write", (min(_cdiv(n, NT), 4096),),
                        (k, v, kc, vc, slots, pos, i32(R), i32(G), i32(C), i32(D)))

    def attention(self, q: Any, kc: Any, vc: Any, slots: Any, pos: Any, scale: float, out: Any) -> Any:
        """Causal GQA of q [R, H, D] over keys 0..pos[r] of slot slots[r] -> out [R, H, D]."""
        R, H, D = q.shape
        S, G, C, D2 = kc.shape
        if D2 != D or H % G or D > MAX_HEAD_DIM or out.shape != q.shape:
            raise ValueError(f"attention: q{tuple(q.shape)} cache{tuple(kc.shape)} (head_dim <= {MAX_HEAD_DIM})")
        if R == 0:
            return out
        rows = max(1, min(R, SCRATCH_FLOATS // (H * C)))  # rows per launch pair
        sc = self.xp.empty((rows, H, C), self.xp.float32)
        i32 = np.int32
        for r0 in range(0, R, rows):
            n = min(rows, R - r0)
            self.launch("attn_scores", (n * H, KSPLIT),
                        (q, kc, slots, pos, sc, i32(H), i32(G), i32(C), i32(D), np.float32(scale), i32(r0)))
            self.launch("attn_softmax_v", (n * H,),
                        (sc, vc, slots, pos, out, i32(H), i32(G), i32(C), i32(D), i32(r0)))
        return out


# --------------------------------------------------------------------------------------
# numpy emulation: the same arithmetic, bit for bit, on the CPU
# --------------------------------------------------------------------------------------

_F32 = np.float32


def fma_f32(a: Any, b: Any, c: Any) -> np.ndarray:
    """Correctly rounded float32 fma(a, b, c) (what __fmaf_rn computes), vectorized.

    a*b is exact in float64; the float64 sum s and its exact error t (TwoSum) give the
    exact a*b + c = s + t; rounding s to float32 is correct except when s is exactly a
    float32 midpoint and t != 0, where t decides the direction (no double rounding).
    """
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    p = a64 * b64
    s = p + c64
    bb = s - p
    t = (p - (s - bb)) + (c64 - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        toward = np.where(s > r64, np.float32(np.inf), np.float32(-np.inf))
        nb = np.nextafter(r, toward)
        mid = (r64 + nb.astype(np.float64)) * 0.5
        tie = (s == mid) & (t != 0) & (s != r64)
    if np.any(tie):
        fix = np.where(t > 0, np.maximum(r, nb), np.minimum(r, nb))
        r = np.where(tie, fix, r)
    return np.asarray(r, np.float32)


_LANE = np.arange(WARP)


def tree32(v: np.ndarray) -> np.ndarray:
    """The warp butterfly over the last axis (32 lanes): v += v[lane ^ h], h = 16..1."""
    v = np.asarray(v, np.float32)
    for h in (16, 8, 4, 2, 1):
        v = v + v[..., _LANE ^ h]
    return v[..., 0]


def block_sum256(v: np.ndarray) -> np.ndarray:
    """block_sum over the last axis (256 threads)."""
    w = tree32(np.asarray(v, np.float32).reshape(*v.shape[:-1], 8, WARP))
    w = [w[..., i] for i in range(8)]
    return ((w[0] + w[1]) + (w[2] + w[3])) + ((w[4] + w[5]) + (w[6] + w[7]))


def emulate_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """out = x @ w.T (x [M, K], w float32 [N, K] as dequantized) with the kernel's order."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    M, K = x.shape
    N = w.shape[0]
    lanes = min(WARP, _cdiv(K, OCTET)) if K else 0
    acc = np.zeros((M, N, WARP), np.float32)
    if lanes:
        a = acc[:, :, :lanes]
        for step in range(_cdiv(K, WARP * OCTET)):
            for j in range(OCTET):
                k = step * WARP * OCTET + np.arange(lanes) * OCTET + j
                valid = k < K
                if not valid.any():
                    continue
                kk = np.where(valid, k, 0)
                new = fma_f32(x[:, None, kk], w[None, :, kk], a)
                a = np.where(valid, new, a)
        acc[:, :, :lanes] = a
    return tree32(acc)


def dequantize(kind: str, w: np.ndarray, scales: np.ndarray | None = None,
               mins: np.ndarray | None = None) -> np.ndarray:
    """The float32 weights a linear kernel of `kind` multiplies (exactly)."""
    if kind == "f32":
        return np.asarray(w, np.float32)
    if kind == "f16":
        return np.asarray(w).view(np.float16).astype(np.float32)
    N, K = w.shape
    q = np.asarray(w).view(np.int8).reshape(N, K // QBLOCK, QBLOCK).astype(np.float32)
    out = q * np.asarray(scales, np.float32)[:, :, None]
    if mins is not None:
        out = out + np.asarray(mins, np.float32)[:, :, None]
    return out.reshape(N, K)


def emulate_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float32)
    R, D = x.shape
    acc = np.zeros((R, NT), np.float32)
    for s in range(_cdiv(D, NT)):
        k = s * NT + np.arange(NT)
        valid = k < D
        v = x[:, np.where(valid, k, 0)]
        acc = np.where(valid, fma_f32(v, v, acc), acc)
    ss = block_sum256(acc)
    inv = _F32(1.0) / np.sqrt(ss / _F32(D) + _F32(eps))
    return (x * inv[:, None]) * np.asarray(weight, np.float32)


_EXP_LO, _LOG2E = _F32(-87.33654), _F32(1.44269504088896341)
_LN2_HI, _LN2_LO = _F32(0.693359375), _F32(-2.12194440e-4)
_P = [_F32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                        4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)]


def expf_pc(x: np.ndarray) -> np.ndarray:
    """The kernels' expf_pc, elementwise in float32."""
    x = np.maximum(np.asarray(x, np.float32), _EXP_LO)
    n = np.floor(x * _LOG2E + _F32(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _P[0] * r + _P[1]
    for c in _P[2:]:
        p = p * r + c
    p = (p * (r * r) + r) + _F32(1.0)
    two_n = ((n.astype(np.int32) + 127) << 23).astype(np.int32).view(np.float32)
    return (p * two_n).astype(np.float32)


def emulate_silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g = np.asarray(g, np.float32)
    e = expf_pc(np.minimum(-g, _F32(88.0)))
    return (g / (_F32(1.0) + e)) * np.asarray(u, np.float32)


def emulate_scores(q: np.ndarray, keys: np.ndarray, scale: float) -> np.ndarray:
    """q [..., D] against keys [..., P, D] -> scores [..., P] (attn_scores' order)."""
    D = q.shape[-1]
    acc = np.zeros(keys.shape[:-1] + (WARP,), np.float32)
    for i in range(_cdiv(D, WARP)):
        d = i * WARP + _LANE
        valid = d < D
        dd = np.where(valid, d, 0)
        new = fma_f32(q[..., None, dd], keys[..., dd], acc)
        acc = np.where(valid, new, acc)
    return tree32(acc) * _F32(scale)


def emulate_softmax_v(scores: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scores [P], vals [P, D] -> (out [D], e [P]) with attn_softmax_v's order."""
    P = scores.shape[0]
    D = vals.shape[1]
    e = expf_pc(scores - scores.max())
    part = np.zeros(NT, np.float32)
    for t0 in range(0, P, NT):
        c = e[t0:t0 + NT]
        part[:len(c)] = part[:len(c)] + c
    total = block_sum256(part)
    S = NT // D
    parts = np.zeros((S, D), np.float32)
    for t0 in range(0, P, S):
        n = min(S, P - t0)
        parts[:n] = fma_f32(e[t0:t0 + n, None], vals[t0:t0 + n], parts[:n])
    acc = parts[0]
    for s in range(1, S):
        acc = acc + parts[s]
    return acc * (_F32(1.0) / total), e


def emulate_attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, slots: np.ndarray,
                      pos: np.ndarray, scale: float) -> np.ndarray:
    R, H, D = q.shape
    G = kc.shape[1]
    out = np.empty_like(q)
    for r in range(R):
        P, s = int(pos[r]) + 1, int(slots[r])
        for h in range(H):
            g = h // (H // G)
            sc = emulate_scores(q[r, h], kc[s, g, :P], scale)
            out[r, h] = emulate_softmax_v(sc, vc[s, g, :P])[0]
    return out


_NP_OF_CTYPE = {
    "float": (np.float32,),
    "unsigned short": (np.float16, np.uint16),
    "signed char": (np.int8,),
    "int": (np.int32,),
    "long long": (np.int64,),
}


class EmulatedModule:
    """A stand-in for cupy.RawModule(code=SOURCE) that runs every kernel on numpy arrays
    through the emulation above, after checking each launch's arguments against the
    kernel's C signature (count, pointer vs scalar, dtypes, contiguity) and its grid."""

    def __init__(self, source: str = SOURCE):
        self.signatures = kernel_signatures(source)
        self.launches: list[tuple[str, tuple]] = []

    def get_function(self, name: str):
        if name not in self.signatures:
            raise KeyError(f"no kernel named {name}")
        sig = self.signatures[name]

        def call(grid, block, args, shared_mem=0):
            _check_args(name, sig, grid, block, args)
            self.launches.append((name, tuple(grid)))
            _EMULATORS["linear" if name.startswith("linear_") else name](name, grid, args)

        return call


def _check_args(name, sig, grid, block, args) -> None:
    if tuple(block) != (NT,):
        raise ValueError(f"{name}: block {block}, kernels assume ({NT},)")
    if not 1 <= len(grid) <= 3 or any(int(g) < 1 for g in grid) or any(int(g) > 65535 for g in grid[1:]):
        raise ValueError(f"{name}: bad grid {grid}")
    if len(args) != len(sig):
        raise TypeError(f"{name}: {len(args)} arguments for {len(sig)} parameters")
    for i, (a, (ctype, is_ptr)) in enumerate(zip(args, sig)):
        ok_types = _NP_OF_CTYPE[ctype]
        if is_ptr:
            if not (isinstance(a, np.ndarray) and a.dtype.type in ok_types and a.flags.c_contiguous):
                raise TypeError(f"{name}: argument {i} must be a C-contiguous {ctype} array, got "
                                f"{getattr(a, 'dtype', type(a).__name__)}")
        elif not (isinstance(a, np.generic) and type(a) in ok_types):
            raise TypeError(f"{name}: argument {i} must be a numpy {ok_types[0].__name__} scalar, "
                            f"got {type(a).__name__}")


def _emu_linear(name, grid, args):
    parts = name.split("_")
    kind = parts[1]
    tm, nc = (1, 1) if parts[2] == "s" else (int(parts[2]), int(parts[3]))
    if kind == "q8":
        x, q, d, m, out, M, N, K, has_m = args
        w = dequantize("q8", q, d, m if has_m else None)
    else:
        x, w0, out, M, N, K = args
        w = dequantize(kind, w0)
    M, N, K = int(M), int(N), int(K)
    if tuple(grid) != (_cdiv(M, tm), _cdiv(N, 8 * nc)):
        raise ValueError(f"{name}: grid {grid} does not cover M={M}, N={N}")
    out.reshape(M, N)[...] = emulate_linear(x.reshape(M, K), w.reshape(N, K))


def _emu_rms(name, grid, args):
    x, w, y, D, eps = args
    R = int(grid[0])
    y.reshape(-1, int(D))[:R] = emulate_rms_norm(x.reshape(-1, int(D))[:R], w, float(eps))


def _emu_silu(name, grid, args):
    g, u, y, n = args
    y.reshape(-1)[: int(n)] = emulate_silu_mul(g.reshape(-1)[: int(n)], u.reshape(-1)[: int(n)])


def _emu_kv_write(name, grid, args):
    k, v, kc, vc, slot, pos, R, G, C, D = args
    R, G, C, D = int(R), int(G), int(C), int(D)
    kcv = kc.reshape(-1, G, C, D)
    vcv = vc.reshape(-1, G, C, D)
    kk, vv = k.reshape(R, G, D), v.reshape(R, G, D)
    for r in range(R):
        kcv[slot[r], :, pos[r], :] = kk[r]
        vcv[slot[r], :, pos[r], :] = vv[r]


def _emu_scores(name, grid, args):
    q, kc, slot, pos, sc, H, G, C, D, scale, r0 = args
    H, G, C, D, r0 = int(H), int(G), int(C), int(D), int(r0)
    if grid[0] % H or grid[1] != KSPLIT:
        raise ValueError(f"{name}: grid {grid}")
    qv = q.reshape(-1, H, D)
    kcv = kc.reshape(-1, G, C, D)
    scv = sc.reshape(-1, H, C)
    for rr in range(grid[0] // H):
        r = r0 + rr
        P, s = int(pos[r]) + 1, int(slot[r])
        for h in range(H):
            scv[rr, h, :P] = emulate_scores(qv[r, h], kcv[s, h // (H // G), :P], float(scale))


def _emu_softmax_v(name, grid, args):
    sc, vc, slot, pos, o, H, G, C, D, r0 = args
    H, G, C, D, r0 = int(H), int(G), int(C), int(D), int(r0)
    if grid[0] % H:
        raise ValueError(f"{name}: grid {grid}")
    scv = sc.reshape(-1, H, C)
    vcv = vc.reshape(-1, G, C, D)
    ov = o.reshape(-1, H, D)
    for rr in range(grid[0] // H):
        r = r0 + rr
        P, s = int(pos[r]) + 1, int(slot[r])
        for h in range(H):
            ov[r, h], scv[rr, h, :P] = emulate_softmax_v(scv[rr, h, :P], vcv[s, h // (H // G), :P])


_EMULATORS = {
    "linear": _emu_linear,
    "rms_norm": _emu_rms,
    "silu_mul": _emu_silu,
    "kv_write": _emu_kv_write,
    "attn_scores": _emu_scores,
    "attn_softmax_v": _emu_softmax_v,
}


def _nvrtc_compile(source: str, target: str, options: tuple, kind: str) -> bytes:
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, "panechat_kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [target, *options])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC ({target}): {e}\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_ptx(arch: str = "compute_90", source: str = SOURCE, options: tuple = OPTIONS) -> bytes:
    """Compile `source` to PTX with NVRTC for `arch`, without a GPU (needs libnvrtc, e.g.
    from the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12`). Raises RuntimeError
    with NVRTC's log on a compile error."""
    return _nvrtc_compile(source, f"-arch={arch}", options, "ptx")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "panechat" / "cuda"


def build_module(cp: Any, cache_dir: str | Path | None = None) -> Any:
    """Compile SOURCE with NVRTC for the current device and load it as a cupy.RawModule.

    NVRTC is called directly rather than through ``cupy.RawModule(code=...)``, because
    CuPy appends ``-ftz=true`` to every compilation (the last -ftz option wins), which
    would flush subnormals in every kernel. The result (cubin for the device's own
    architecture, else PTX for the newest one NVRTC knows) is cached on disk, keyed by
    source, options, target and NVRTC version (``$XDG_CACHE_HOME/panechat/cuda``).
    """
    from cupy.cuda import nvrtc

    cc = int(cp.cuda.Device().compute_capability)
    archs = [a for a in nvrtc.getSupportedArchs() if a <= cc]
    if not archs:
        raise RuntimeError(f"this NVRTC supports no architecture up to sm_{cc}")
    target, kind = (f"-arch=sm_{cc}", "cubin") if cc in archs else (f"-arch=compute_{max(archs)}", "ptx")
    key = hashlib.sha256(repr((SOURCE, OPTIONS, target, nvrtc.getVersion())).encode()).hexdigest()[:24]
    for folder in ([Path(cache_dir)] if cache_dir else [_cache_dir(), Path(tempfile.gettempdir()) / "panechat-cuda"]):
        path = folder / f"kernels-{key}.{kind}"
        if path.is_file():
            return cp.RawModule(path=str(path))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            data = _nvrtc_compile(SOURCE, target, OPTIONS, kind)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return cp.RawModule(path=str(path))
        except OSError:
            continue  # an unwritable cache folder: try the next one
    raise RuntimeError("no writable folder for the compiled CUDA kernels")


__all__ = [
    "SOURCE", "OPTIONS", "KERNEL_NAMES", "NT", "KSPLIT", "MAX_HEAD_DIM", "Kernels", "EmulatedModule",
    "fma_f32", "tree32", "block_sum256", "emulate_linear", "emulate_rms_norm", "emulate_attention",
    "emulate_silu_mul", "expf_pc", "dequantize", "row_tile", "col_tile", "compile_ptx", "build_module",
]

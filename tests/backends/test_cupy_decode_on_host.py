"""The CuPy block-form kernels' weight decoders -- the very `load` / `decode` source of
WQ4, WQ5, WQ4K, WQ5K and WQ6K in backends/cuda/kernels/source.py -- compiled for the host
with g++ (a few shims: __ldg a load, __fmul_rn / __fadd_rn one rounded float operation,
h2f an exact half-to-float) and run over every octet of a weight: the floats must be
gguf's dequantized weights bit for bit. This checks the CUDA code's addressing (strides,
nibble and bit positions, scale bytes) without a GPU; the emulation's decoders are written
apart from it. Skipped without g++."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from panechat.backends.cuda.cupy_backend import prepare_weight
from panechat.backends.cuda.kernels.source import SOURCE
from panechat.backends.cuda.widen import random_blocks
from panechat.backends.quant.gguf_tensor import GGUFTensor

GXX = shutil.which("g++")

_SHIMS = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#define __device__
#define __forceinline__ inline
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
template <class T> static inline T __ldg(const T* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float h2f(unsigned short h) {  // exact: every float16 is a float32
    unsigned int s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? std::ldexp((double)m, -24)
             : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((double)(m | 1024), (int)e - 25);
    return (float)(s ? -v : v);
}
"""

_MAIN = r"""
static void* slurp(const char* f) {
    FILE* fp = fopen(f, "rb");
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    void* p = calloc(n + 16, 1);
    if (fread(p, 1, n, fp) != (size_t)n) exit(2);
    fclose(fp);
    return p;
}
template <class W> static void run(const W& w, int N, int K, float* out) {
    for (int n = 0; n < N; ++n)
        for (int g = 0; g < K / 8; ++g) w.decode(w.load(n, g), g, out + (size_t)n * K + 8 * g);
}
int main(int argc, char** argv) {  // kind N K has_m dir: reads dir/{w,d,m,qh}.bin, writes dir/out.bin
    const char* kind = argv[1];
    const int N = atoi(argv[2]), K = atoi(argv[3]), has_m = atoi(argv[4]);
    char path[4096];
    auto in = [&](const char* f) { snprintf(path, sizeof path, "%s/%s.bin", argv[5], f); return slurp(path); };
    const unsigned char* w = (const unsigned char*)in("w");
    const unsigned short* d = (const unsigned short*)in("d");
    const unsigned short* m = (const unsigned short*)in("m");
    float* out = (float*)malloc(sizeof(float) * N * K);
    if (!strcmp(kind, "q4")) run(WQ4{w, d, m, K, has_m}, N, K, out);
    else if (!strcmp(kind, "q5")) run(WQ5{w, d, m, (const unsigned int*)in("qh"), K, has_m}, N, K, out);
    else if (!strcmp(kind, "q4k")) run(WQ4K{w, K}, N, K, out);
    else if (!strcmp(kind, "q5k")) run(WQ5K{w, K}, N, K, out);
    else if (!strcmp(kind, "q6k")) run(WQ6K{w, d, K}, N, K, out);
    else return 3;
    snprintf(path, sizeof path, "%s/out.bin", argv[5]);
    FILE* fp = fopen(path, "wb");
    fwrite(out, sizeof(float), (size_t)N * K, fp);
    fclose(fp);
    return 0;
}
"""


def _struct(name: str) -> str:
    i = SOURCE.index(f"struct {name} {{")
    return SOURCE[i:SOURCE.index("\n};\n", i) + 4]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ not on PATH")
    d = tmp_path_factory.mktemp("decode")
    src = _SHIMS + "\n".join(_struct(n) for n in ("WQ4", "WQ5", "WQ4K", "WQ5K", "WQ6K")) + _MAIN
    (d / "decode.cpp").write_text(src)
    subprocess.run([GXX, "-O1", "-ffp-contract=off", "-std=c++17", "-o", str(d / "decode"), str(d / "decode.cpp")],
                   check=True, capture_output=True)
    return d


def _tensor(qtype: str, n: int, k: int, rng: np.random.Generator) -> GGUFTensor:
    if qtype.endswith("_K"):
        blocks = random_blocks(rng, qtype, n, k)
        if qtype == "Q6_K":
            blocks[0, 192:208] = 128  # int8 scales -128
            blocks[0, 0:192] = 255  # every code 31
        else:
            blocks[0, 4:16] = 255  # the largest 6-bit scales and mins
        return GGUFTensor("w", (n, k), qtype, blocks)
    w = rng.standard_normal((n, k), dtype=np.float32)
    w[0, :32] = 0.0
    w[1, 32:64] *= 1e4
    return GGUFTensor.from_array(w, qtype)


@pytest.mark.parametrize("qtype,n,k", [("Q4_0", 5, 96), ("Q4_1", 5, 96), ("Q5_0", 9, 256), ("Q5_1", 9, 256),
                                       ("Q4_K", 4, 512), ("Q5_K", 7, 512), ("Q6_K", 7, 768)])
def test_cuda_decoders_give_gguf_weights(decoder, qtype, n, k):
    t = _tensor(qtype, n, k, np.random.default_rng(n * k))
    pw = prepare_weight(t)
    assert pw.kind in ("q4", "q5", "q4k", "q5k", "q6k")
    dummy = np.zeros(8, np.uint16)
    np.ascontiguousarray(pw.w).tofile(decoder / "w.bin")
    np.ascontiguousarray(pw.scales if pw.scales is not None else dummy).tofile(decoder / "d.bin")
    np.ascontiguousarray(pw.mins if pw.mins is not None else dummy).tofile(decoder / "m.bin")
    if pw.qh is not None:
        np.ascontiguousarray(pw.qh, dtype="<u4").tofile(decoder / "qh.bin")
    subprocess.run([str(decoder / "decode"), pw.kind, str(n), str(k), str(int(pw.mins is not None)), str(decoder)],
                   check=True)
    got = np.fromfile(decoder / "out.bin", np.float32).reshape(n, k)
    want = t.dequantize()
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} weights differ, first at {np.argwhere(bad)[0]}"

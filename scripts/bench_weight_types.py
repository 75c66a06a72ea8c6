"""One product per GGUF weight type through the numpy backend, for A/B runs between builds.

    NUMBA_NUM_THREADS=1 python scripts/bench_weight_types.py [--n 576] [--k 1536]
        [--ms 1,4,32] [--types F32,Q8_0,Q4_1,Q4_K,Q6_K,F16] [--calls 30]

Random weights of each type (gguf's writer), the backend's `linear_weight` and `linear`,
so the same script measures whatever kernels a build has. Calls are interleaved over
types and M, and the table shows the median ms of `--calls` per cell. The weights stay
hot in cache: this is the dequantization and multiply work, not memory traffic. Run it
single-threaded on a shared machine (the thread's own time is what it measures).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.cpu.numpy_backend import NumpyBackend


_KQUANT = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}  # bytes, f16 d (dmin)


def _tensor(rng: np.random.Generator, w: np.ndarray, qtype: str) -> GGUFTensor:
    """`w` as `qtype` by gguf's writer; K-quants (which it cannot write) as random codes
    with small positive f16 scales."""
    if qtype not in _KQUANT:
        return GGUFTensor.from_array(w, qtype)
    size, f16_at = _KQUANT[qtype]
    n, k = w.shape
    b = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for o in f16_at:
        b[..., o:o + 2] = rng.uniform(0.001, 0.01, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return GGUFTensor("w", (n, k), qtype, b.reshape(n, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=576)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--ms", default="1,4,32")
    ap.add_argument("--types", default="F32,Q8_0,Q4_1,Q4_K,Q6_K,F16")
    ap.add_argument("--calls", type=int, default=30)
    a = ap.parse_args()
    ms = [int(m) for m in a.ms.split(",")]
    types = a.types.split(",")
    rng = np.random.default_rng(0)
    be = NumpyBackend()
    w = rng.standard_normal((a.n, a.k), dtype=np.float32) * 0.05
    kept = {t: be.linear_weight(_tensor(rng, w, t)) for t in types}
    xs = {m: rng.standard_normal((m, a.k), dtype=np.float32) for m in ms}
    times = {(t, m): [] for t in types for m in ms}
    for t in types:  # compile / warm
        for m in ms:
            be.linear(xs[m], kept[t])
    for _ in range(a.calls):
        for t in types:
            for m in ms:
                t0 = time.thread_time()
                be.linear(xs[m], kept[t])
                times[t, m].append(time.thread_time() - t0)
    print(f"N = {a.n}, K = {a.k}, median thread ms of {a.calls} interleaved calls")
    print("|  M | " + " | ".join(types) + " |")
    print("|---:|" + "|".join("---:" for _ in types) + "|")
    for m in ms:
        print(f"| {m:2d} | " + " | ".join(f"{np.median(times[t, m]) * 1e3:.3f}" for t in types) + " |")


if __name__ == "__main__":
    main()

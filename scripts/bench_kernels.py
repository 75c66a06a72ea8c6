"""Benchmark the batch-invariant kernels against OpenBLAS on the default model's shapes.

    python -m scripts.bench_kernels [--rounds 5] [--ms 1,2,4,8,16,32,512]
                                              [--methods linear,q8,gemv,gemm]
                                              [--no-attention] [--compile-time] [--cpu-time]

One "step" = every projection of a 30-layer SmolLM-135M-sized model (q, k, v,
o, gate, up, down) plus the lm_head, with random float32 weights (~540 MB, so
weights stream from DRAM like in real decoding).  Methods:

  gemv    stacked GEMV  np.matmul(W, x[:, :, None])   invariant, slow for M > 1
  gemm    OpenBLAS      x @ W.T                        NOT invariant (reference)
  linear  numpy_kernels.linear (f32)                   invariant
  q8      reference_kernels.linear_q8 (int8 blocks)    invariant

Cells are measured round-robin (every method and M once per round, after an
untimed warm-up step) and the table shows medians over rounds, in ms per step,
so noise from other work on the machine hits all variants alike.

On a machine shared with other work, wall-clock times of multi-threaded kernels
are dominated by preempted threads.  For a robust per-core comparison run
single-threaded and measure the thread's CPU time:

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python -m scripts.bench_kernels --cpu-time
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

from panechat.backends.cpu import numpy_kernels as nk
from panechat.backends.cpu.numpy_backend import NumpyBackend

if not __package__:  # run as a file (python scripts/bench_kernels.py): `scripts` from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import reference_kernels as ref  # noqa: E402  (the kernels only benchmarks use)

_clock = time.perf_counter  # --cpu-time switches to time.thread_time

# (N, K) of q, k, v, o, gate, up, down
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LM_HEAD = (49152, 576)
N_LAYERS = 30
N_HEAD, N_KV, HEAD_DIM = 9, 3, 64


def make_weights(rng: np.random.Generator) -> list[np.ndarray]:
    shapes = [s for _ in range(N_LAYERS) for s in LAYER_SHAPES] + [LM_HEAD]
    return [(rng.standard_normal(s, dtype=np.float32) * 0.05) for s in shapes]


def _step_fn(method: str, ws: list[np.ndarray], q8: list | None):
    """A callable running one model step for activations xs[K] into outs[(N, K)]."""
    if method == "gemv":
        return lambda xs, outs: [
            np.matmul(w, xs[w.shape[1]][:, :, None], out=outs[w.shape][:, :, None]) for w in ws
        ]
    if method == "gemm":
        return lambda xs, outs: [np.matmul(xs[w.shape[1]], w.T, out=outs[w.shape]) for w in ws]
    if method == "linear":
        f = nk._linear_f32  # the jitted kernel itself: no per-call shape checks
        return lambda xs, outs: [f(xs[w.shape[1]], w, outs[w.shape]) for w in ws]
    if method == "q8":
        f = ref._linear_q8
        return lambda xs, outs: [f(xs[wq.shape[1]], wq, d, outs[wq.shape]) for wq, d in q8]
    raise ValueError(method)


def _buffers(M: int, rng: np.random.Generator):
    xs = {K: rng.standard_normal((M, K), dtype=np.float32) for K in (576, 1536)}
    outs = {s: np.empty((M, s[0]), np.float32) for s in LAYER_SHAPES + [LM_HEAD]}
    return xs, outs


def _time(fn, *args) -> float:
    t = _clock()
    fn(*args)
    return (_clock() - t) * 1e3


METHODS = ("linear", "q8", "gemv", "gemm")


def bench_linear(ms: list[int], rounds: int, methods: list[str]) -> None:
    rng = np.random.default_rng(0)
    ws = make_weights(rng)
    q8 = [ref.quantize_q8(w) for w in ws] if "q8" in methods else None
    fns = {m: _step_fn(m, ws, q8) for m in methods}
    bufs = {M: _buffers(M, rng) for M in ms}
    skip = {("gemv", M) for M in ms if M > 64}  # ~12 ms + 5 ms per row: pointless
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for m in methods:
            time.sleep(0.3)  # BLAS / OpenMP threads spin a while after a call
            for M in ms:
                if (m, M) in skip:
                    continue
                fns[m](*bufs[M])  # warm-up: thread pools, caches
                times.setdefault((m, M), []).append(_time(fns[m], *bufs[M]))
    print(f"\nlinear: ms per model step (30 layers + lm_head), median of {rounds} rounds")
    per_row = [m for m in ("linear", "q8") if m in methods]
    print(f"{'M':>5} " + "".join(f"{m:>9}" for m in methods) + "".join(f"{m + '/row':>11}" for m in per_row))
    for M in ms:
        med = {m: np.median(times[(m, M)]) if (m, M) in times else np.nan for m in methods}
        cells = "".join(f"{med[m]:>9.1f}" for m in methods)
        print(f"{M:>5} " + cells + "".join(f"{med[m] / M:>11.2f}" for m in per_row))


def bench_attention(rounds: int) -> None:
    """30 attention calls (one per layer) per step; decode at several lengths and prefill."""
    rng = np.random.default_rng(1)
    S, ctx = 32, 2048
    kc = rng.standard_normal((S, N_KV, ctx, HEAD_DIM), dtype=np.float32)
    vc = rng.standard_normal((S, N_KV, ctx, HEAD_DIM), dtype=np.float32)
    cases = []
    for R in (1, 8, 32):
        for pos in (256, 2000):
            slots = np.arange(R, dtype=np.int32)  # one sequence per slot
            cases.append((f"decode R={R:<3} pos={pos}", slots, np.full(R, pos, np.int32)))
    prefill = np.arange(512, dtype=np.int32)  # one sequence, 512 consecutive positions
    cases.append(("prefill R=512 pos=0..511", np.zeros(512, np.int32), prefill))
    times = {name: [] for name, _, _ in cases}
    for _ in range(rounds):
        for name, slots, poss in cases:
            q = rng.standard_normal((len(slots), N_HEAD, HEAD_DIM), dtype=np.float32)
            out = np.empty_like(q)

            def step():
                for _ in range(N_LAYERS):
                    ref._attention(q, kc, vc, slots, poss, np.float32(0.125), np.int64(0), out)

            step()
            times[name].append(_time(step))
    print(f"\nattention: ms per model step ({N_LAYERS} layers, {N_HEAD} heads / {N_KV} kv, hd={HEAD_DIM})")
    for name, ts in times.items():
        print(f"  {name:<28} {np.median(ts):8.1f}")


def compile_time() -> None:
    """Import + self_check in a fresh process with an empty numba cache."""
    code = (
        "import time; t = time.perf_counter();"
        "from panechat.backends.cpu.numpy_backend import NumpyBackend;"
        "r = NumpyBackend().self_check(); print(f'{time.perf_counter() - t:.1f}', r)"
    )
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        for label in ("cold (compile)", "warm (cache) "):
            cmd = [sys.executable, "-c", code]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            secs, result = out.stdout.split(maxsplit=1)
            print(f"import + self_check, {label}: {secs} s  self_check -> {result.strip()}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", default="1,2,4,8,16,32,512", help="batch sizes (rows per step)")
    ap.add_argument("--methods", default=",".join(METHODS), help="subset of " + ",".join(METHODS))
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--compile-time", action="store_true", help="also measure cold compile time")
    ap.add_argument("--cpu-time", action="store_true", help="use thread CPU time (single-threaded)")
    args = ap.parse_args(argv)
    global _clock
    if args.cpu_time:
        _clock = time.thread_time
        if numba.get_num_threads() > 1:
            print("warning: --cpu-time only measures the main thread; set NUMBA_NUM_THREADS=1")
    if args.compile_time:
        compile_time()
    err = NumpyBackend().self_check()  # also compiles / loads every kernel
    print(f"self_check: {err or 'ok'}")
    print(
        f"numba threads: {numba.get_num_threads()} ({numba.threading_layer()}), "
        f"tiles: {'4x6/2x6/1x6 (AVX-512)' if nk._WIDE else '1x6'}, clock: {_clock.__name__}"
    )
    methods = [m for m in METHODS if m in args.methods.split(",")]  # invariant kernels first
    bench_linear([int(m) for m in args.ms.split(",")], args.rounds, methods)
    if not args.no_attention:
        bench_attention(args.rounds)


if __name__ == "__main__":
    main()

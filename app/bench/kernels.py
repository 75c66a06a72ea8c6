"""`panechat bench kernels`: each weight type's product at a model's matrix sizes, in GB/s
and GFLOP/s, next to the machine's read bandwidth measured in the same run.

A cell is one type, one (N, K) and one row count M. The weights are random valid blocks
(codes random, f16 scales small and positive), read-only as a model's memory map is, so
the kernel is the build a model runs. For each cell the product cycles through enough
copies of the matrix to pass `--pool-mb` (more than the L3), so the weights stream from
memory as in a decode step. GB/s counts the weight bytes read (as stored, the per-block
scales taken at load included); GFLOP/s is 2 M N K over the time; `%bw` is GB/s over the
measured read bandwidth: how far a kernel is from its memory limit. On a machine other
work shares, `--cpu-time` with NUMBA_NUM_THREADS=1 times this thread's CPU time instead
of the wall clock (a per-core figure that excludes time spent preempted)."""

from __future__ import annotations

import argparse
import json
import time

import numba
import numpy as np

from panechat.backends.cpu import repack
from panechat.backends.cpu import quant_kernels as qk
from panechat.backends.cpu.read_bandwidth import read_bandwidth
from panechat.backends.quant import registry

#: (name, N, K) of Llama-3.2-1B's products: q and o, k and v, gate and up, down, the head
SHAPES_1B = (("q,o", 2048, 2048), ("k,v", 512, 2048), ("gate,up", 8192, 2048), ("down", 2048, 8192),
             ("head", 49152, 2048))


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, row bytes] of valid `qtype` blocks: random codes and sub-scales, every f16 scale
    the registry names a small positive half (read-only, like a memory-mapped tensor)."""
    t = registry.get(qtype)
    b = rng.integers(0, 256, (n, k // t.block_weights, t.block_bytes), dtype=np.uint8)
    for o in t.f16_at:
        b[..., o:o + 2] = rng.uniform(1e-4, 1e-2, b.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    b = b.reshape(n, -1)
    b.flags.writeable = False
    return b


class _Product:
    """One matrix's product as the model calls it, through the type's compiled kernel (a
    `cpu_packed` type's over its repacked records, unless `float32`: the pair-loader kernel
    on the blocks as stored, the path before repacking)."""

    def __init__(self, qtype: str, blocks: np.ndarray, float32: bool = False):
        t = registry.get(qtype)
        self.packed = bool(t.cpu_packed) and not float32
        self.blocks = repack.pack(blocks, qtype) if self.packed else blocks
        self.at_load = t.scales_at_load and not self.packed
        self.nbytes = blocks.nbytes
        if self.at_load:
            self.d, self.dmin = qk.superblock_scales(blocks, qtype)
            self.nbytes += self.d.nbytes + (self.dmin.nbytes if len(t.f16_at) > 1 else 0)
        self.kernel = qk.packed_kernel(qtype) if self.packed else qk.kernel(qtype)

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        b = self.blocks
        if self.at_load:
            self.kernel(x, (b, b, b), (self.d,) * 3, (self.dmin,) * 3, (out, out, out), 1)
        else:
            self.kernel(x, (b, b, b), (out, out, out), 1)


def time_cell(products: list[_Product], m: int, k: int, n: int, min_s: float, rng, clock=time.perf_counter) -> float:
    """Seconds one product of `m` rows takes: the products cycled (weights from memory),
    after one warm-up call, for at least `min_s` and at least one pass over the pool."""
    x = rng.standard_normal((m, k), dtype=np.float32)
    out = np.empty((m, n), np.float32)
    products[0](x, out)
    calls, t0 = 0, clock()
    while True:
        for p in products:
            p(x, out)
        calls += len(products)
        spent = clock() - t0
        if spent >= min_s:
            return spent / calls


def run_kernels(args: argparse.Namespace) -> int:
    """Print (or --json) the table; returns 0."""
    types = [s.strip().upper() for s in args.types.split(",") if s.strip()]
    for q in types:
        t = registry.get(q)
        if t is None or not t.cpu_loader:
            from panechat.app.usage import UsageError

            raise UsageError(f"--types: no CPU block kernel reads {q!r} (try Q4_K, Q6_K, Q5_K, Q8_0, Q4_0)")
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [s for s in SHAPES_1B if args.shapes == "all" or s[0] in args.shapes.split(";")]
    if not shapes:
        from panechat.app.usage import UsageError

        raise UsageError(f"--shapes: none of {args.shapes!r}; give 'all' or some of "
                         + "; ".join(repr(s[0]) for s in SHAPES_1B) + ", ';'-separated")
    threads = numba.get_num_threads()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.cpu_time and threads != 1:
        from panechat.app.usage import UsageError

        raise UsageError("--cpu-time measures this thread only: run it with NUMBA_NUM_THREADS=1")
    bw = read_bandwidth(args.read_mb << 20, threads=threads, clock=clock)
    rows = []
    if not args.json:
        path = "; float32 pair-loader kernels for Q4_0/Q4_1/Q8_0" if args.float32 else ""
        print(f"read bandwidth: {bw:.1f} GB/s ({args.read_mb} MiB, {threads} threads); pool {args.pool_mb} MB a cell{path}")
        print(f"{'type':6} {'matrix':8} {'N':>6} {'K':>5} {'M':>4} {'ms':>9} {'GB/s':>7} {'%bw':>5} {'GFLOP/s':>8}")
    rng = np.random.default_rng(0)
    for q in types:
        for name, n, k in shapes:
            one = _Product(q, random_blocks(rng, q, n, k), args.float32)
            copies = max(1, int(args.pool_mb * 1e6 // one.nbytes))
            pool = [one] + [_Product(q, random_blocks(rng, q, n, k), args.float32) for _ in range(copies - 1)]
            for m in ms:
                s = time_cell(pool if m <= 64 else pool[:1], m, k, n, args.min_time, rng, clock)
                row = {"type": q, "matrix": name, "N": n, "K": k, "M": m, "ms": s * 1e3,
                       "GB_s": one.nbytes / s / 1e9, "GFLOP_s": 2 * m * n * k / s / 1e9}
                row["pct_bw"] = 100 * row["GB_s"] / bw
                rows.append(row)
                if not args.json:
                    print(f"{q:6} {name:8} {n:6} {k:5} {m:4} {row['ms']:9.3f} {row['GB_s']:7.1f} "
                          f"{row['pct_bw']:5.0f} {row['GFLOP_s']:8.1f}", flush=True)
            del pool, one
    if args.json:
        print(json.dumps({"read_GB_s": bw, "threads": threads, "float32": args.float32, "cells": rows}))
    return 0

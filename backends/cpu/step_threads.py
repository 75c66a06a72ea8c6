"""Threads that run one numba function together, meeting at barriers inside it.

llama.cpp's CPU backend runs a whole step's graph on a fixed crew of threads: each thread
takes its share of every operation, then waits at a spinning barrier for the others. A
numba `prange` instead forks and joins at every parallel region and a Python call stands
between any two, about 8 us of the CPU's time per kernel and a few hundred kernels a step
(docs/benchmarks.md). `StepCrew` gives the numpy backend llama.cpp's arrangement: the
calling thread and `n - 1` Python worker threads each call the same `nogil` numba function
with its thread index, and inside it `barrier(sync, n)` separates the phases.

`barrier` is a sense-reversing spin barrier on an int64 array [2] (arrivals, generation),
built from sequentially consistent LLVM atomics, so every store a thread made before the
barrier is visible to every thread after it. Work is split by thread index only over
disjoint output elements, so which thread computes an element never changes its bits.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from panechat.backends.cpu.numpy_kernels import _JIT, _element_ptr

_I64 = ir.IntType(64)


def _is_sync(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.layout == "C"


@intrinsic
def atomic_add(typingctx, arr, i, v):
    """Atomically ``old = arr.flat[i]; arr.flat[i] += v``; returns old (int64 array)."""
    if not (_is_sync(arr) and isinstance(i, types.Integer) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", p, val, "seq_cst")

    return types.int64(arr, i, v), codegen


@intrinsic
def atomic_load(typingctx, arr, i):
    """``arr.flat[i]`` read atomically (sequentially consistent; never cached in a register)."""
    if not (_is_sync(arr) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load_atomic(p, "seq_cst", 8)

    return types.int64(arr, i), codegen


@intrinsic
def atomic_store(typingctx, arr, i, v):
    """``arr.flat[i] = v`` atomically (sequentially consistent)."""
    if not (_is_sync(arr) and isinstance(i, types.Integer) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), p, "seq_cst", 8)
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


@intrinsic
def spin_pause(typingctx):
    """The CPU's spin-wait hint (x86 `pause`); nothing elsewhere."""
    def codegen(context, builder, sig, args):
        if "x86" in builder.module.triple:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def sched_yield(typingctx):
    """POSIX sched_yield(): give the core to another runnable thread."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


SPINS = 2000  # pauses (tens of microseconds) before a waiting thread starts yielding its core


@njit(**_JIT)
def barrier(sync, n):
    """Wait until all `n` threads of the crew have arrived (sync: int64 [2], zeroed once).
    A waiting thread spins, then yields its core between looks, so that a crew sharing
    cores with other threads (more threads than cores) still moves on."""
    if n == 1:
        return
    gen = atomic_load(sync, 1)
    if atomic_add(sync, 0, 1) == n - 1:  # the last to arrive opens the next generation
        atomic_store(sync, 0, 0)
        atomic_add(sync, 1, 1)
    else:
        spins = 0
        while atomic_load(sync, 1) == gen:
            if spins < SPINS:
                spin_pause()
                spins += 1
            else:
                sched_yield()


def new_sync() -> np.ndarray:
    """A barrier's state: int64 [2], (arrivals, generation)."""
    return np.zeros(2, np.int64)


class StepCrew:
    """Runs ``fn(*args, tid, n)`` on n threads at once: tid 0 on the caller, the others on
    worker threads kept for the process's life (daemons, started on first use). `fn` must
    be a numba function compiled with nogil, must not raise, and must reach the same
    barriers in every thread, or the crew waits forever."""

    def __init__(self):
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # one run at a time: the workers and a barrier serve one
        self._pid = os.getpid()

    def run(self, fn, args: tuple, n: int):
        with self._lock:
            if os.getpid() != self._pid:  # a forked child has none of the parent's threads
                self._workers, self._pid = [], os.getpid()
            while len(self._workers) < n - 1:
                self._workers.append(_Worker(len(self._workers) + 1))
            for w in self._workers[:n - 1]:
                w.start(fn, args, n)
            try:
                return fn(*args, 0, n)
            finally:
                for w in self._workers[:n - 1]:
                    w.wait()


class _Worker:
    def __init__(self, tid: int):
        self.tid = tid
        self._go, self._done = threading.Semaphore(0), threading.Semaphore(0)
        self._job: tuple | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name=f"panechat-step-{tid}", daemon=True).start()

    def start(self, fn, args: tuple, n: int) -> None:
        self._job = (fn, args, n)
        self._go.release()

    def wait(self) -> None:
        self._done.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            fn, args, n = self._job
            try:
                fn(*args, self.tid, n)
            except BaseException as e:  # handed to the caller by wait()
                self._error = e
            self._job = None
            self._done.release()

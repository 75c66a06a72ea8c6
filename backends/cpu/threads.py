"""How many threads the CPU kernels use: the cores that other processes leave free.

The numba kernels fork and join at every parallel region, a few hundred per decode step,
and each join waits for its slowest thread. When another process holds a core, the thread
the OS parks behind it stalls every join for a time slice, so two threads on a two-core
machine with one busy neighbour decode 2.6x slower than one thread (docs/benchmarks.md).
`ThreadGovernor` reads the CPU counters of the cores this process may use at most twice a
second, subtracts this process's own CPU time, and runs as many threads as there are cores
left idle (at least one, at most the start-up count).

Changing the count never changes a result: every output element of every kernel is
computed by one task in a fixed order, whichever thread runs it
(tests/engine/test_batch_invariance.py checks the model's logits bit for bit at 1 and at all threads).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator


def read_proc_stat() -> tuple[float, int] | None:
    """(CPU-seconds spent busy since boot, summed over the cores this process may run on;
    the number of those cores), from Linux's /proc/stat; None where there is no such file."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    ticks, cores = 0, 0
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or not fields[0].startswith(b"cpu") or fields[0] == b"cpu":
            continue
        if allowed is not None and int(fields[0][3:]) not in allowed:
            continue
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
        steal = int(fields[8]) if len(fields) > 8 else 0
        ticks += user + nice + system + irq + softirq + steal
        cores += 1
    if not cores:
        return None
    return ticks / os.sysconf("SC_CLK_TCK"), cores


_reserved = 0  # cores held by work of this process that the counters cannot tell apart
_reserved_lock = threading.Lock()


@contextlib.contextmanager
def reserve_core() -> Iterator[None]:
    """Inside, every governor of this process runs one thread fewer (at least one) from its
    next step on: for work of this process beside the serving engines, such as a model
    loading (its Python, then its start-up check on one thread). The counters subtract this
    process's own CPU time, so they cannot see it, and an engine's crew on every core then
    waits at its spinning barriers for a thread the OS parked behind that work (a stream
    stalled 0.3-0.5 s while a model loaded beside it on 2 cores)."""
    global _reserved
    with _reserved_lock:
        _reserved += 1
    try:
        yield
    finally:
        with _reserved_lock:
            _reserved -= 1


class ThreadGovernor:
    """Call `tick()` once per step on the thread that runs the kernels (numba's thread
    count belongs to the calling thread); it returns the thread count in force."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], interval_s: float = 0.5,
                 read_counters: Callable[[], tuple[float, int] | None] = read_proc_stat,
                 own_cpu: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic):
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self._set_threads, self._read, self._own, self._clock = set_threads, read_counters, own_cpu, clock
        self.interval_s = interval_s
        self._last: tuple[float, float, float] | None = None  # (wall, busy, own) at the last look
        self._next = 0.0

    def prime(self) -> None:
        """Take the first reading now (at start-up), so that the first step's `tick()`
        already knows the load: on a busy machine the first step, which also loads the
        kernels, then starts on the threads the other processes leave free."""
        counters = self._read()
        if counters is not None:
            self._last = (self._clock(), counters[0], self._own())

    def tick(self) -> int:
        now = self._clock()
        cap = max(1, self.max_threads - _reserved)
        if self.threads > cap:  # a core was reserved since the last look: give it up now
            self.threads = cap
            self._set_threads(cap)
        if now < self._next:
            return self.threads
        self._next = now + self.interval_s
        counters = self._read()
        if counters is None:  # not Linux: keep every thread
            return self.threads
        busy, cores = counters
        own = self._own()
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return self.threads
        others = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])  # cores in use elsewhere
        self.threads = max(1, min(cap, int(cores - others + 0.5)))
        self._set_threads(self.threads)  # every time: the count is per calling thread
        return self.threads

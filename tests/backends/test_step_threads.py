"""The crew and its barrier (backends/cpu/step_threads.py): every thread sees every other
thread's writes after a barrier, at 1, 2 and 3 threads (more threads than this machine's
2 cores: the waiting threads yield), and a worker's error reaches the caller."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from panechat.backends.cpu.step_threads import StepCrew, barrier, new_sync


@njit(nogil=True)
def _rounds(slots, sync, rounds, tid, n):
    """Each round every thread writes its slot, meets the others, and checks all slots;
    returns the number of rounds where some slot was stale."""
    bad = 0
    for r in range(rounds):
        slots[tid] = r
        barrier(sync, n)
        for j in range(n):
            if slots[j] != r:
                bad += 1
        barrier(sync, n)  # nobody writes the next round before all have read this one
    return bad


@pytest.mark.parametrize("n", [1, 2, 3])
def test_barrier_orders_every_write(n):
    crew = StepCrew()
    slots = np.full(4, -1, np.int64)
    assert crew.run(_rounds, (slots, new_sync(), 3000), n) == 0
    assert crew.run(_rounds, (slots, new_sync(), 10), n) == 0  # the same workers again


def test_a_worker_error_reaches_the_caller():
    crew = StepCrew()

    def fails_on_worker(tid, n):
        if tid == 1:
            raise RuntimeError("worker failed")
        return tid

    with pytest.raises(RuntimeError, match="worker failed"):
        crew.run(fails_on_worker, (), 2)
    assert crew.run(lambda tid, n: tid + 10, (), 2) == 10  # the crew still runs: tid 0's result

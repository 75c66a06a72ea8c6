"""The CPU thread governor: as many kernel threads as other processes leave cores idle."""

import os
import subprocess
import sys
import time

import pytest

from panechat.backends.cpu.threads import ThreadGovernor, read_proc_stat, reserve_core


class Counters:
    """Scripted machine counters: busy CPU-seconds of all cores, and of this process."""

    def __init__(self, cores: int):
        self.cores, self.busy, self.own, self.now = cores, 100.0, 5.0, 1000.0

    def advance(self, seconds: float, others: float, own: float) -> None:
        """`seconds` pass while other processes use `others` cores and we use `own`."""
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds


def governor_on(c: Counters, max_threads: int, applied: list[int]) -> ThreadGovernor:
    return ThreadGovernor(max_threads, applied.append, interval_s=0.5,
                          read_counters=lambda: (c.busy, c.cores), own_cpu=lambda: c.own, clock=lambda: c.now)


def test_threads_follow_the_cores_other_processes_leave_idle():
    c, applied = Counters(cores=4), []
    g = governor_on(c, 4, applied)
    assert g.tick() == 4 and applied == []  # the first look only takes a reading
    for others, want in ((0.0, 4), (0.9, 3), (2.7, 1), (3.9, 1), (1.2, 3), (0.3, 4)):
        c.advance(1.0, others=others, own=min(4.0 - others, g.threads))
        assert g.tick() == want, f"{others} cores busy elsewhere"
        assert applied[-1] == want
    g2 = governor_on(c, 2, [])  # never above the start-up count
    g2.tick()
    c.advance(1.0, others=0.0, own=2.0)
    assert g2.tick() == 2


def test_the_counters_are_read_at_most_every_interval():
    c, applied = Counters(cores=2), []
    g = governor_on(c, 2, applied)
    g.tick()
    c.advance(0.2, others=2.0, own=0.0)
    assert g.tick() == 2 and applied == []  # too soon to look again
    c.advance(0.4, others=2.0, own=0.0)
    assert g.tick() == 1 and applied == [1]


def test_a_reserved_core_is_given_up_at_the_next_step_and_taken_back_after():
    """A model loading beside a serving engine reserves a core (its work is this process's
    own, so the counters cannot see it): the engine runs one thread fewer at once, not at
    the next look, and all of them again once the reservation ends and a look finds the
    cores idle."""
    c, applied = Counters(cores=2), []
    g = governor_on(c, 2, applied)
    g.tick()
    with reserve_core():
        c.advance(0.1, others=0.0, own=2.0)  # too soon for a look: the cap applies anyway
        assert g.tick() == 1 and applied == [1]
        c.advance(1.0, others=0.0, own=1.0)  # a look with idle cores: still within the cap
        assert g.tick() == 1
    c.advance(1.0, others=0.0, own=1.0)
    assert g.tick() == 2 and applied[-1] == 2
    one = governor_on(c, 1, [])
    with reserve_core():
        assert one.tick() == 1  # never below one thread


def test_a_primed_governor_knows_the_load_at_the_first_step():
    """prime() at start-up: the first step (kernel loading and all) already runs on the
    cores left free, not on every core of a busy machine."""
    c, applied = Counters(cores=2), []
    g = governor_on(c, 2, applied)
    g.prime()
    c.advance(0.8, others=1.2, own=0.8)  # the model loads on one core; other processes hold 1.2
    assert g.tick() == 1 and applied == [1]
    unprimed = governor_on(c, 2, [])
    c.advance(0.8, others=1.2, own=0.8)
    assert unprimed.tick() == 2  # without it the first step takes every core


def test_without_counters_every_thread_stays():
    applied = []
    g = ThreadGovernor(2, applied.append, read_counters=lambda: None)
    assert g.tick() == 2 and g.tick() == 2 and applied == []


@pytest.mark.skipif(read_proc_stat() is None or read_proc_stat()[1] < 2 or not hasattr(os, "sched_getaffinity"),
                    reason="needs Linux's /proc/stat and two cores")
def test_a_busy_neighbour_process_takes_a_thread_away():
    """Real counters: a busy-loop process on this machine makes the governor give up a core."""
    cores = read_proc_stat()[1]
    applied = []
    g = ThreadGovernor(cores, applied.append, interval_s=0.0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        g.tick()
        time.sleep(1.0)
        assert g.tick() <= cores - 1, applied
    finally:
        hog.kill()
        hog.wait()

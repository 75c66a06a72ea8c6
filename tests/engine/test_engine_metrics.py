"""The Retry-After estimate (engine/serving/metrics.py): the time the queue ahead takes to clear at
the recent pace, growing with the queue, clamped to 1..60 s; and the recent pace itself."""

from __future__ import annotations

import pytest

from panechat.engine.serving.metrics import EngineMetrics, retry_after_estimate


def test_the_estimate_grows_with_the_queue():
    # 4 at a time, 2 s each: 8 waiting clear in 4 s, 64 in 32 s
    waits = [retry_after_estimate(n, 4, 2.0) for n in (1, 4, 8, 16, 32, 64)]
    assert waits == [1, 2, 4, 8, 16, 32]
    assert waits == sorted(waits) and len(set(waits)) == len(waits)


@pytest.mark.parametrize("waiting,concurrent,mean,expected", [
    (0, 4, 2.0, 1),  # nothing ahead: at once (but never "0")
    (64, 4, None, 1),  # no completed request yet: nothing to estimate from
    (1, 4, 0.01, 1),  # rounds up, at least 1
    (4096, 1, 30.0, 60),  # at most a minute: a client will not wait longer
    (3, 2, 1.0, 2),  # ceil(1.5)
])
def test_the_estimate_is_clamped(waiting, concurrent, mean, expected):
    assert retry_after_estimate(waiting, concurrent, mean) == expected


def test_the_pace_is_the_mean_of_recent_completed_requests():
    m = EngineMetrics(4)
    assert m.mean_request_s() is None
    m.record_finish("stop", 0.1, 2.0)
    m.record_finish("length", 0.1, 4.0)
    m.record_finish("cancelled", 0.1, 0.01)  # a client leaving says nothing about the pace
    m.record_finish("error", None, None)  # never admitted
    assert m.mean_request_s() == pytest.approx(3.0)
    for _ in range(100):
        m.record_finish("stop", 0.1, 1.0)
    assert m.mean_request_s() == pytest.approx(1.0)  # only the recent ones count

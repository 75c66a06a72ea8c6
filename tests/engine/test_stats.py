"""EngineStats: the one snapshot type; its wire form rebuilds the same value."""

import json

import pytest

from panechat.engine.serving.stats import EngineStats, IdleConversation, StreamState, StreamStats, TTFTHistogram


def sample() -> EngineStats:
    return EngineStats(
        batch_now=2, batch_max=4, rows_now=9, steps=40, step_hist=(3, 20, 17, 0, 0), tok_s=31.5, queue_depth=1,
        kv_in_use=3, kv_resident=4, kv_total=8, evictions=1,
        streams=(StreamStats("req-1", "c-a", StreamState.DECODING, tokens=12, tok_s=15.2, ttft_ms=80.5,
                             prefill_done=30, prefill_total=30),
                 StreamStats("req-2", "c-b", StreamState.PREFILLING, prefill_done=8, prefill_total=120),
                 StreamStats("req-3", "c-c", StreamState.QUEUED, prefill_total=7)),
        idle=(IdleConversation("c-d", 5, 44),), requests_total=6,
        requests_finished={"stop": 2, "length": 1, "cancelled": 0, "error": 0}, refused=1, prompt_tokens=300,
        generated_tokens=90, reused_tokens=120, ttft_hist=TTFTHistogram((0.05, 0.1), (1, 3, 4), 0.42),
        batching=True, ctx=512, terminals=2)


def test_the_wire_form_is_json_and_rebuilds_the_same_stats():
    s = sample()
    frame = json.loads(json.dumps({"type": "stats", **s.to_dict(), "model": "m.gguf"}))
    assert frame["streams"][1]["state"] == "prefilling" and frame["step_hist"] == [3, 20, 17, 0, 0]
    assert EngineStats.from_dict(frame) == s  # unknown keys (type, model) ignored


def test_what_a_backend_cannot_know_stays_none():
    s = EngineStats.from_dict({"tok_s": 2.0, "streams": [{"id": "h-1", "conversation": "c", "state": "waiting"}]})
    assert s.batch_now is None and s.queue_depth is None and s.kv_total is None and s.terminals is None
    assert s.streams == (StreamStats("h-1", "c", StreamState.WAITING),)


def test_a_malformed_stream_is_refused():
    with pytest.raises(ValueError):
        EngineStats.from_dict({"streams": [{"id": "x", "conversation": "c", "state": "prefill 42%"}]})
    with pytest.raises(KeyError):
        EngineStats.from_dict({"streams": [{"id": "x", "state": "queued"}]})

"""/metrics in Prometheus text format, parsed with prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def _scrape(http) -> dict:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model"}  # the one model served here
            key = s.name if not labels else (s.name, tuple(sorted(labels.items())))
            out[key] = s.value
    return out


def test_metrics_follow_the_engine(http, live):
    live.wait_idle()
    before = _scrape(http)
    body = {"messages": [{"role": "user", "content": "Name a planet."}], "max_tokens": 5, "temperature": 0}
    r1 = http.post("/v1/chat/completions", json=body).json()
    r2 = http.post("/v1/chat/completions", json=body).json()  # same prompt: reused prefix
    after = _scrape(http)

    assert after["panechat_ready"] == 1.0
    assert after["panechat_requests_running"] == 0 and after["panechat_requests_waiting"] == 0
    assert after["panechat_kv_blocks_in_use"] == 0 and after["panechat_kv_cache_usage_perc"] == 0
    assert after["panechat_kv_blocks_total"] == live.engine.pool.n_blocks
    assert after["panechat_kv_bytes_total"] == live.engine.kv.nbytes
    assert after["panechat_kv_blocks_resident"] >= 1
    assert after["panechat_prefix_cache_hits_total"] - before["panechat_prefix_cache_hits_total"] >= 16
    assert after["panechat_prefix_cache_queries_total"] - before["panechat_prefix_cache_queries_total"] == (
        r1["usage"]["prompt_tokens"] + r2["usage"]["prompt_tokens"])
    assert after["panechat_kv_snapshots_written_total"] == 0
    gen = r1["usage"]["completion_tokens"] + r2["usage"]["completion_tokens"]
    assert after["panechat_generated_tokens_total"] - before["panechat_generated_tokens_total"] == gen
    prompt = r1["usage"]["prompt_tokens"] + r2["usage"]["prompt_tokens"]
    assert after["panechat_prompt_tokens_total"] - before["panechat_prompt_tokens_total"] == prompt
    reused = r1["usage"]["prompt_tokens_details"]["cached_tokens"] + r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused > 0
    assert after["panechat_reused_prefix_tokens_total"] - before["panechat_reused_prefix_tokens_total"] == reused
    # time-to-first-token histogram: two more observations, cumulative buckets
    assert after["panechat_time_to_first_token_seconds_count"] - before.get(
        "panechat_time_to_first_token_seconds_count", 0) == 2
    assert after[("panechat_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == \
        after["panechat_time_to_first_token_seconds_count"]
    assert after["panechat_time_to_first_token_seconds_sum"] > 0
    # step batch-size histogram: one step per generated token at batch size 1 here
    b1 = ("panechat_step_batch_size_bucket", (("le", "1.0"),))
    assert after[b1] - before[b1] >= gen
    assert after[("panechat_step_batch_size_bucket", (("le", "+Inf"),))] == after["panechat_step_batch_size_count"]
    fin = ("panechat_requests_finished_total", (("reason", "length"),))
    assert after[fin] >= 1


def test_metrics_count_batched_steps_and_terminals(http, live):
    import threading

    live.wait_idle()
    before = _scrape(http)
    out = []

    def go(i):
        body = {"messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 8}
        out.append(http.post("/v1/chat/completions", json=body).status_code)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    after = _scrape(http)
    assert out == [200] * 3
    b1 = ("panechat_step_batch_size_bucket", (("le", "1.0"),))
    count = "panechat_step_batch_size_count"
    if live.engine.batching:  # some steps had 2+ sequences
        assert (after[count] - before[count]) - (after[b1] - before[b1]) > 0
    assert after["panechat_websocket_terminals"] == 0

"""A model loading lazily does not stall another model's stream (issue 25, item 8).

Through `panechat serve` as users run it: the default SmolLM2 streams while the first
request naming gemma-3-270m (listed by the catalog via PANECHAT_MODELS) loads it. Its
tokenizer (262k tokens, 515k merges) used to be built in-process by one Rust call that held
the GIL for 1-3 s, during which SmolLM2's stream stopped. The bound checked here (no gap over
GAP_BOUND_S, or NOISE_FACTOR x the longest gap before the load on a machine that busy) is what
the code guarantees on a noisy shared 2-core machine, not the 60 ms goal, which
`scripts/lazy_load_gaps.py` measures phase by phase; the figure is printed and in a failure."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from .serve_process import ServeProcess, private_env

# The old stall was 1-3 s (the tokenizer built in-process): what this bound guards against.
# Measured on a 2-core AMD EPYC (AVX2): quiet, 0.34-0.47 s while the loading model's self-check
# ran on both cores beside the serving engine's spinning crew, 0.18-0.36 s since it runs on one
# thread with a core reserved for the load; beside two busy processes 0.37-0.51 s (before it
# 0.18 s). On a quiet 2-core Xeon with a 480 MiB L3 (2026-12-04, 6e1639f): 30-44 ms over 6 runs,
# the 60 ms goal met there; the bound stays loose for CI's shared machines.
GAP_BOUND_S = 0.6
NOISE_FACTOR = 3.0  # a machine so busy that gaps were long before the load: the bound grows with them
STORY = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]


def _stream_times(url: str, stop_ids, started: threading.Event, times: list[float], stop: threading.Event) -> None:
    """Stream a long chat reply from the default model (its stop tokens barred, so it lasts
    until `stop`), noting when each content chunk arrives. 3,800 tokens (the context's
    room): at 1,900 a cold load, compiling the K-quants' kernels first, once outlasted it."""
    body = {"messages": STORY, "max_tokens": 3800, "temperature": 0, "stream": True,
            "logit_bias": {str(i): -100 for i in stop_ids}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if stop.is_set():
                break
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    times.append(time.perf_counter())
                    if len(times) == 40:
                        started.set()


@pytest.fixture
def server(model_path, gemma_path, tmp_path):
    env = {**private_env(tmp_path), "PANECHAT_MODELS": str(gemma_path)}
    if gemma_path.parent.name == "models":  # the user cache it was assembled in: its derived data too
        env["XDG_CACHE_HOME"] = str(gemma_path.parents[2])
    srv = ServeProcess(model_path, env, "--ctx-size", "4096", "--max-concurrent", "2",
                       "--kv-snapshots", "off").wait_ready()
    yield srv
    srv.stop()


def test_a_lazy_load_does_not_stall_the_other_models_stream(server, tokenizer):
    times: list[float] = []
    started, stop = threading.Event(), threading.Event()
    reader = threading.Thread(target=_stream_times, args=(server.url, tokenizer.stop_ids, started, times, stop), daemon=True)
    reader.start()
    assert started.wait(120), server.err
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": "gemma-3-270m-q4_k_m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "temperature": 0})
    t1 = time.perf_counter()
    time.sleep(0.3)
    stop.set()
    reader.join(60)
    assert r.status_code == 200 and r.json()["model"] == "gemma-3-270m-q4_k_m", r.text
    assert times[-1] > t1, "the stream ended before the load did: nothing was measured"
    during = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]
    before = [b - a for a, b in zip(times, times[1:]) if b < t0]
    assert during
    worst = max(during)
    report = (f"load {t1 - t0:.1f} s; longest gap during it {worst * 1e3:.0f} ms "
              f"(before it {max(before) * 1e3:.0f} ms, {len(during)} gaps)")
    print(report)
    assert worst < max(GAP_BOUND_S, NOISE_FACTOR * max(before)), report

"""Black box: conversations held concurrently get exactly the replies each gets alone."""

from __future__ import annotations

import threading

import httpx
import pytest

CLIENTS = [
    ["Name a fruit.", "What color is it?", "Is it sweet?"],
    ["Why is the sky blue?", "Explain it more simply.", "Thanks!"],
    ["Write a haiku about the sea.", "Now one about mountains.", "Which do you prefer?"],
    ["What is the capital of France?", "And of Italy?", "Which is bigger?"],
]


def converse(url: str, turns: list[str], params: dict) -> list[str]:
    messages, replies = [], []
    with httpx.Client(base_url=url, timeout=300) as c:
        for text in turns:
            messages.append({"role": "user", "content": text})
            r = c.post("/v1/chat/completions", json={"messages": messages, **params})
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
            replies.append(reply)
    return replies


@pytest.mark.parametrize("params", [{"temperature": 0, "max_tokens": 12},
                                    {"temperature": 0.8, "seed": 7, "max_tokens": 12}],
                         ids=["greedy", "seeded-t0.8"])
def test_four_concurrent_conversations_match_solo(live, params):
    assert live.engine.batching, f"the engine refused to batch: {live.engine.invariance_problem}"
    live.wait_idle()
    solo = [converse(live.url, turns, params) for turns in CLIENTS]
    before = live.engine.stats().step_hist
    together: list = [None] * len(CLIENTS)

    def run(i):
        together[i] = converse(live.url, CLIENTS[i], params)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CLIENTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo
    after = live.engine.stats().step_hist
    assert sum(after[2:]) > sum(before[2:])  # the concurrent run really shared forward steps

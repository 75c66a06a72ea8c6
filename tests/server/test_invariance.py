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


SCHEMA = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 30},
                                           "colours": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
          "required": ["fruit", "colours"], "additionalProperties": False}
JSON_MODE = {"response_format": {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA}}}


@pytest.mark.parametrize("params", [{"temperature": 0, "max_tokens": 16},
                                    {"temperature": 0.8, "seed": 7, "max_tokens": 16}],
                         ids=["greedy", "seeded-t0.8"])
def test_a_constrained_reply_is_the_same_beside_three_free_ones(live, params):
    """The grammar's mask depends on its own row only: a json_schema reply alone and batched
    beside three unconstrained conversations is the same text, and theirs do not change."""
    live.wait_idle()
    jobs = [(CLIENTS[0][:1], {**params, **JSON_MODE})] + [(turns[:1], params) for turns in CLIENTS[1:]]
    solo = [converse(live.url, turns, p) for turns, p in jobs]
    assert solo[0][0].startswith('{"fruit"')
    before = live.engine.stats().step_hist
    together: list = [None] * len(jobs)

    def run(i):
        together[i] = converse(live.url, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo
    assert sum(live.engine.stats().step_hist[2:]) > sum(before[2:])  # steps really were shared

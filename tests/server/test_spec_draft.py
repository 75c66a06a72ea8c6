"""Draft-model speculation through a live server (issue 27): with `--spec draft
--draft-model` (here the default model drafting for itself: most drafts stand greedy, and
many fall at temperature 0.8, so both the accept and the roll-back paths run) every reply
is the one plain decoding gives on another engine, alone and beside 3 others; /metrics
counts the drafts; the draft KV is given back when requests finish or are cancelled."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from panechat.app.server import ServerThread, create_app
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.speculation import StepCost

from .conftest import Live

PROMPTS = ["Count from 1 to 12, separated by commas.", "Repeat after me: the cat sat on the mat, the cat sat.",
           "Name three colours.", "Write the alphabet in capitals."]


class FreeRows(StepCost):
    """Extra rows cost nothing: every draft is tried whatever this machine's load."""

    def ratio(self, rows: int, extra: int) -> float:
        return 1.0

    def seconds(self, rows: int) -> float:  # and the draft model's passes too (unmeasured: not weighed)
        return 0.0


@pytest.fixture(scope="module")
def draft_live(loaded_model, model_path):
    engine = Engine(loaded_model, EngineConfig(max_concurrent=4, kv_sessions=8, max_queue=8, ctx_size=1024,
                                               spec="draft", draft_model=str(model_path))).start()
    engine.scheduler.step_cost = FreeRows()
    srv = ServerThread(create_app(engine), "127.0.0.1", 0).start()
    yield Live(engine, srv)
    srv.stop()
    engine.stop()


def _chat(url: str, prompt: str, params: dict) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], **params}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.parametrize("params", [{"temperature": 0, "max_tokens": 16},
                                    {"temperature": 0.8, "seed": 11, "max_tokens": 16}],
                         ids=["greedy", "seeded-t0.8"])
def test_draft_model_replies_equal_plain_decoding_alone_and_beside_three(draft_live, live, params):
    """Plain: another engine (the session's), speculation off for the request."""
    assert draft_live.engine.draft is not None and draft_live.engine.spec_problem is None
    plain = [_chat(live.url, p, {**params, "spec": False}) for p in PROMPTS]
    d0, a0 = (_metric(draft_live.url, f"panechat_spec_{n}_total") for n in ("draft_tokens", "accepted"))
    alone = [_chat(draft_live.url, p, params) for p in PROMPTS]
    together: list = [None] * len(PROMPTS)

    def run(i):
        together[i] = _chat(draft_live.url, PROMPTS[i], params)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert alone == plain and together == plain
    d1, a1 = (_metric(draft_live.url, f"panechat_spec_{n}_total") for n in ("draft_tokens", "accepted"))
    assert d1 > d0 and 0 < a1 - a0 <= d1 - d0  # the draft model's drafts were checked, and some stood
    draft = draft_live.engine.draft
    assert draft.forwards > 0 and draft.pool.peak_in_use > 0
    draft_live.wait_idle()
    assert draft.held == 0 and draft.pool.in_use == 0  # every finished request gave its draft KV back


def test_a_cancelled_stream_gives_its_draft_kv_back(draft_live):
    draft = draft_live.engine.draft
    runs = draft.runs
    # a raw pattern to continue: no end of turn in sight, so it is still running when checked
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", draft_live.url + "/v1/completions", json=body, timeout=300) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 6 and draft.runs > runs:
                assert draft.held == 1 and draft.pool.in_use > 0
                break  # the client goes away mid-reply: the request is cancelled
    deadline = time.monotonic() + 60
    while (draft.held or draft.pool.in_use) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert draft.held == 0 and draft.pool.in_use == 0


def test_startup_line_names_the_draft_model(draft_live, model_path):
    lines = [s for s in draft_live.engine.startup_lines() if s.startswith("speculative decoding:")]
    assert len(lines) == 1 and f"draft model {model_path.name}" in lines[0], lines


def test_panechat_serve_takes_the_draft_model_and_replies_as_plain_decoding(live, model_path, tmp_path):
    """`panechat serve --spec draft --draft-model X` as users run it: the start-up names the
    draft model (the option is not dropped on the way to the engine) and a greedy reply is
    the one plain decoding gives (the engine's own cost model decides which drafts run)."""
    from .serve_process import ServeProcess, private_env

    srv = ServeProcess(model_path, private_env(tmp_path), "--spec", "draft", "--draft-model", str(model_path),
                       "--kv-snapshots", "off").wait_ready()
    try:
        line = next((s for s in srv.lines if "speculative decoding:" in s), "")
        assert f"draft model {model_path.name}" in line, srv.err
        params = {"temperature": 0, "max_tokens": 16}
        assert _chat(srv.url, PROMPTS[1], params) == _chat(live.url, PROMPTS[1], {**params, "spec": False})
    finally:
        assert srv.stop() == 0, srv.err

"""Speculative decoding through the live server: `"spec": false` turns it off for one
request (the text is the same either way), and /metrics counts the drafts."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from panechat.app.server.request_schema import WS, read_fields
from panechat.engine.serving.speculation import StepCost

PROMPT = "apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple,"


def _spec_counters(http) -> tuple[float, float, float]:
    r = http.get("/metrics")
    got = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    return (got["panechat_spec_draft_tokens_total"], got["panechat_spec_accepted_total"],
            got["panechat_spec_steps_total"])


def _complete(http, **extra) -> str:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


class _FreeRows(StepCost):
    def ratio(self, rows: int, extra: int) -> float:  # every draft tried, whatever the machine's load
        return 1.0


def test_spec_false_is_honoured_and_metrics_count_drafts(http, live, monkeypatch):
    live.wait_idle()
    monkeypatch.setattr(live.engine.scheduler, "step_cost", _FreeRows())
    d0, a0, s0 = _spec_counters(http)
    plain = _complete(http, spec=False)
    d1, a1, s1 = _spec_counters(http)
    assert (d1, a1, s1) == (d0, a0, s0)  # no drafts for this request
    fast = _complete(http)  # the default: on
    d2, a2, s2 = _spec_counters(http)
    assert fast == plain
    assert d2 > d1 and 0 < a2 - a1 <= d2 - d1
    # each verify step checked at least one draft and gave its accepted ones plus its own token,
    # and 16 tokens took fewer steps than tokens
    assert 0 < s2 - s1 <= d2 - d1 and (s2 - s1) + (a2 - a1) <= 16


def test_websocket_params_take_spec():
    assert read_fields({"spec": False}, WS)["spec"] is False
    assert read_fields({}, WS)["spec"] is True

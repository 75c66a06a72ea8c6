"""The request schema (app/server/request_schema.py): one table of fields, each protocol's
defaults in it, the engine's own ranges, and the table docs/protocol.md shows. No model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from panechat.app.server.request_fields import FieldError
from panechat.app.server.request_schema import (CHAT, COMPLETIONS, CONTEXT, FIELDS, HONOURED, PROTOCOLS, REFUSED, WS,
                                                markdown_table, read_fields, sampling_params)
from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.serving.sampling import BOUNDS, SamplingParams

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_the_docs_show_the_table():
    assert markdown_table() in DOCS.read_text(encoding="utf-8"), (
        "docs/protocol.md's 'Request fields' table differs from request_schema.FIELDS; paste:\n" + markdown_table())


@pytest.mark.parametrize("protocol,want", [  # what an empty request means, per protocol
    (CHAT, {"temperature": 1.0, "max_tokens": CONTEXT, "stream": False}),
    (COMPLETIONS, {"temperature": 1.0, "max_tokens": 16, "stream": False}),
    (WS, {"temperature": 0.0, "max_tokens": 256}),
])
def test_each_protocols_defaults(protocol, want):
    got = read_fields({}, protocol)
    assert {k: got[k] for k in want} == want
    assert (got["top_p"], got["top_k"], got["min_p"], got["seed"], list(got["stop"])) == (1.0, 0, 0.0, None, [])
    assert ("stream" in got) == (protocol != WS)  # the websocket streams every reply


def test_defaults_build_the_params_each_protocol_had():
    ctx = 1024
    assert sampling_params(read_fields({}, CHAT), ctx) == SamplingParams(temperature=1.0, max_tokens=ctx)
    assert sampling_params(read_fields({}, COMPLETIONS), ctx) == SamplingParams(temperature=1.0, max_tokens=16)
    assert sampling_params(read_fields({}, WS), ctx) == SamplingParams()  # the engine's own: greedy, 256
    assert sampling_params(read_fields({"max_tokens": 10**12}, WS), ctx).max_tokens == ctx


def test_the_ranges_are_the_engines():
    """One range per sampling field, checked by the schema and by SamplingParams.validate alike."""
    by_name = {f.name: f for f in FIELDS}
    for name, bound in BOUNDS.items():
        if name != "seed":  # any integer, taken mod 2**64 first
            assert by_name[name].bound is bound
    for name, bad in [("temperature", 10.5), ("top_p", 0.0), ("min_p", 1.0), ("top_k", -1), ("max_tokens", 0),
                      ("temperature", math.inf)]:
        with pytest.raises(FieldError) as app:
            read_fields({name: bad}, WS)
        with pytest.raises(InvalidRequest) as engine:
            SamplingParams(**{name: bad}).validate()
        assert (app.value.key, app.value.what, app.value.code) == (name, str(engine.value)[len(name) + 1:],
                                                                    "invalid_value")
        assert engine.value.param == name


@pytest.mark.parametrize("body,key,code", [
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"top_k": 2.5}, "top_k", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stop": 3}, "stop", None),
    ({"max_completion_tokens": "x"}, "max_completion_tokens", "invalid_type"),
    ({"max_completion_tokens": -3, "max_tokens": 5}, "max_tokens", "invalid_value"),  # the alias wins
    ({"n": 0}, "n", "invalid_value"),
    ({"frequency_penalty": 5}, "frequency_penalty", "invalid_value"),
    ({"logit_bias": {"3": -101}}, "logit_bias", "invalid_value"),
    ({"audio": {"format": "wav"}}, "audio", None),
    ({"response_format": {"type": "bogus"}}, "response_format", "invalid_value"),
    ({"temperature": 10**400}, "temperature", "invalid_value"),  # too large for a float: infinite
])
def test_a_bad_field_is_named(body, key, code):
    with pytest.raises(FieldError) as err:
        read_fields(body, CHAT)
    assert (err.value.key, err.value.code) == (key, code) and "\n" not in str(err.value)


def test_asking_for_nothing_is_not_refused():
    body = {"n": 1, "logprobs": False, "tools": [], "tool_choice": "auto", "frequency_penalty": 0,
            "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}, "user": "u-1"}
    assert read_fields(body, CHAT) == read_fields({}, CHAT)
    assert read_fields({"max_completion_tokens": 7, "max_tokens": 9}, CHAT)["max_tokens"] == 7
    assert read_fields({"seed": -1}, WS)["seed"] == 2**64 - 1


def test_a_protocol_ignores_what_its_column_lacks():
    """`n` is an HTTP field: in a websocket `params` it is an unknown key, ignored like any."""
    assert read_fields({"n": 5, "echo": True}, WS) == read_fields({}, WS)
    with pytest.raises(FieldError):
        read_fields({"suffix": "!"}, COMPLETIONS)
    assert read_fields({"echo": True}, CHAT) == read_fields({}, CHAT)


def test_every_row_is_whole():
    for f in FIELDS:
        assert f.defaults and set(f.defaults) <= set(PROTOCOLS), f.name
        if f.status == HONOURED:
            assert f.read is not None, f.name
        if f.status == REFUSED:
            assert f.accepts is not None and f.refusal and f.unless, f.name
            assert all(f.accepts(v) for v in f.defaults.values() if v is not None), f.name
    assert len({f.name for f in FIELDS}) == len(FIELDS)

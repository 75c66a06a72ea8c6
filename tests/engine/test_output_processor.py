"""The output processor without a model: requests, a byte table for a tokenizer, and fake
steps of sampled token ids; what it emits and which requests it ends."""

from __future__ import annotations

import pytest

from panechat.engine.serving.events import FinishEvent, PrefillEvent, TokenEvent
from panechat.engine.serving.output import OutputProcessor, ReplyText
from panechat.engine.serving.request import Request, RequestState
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.text.tokenizer import StreamDecoder

EOS = 9
PIECES = {0: b"Hel", 1: b"lo", 2: b" w", 3: b"orld", 4: b"!", 5: b"\xc3", 6: b"\xa9", 7: b" ", EOS: b""}


class ByteTable:
    """What StreamDecoder needs of a tokenizer."""

    @staticmethod
    def token_bytes(token_id: int) -> bytes:
        return PIECES[token_id]


def _request(rid="r", prompt=(1, 2, 3), max_tokens=50, stop=()):
    events = []
    r = Request(id=rid, conversation=rid, prompt_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens),
                sampler=None, emit=events.append, stop_ids=frozenset({EOS}), stop_strings=tuple(stop))
    r.state, r.computed = RequestState.DECODING, len(prompt)
    return r, events


def _run(tokens, ctx=100, **kw):
    """Feed `tokens` one step at a time until the request ends -> (its events, end reason)."""
    out = OutputProcessor(ByteTable(), ctx)
    r, events = _request(**kw)
    out.add(r)
    for step, tok in enumerate(tokens):
        ends = out.process([], [(r, tok)], now=1.0 + step)
        if ends:
            assert ends == [(r, ends[0][1])]
            r.t_end = 9.0
            out.finish(r, ends[0][1])
            return events, ends[0][1]
    return events, None


def _texts(events):
    return [(e.token_id, e.text) for e in events if isinstance(e, TokenEvent)]


def test_tokens_stream_as_text_deltas_and_the_finish_counts_them():
    events, reason = _run([0, 1, 2, 3, 4], max_tokens=5)
    assert reason == "length"
    assert events[0] == PrefillEvent("r", 3, 3)  # the first token says the prompt is done
    assert _texts(events) == [(0, "Hel"), (1, "lo"), (2, " w"), (3, "orld"), (4, "!")]
    fin = events[-1]
    assert isinstance(fin, FinishEvent) and fin.reason == "length" and fin.text == "Hello world!"
    assert fin.token_ids == [0, 1, 2, 3, 4]
    assert fin.usage == {"prompt_tokens": 3, "completion_tokens": 5, "reused_tokens": 0}
    assert fin.timings["ttft_ms"] is not None and fin.timings["decode_tok_s"] == pytest.approx(4 / 8.0)


def test_a_stop_string_across_tokens_is_held_back_then_cut():
    events, reason = _run([0, 1, 2, 3, 4], stop=["o wo"])
    assert reason == "stop"
    assert _texts(events) == [(0, "Hel"), (1, "l"), (2, ""), (3, "")]  # "o w" held: it may begin "o wo"
    assert events[-1].text == "Hell" and events[-1].token_ids == [0, 1, 2, 3]


def test_held_text_is_shown_when_the_reply_ends_another_way():
    events, reason = _run([0, 1, 2], max_tokens=3, stop=["o wo"])
    assert reason == "length"
    assert _texts(events)[-1] == (-1, "o w")  # the flushed tail, after the last token
    assert events[-1].text == "Hello w"
    events, reason = _run([0, 1, EOS], stop=["o wo"])
    assert reason == "stop" and _texts(events)[-1] == (-1, "o")
    assert events[-1].token_ids == [0, 1]  # a stop token is not part of the reply


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    events, _ = _run([7, 5, 6], max_tokens=3)
    assert _texts(events) == [(7, " "), (5, ""), (6, "\u00e9")]
    events, _ = _run([7, 5], max_tokens=2)  # cut mid-character: the flush shows U+FFFD
    assert _texts(events)[-1] == (-1, "\ufffd") and events[-1].text == " \ufffd"


def test_the_context_ends_a_reply_before_max_tokens():
    events, reason = _run([0, 1, 2, 3], ctx=5, prompt=(1, 2, 3))
    assert reason == "length" and events[-1].token_ids == [0, 1]


def test_a_cancelled_reply_ends_where_it_stood():
    out = OutputProcessor(ByteTable(), 100)
    r, events = _request(stop=["o wo"])
    out.add(r)
    out.process([], [(r, 0)], 1.0)
    out.process([], [(r, 1)], 2.0)
    r.t_end = 3.0
    out.finish(r, "cancelled")
    assert events[-1].reason == "cancelled" and events[-1].text == "Hell"  # "o" was still held


def test_prefill_progress_and_a_failing_reader_stay_with_their_request():
    out = OutputProcessor(ByteTable(), 100)
    reading, reading_events = _request("a", prompt=range(40))
    reading.state, reading.computed = RequestState.PREFILLING, 16
    broken, _ = _request("b")
    ok, ok_events = _request("c")

    def refuse(ev):
        raise RuntimeError("reader gone")

    broken.emit = refuse
    for r in (reading, broken, ok):
        out.add(r)
    ends = out.process([reading], [(broken, 0), (ok, 0)], 1.0)
    assert [(r.id, type(e).__name__) for r, e in ends] == [("b", "RuntimeError")]
    assert reading_events == [PrefillEvent("a", 16, 40)]
    assert _texts(ok_events) == [(0, "Hel")] and ok.output_ids == [0]
    ends = out.process([], [(ok, 1)], 2.0)
    assert ends == [] and ok_events.count(PrefillEvent("c", 3, 3)) == 1  # once, at the first token


def test_reply_text_matches_the_whole_decode_when_no_stop_string_cuts_it():
    pieces = [0, 1, 7, 5, 6, 2, 3, 4]
    text = ReplyText(StreamDecoder(ByteTable()), ("xyz", "ld?"))
    shown = "".join(text.push(t) for t in pieces) + text.flush()
    assert shown == text.text == b"".join(PIECES[t] for t in pieces).decode()

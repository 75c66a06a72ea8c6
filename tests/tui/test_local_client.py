"""The embedded engine as a ChatBackend (app/clients/local.py), on the real engine: what a
pane's stream yields when the prompt cannot run, or when it is stopped before it starts."""

from __future__ import annotations

from panechat.app.clients.base import Finished, GenParams
from panechat.app.clients.local import LocalBackend

from .conftest import MAX_TOKENS


async def _events(stream) -> list:
    return [ev async for ev in stream]


async def test_a_prompt_longer_than_the_context_ends_in_one_error(tui_engine):
    long = [{"role": "user", "content": "word " * (2 * tui_engine.ctx)}]
    events = await _events(LocalBackend(tui_engine).stream("c-long", long, GenParams(max_tokens=MAX_TOKENS)))
    assert len(events) == 1 and isinstance(events[0], Finished)
    assert events[0].reason == "error" and "context holds" in events[0].error


async def test_a_stream_stopped_before_it_starts_ends_cancelled(tui_engine):
    stream = LocalBackend(tui_engine).stream("c-stop", [{"role": "user", "content": "Tell me a long story"}],
                                             GenParams(max_tokens=400))
    stream.cancel()  # before the prompt is even tokenized
    events = await _events(stream)
    assert isinstance(events[-1], Finished) and events[-1].reason == "cancelled"
    assert sum(isinstance(ev, Finished) for ev in events) == 1


async def test_a_backend_still_loading_says_so():
    events = await _events(LocalBackend(build=lambda: None).stream("c-early", [{"role": "user", "content": "Hi"}],
                                                                   GenParams()))
    assert [(ev.reason, ev.error) for ev in events] == [("error", "the model is still loading")]

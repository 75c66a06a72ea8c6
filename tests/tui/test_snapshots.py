"""SVG snapshots of whole screens (pytest-textual-snapshot), from fixed stored conversations.

Deterministic: nothing is generated; the engine is a fresh one (no conversation cached in
its KV slots, which the dashboard would count), idle (empty sparklines, no streams), and
the pane figures come from the stored replies' metadata, and the start-up time the
dashboard shows is pinned (`clock`). Update with --snapshot-update."""

from __future__ import annotations

import pytest

from panechat.app.clients.local import LocalBackend

from .conftest import make_app, running_engine, wait_engine_idle

READY_S = 0.9  # what the dashboard's "ready in" shows in the snapshots


@pytest.fixture(scope="module")
def fresh_engine(loaded_model):
    """Configured like the shared `tui_engine`, but with nothing left in it by other tests."""
    with running_engine(loaded_model) as engine:
        yield engine

CONVERSATIONS = [
    ("Sea haiku", "Write a haiku about the sea",
     "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("Python tip", "How do I reverse a list in Python?",
     "Use slicing or the method:\n\n```python\nitems[::-1]      # a reversed copy\nitems.reverse()  # in place\n```"),
    ("Packing list", "What should I pack for a day hike?",
     "- water (2 litres)\n- a snack\n- a rain jacket\n- **sun cream**"),
    ("Arithmetic", "What is 2+2?", "2 + 2 = **4**."),
]


def fill(store) -> None:
    ids = []
    for i, (title, q, a) in enumerate(CONVERSATIONS):
        c = store.new_conversation(title, max_tokens=64)
        store.add_message(c.id, "user", q)
        store.add_message(c.id, "assistant", a, {
            "reason": "stop", "usage": {"prompt_tokens": 30, "completion_tokens": 20 + i},
            "timings": {"ttft_ms": 120.0 + 10 * i, "decode_tok_s": 30.5 - i}})
        ids.append(c.id)
    store.save_layout("local", ids)


async def no_blink(pilot) -> None:
    """A blinking cursor is on or off depending on timing: make it steady."""
    for box in pilot.app.screen.query("PromptInput"):
        box.cursor_blink = False
    await pilot.pause(0.1)


def test_four_pane_layout(snap_compare, fresh_engine, store):
    fill(store)
    wait_engine_idle(fresh_engine)

    async def settle(pilot):
        await pilot.pause(0.5)
        pilot.app.main.panes[0].focus_input()
        await no_blink(pilot)

    assert snap_compare(make_app(LocalBackend(fresh_engine, clock=lambda: READY_S), store), terminal_size=(160, 45), run_before=settle)


def test_light_theme_maximized(snap_compare, fresh_engine, store):
    fill(store)
    store.set_setting("theme", "panechat-light")
    wait_engine_idle(fresh_engine)

    async def settle(pilot):
        await pilot.pause(0.5)
        pilot.app.main.panes[1].focus_input()
        await pilot.press("ctrl+o")
        await no_blink(pilot)

    assert snap_compare(make_app(LocalBackend(fresh_engine, clock=lambda: READY_S), store), terminal_size=(120, 36), run_before=settle)

"""Large pastes stay cheap (issue 24 item 4): the real app on a backend that answers at once.

The bounds are loose guards against the pathological case (a 40 KB unbracketed paste
froze the app for minutes); the figures are in docs/benchmarks.md (test_ui_cost.py -m bench)."""

from __future__ import annotations

from panechat.app.tui.widgets.prompt_input import PASTE_INLINE_MAX, PromptInput
from panechat.app.tui.widgets.transcript import UserMessage

from .conftest import make_app, wait_for
from .paste_probe import EchoBackend, filler, paste_figures


async def _ready(pilot):
    app = pilot.app
    await wait_for(pilot, app.backend_ready.is_set, timeout=30, what="the backend")
    pane = app.main.panes[0]
    pane.focus_input()
    await pilot.pause()
    return pane, pane.query_one(PromptInput)


async def test_a_40kb_paste_without_bracketed_paste_shows_within_seconds(store):
    app = make_app(EchoBackend(), store)
    async with app.run_test(size=(160, 45)) as pilot:
        pane, box = await _ready(pilot)
        text = filler(40_000).replace("\n", " ")  # a terminal sends a newline as Enter
        shown, key = await paste_figures(pilot, box, text, as_keys=True, timeout=10)
        assert box.value == text + "x"
        assert len(box.text) < 200, "a paste this long is held as a chip, not wrapped in the box"


async def test_a_1mb_paste_shows_as_a_chip_and_is_sent_whole(store):
    backend = EchoBackend()
    app = make_app(backend, store)
    async with app.run_test(size=(160, 45)) as pilot:
        pane, box = await _ready(pilot)
        text = filler(1_000_000)
        await paste_figures(pilot, box, text, as_keys=False, timeout=10)
        assert box.text.startswith("[pasted text #1: 1,000,000 chars, 12,500 lines]")
        await pilot.press("backspace", "enter")  # the key typed after it, then send
        await wait_for(pilot, lambda: pane.last_finish is not None, timeout=10, what="the reply")
        assert backend.sent[-1][-1] == {"role": "user", "content": text.strip()}  # as send() strips it
        assert store.messages(pane.conversation.id)[0].content == text.strip()  # stored whole
        shown = str(pane.query_one(UserMessage).render())
        assert len(shown) < 5_000 and "more characters, sent in full" in shown


async def test_a_short_paste_is_text_and_typing_around_it_keeps_order(store):
    app = make_app(EchoBackend(), store)
    async with app.run_test(size=(160, 45)) as pilot:
        pane, box = await _ready(pilot)
        await pilot.press("a", "b")
        await paste_figures(pilot, box, "12\n34", as_keys=False)  # then types "x"
        await pilot.press("left", "y", "ctrl+j", "z")
        assert box.text == box.value == "ab12\n34y\nzx"
        box.clear()
        await paste_figures(pilot, box, "p" * PASTE_INLINE_MAX, as_keys=False)
        assert box.text == "p" * PASTE_INLINE_MAX + "x"  # up to the limit it is text
        box.clear()
        await paste_figures(pilot, box, "q" * (PASTE_INLINE_MAX + 1), as_keys=False)
        assert box.text == f"[pasted text #1: {PASTE_INLINE_MAX + 1:,} chars]x"


async def test_the_first_keys_of_a_blurred_app_keep_their_order(store):
    """A browser tab (`panechat web`) starts the app blurred, with no widget focused; the
    first key of a burst gives the focus back. It used to take the slow path and land after
    the rest of its burst ("ameN" for "Name")."""
    from textual import events

    app = make_app(EchoBackend(), store)
    async with app.run_test(size=(80, 24)) as pilot:
        pane, box = await _ready(pilot)
        app.post_message(events.AppBlur())
        await wait_for(pilot, lambda: app.focused is None, timeout=5, what="the app to blur")
        for ch in "Name":  # one burst: queued before any is handled, as a terminal's read gives them
            app.post_message(events.Key(ch, ch))
        await wait_for(pilot, lambda: len(box.value) == 4, timeout=5, what="the keys")
        assert box.value == "Name"

"""The whole app on the real engine (default model), driven with Pilot."""

from __future__ import annotations

import asyncio
import re
import threading

from textual import events

from panechat.app.store import Store
from panechat.app.tui.screens.broadcast import BroadcastScreen
from panechat.app.tui.screens.pane_settings import PaneSettingsScreen
from panechat.app.tui.widgets.dashboard import Dashboard
from panechat.app.tui.widgets.prompt_input import PromptInput
from panechat.app.tui.widgets.transcript import AssistantMessage, UserMessage

from .conftest import MAX_TOKENS, make_app, type_and_send, type_into, wait_busy, wait_for

SIZE = (160, 45)


async def test_four_panes_stream_at_once_and_finish(tui_engine, store):
    store.set_setting("default_max_tokens", "32")
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        for _ in range(3):
            await pilot.press("ctrl+n")
        await pilot.pause()
        panes = app.main.panes
        assert len(panes) == 4 and [p.number for p in panes] == [1, 2, 3, 4]
        for i, pane in enumerate(panes):  # type all four prompts, then send them one after another
            await type_into(pilot, pane, f"Name color {i}")
        dash = app.main.query_one(Dashboard)
        most_decoding = 0

        async def sample() -> None:  # runs on the app's loop while the keys are pressed
            nonlocal most_decoding
            while True:
                most_decoding = max(most_decoding, sum(
                    p.state == "decoding" and p.meter is not None and p.meter.tokens > 0 for p in panes))
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        # Enter in each pane's input, back to back: pilot.press would wait for the whole screen to
        # go idle between keys, which takes seconds once replies stream on a loaded 2-core machine
        for pane in panes:
            pane.query_one(PromptInput).post_message(events.Key("enter", None))
        await wait_for(pilot, lambda: all(p.last_finish is not None and not p.busy for p in panes),
                       timeout=120, what="four replies")
        sampler.cancel()
        assert most_decoding == 4, "the four panes never streamed at the same time"
        assert dash.peak_batch > 1, "the dashboard never showed more than one sequence in the batch"
        # the four finished conversations stay warm in cached KV blocks (a block or more each
        # beyond the system prompt they share), and the dashboard says so
        kv_line = lambda: str(dash.query_one("#dash-kv").render())  # noqa: E731
        cached = lambda: re.search(r"KV 0/512 0%, (\d+) cached", kv_line())  # noqa: E731
        await wait_for(pilot, lambda: cached() is not None and int(cached().group(1)) >= 5,
                       timeout=10, what="the cached conversations on the dashboard")
        for pane in panes:
            assert pane.last_finish.reason in ("stop", "length")
            assert 0 < len(pane.last_finish.text)
            roles = [m.role for m in pane.history]
            assert roles == ["user", "assistant"]
            reply = pane.query(AssistantMessage).last()
            assert reply.source.strip() == pane.last_finish.text.strip()  # the tail was flushed
            assert "tok/s" in pane.border_subtitle and pane.border_subtitle.startswith("idle")
            stored = store.messages(pane.conversation.id)
            assert stored[-1].content == pane.last_finish.text
            assert stored[-1].meta["usage"]["completion_tokens"] <= 32


async def test_stop_cancels_one_pane_mid_stream(tui_engine, store):
    store.set_setting("default_max_tokens", "400")
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await pilot.press("ctrl+n")
        first, second = app.main.panes
        second.conversation.max_tokens = MAX_TOKENS
        await type_into(pilot, first, "Tell me a long story about a dragon")
        await type_into(pilot, second, "Say hi")
        for p in (first, second):  # Enter in both, back to back (see above)
            p.query_one(PromptInput).post_message(events.Key("enter", None))
        await wait_busy(lambda: first.meter is not None and first.meter.tokens >= 3, what="tokens")
        first.focus_input()
        await pilot.pause()
        app.post_message(events.Key("ctrl+s", None))  # as the terminal driver delivers it (no idle wait)
        await wait_for(pilot, lambda: not first.busy and not second.busy, timeout=60, what="both to end")
        assert first.last_finish.reason == "cancelled"
        assert first.meter.tokens < 400
        assert first.state == "idle (stopped)"
        assert second.last_finish.reason in ("stop", "length")
        # the partial reply is kept, as the server does (the screen stores what the pane posts)
        await wait_for(pilot, lambda: store.messages(first.conversation.id)[-1].role == "assistant",
                       timeout=10, what="the partial reply stored")
        assert store.messages(first.conversation.id)[-1].meta["reason"] == "cancelled"


async def test_restart_restores_conversations_and_layout(tui_engine, store, data_dir):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await pilot.press("ctrl+n", "ctrl+n")
        a, b, c = app.main.panes
        await type_and_send(pilot, b, "Hello there")
        await wait_for(pilot, lambda: b.last_finish is not None and not b.busy, what="the reply")
        ids = [p.conversation.id for p in app.main.panes]
        reply = b.last_finish.text
        await pilot.press("ctrl+q")

    store2 = Store.open()  # a second App instance on the same data dir
    app2 = make_app(tui_engine, store2)
    async with app2.run_test(size=SIZE) as pilot:
        await pilot.pause()
        panes = app2.main.panes
        assert [p.conversation.id for p in panes] == ids
        restored = panes[1]
        assert restored.title == "Hello there"
        assert [m.content for m in restored.history] == ["Hello there", reply]
        assert restored.query_one(UserMessage).text == "Hello there"
        assert restored.query_one(AssistantMessage).source == reply
        assert "tok/s" in restored.border_subtitle  # last reply's figures come back too
    store2.close()


async def test_theme_switch_persists(tui_engine, store):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        assert app.theme == "panechat-dark"
        assert {"panechat-dark", "panechat-light", "panechat-ember"} <= set(app.available_themes)
        app.theme = "panechat-light"  # what the palette's theme picker does
        await pilot.pause()
        assert not app.current_theme.dark
    assert store.get_setting("theme") == "panechat-light"
    app2 = make_app(tui_engine, store)
    async with app2.run_test(size=SIZE) as pilot:
        assert app2.theme == "panechat-light"


async def test_pane_keys_new_close_cycle_maximize(tui_engine, store):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main
        for _ in range(9):  # one past the limit: refused with a notice
            await pilot.press("ctrl+n")
        await pilot.pause()
        assert len(screen.panes) == 8
        grid = screen.query_one("PaneGrid")
        assert (grid.styles.grid_size_columns, grid.styles.grid_size_rows) == (4, 2)
        assert screen.active is screen.panes[-1]
        await pilot.press("tab")
        assert screen.active is screen.panes[0]
        await pilot.press("shift+tab")
        assert screen.active is screen.panes[-1]
        await pilot.press("ctrl+o")
        await pilot.pause()
        visible = [p for p in screen.panes if p.display and p.region.width > 0]
        assert visible == [screen.panes[-1]] and visible[0].region.width > 100
        await pilot.press("tab")  # cycling while maximized shows the next pane alone
        await pilot.pause()
        assert [p for p in screen.panes if p.region.width > 0] == [screen.panes[0]]
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert all(p.region.width > 0 for p in screen.panes)
        for _ in range(5):
            await pilot.press("ctrl+w")
        await pilot.pause()
        assert len(screen.panes) == 3
        assert (grid.styles.grid_size_columns, grid.styles.grid_size_rows) == (3, 1)
        assert [p.number for p in screen.panes] == [1, 2, 3]
        assert store.layout("local") == [p.conversation.id for p in screen.panes]


async def test_broadcast_settings_and_export(tui_engine, store, data_dir):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await pilot.press("ctrl+n")
        panes = app.main.panes
        # per-pane settings through the dialog
        panes[0].focus_input()
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, PaneSettingsScreen), what="settings")
        dialog = app.screen
        dialog.query_one("#max_tokens").value = "8"
        dialog.query_one("#seed").value = "42"
        dialog.query_one("#temperature").value = "0.5"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.main, what="the dialog to close")
        conv = store.get_conversation(panes[0].conversation.id)
        assert (conv.max_tokens, conv.seed, conv.temperature) == (8, 42, 0.5)
        # one prompt to every pane
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: isinstance(app.screen, BroadcastScreen), what="broadcast")
        await pilot.press(*"Count to three")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is app.main, what="the dialog to close")
        assert all(p.busy or p.last_finish for p in panes)  # every pane took the prompt
        await wait_for(pilot, lambda: all(p.last_finish and not p.busy for p in panes), timeout=90, what="replies")
        assert [p.history[0].content for p in panes] == ["Count to three"] * 2
        assert panes[0].last_finish.usage["completion_tokens"] <= 8
        # export the first pane to Markdown
        panes[0].focus_input()
        await pilot.press("f3")
        await pilot.pause()
        files = list((data_dir.parent / "exports").glob("*.md"))
        assert len(files) == 1
        text = files[0].read_text()
        assert "## User\n\nCount to three" in text and panes[0].last_finish.text.strip()[:20] in text


async def test_palette_lists_the_pane_commands(tui_engine, store):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE):
        titles = {c.title for c in app.get_system_commands(app.main)}
        assert {"New pane", "Close pane", "Next pane", "Previous pane", "Maximize / restore pane",
                "Stop generation", "Broadcast prompt", "Pane settings", "Export conversation to Markdown",
                "Theme"} <= titles
        # built from the bindings: each of the screen's own keys has its entry, key named
        helps = [c.help for c in app.get_system_commands(app.main)]
        for b in app.main.BINDINGS:
            if not b.action.startswith("app."):
                assert any(h.endswith(f"({b.key})") for h in helps), f"{b.key} is not in the palette"
        new = next(c for c in app.get_system_commands(app.main) if c.title == "New pane")
        await new.callback()
        assert len(app.main.panes) == 2


async def test_reply_keeps_position_when_reading_back(tui_engine, store):
    """Scrolled up while a reply streams, the view stays put; at the bottom it follows."""
    conv = store.new_conversation("long", max_tokens=24)
    for i in range(6):
        store.add_message(conv.id, "user", f"question {i}")
        store.add_message(conv.id, "assistant", "\n\n".join(f"paragraph {i}.{j}" for j in range(6)))
    store.save_layout("local", [conv.id])
    app = make_app(tui_engine, store)
    async with app.run_test(size=(100, 24)) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        transcript = pane.query_one("Transcript")
        await wait_for(pilot, lambda: transcript.max_scroll_y > 10, what="a scrollable history")
        assert transcript.scroll_y == transcript.max_scroll_y  # opens at the bottom
        await type_and_send(pilot, pane, "Say something")
        await wait_for(pilot, lambda: pane.meter is not None and pane.meter.tokens > 0, what="tokens")
        transcript.scroll_to(y=3, animate=False, immediate=True)  # the user scrolls up (releases the anchor)
        await wait_for(pilot, lambda: not pane.busy, timeout=60, what="the reply")
        await pilot.pause(0.3)
        assert transcript.scroll_y == 3, "the view jumped while reading back"
        transcript.scroll_to(y=transcript.max_scroll_y, animate=False, immediate=True)  # back down: follow again
        await type_and_send(pilot, pane, "Again")
        await wait_for(pilot, lambda: not pane.busy and len(pane.history) == 16, timeout=60, what="the reply")
        await pilot.pause(0.3)
        assert transcript.scroll_y == transcript.max_scroll_y


async def test_reply_text_is_selectable_and_copies(tui_engine, store):
    conv = store.new_conversation("copy me")
    store.add_message(conv.id, "user", "hi")
    store.add_message(conv.id, "assistant", "Copy this sentence.")
    store.save_layout("local", [conv.id])
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        pane = app.main.panes[0]
        await pilot.pause()
        assert app.focused is pane.query_one(PromptInput)  # the input keeps the focus
        paragraph = pane.query_one(AssistantMessage).query_one("MarkdownParagraph")
        paragraph.text_select_all()  # what a mouse drag over the reply does
        await pilot.pause()
        await pilot.press("ctrl+c")  # nothing selected in the input: the screen copies
        assert app.clipboard.strip() == "Copy this sentence."


async def test_closing_a_busy_pane_cancels_its_reply(tui_engine, store):
    store.set_setting("default_max_tokens", "400")
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await pilot.press("ctrl+n")
        busy = app.main.panes[1]
        await type_and_send(pilot, busy, "Tell me a long story")
        await wait_for(pilot, lambda: busy.meter is not None and busy.meter.tokens > 0, what="tokens")
        conv_id = busy.conversation.id
        await pilot.press("ctrl+w")
        await pilot.pause()
        assert len(app.main.panes) == 1
        await wait_for(pilot, lambda: not any(s.conversation == conv_id for s in tui_engine.stats().streams),
                       timeout=30, what="the engine to drop the stream")
        assert store.layout("local") == [app.main.panes[0].conversation.id]
        assert store.get_conversation(conv_id) is not None  # closed, not deleted: F4 reopens it


async def test_prompts_are_tokenized_off_the_event_loop(tui_engine, store, monkeypatch):
    """Rendering the chat template and tokenizing a pane's prompt run in a worker thread,
    never on the thread of the app's event loop (a long history takes milliseconds)."""
    lm, calls = tui_engine.lm, []

    def recorded(fn):
        def call(*args, **kwargs):
            calls.append((fn.__name__, threading.get_ident()))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(lm.template, "render", recorded(lm.template.render))
    monkeypatch.setattr(lm.tokenizer, "encode", recorded(lm.tokenizer.encode))
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        loop_thread = threading.get_ident()  # the test runs on the app's loop
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Hello")
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, what="the reply")
        assert pane.last_finish.reason in ("stop", "length")
    assert {name for name, _ in calls} == {"render", "encode"}
    assert [name for name, thread in calls if thread == loop_thread] == []

"""Widgets in tiny host apps: the prompt input, the pane grid, the dashboard, streamed
Markdown lists, and a pane on the real engine."""

from __future__ import annotations

import re

from textual.app import App
from textual.widgets import DataTable, Static

from panechat.app.clients.base import BackendInfo, ChatBackend
from panechat.app.clients.local import LocalBackend
from panechat.app.store import Conversation
from panechat.app.tui.widgets.dashboard import Dashboard, sparkline, state_words
from panechat.app.tui.widgets.pane import ChatPane
from panechat.app.tui.widgets.pane_grid import GRID_SHAPES, PaneGrid
from panechat.app.tui.widgets.prompt_input import PromptInput
from panechat.engine.serving.stats import EngineStats, StreamState, StreamStats

from .conftest import MAX_TOKENS, wait_for


class InputHost(App):
    def __init__(self):
        super().__init__()
        self.sent: list[str] = []

    def compose(self):
        yield PromptInput()

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        self.sent.append(event.text)


async def test_enter_sends_and_ctrl_j_inserts_a_newline():
    app = InputHost()
    async with app.run_test() as pilot:
        box = app.query_one(PromptInput)
        box.focus()
        await pilot.press("h", "i", "ctrl+j", "y", "o")
        assert box.text == "hi\nyo" and app.sent == []
        await pilot.press("enter")
        await pilot.pause()
        assert app.sent == ["hi\nyo"]
        assert box.text == ""


async def test_blank_input_is_not_sent():
    app = InputHost()
    async with app.run_test() as pilot:
        app.query_one(PromptInput).focus()
        await pilot.press("space", "ctrl+j", "enter")
        await pilot.pause()
        assert app.sent == []


class GridHost(App):
    def compose(self):
        with PaneGrid():
            for i in range(8):
                yield Static(str(i))


async def test_a_removed_input_can_still_be_painted():
    """Textual 8.2 may paint a TextArea in the frame after it was removed, when its
    component styles are already cleared (textual#6528): closing a busy pane hit this."""
    app = InputHost()
    async with app.run_test() as pilot:
        box = app.query_one(PromptInput)
        await pilot.pause()
        lines = box.render_lines(box.region.reset_offset)
        assert len(lines) == box.region.height
        await box.remove()
        lines = box.render_lines(box.region.reset_offset)  # raised KeyError before the guard
        assert len(lines) == box.region.height


async def test_grid_shapes_reflow():
    app = GridHost()
    async with app.run_test(size=(120, 40)) as pilot:
        grid = app.query_one(PaneGrid)
        for n, (cols, rows) in GRID_SHAPES.items():
            grid.reflow(n)
            await pilot.pause()
            assert (grid.styles.grid_size_columns, grid.styles.grid_size_rows) == (cols, rows)
        grid.reflow(4, zoomed=True)
        assert (grid.styles.grid_size_columns, grid.styles.grid_size_rows) == (1, 1)
        assert grid.has_class("-zoomed")


def test_sparkline_scales_to_vmax_and_width():
    assert sparkline([0, 0, 0, 0], 4, 4) == "    "
    assert sparkline([0, 1, 2, 4], 4, 4) == " ▂▄█"
    assert sparkline([0.01], 1, 100) == "▁"  # anything above zero shows
    assert len(sparkline(list(range(240)), 30, 240)) == 30
    assert sparkline([4] * 240, 10, 4) == "█" * 10


class StatsBackend(ChatBackend):
    """A backend whose stats are whatever the test sets (the dashboard samples it 4x a second)."""

    profile = "test"

    def __init__(self):
        self.info = BackendInfo(kind="remote", url="ws://h:1")
        self.current: EngineStats | None = None

    async def start(self):
        return self.info

    def stream(self, conversation, messages, params, system=""):
        raise NotImplementedError

    def stats(self):
        return self.current


class DashboardHost(App):
    def __init__(self, backend):
        super().__init__()
        self.backend = backend

    def compose(self):
        yield Dashboard(self.backend)


def _text(dash, widget_id: str) -> str:
    return str(dash.query_one(f"#{widget_id}").render())


async def test_dashboard_words_the_typed_stats_it_is_given():
    backend = StatsBackend()
    app = DashboardHost(backend)
    async with app.run_test(size=(60, 30)) as pilot:
        dash = app.query_one(Dashboard)
        dash.set_status("connecting…")
        dash.set_share("sharing: panechat --connect ws://h:2")
        assert _text(dash, "dash-model") == "connecting…" and "ws://h:2" in _text(dash, "dash-share")
        assert _text(dash, "dash-batch") == "batch -"  # no stats yet
        stats = EngineStats(
            batch_now=2, batch_max=4, queue_depth=1, kv_in_use=3, kv_resident=4, kv_total=8, terminals=2,
            streams=(StreamStats("r1", "conv-a", StreamState.PREFILLING, prefill_done=42, prefill_total=100),
                     StreamStats("r2", "conv-bbbbbbbb", StreamState.DECODING, tokens=12, tok_s=15.25),
                     StreamStats("r3", "conv-a2", StreamState.QUEUED, prefill_total=9)))
        backend.current = stats
        dash.set_pane_names({"conv-a": "1 Sea haiku"})
        dash.show_stats(stats)
        await pilot.pause()
        assert _text(dash, "dash-batch") == "batch 2/4  queue 1"
        assert _text(dash, "dash-kv") == "terminals 2  KV 3/8 38%, 1 cached"
        table = dash.query_one(DataTable)
        rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
        assert rows == [["1 Sea haiku", "prefill 42%", "0", "0.0"], ["other bbbbbb", "decoding", "12", "15.2"],
                        ["other onv-a2", "queued", "0", "0.0"]]
        dash.set_pane_names({"conv-a": "1 Sea haiku", "conv-a2": "2 Tree"})  # shown without a new sample
        assert str(table.get_row_at(2)[0]) == "2 Tree"


async def test_the_dashboard_names_whose_streams_the_others_are():
    """A stream the server attributes to a --tokens name shows it, not "other"."""
    backend = StatsBackend()
    app = DashboardHost(backend)
    async with app.run_test(size=(60, 30)) as pilot:
        dash = app.query_one(Dashboard)
        stats = EngineStats(batch_now=1, batch_max=4, streams=(
            StreamStats("r2", "conv-22fb6f", StreamState.DECODING, tokens=3, client="alice"),))
        backend.current = stats
        dash.show_stats(stats)
        await pilot.pause()
        table = dash.query_one(DataTable)
        assert str(table.get_row_at(0)[0]) == "alice 22fb6f"


async def test_dashboard_names_the_chatml_fallback_of_a_base_model(tmp_path, tui_engine):
    """A model file without a chat template (a base model) chats in ChatML, and the
    dashboard's model line says so; the default model, with its own template, shows none."""
    from panechat.app.clients.base import Finished, GenParams
    from panechat.engine.serving.engine import Engine, EngineConfig
    from panechat.engine.model.loader import load_model

    from ..tiny_gguf import write_tiny_gguf

    path = tmp_path / "tiny-base.gguf"
    write_tiny_gguf(path, "llama", chat_template=False)
    base = Engine(load_model(path, "numpy", max_positions=128),
                  EngineConfig(max_concurrent=1, kv_sessions=1, ctx_size=128, verify_invariance=False)).start()
    try:
        shown = {}
        for engine in (base, tui_engine):
            backend = LocalBackend(engine)
            await backend.start()
            app = DashboardHost(backend)
            async with app.run_test(size=(60, 30)) as pilot:
                await pilot.pause()
                shown[engine.lm.name] = _text(app.query_one(Dashboard), "dash-model")
                backend_line = _text(app.query_one(Dashboard), "dash-backend")
                # the local engine's line ends with the start-up time, as `run` and `serve` print it
                assert re.fullmatch(r"local engine · numpy · ready in \d+\.\d s", backend_line), backend_line
                assert float(backend_line.rsplit(" ", 2)[1]) == round(backend.info.ready_s, 1) > 0
        # the model line names the model as `panechat models` does (the file name without .gguf)
        assert shown["tiny-base.gguf"] == "tiny-base\ntemplate: chatml (fallback)"
        assert shown[tui_engine.lm.name] == tui_engine.lm.name.removesuffix(".gguf")
        events = [ev async for ev in LocalBackend(base).stream("c1", [{"role": "user", "content": "hi"}],
                                                               GenParams(max_tokens=4))]
        fin = events[-1]
        assert isinstance(fin, Finished) and fin.reason in ("stop", "length"), fin
        chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert fin.usage["prompt_tokens"] == len(base.lm.tokenizer.encode(chatml, parse_special=True))
    finally:
        base.stop()


def test_stream_states_are_worded_by_the_dashboard():
    words = [state_words(StreamStats("r", "c", state, prefill_done=7, prefill_total=8)) for state in StreamState]
    assert words == ["waiting", "queued", "prefill 87%", "decoding"]


class MarkdownHost(App):
    def compose(self):
        from panechat.app.tui.widgets.transcript import AssistantMessage

        yield AssistantMessage("", id="streamed")
        yield AssistantMessage("", id="whole")


def _blocks_of(widget) -> list[tuple[str, str]]:
    """The widget tree under a Markdown widget: kinds, bullets and paragraph text."""
    out = []
    for w in widget.walk_children():
        text = getattr(w, "symbol", None) or getattr(getattr(w, "_content", None), "plain", "")
        out.append((type(w).__name__.replace("Growing", "Markdown"), str(text)))
    return out


async def test_streamed_lists_render_like_a_full_parse():
    """Growing lists update in place; the result matches parsing the whole reply at once."""
    from textual.widgets import Markdown

    reply = ("Here:\n\n1. one\n2. two\n3. three\n4. four\n5. five\n6. six\n7. seven\n8. eight\n9. nine\n"
             "10. ten\n\n- x\n- y\n\nThen:\n\n- alpha beta\n- with **bold** words\n  - nested item here\n"
             "- the last item grows token by token")
    app = MarkdownHost()
    async with app.run_test(size=(60, 60)) as pilot:
        streamed, whole = app.query_one("#streamed"), app.query_one("#whole")
        stream = Markdown.get_stream(streamed)
        for i in range(0, len(reply), 2):  # a few characters at a time, like tokens
            await stream.write(reply[i:i + 2])
            await pilot.pause()
        await stream.stop()
        await whole.update(reply)
        await pilot.pause()
        assert streamed.source == reply
        assert _blocks_of(streamed) == _blocks_of(whole)
        assert ("MarkdownBullet", " 10. ") in _blocks_of(streamed)


async def test_a_growing_list_keeps_the_items_it_shows():
    """Appending an item leaves the rows already shown mounted (same widgets), until the
    numbers get wider (9 -> 10), when every row is rebuilt with wider bullets."""
    from textual.containers import Horizontal
    from textual.widgets import Markdown

    from panechat.app.tui.widgets.transcript import GrowingOrderedList

    app = MarkdownHost()
    async with app.run_test(size=(60, 40)) as pilot:
        streamed = app.query_one("#streamed")
        stream = Markdown.get_stream(streamed)

        async def write(text: str) -> list:
            await stream.write(text)
            await pilot.pause()
            return list(streamed.query_one(GrowingOrderedList).query_children(Horizontal))

        rows = await write("1. one\n2. two\n")
        grown = await write("3. three\n4. four\n")
        assert len(grown) == 4 and grown[0] is rows[0]
        wider = await write("".join(f"{i}. item\n" for i in range(5, 11)))
        assert len(wider) == 10 and wider[0] is not rows[0]
        await stream.stop()


class PaneHost(App):
    """One ChatPane and no store: the host records what the pane posts up."""

    def __init__(self, pane: ChatPane):
        super().__init__()
        self.pane = pane
        self.posted: list[tuple] = []

    def compose(self):
        yield self.pane

    def on_chat_pane_conversation_changed(self, event: ChatPane.ConversationChanged) -> None:
        self.posted.append(("renamed", event.pane.conversation.title))

    def on_chat_pane_message_added(self, event: ChatPane.MessageAdded) -> None:
        self.posted.append(("added", event.message.role, event.message.content))

    def on_chat_pane_reply_finished(self, event: ChatPane.ReplyFinished) -> None:
        self.posted.append(("finished", event.finished.reason))


async def test_a_pane_reports_its_turns_as_messages(tui_engine):
    """A pane keeps no store: the rename, the prompt and the reply go up as messages, in order."""
    pane = ChatPane(Conversation("c-pane", "New chat", max_tokens=MAX_TOKENS), [], LocalBackend(tui_engine))
    app = PaneHost(pane)
    async with app.run_test(size=(80, 24)) as pilot:
        assert pane.send("Hello there\nsecond line")
        await wait_for(pilot, lambda: app.posted and app.posted[-1][0] == "finished", what="the reply")
        reply = pane.last_finish.text
        assert reply
        assert app.posted == [("renamed", "Hello there"), ("added", "user", "Hello there\nsecond line"),
                              ("added", "assistant", reply), ("finished", pane.last_finish.reason)]
        assert [(m.role, m.content) for m in pane.history] == [("user", "Hello there\nsecond line"),
                                                               ("assistant", reply)]

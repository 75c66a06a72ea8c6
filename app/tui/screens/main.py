"""The main screen: the pane grid, the dashboard beside it, the footer with the keys."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Iterator

from textual import work
from textual.app import SystemCommand
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer

from ...clients.base import ChatBackend
from ...store import Store
from ..branches import from_store
from ..commands import Command, binding_commands
from ..widgets.dashboard import Dashboard
from ..widgets.pane import FLUSH_HZ, ChatPane
from ..widgets.pane_grid import MAX_PANES, PaneGrid
from .broadcast import BroadcastScreen
from .conversations import ConversationsScreen
from .model_picker import ModelPickerScreen
from .pane_settings import PaneSettings, PaneSettingsScreen

EXPORT_DIR_ENV = "PANECHAT_EXPORT_DIR"
NARROW_COLUMNS = 120  # under this width the dashboard is one line under the panes (F6 toggles)
WIDE_COLUMNS = 150  # from this width the dashboard panel is wider (longer names)
UI_CPU_TARGET = 0.15  # share of one core the UI thread may use while replies stream
MAX_FLUSH_S = 1.0  # the slowest the panes refresh under load
PANES, REPLIES, DIALOGS, APP = "Panes", "Replies", "Dialogs", "App"  # the F1 help's groups


class MainScreen(Screen):
    """Owns the panes (their order is the grid order) and the store: saves the layout on
    every change, and what the panes report (their turns, titles, a server's history)."""

    BINDINGS = [  # the Commands are the command palette's entries too (app.get_system_commands)
        Command("ctrl+n", "new_pane", "New", priority=True, title="New pane",
                tooltip="Open a new conversation pane", group_name=PANES),
        Command("ctrl+w", "close_pane", "Close", priority=True, title="Close pane", tooltip="Close the active pane",
                group_name=PANES),
        Command("tab", "next_pane", "Next", title="Next pane", tooltip="Focus the next pane", show=False,
                group_name=PANES),
        Command("shift+tab", "previous_pane", "Prev", title="Previous pane", tooltip="Focus the previous pane",
                show=False, group_name=PANES),
        Command("ctrl+o", "toggle_maximize", "Max", priority=True, title="Maximize / restore pane",
                tooltip="Show the active pane alone, or the grid again", group_name=PANES),
        Command("ctrl+s", "stop", "Stop", priority=True, title="Stop generation",
                tooltip="Stop the active pane's reply", group_name=REPLIES),
        # not in the footer: there F2-F5 and ctrl+q fit 80 columns (F1 and the palette list it)
        Command("ctrl+t", "broadcast", "All", priority=True, title="Broadcast prompt", show=False,
                tooltip="Send the same prompt to every pane", group_name=REPLIES),
        Command("f2", "settings", "Settings", title="Pane settings",
                tooltip="System prompt, temperature, max tokens, seed, top p/k, min p, stop, penalties",
                group_name=DIALOGS),
        Command("f3", "export", "Export", title="Export conversation to Markdown",
                tooltip="Write the active pane's conversation to a .md file", group_name=DIALOGS),
        Command("f4", "open_conversation", "Open", title="Open conversation",
                tooltip="Search, preview, open or delete stored conversations", group_name=DIALOGS),
        Command("f5", "pick_model", "Model", title="Choose model",
                tooltip="Open a new pane on a model (or put the empty active pane on it)", group_name=DIALOGS),
        Command("f7", "take_over", "Take", priority=True, title="Take over conversation", show=False,
                tooltip="Hold the active read-only pane's conversation here (the other terminal follows it)",
                group_name=REPLIES),
        Command("f6", "toggle_dashboard", "Dash", priority=True, show=False, title="Dashboard: panel or line",
                tooltip="Show the dashboard as a panel beside the panes, or as one line under them",
                group_name=APP),
    ]

    def __init__(self, backend: ChatBackend, store: Store, **kwargs):
        super().__init__(**kwargs)
        self.backend = backend
        self.store = store
        self.active: ChatPane | None = None
        self.zoomed = False
        self.dashboard_line: bool | None = None  # F6's choice; None: by the width (NARROW_COLUMNS)
        self.elsewhere: list[str] = []  # restored conversations another terminal holds: kept in the layout

    def compose(self):
        with Horizontal():
            yield PaneGrid()
            yield Dashboard(self.backend)
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        panes = []
        for cid in self.store.layout(self.backend.profile)[:MAX_PANES]:
            conv = self.store.get_conversation(cid)
            if conv is not None:
                panes.append(self._make_pane(conv))
                panes[-1].restored = True
        if not panes:
            panes.append(self._make_pane(self._new_conversation()))
        await self.query_one(PaneGrid).mount_all(panes)
        self._relayout()
        panes[0].focus_input()
        # one clock for every pane's flush, so 8 streaming panes cost one layout pass per tick
        self.flush_interval = 1 / FLUSH_HZ
        self._mark = (time.perf_counter(), time.thread_time())
        self.set_timer(self.flush_interval, self._flush_panes)

    async def _flush_panes(self) -> None:
        """Flush every streaming pane, then pick the next tick: slower while the UI thread
        uses more than UI_CPU_TARGET of a core (Markdown re-layout grows with the replies),
        back to FLUSH_HZ when it is cheap again. Finished replies always flush their tail."""
        busy = [p for p in self.panes if p.busy]
        if busy:
            with self.app.batch_update():
                for pane in busy:
                    await pane.flush()
        now, cpu = time.perf_counter(), time.thread_time()
        share = (cpu - self._mark[1]) / max(1e-3, now - self._mark[0])
        self._mark = (now, cpu)
        if share > UI_CPU_TARGET:
            self.flush_interval = min(MAX_FLUSH_S, self.flush_interval * 1.5)
        elif share < UI_CPU_TARGET / 2:
            self.flush_interval = max(1 / FLUSH_HZ, self.flush_interval / 1.5)
        self.set_timer(self.flush_interval, self._flush_panes)

    # -- helpers ---------------------------------------------------------------------------
    @property
    def panes(self) -> list[ChatPane]:
        return list(self.query_one(PaneGrid).query_children(ChatPane))

    def _new_conversation(self, model: str = ""):
        """A new conversation with the stored defaults (settings `default_max_tokens`,
        `default_temperature`, `default_system`) on `model` ('' = the default model)."""
        st = self.store.get_setting
        return self.store.new_conversation(
            system=st("default_system", ""), temperature=float(st("default_temperature", "0") or 0),
            max_tokens=int(st("default_max_tokens", "512") or 512), model=model)

    def _make_pane(self, conv) -> ChatPane:
        return ChatPane(conv, self.store.messages(conv.id), self.backend,
                        ready=getattr(self.app, "backend_ready", None), ticker=False,
                        branches=from_store(self.store.branches(conv.id)))

    def on_resize(self) -> None:
        self._fit_width()

    def _fit_width(self) -> None:
        """The dashboard as a panel (wider on a wide screen) or, on a narrow one, a line."""
        width = self.size.width
        line = width < NARROW_COLUMNS if self.dashboard_line is None else self.dashboard_line
        self.set_class(line, "-narrow")
        dash = self.query_one(Dashboard)
        dash.set_class(line, "-line")
        dash.set_class(width >= WIDE_COLUMNS, "-wide")
        # the footer's palette entry would push F2-F5 off a narrow screen (ctrl+p still works)
        self.query_one(Footer).show_command_palette = width >= NARROW_COLUMNS

    def action_toggle_dashboard(self) -> None:
        self.dashboard_line = not self.query_one(Dashboard).has_class("-line")
        self._fit_width()

    def _relayout(self) -> None:
        panes = self.panes
        for i, p in enumerate(panes, start=1):
            if p.number != i:
                p.number = i
                p.refresh_title()
        if self.zoomed and not any(p.has_class("-zoomed") for p in panes):
            self.zoomed = False
        self.query_one(PaneGrid).reflow(len(panes), self.zoomed)
        shown = [p.conversation.id for p in panes]
        self.store.save_layout(self.backend.profile, shown + [c for c in self.elsewhere if c not in shown])
        self.refresh_names()

    def refresh_names(self) -> None:
        """Tell the dashboard which conversation ids are our panes (data down)."""
        self.query_one(Dashboard).set_pane_names({p.conversation.id: f"{p.number} {p.title}" for p in self.panes})

    def _active(self) -> ChatPane | None:
        """The pane holding the focus (else the last one that did, else the first)."""
        node = self.focused
        while node is not None and not isinstance(node, ChatPane):
            node = node.parent
        if node is not None:
            self.active = node
            return node
        panes = self.panes
        if self.active in panes:
            return self.active
        return panes[0] if panes else None

    def _focus(self, pane: ChatPane) -> None:
        self.active = pane
        if self.zoomed:
            for p in self.panes:
                p.set_class(p is pane, "-zoomed")
        pane.focus_input()

    # -- messages from panes (the panes never touch the store) -----------------------------
    def on_chat_pane_activated(self, event: ChatPane.Activated) -> None:
        self.active = event.pane

    def on_chat_pane_message_added(self, event: ChatPane.MessageAdded) -> None:
        m = event.message
        m.id = self.store.add_message(event.pane.conversation.id, m.role, m.content, m.meta).id

    def on_chat_pane_message_withdrawn(self, event: ChatPane.MessageWithdrawn) -> None:
        if event.message.id is not None:
            self.store.delete_message(event.message.id)

    def keep_partial_replies(self) -> None:
        """Store every reply still streaming, marked cut off (the app is quitting: the
        panes' messages would not be handled any more)."""
        for pane in self.panes:
            message = pane.cut_off()
            if message is not None:
                self.store.add_message(pane.conversation.id, message.role, message.content, message.meta)

    def on_chat_pane_conversation_changed(self, event: ChatPane.ConversationChanged) -> None:
        self.store.save_conversation(event.pane.conversation)
        self.refresh_names()  # the dashboard lists the new title during the first reply already

    def on_chat_pane_history_replaced(self, event: ChatPane.HistoryReplaced) -> None:
        self.store.replace_messages(event.pane.conversation.id, event.messages)

    def on_chat_pane_history_rewritten(self, event: ChatPane.HistoryRewritten) -> None:
        pane = event.pane
        self.store.replace_messages(pane.conversation.id, pane.history)
        self.store.save_branches(pane.conversation.id, pane.branches)

    def on_chat_pane_reply_finished(self, event: ChatPane.ReplyFinished) -> None:
        self.refresh_names()

    async def on_chat_pane_held_elsewhere(self, event: ChatPane.HeldElsewhere) -> None:
        """Another live terminal holds the pane's conversation: a pane restored at start
        gives it up (this terminal opens its own); one opened on purpose follows it read-only."""
        pane, title = event.pane, event.pane.conversation.title
        if not event.restored:
            self.notify(f"pane {pane.number}: {title!r} is open in terminal {event.holder}: read-only here, "
                        "following its replies; F7 takes it over", severity="warning", timeout=8)
            return
        self.elsewhere.append(pane.conversation.id)
        self.notify(f"{title!r} is open in terminal {event.holder}; not restored here (F4 opens it read-only)",
                    timeout=8)
        await self.backend.release(pane.conversation.id)
        focused = pane is self._active()
        if len(self.panes) == 1:
            await self.query_one(PaneGrid).mount(self._make_pane(self._new_conversation()))
        await pane.remove()
        self._relayout()
        if focused:
            self._focus(self.panes[0])

    # -- actions (keys and command palette) ----------------------------------------------
    def palette_commands(self) -> Iterator[SystemCommand]:
        """The command palette's entries for this screen: every Command binding, then the
        one action that has no key."""
        yield from binding_commands(self)
        pane = self._active()
        if pane is not None:  # the message actions: edit, delete, regenerate, copy, branches
            yield from binding_commands(pane)

    async def action_new_pane(self, conversation_id: str | None = None) -> ChatPane | None:
        if len(self.panes) >= MAX_PANES:
            self.notify(f"at most {MAX_PANES} panes; close one first (ctrl+w)", severity="warning")
            return None
        conv = self.store.get_conversation(conversation_id) if conversation_id else None
        pane = self._make_pane(conv or self._new_conversation())
        if self.zoomed:
            self.zoomed = False
            for p in self.panes:
                p.remove_class("-zoomed")
        await self.query_one(PaneGrid).mount(pane)
        self._relayout()
        self._focus(pane)
        return pane

    async def action_close_pane(self) -> None:
        pane = self._active()
        if pane is None:
            return
        panes = self.panes
        if len(panes) == 1 and not pane.history and not pane.busy:
            return  # the last pane is already an empty one
        idx = panes.index(pane)
        pane.stop()
        self.run_worker(self.backend.release(pane.conversation.id), group="release")
        if not pane.history:
            self.store.delete_conversation(pane.conversation.id)
        await pane.remove()
        if len(panes) == 1:
            await self.query_one(PaneGrid).mount(self._make_pane(self._new_conversation()))
        self._relayout()
        rest = self.panes
        self._focus(rest[min(idx, len(rest) - 1)])

    def action_next_pane(self) -> None:
        self._step(+1)

    def action_previous_pane(self) -> None:
        self._step(-1)

    def _step(self, delta: int) -> None:
        panes = self.panes
        cur = self._active()
        if not panes or cur is None:
            return
        self._focus(panes[(panes.index(cur) + delta) % len(panes)])

    def action_toggle_maximize(self) -> None:
        pane = self._active()
        if pane is None:
            return
        self.zoomed = not self.zoomed
        for p in self.panes:
            p.set_class(self.zoomed and p is pane, "-zoomed")
        self.query_one(PaneGrid).reflow(len(self.panes), self.zoomed)
        pane.focus_input()

    def action_take_over(self) -> None:
        pane = self._active()
        if pane is not None and not pane.take_over():
            self.notify(f"pane {pane.number} already holds its conversation")

    def action_stop(self) -> None:
        pane = self._active()
        if pane is not None and pane.busy:
            pane.stop()

    def action_broadcast(self) -> None:
        def send_all(text: str | None) -> None:
            if not text:
                return
            sent = sum(p.send(text) for p in self.panes)
            if sent < len(self.panes):
                self.notify(f"sent to {sent} of {len(self.panes)} panes (the others are still replying)")

        self.app.push_screen(BroadcastScreen(len(self.panes)), send_all)

    def action_settings(self) -> None:
        pane = self._active()
        if pane is None:
            return

        def apply(result: PaneSettings | None) -> None:
            if result is not None:
                pane.apply_settings(result.title, result.system, result.temperature, result.max_tokens, result.seed,
                                    result.json_output, result.sampling)
                self.store.save_conversation(pane.conversation)
                self.refresh_names()

        self.app.push_screen(PaneSettingsScreen(pane.conversation), apply)

    def action_export(self) -> Path | None:
        pane = self._active()
        if pane is None:
            return None
        folder = Path(os.environ.get(EXPORT_DIR_ENV) or Path.cwd())
        slug = re.sub(r"[^A-Za-z0-9]+", "-", pane.title).strip("-").lower()[:40] or "conversation"
        path = folder / f"{slug}-{pane.conversation.id[2:8]}.md"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(pane.transcript_markdown(), encoding="utf-8")
        except OSError as e:
            self.notify(f"export failed: {e}", severity="error")
            return None
        self.notify(f"exported to {path}", title="export")
        return path

    def action_open_conversation(self) -> None:
        shown = {p.conversation.id for p in self.panes}
        convs = [c for c in self.store.list_conversations() if c.id not in shown]

        async def open_it(conv_id: str | None) -> None:
            if conv_id:
                await self.action_new_pane(conv_id)

        self.app.push_screen(ConversationsScreen(convs, store=self.store, exclude=shown,
                                                 default_model=self.backend.info.model), open_it)

    @work(exclusive=True, group="model-picker")
    async def action_pick_model(self) -> None:
        """The model picker; the chosen model goes to the active pane if it is empty and
        idle, else to a new pane."""
        try:
            choices = await self.backend.model_choices()
        except Exception as e:  # noqa: BLE001 - a listing problem is a notice, not a crash
            self.notify(f"cannot list the models: {e}", severity="error")
            return
        name = await self.app.push_screen_wait(ModelPickerScreen(choices))
        if name:
            await self.open_on_model(name)

    async def open_on_model(self, name: str) -> ChatPane | None:
        """Put the active pane on model `name` when it has no turns and is idle, else open
        a new pane on it; the conversation keeps the model (the store reopens it on it)."""
        pane = self._active()
        if pane is not None and not pane.history and not pane.busy:
            pane.set_model(name)
            self.store.save_conversation(pane.conversation)
            self.refresh_names()
            pane.focus_input()
            return pane
        conv = self._new_conversation(model=name)
        pane = await self.action_new_pane(conv.id)
        if pane is None:
            self.store.delete_conversation(conv.id)
        return pane

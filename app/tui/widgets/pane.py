"""A conversation pane: transcript, prompt input, and a live status line in its border.

Tokens arrive on the pane's generation worker; text is buffered and flushed to the
reply's MarkdownStream at most `FLUSH_HZ` times a second (one Markdown append per flush,
which re-parses only the last block), and the tail is always flushed at the finish.
"""

from __future__ import annotations

import asyncio
import re
import time

from textual import work
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

from ...store import Conversation, Message as StoredMessage, conversation_markdown
from ...clients.base import (ChatBackend, ChatStream, Delta, Finished, Followed, GenParams, HolderChanged, Prefill,
                             Queued, Reconnected, StreamMeter)
from .. import branches as br
from ..commands import Command
from ..json_output import response_format_of
from ..sampling_fields import DEFAULTS as SAMPLING_DEFAULTS
from ..perf import UI_COST
from .prompt_input import PromptInput
from .transcript import CUT_OFF_MARK, AssistantMessage, BranchLabel, ContextNotice, Transcript, UserMessage

_CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)

FLUSH_HZ = 10
BASE_NOTE = "base model: completes text"  # the status of a pane on a model without a chat template


class ChatPane(Vertical):
    """One conversation. Data comes down as constructor arguments and method calls; what
    changes goes up as messages (the screen keeps the store): `MessageAdded`,
    `MessageWithdrawn` (a refused prompt), `ConversationChanged`, `HistoryReplaced`, then
    `ReplyFinished` when a reply ends, `HistoryRewritten` after an edit, a delete, a
    regenerate or a branch flip. `cut_off()` hands over a reply in flight at quit.

    Message actions work on the selected message (ctrl+up/down), else on the last one of
    the kind they need; an edit or a regenerate keeps the turns it replaces as a branch
    (app/tui/branches.py), which alt+left/right flips back."""

    BINDINGS = [
        Command("ctrl+r", "regenerate", "Regen", show=False, title="Regenerate reply",
                tooltip="Answer the last prompt again; the earlier reply stays as a branch"),
        Command("ctrl+g", "edit", "Edit", show=False, title="Edit prompt",
                tooltip="Put the selected (or last) prompt in the input; Enter resends it"),
        Command("f8", "delete_message", "Del", show=False, title="Delete message",
                tooltip="Delete the selected (or last) message"),
        Command("ctrl+l", "copy_reply", "Copy", show=False, title="Copy reply",
                tooltip="Copy the selected (or last) reply to the clipboard"),
        Command("ctrl+b", "copy_code", "Code", show=False, title="Copy code block",
                tooltip="Copy the last code block of the selected (or last) reply"),
        Command("ctrl+up", "select(-1)", "Select", show=False, title="Select previous message",
                tooltip="Move the message selection up"),
        Command("ctrl+down", "select(1)", "Select", show=False, title="Select next message",
                tooltip="Move the message selection down"),
        Command("alt+left", "flip(-1)", "Branch", show=False, title="Previous branch",
                tooltip="Show the previous branch of the selected (or last) branch point"),
        Command("alt+right", "flip(1)", "Branch", show=False, title="Next branch",
                tooltip="Show the next branch of the selected (or last) branch point"),
        Binding("escape", "unselect", "Unselect", show=False),
    ]

    DEFAULT_CSS = """
    ChatPane {
        border: round $surface-lighten-2;
        border-title-color: $text-muted;
        border-subtitle-color: $text-muted;
        border-subtitle-align: right;
        height: 1fr;
        width: 1fr;
        padding: 0 0 0 1;
    }
    ChatPane:focus-within {
        border: round $primary;
        border-title-color: $text;
        border-title-style: bold;
        border-subtitle-color: $text;
    }
    """

    class ReplyFinished(Message):
        """A generation in this pane ended (any reason)."""

        def __init__(self, pane: "ChatPane", finished: Finished):
            super().__init__()
            self.pane = pane
            self.finished = finished

    class MessageAdded(Message):
        """A turn joined the pane's history: the prompt when it is sent, the reply (with its
        finish reason, usage and timings in `message.meta`) when it ends."""

        def __init__(self, pane: "ChatPane", message: StoredMessage):
            super().__init__()
            self.pane = pane
            self.message = message

    class ConversationChanged(Message):
        """The pane renamed its conversation (a new chat takes its first prompt's first line)."""

        def __init__(self, pane: "ChatPane"):
            super().__init__()
            self.pane = pane

    class MessageWithdrawn(Message):
        """The backend refused the prompt `message` before it started (too long for the
        context, queue full, ...): it left the history, and its text is back in the input."""

        def __init__(self, pane: "ChatPane", message: StoredMessage):
            super().__init__()
            self.pane = pane
            self.message = message

    class HistoryReplaced(Message):
        """The pane's history is now `messages`, the server's copy of the conversation."""

        def __init__(self, pane: "ChatPane", messages: list[StoredMessage]):
            super().__init__()
            self.pane = pane
            self.messages = messages

    class HeldElsewhere(Message):
        """The server says another live terminal (`holder`) holds this pane's conversation:
        the pane is read-only, following it. `restored`: at the pane's first open (the
        screen restored it from the layout)."""

        def __init__(self, pane: "ChatPane", holder: str, restored: bool):
            super().__init__()
            self.pane = pane
            self.holder = holder
            self.restored = restored

    class Remote(Message):
        """A Followed, HolderChanged or Reconnected event from the backend, brought onto the pane."""

        def __init__(self, event: Followed | HolderChanged | Reconnected):
            super().__init__()
            self.event = event

    class HistoryRewritten(Message):
        """The pane's history and branch points changed other than by a new turn: the
        store takes `pane.history` and `pane.branches` as they are."""

        def __init__(self, pane: "ChatPane"):
            super().__init__()
            self.pane = pane

    class Activated(Message):
        """Focus moved into this pane."""

        def __init__(self, pane: "ChatPane"):
            super().__init__()
            self.pane = pane

    def __init__(self, conversation: Conversation, history: list[StoredMessage], backend: ChatBackend,
                 *, ready: asyncio.Event | None = None, number: int = 1, ticker: bool = True,
                 branches: br.Branches | None = None, **kwargs):
        super().__init__(**kwargs)
        self.conversation = conversation
        self.history = list(history)
        self.branches: br.Branches = dict(branches or {})
        self.selected: int | None = None  # the message index the actions work on (None: the last)
        self._auto_title: str | None = None  # the title the first prompt gave (a refused one gives it back)
        self._editing: int | None = None  # the prompt being edited: the next send replaces it
        self._regenerating = False  # the reply in flight answers a prompt already in the history
        self.backend = backend
        self.ready = ready
        self.number = number
        self.ticker = ticker  # False: the screen calls flush() for all panes on one clock
        self.state = "idle"
        self.meter: StreamMeter | None = None
        self.last_metrics: tuple[str, ...] = ()
        self.last_finish: Finished | None = None
        self.stream: ChatStream | None = None
        self._pending: list[str] = []
        self._md_stream: MarkdownStream | None = None
        self._reply: AssistantMessage | None = None
        self._status = ""
        self._stop_requested = False
        self._response_format: dict | None = None  # of the turn being sent (JSON output setting)
        self._received: list[str] = []  # the reply's text so far (kept if the app quits mid-reply)
        self._queued = False  # the backend accepted the prompt (a refusal comes before this)
        self._cut = False  # cut_off() stored the reply in flight
        self.prompt_tokens: int | None = None  # the current (or last) prompt's tokens
        self.context_used: int | None = None  # tokens of the context the conversation fills
        self.held_by: str | None = None  # the other terminal holding the conversation: read-only
        self.restored = False  # set by the screen for panes it restores at start
        self._follow: tuple[AssistantMessage, MarkdownStream] | None = None  # a followed reply streaming
        last = next((m for m in reversed(self.history) if m.role == "assistant"), None)
        if last is not None:  # the previous session's last reply figures
            t, u = last.meta.get("timings") or {}, last.meta.get("usage") or {}
            if t.get("decode_tok_s") is not None or u.get("completion_tokens"):
                self.last_metrics = _metrics(t.get("decode_tok_s") or 0.0, t.get("ttft_ms"),
                                             u.get("completion_tokens") or 0)
            if u.get("prompt_tokens") is not None:
                self.context_used = u["prompt_tokens"] + (u.get("completion_tokens") or 0)

    # -- composition --------------------------------------------------------------------
    def compose(self):
        yield Transcript()
        yield PromptInput()

    async def on_mount(self) -> None:
        await self._render_history()
        self.query_one(Transcript).anchor()
        self.refresh_title()
        self._update_status()
        self._sync_remote()

    async def _render_history(self) -> None:
        transcript = self.query_one(Transcript)
        await transcript.remove_children()
        widgets = []
        for i, m in enumerate(self.history):
            if br.label(self.branches, i):
                widgets.append(BranchLabel(br.label(self.branches, i) + "  alt+left/right"))
            if m.role == "user":
                widgets.append(UserMessage(m.content))
            elif m.role == "assistant":
                widgets.append(AssistantMessage(m.content + (CUT_OFF_MARK if m.meta.get("cut_off") else "")))
            else:
                continue
            widgets[-1].index = i
            widgets[-1].set_class(i == self.selected, "-selected")
        if br.label(self.branches, len(self.history)):  # a regenerated reply is about to come
            widgets.append(BranchLabel(br.label(self.branches, len(self.history)) + "  alt+left/right"))
        if widgets:
            await transcript.mount_all(widgets)
        transcript.scroll_end(animate=False, immediate=True)

    @work(group="attach")
    async def _sync_remote(self, take: bool = False) -> None:
        """Once the backend is up, sync with a server that keeps its own copy of the history;
        learn whether another terminal holds the conversation (`take`: take it over)."""
        if self.ready is not None:
            await self.ready.wait()
        if self.backend.info.kind != "remote":
            return
        ours = [{"role": m.role, "content": m.content} for m in self.history if m.role in ("user", "assistant")]
        cid = self.conversation.id
        self.backend.watch(cid, lambda ev: self.post_message(self.Remote(ev)))
        try:
            remote = await self.backend.attach(cid, self.conversation.system, ours, take=take)
        except Exception as e:  # noqa: BLE001 - shown, never fatal: the pane still works locally
            self.notify(f"pane {self.number}: could not open the conversation on the server: {e}", severity="error")
            return
        if remote is None:
            return
        holder, restored = self.backend.holder_of(cid), self.restored
        self.restored = False
        if holder is not None:
            self._hold(holder)
            self.post_message(self.HeldElsewhere(self, holder, restored))
        elif take:
            self._hold(None)
        partial = self.backend.replying(cid)
        if remote and [{"role": m["role"], "content": m["content"]} for m in remote] != ours:
            self.history = [StoredMessage(m["role"], m["content"], {"cut_off": True} if m.get("cut_off") else {})
                            for m in remote]
            if holder is None:  # a follower's copy is the holder's to store
                self.post_message(self.HistoryReplaced(self, list(self.history)))
            await self._stop_following()
            await self._render_history()
        elif not remote and ours:
            self.notify(f"pane {self.number}: the server has no copy of this conversation; "
                        "its replies start without the earlier turns", severity="warning")
        if partial is not None and not self.busy and self._follow is None:  # another terminal's reply in flight
            await self._follow_event(Followed("delta", partial))

    async def _stop_following(self) -> None:
        """Forget a followed reply's widget (the history is shown again from the server's copy)."""
        if self._follow is not None:
            await self._follow[1].stop()
            self._follow = None

    def _hold(self, holder: str | None) -> None:
        self.held_by = holder
        self.refresh_title()
        self._set_state(f"read-only: terminal {holder} holds it" if holder else "idle")

    def take_over(self) -> bool:
        """Take the conversation from the terminal holding it (False: this pane holds it)."""
        if self.held_by is None:
            return False
        self._sync_remote(take=True)
        return True

    async def on_chat_pane_remote(self, event: "ChatPane.Remote") -> None:
        event.stop()
        ev = event.event
        if isinstance(ev, Reconnected):
            self._sync_remote()  # open it again: the server may have restarted without it
        elif isinstance(ev, HolderChanged):
            was = self.held_by
            if ev.holder != was:
                self._hold(ev.holder)
            if ev.holder is None and was is not None:
                self.notify(f"pane {self.number}: terminal {was} let go of this conversation; "
                            "this terminal holds it now")
                self._sync_remote()  # the server's copy, now ours to store
            elif ev.holder is not None and was is None:
                self.notify(f"pane {self.number}: terminal {ev.holder} took this conversation over; "
                            "read-only here now (F7 takes it back)", severity="warning")
        else:
            await self._follow_event(ev)

    async def _follow_event(self, ev: Followed) -> None:
        """Show another terminal's turn as it happens (kept in the history, not stored: the
        holder stores it)."""
        transcript = self.query_one(Transcript)
        if ev.event == "user":
            if ev.replaces and self.history and self.history[-1].role == "user":
                self.history.pop()
            if ev.text:
                self.history.append(StoredMessage("user", ev.text))
                await transcript.mount(UserMessage(ev.text))
            ev = Followed("delta", "")
        if ev.event == "delta":
            if self._follow is None:
                reply = AssistantMessage("")
                await transcript.mount(reply)
                self._follow = (reply, Markdown.get_stream(reply))
                if self.held_by:
                    self._set_state(f"read-only: terminal {self.held_by} is replying")
            if ev.text:
                await self._follow[1].write(ev.text)
            transcript.anchor()
        elif ev.event == "finished" and self._follow is not None:
            reply, md = self._follow
            self._follow = None
            await md.stop()
            if ev.text:
                reply.update(ev.text)
                self.history.append(StoredMessage("assistant", ev.text))
            else:
                await reply.remove()
            self._hold(self.held_by)

    # -- public API (called by the screen) -------------------------------------------
    @property
    def busy(self) -> bool:
        return self.stream is not None

    @property
    def title(self) -> str:
        return self.conversation.title

    @property
    def model(self) -> str:
        """The model this pane talks to: its conversation's, else the backend's default."""
        return self.conversation.model or self.backend.info.model

    def refresh_title(self) -> None:
        model = self.model
        self.border_title = (f"{self.number} · {self.conversation.title}" + (f" · {model}" if model else "")
                             + (" · read-only" if self.held_by else ""))
        self._update_status()  # a base model's note follows the model

    def set_model(self, model: str) -> None:
        """Talk to `model` from the next reply on (the caller stores the conversation)."""
        self.conversation.model = model
        self.refresh_title()

    def focus_input(self) -> None:
        self.query_one(PromptInput).focus()

    def send(self, text: str, *, replacing: int | None = None) -> bool:
        """Append a user turn and start the reply; False (and a notice) while one is running.
        `replacing`: the index of the prompt this one edits (it and what followed become a branch)."""
        text = text.strip()
        if not text:
            return False
        if self.busy:
            self.notify(f"pane {self.number} is still replying; ctrl+s stops it", severity="warning")
            return False
        if self.held_by is not None:
            self.notify(f"pane {self.number} is read-only: terminal {self.held_by} holds this conversation; "
                        "F7 takes it over", severity="warning")
            return False
        try:
            self._response_format = response_format_of(self.conversation.json_output)
        except ValueError as e:  # the schema file went away or changed since the settings were saved
            self.notify(f"pane {self.number}: {e}", severity="error")
            return False
        if self.conversation.title == "New chat":
            self.conversation.title = self._auto_title = text.splitlines()[0][:40]
            self.post_message(self.ConversationChanged(self))
            self.refresh_title()
        rerender = replacing is not None and replacing < len(self.history)
        if rerender:  # the edited prompt and what followed it become a branch
            self._fork(replacing)
        self._editing = None
        self._regenerating = False
        self._add_message(StoredMessage("user", text))
        self._stop_requested = False
        self.stream = _PENDING  # busy from now on, even before the backend answers
        self._generate(rerender=rerender)
        return True

    # -- message actions ------------------------------------------------------------------
    def _fork(self, pos: int) -> None:
        self.history, self.branches = br.fork(self.history, self.branches, pos)
        self._editing = self.selected = None
        self.post_message(self.HistoryRewritten(self))

    def _target(self, role: str) -> int | None:
        """The selected message when it has `role`, else the last message with it."""
        if self.selected is not None and self.selected < len(self.history) \
                and self.history[self.selected].role == role:
            return self.selected
        return next((i for i in range(len(self.history) - 1, -1, -1) if self.history[i].role == role), None)

    def _idle_or_say(self) -> bool:
        if self.busy:
            self.notify(f"pane {self.number} is still replying; ctrl+s stops it", severity="warning")
        return not self.busy

    def action_regenerate(self) -> None:
        """Answer the last prompt again; the reply it had becomes a branch."""
        if not self._idle_or_say():
            return
        if not self.history or self.history[-1].role not in ("user", "assistant") or (
                self.history[-1].role == "assistant" and len(self.history) < 2):
            self.notify(f"pane {self.number}: no reply to regenerate", severity="warning")
            return
        if self.history[-1].role == "assistant":
            self._fork(len(self.history) - 1)
        self.selected = None
        self._stop_requested = False
        self._regenerating = True  # a refusal leaves the prompt where it is
        self.stream = _PENDING
        self._generate(rerender=True, prompt_shown=True)

    def action_edit(self) -> None:
        """Put the selected (else last) prompt in the input; the next send replaces it."""
        i = self._target("user")
        if i is None or not self._idle_or_say():
            return
        self._editing = i
        box = self.query_one(PromptInput)
        box.clear()
        box.restore(self.history[i].content)
        box.focus()
        self.notify(f"pane {self.number}: editing a prompt; Enter resends it (what followed stays as a branch), "
                    "Escape cancels", timeout=6)

    def action_delete_message(self) -> None:
        """Delete the selected (else the last) message."""
        if not self.history or not self._idle_or_say():
            return
        i = self.selected if self.selected is not None and self.selected < len(self.history) else len(self.history) - 1
        del self.history[i]
        self.branches = br.after_delete(self.branches, i)
        self.selected = self._editing = None
        self.post_message(self.HistoryRewritten(self))
        self.run_worker(self._render_history(), group="render", exclusive=True)

    def action_flip(self, step: int) -> None:
        """Show another branch at the selected (else the last) branch point."""
        if not self._idle_or_say():
            return
        upto = self.selected if self.selected is not None else len(self.history)
        points = [p for p in self.branches if p <= upto and br.label(self.branches, p)]
        if not points:
            self.notify(f"pane {self.number}: no branches here (ctrl+r or ctrl+g make one)", severity="warning")
            return
        self.history, self.branches = br.flip(self.history, self.branches, max(points), step)
        self.selected = self._editing = None
        self.post_message(self.HistoryRewritten(self))
        self.run_worker(self._render_history(), group="render", exclusive=True)

    def action_copy_reply(self) -> None:
        i = self._target("assistant")
        if i is not None:
            self.app.copy_to_clipboard(self.history[i].content)
            self.notify("copied the reply")

    def action_copy_code(self) -> None:
        i = self._target("assistant")
        blocks = _CODE_BLOCK.findall(self.history[i].content) if i is not None else []
        if not blocks:
            self.notify(f"pane {self.number}: no code block in the reply", severity="warning")
            return
        self.app.copy_to_clipboard(blocks[-1].rstrip("\n"))
        self.notify("copied the code block")

    def action_select(self, step: int) -> None:
        """Move the message selection (starting from the last message going up)."""
        if not self.history:
            return
        n = len(self.history)
        cur = self.selected if self.selected is not None else n
        self.selected = min(max(cur + step, 0), n - 1)
        self._mark_selected()

    def action_unselect(self) -> None:
        if self._editing is not None:
            self._editing = None
            self.query_one(PromptInput).clear()
        self.selected = None
        self._mark_selected()

    def _mark_selected(self) -> None:
        for w in self.query_one(Transcript).query_children(".message"):
            w.set_class(getattr(w, "index", None) == self.selected, "-selected")
            if w.has_class("-selected"):
                w.scroll_visible(animate=False)

    def stop(self) -> None:
        """Cancel the generation in flight (its Finished still arrives, reason 'cancelled')."""
        if self.stream is not None:
            self._stop_requested = True  # also covers a reply still waiting for the model
            self.stream.cancel()

    def apply_settings(self, title: str, system: str, temperature: float, max_tokens: int, seed: int | None,
                       json_output: str | None = None, sampling: dict | None = None) -> None:
        """Change the conversation's title and settings (the caller stores them); `sampling`
        holds the other request fields set away from their defaults (app/tui/sampling_fields.py)."""
        c = self.conversation
        c.title, c.system, c.temperature, c.max_tokens, c.seed = title or c.title, system, temperature, max_tokens, seed
        if json_output is not None:
            c.json_output = json_output
        if sampling is not None:
            c.sampling = dict(sampling)
        self.refresh_title()

    def cut_off(self) -> StoredMessage | None:
        """The reply in flight as a message marked cut off (the app is quitting), or None
        when no text has come yet. The caller stores it: no message is processed any more."""
        if not self.busy or not self._received:
            return None
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.meter.tokens if self.meter else 0}
        message = StoredMessage("assistant", "".join(self._received), {"reason": "cut off", "cut_off": True,
                                                                        "usage": usage})
        self.history.append(message)
        self._received = []
        self._cut = True  # its end, if it still comes, is not added a second time
        return message

    def transcript_markdown(self) -> str:
        return conversation_markdown(self.conversation, self.history)

    # -- events --------------------------------------------------------------------------
    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if not self.send(event.text, replacing=self._editing):
            event.prompt_input.restore(event.text)  # keep what they typed

    def on_descendant_focus(self) -> None:
        self.post_message(self.Activated(self))

    # -- the generation ------------------------------------------------------------------
    @work(group="generate")
    async def _generate(self, rerender: bool = False, prompt_shown: bool = False) -> None:
        transcript = self.query_one(Transcript)
        if rerender:  # an edit or a regenerate cut the history
            await self._render_history()
        self._reply = reply = AssistantMessage("")
        shown = [] if prompt_shown else [UserMessage(self.history[-1].content)]
        for w in shown:
            w.index = len(self.history) - 1
        await transcript.mount_all([*shown, reply])  # one layout pass
        transcript.anchor()
        if self.ready is not None and not self.ready.is_set():
            self._set_state("waiting for the model")
            await self.ready.wait()
        c = self.conversation
        extra = {k: c.sampling[k] for k in SAMPLING_DEFAULTS if k in c.sampling}
        params = GenParams(temperature=c.temperature, max_tokens=c.max_tokens, seed=c.seed,
                           response_format=self._response_format, stop=tuple(c.sampling.get("stop") or ()), **extra)
        messages = [{"role": m.role, "content": m.content} for m in self.history if m.role in ("user", "assistant")]
        self.meter = meter = StreamMeter()
        self._received, self._queued = [], False
        loaded = self.backend.model_loaded(c.model)
        self.stream = stream = self.backend.respond(c.id, messages, params, c.system, c.model)
        if self._stop_requested:
            stream.cancel()
        self._md_stream = Markdown.get_stream(reply)
        await asyncio.sleep(0)  # let its task start: stopping one that never ran raises CancelledError here
        self._set_state("queued" if loaded else f"loading {self.model}...")
        timer = self.set_interval(1 / FLUSH_HZ, self.flush) if self.ticker else None
        fin = Finished("error", "", error="the stream ended without a finish")
        perf = time.perf_counter
        try:
            async for ev in stream:
                t0 = perf()
                if isinstance(ev, Delta):
                    self._pending.append(ev.text)
                    self._received.append(ev.text)
                    meter.on_tokens(ev.tokens)
                    if self.state != "decoding":
                        self.state = "decoding"
                elif isinstance(ev, Prefill):
                    pct = 100 * ev.done // max(1, ev.total)
                    self.state = "decoding" if ev.done >= ev.total else f"prefilling {pct}%"
                elif isinstance(ev, Queued):
                    self.state = "queued"
                    self._queued = True
                    if ev.prompt_tokens is not None:
                        self.prompt_tokens = ev.prompt_tokens
                    if ev.dropped:
                        await self._say_dropped(ev.dropped, reply)
                elif isinstance(ev, Finished):
                    fin = ev
                UI_COST.add("token", perf() - t0)
        finally:
            if timer is not None:
                timer.stop()
            await self.flush()
            await self._md_stream.stop()
            self._md_stream = None
            self.stream = None
        self._finish(fin, reply)

    async def flush(self) -> None:
        """Hand the buffered text to the Markdown stream and refresh the status line
        (called FLUSH_HZ times a second while streaming, and once at the finish)."""
        t0 = time.perf_counter()
        text = "".join(self._pending) if self._pending else ""
        self._pending.clear()
        self._update_status()
        UI_COST.add("flush", time.perf_counter() - t0)
        if text and self._md_stream is not None:
            await self._md_stream.write(text)

    async def _say_dropped(self, dropped: int, reply: AssistantMessage) -> None:
        """Show, above the reply, that its prompt left out the oldest turns."""
        ctx = self.backend.info.ctx
        room = f"the {ctx:,}-token context" if ctx else "the context"
        turns = "message" if dropped == 1 else f"{dropped} messages"
        line = f"the oldest {turns} no longer fit {room}: this reply does not see them"
        await self.query_one(Transcript).mount(ContextNotice(line), before=reply)
        self.notify(f"pane {self.number}: {line}", severity="warning", timeout=6)

    def _finish(self, fin: Finished, reply: AssistantMessage) -> None:
        t0 = time.perf_counter()
        self.last_finish = fin
        self._received = []
        usage = fin.usage or {}
        if usage.get("prompt_tokens") is not None:
            self.prompt_tokens = usage["prompt_tokens"]
            self.context_used = usage["prompt_tokens"] + (usage.get("completion_tokens") or 0)
        text = fin.text or reply.source
        if fin.text and not reply.source:
            reply.update(fin.text)
        meta = {"reason": fin.reason, "usage": fin.usage, "timings": fin.timings}
        if text and not self._cut:
            reply.index = len(self.history)
            self._add_message(StoredMessage("assistant", text, meta))
        if fin.reason == "error":
            if not text and not self._queued:
                self._withdraw(reply)
            elif not text:
                reply.add_class("-error")
                reply.update(f"*error: {fin.error or 'unknown'}*")
            self._set_state(f"error: {fin.error or 'unknown'}")
            self.notify(f"pane {self.number}: {fin.error or 'the reply failed'}", severity="error", timeout=8)
        else:
            m = self.meter
            tok_s = fin.timings.get("decode_tok_s") or (m.tok_s(m.t_last) if m else 0.0)
            ttft = fin.timings.get("ttft_ms") or (m.ttft_ms if m else None)
            n = fin.usage.get("completion_tokens") or (m.tokens if m else 0)
            self.last_metrics = _metrics(tok_s, ttft, n)
            if not text and fin.reason == "cancelled":
                reply.remove()
            self._set_state({"cancelled": "idle (stopped)", "shutdown": "idle (server shut down)"}.get(fin.reason, "idle"))
        UI_COST.add("finish", time.perf_counter() - t0)
        self.post_message(self.ReplyFinished(self, fin))

    def _withdraw(self, reply: AssistantMessage) -> None:
        """The prompt was refused before it started: take it out of the history (so later
        prompts do not carry it) and give its text back to the input."""
        reply.remove()
        if self._regenerating:  # the prompt was there before: it stays, the old reply is a branch
            return
        prompt = self.history.pop() if self.history and self.history[-1].role == "user" else None
        users = list(self.query_one(Transcript).query_children(UserMessage))
        if users:
            users[-1].remove()
        if prompt is not None:
            box = self.query_one(PromptInput)
            if not box.value.strip():
                box.restore(prompt.content)
            self.post_message(self.MessageWithdrawn(self, prompt))
            if not self.history and self.conversation.title == self._auto_title:  # named by the refused prompt
                self.conversation.title, self._auto_title = "New chat", None
                self.post_message(self.ConversationChanged(self))
                self.refresh_title()

    def _add_message(self, message: StoredMessage) -> None:
        self.history.append(message)
        self.post_message(self.MessageAdded(self, message))

    def _set_state(self, state: str) -> None:
        self.state = state
        self._update_status()

    def _update_status(self) -> None:
        m = self.meter
        if self.busy and m is not None:
            metrics = _metrics(m.tok_s(), m.ttft_ms, m.tokens)
            used = self.prompt_tokens + m.tokens if self._queued and self.prompt_tokens is not None else None
        else:
            metrics = self.last_metrics
            used = self.context_used
        ctx = self.backend.info.ctx
        if used is not None and ctx:  # before TTFT, the first figure a narrow pane drops
            metrics = (*metrics[:2], f"{used:,} / {ctx:,} tok", *metrics[2:])
        if self.state.startswith("loading"):
            metrics = ()  # no figures until the model serves
        note = (BASE_NOTE,) if self.backend.completes_text(self.conversation.model) else ()
        status = _fit([self.state, *note, *metrics], self.size.width - 6)
        if status != self._status:
            self._status = status
            # colour through the title's own style: a CSS class change would restyle the whole
            # subtree (every Markdown block in the transcript) at each start and finish
            color = "$error" if self.state.startswith("error") else "$accent" if self.busy else None
            self.border_subtitle = Content.styled(status, color) if color else Content(status)

    def on_resize(self) -> None:
        self._update_status()


def _metrics(tok_s: float, ttft_ms: float | None, tokens: int) -> tuple[str, ...]:
    """tok/s, TTFT, tokens: in the order they are dropped from a narrow pane's status, last first."""
    ttft = f"TTFT {ttft_ms:.0f} ms" if ttft_ms is not None else "TTFT -"
    return (f"{tok_s:.1f} tok/s", f"{tokens} tok", ttft)


def _fit(parts: list[str], width: int) -> str:
    """Join parts with ' · ', dropping trailing ones until it fits `width` (0: unknown)."""
    while len(parts) > 1 and width > 0 and len(" · ".join(parts)) > width:
        parts = parts[:-1]
    return " · ".join(parts)


class _Pending(ChatStream):
    """Placeholder stream between send() and the backend accepting the request."""

    def __aiter__(self):  # pragma: no cover - never iterated
        raise NotImplementedError

    def cancel(self) -> None:
        pass


_PENDING = _Pending()

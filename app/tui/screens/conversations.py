"""Pick a stored conversation to open in a new pane: search, preview, delete with undo."""

from __future__ import annotations

import time

from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from ...store import Conversation, Store

PREVIEW_MESSAGES = 4  # the first turns the preview shows
PREVIEW_CHARS = 300  # of each


class ConversationsScreen(ModalScreen[str | None]):
    """Dismisses with the chosen conversation id, or None.

    With a `store` the search box matches titles and message text (Store.search_conversations)
    and the preview shows the highlighted conversation's first turns; without one it
    filters the given titles. F8 deletes the highlighted conversation and ctrl+z brings the
    last one deleted back: deletions reach the store only when the dialog closes."""

    DEFAULT_CSS = """
    ConversationsScreen { align: center middle; }
    ConversationsScreen > Vertical {
        width: 100; max-width: 100%; height: 90%; border: round $primary; background: $surface; padding: 0 1;
    }
    ConversationsScreen Input { margin-bottom: 1; }
    ConversationsScreen OptionList { height: 1fr; min-height: 3; }
    ConversationsScreen #preview { height: auto; max-height: 7; color: $text-muted; margin-top: 1; }
    ConversationsScreen #hint { color: $text-muted; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel"),
                Binding("f8", "delete", "Delete", priority=True),
                Binding("ctrl+z", "undo", "Undo delete", priority=True)]

    def __init__(self, conversations: list[Conversation], *, store: Store | None = None,
                 exclude: set[str] | None = None, default_model: str = ""):
        super().__init__()
        self.conversations = conversations
        self.store = store
        self.exclude = exclude or set()
        self.default_model = default_model
        self.deleted: list[Conversation] = []  # soft-deleted, newest last, until the dialog closes
        self.shown: list[Conversation] = list(conversations)

    def compose(self):
        with Vertical():
            if self.conversations:
                yield Input(placeholder="search titles and messages", id="search", compact=True)
                yield OptionList(id="list")
                yield Static("", id="preview")
                yield Label("Enter opens · F8 deletes · ctrl+z undoes · Escape closes", id="hint")
            else:
                yield Label("No other stored conversations.")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "open a conversation"
        if self.conversations:
            self._fill()
            self.query_one("#search", Input).focus()

    # -- the list ------------------------------------------------------------------------
    def _matching(self, text: str) -> list[Conversation]:
        gone = {c.id for c in self.deleted} | self.exclude
        if self.store is not None:
            found = self.store.search_conversations(text)
        else:
            found = [c for c in self.conversations if text.strip().lower() in c.title.lower()]
        return [c for c in found if c.id not in gone]

    def _fill(self) -> None:
        text = self.query_one("#search", Input).value if self.conversations else ""
        self.shown = self._matching(text)
        options = self.query_one("#list", OptionList)
        options.clear_options()
        options.add_options([Option(self._line(c), id=c.id) for c in self.shown])
        if self.shown:
            options.highlighted = 0
        self._preview()

    def _line(self, c: Conversation) -> Content:
        model = c.model or self.default_model or "default model"
        return Content.assemble(c.title, ("  ·  " + model + "  ·  " + _ago(c.updated), "dim"))

    def _highlighted(self) -> Conversation | None:
        options = self.query_one("#list", OptionList)
        i = options.highlighted
        return self.shown[i] if i is not None and 0 <= i < len(self.shown) else None

    def _preview(self) -> None:
        conv = self._highlighted()
        lines = []
        if conv is not None and self.store is not None:
            for m in self.store.messages(conv.id)[:PREVIEW_MESSAGES]:
                text = " ".join(m.content.split())
                lines.append(f"{m.role}: {text[:PREVIEW_CHARS]}")
        self.query_one("#preview", Static).update(Content("\n".join(lines) or ("(no messages)" if conv else "")))

    # -- events --------------------------------------------------------------------------
    def on_input_changed(self, event: Input.Changed) -> None:
        self._fill()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        conv = self._highlighted()
        if conv is not None:
            self._close(conv.id)

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self._preview()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self._close(event.option.id)

    def on_key(self, event) -> None:
        # up/down in the search box move the list's highlight: typing and choosing go together
        if event.key in ("up", "down") and self.conversations and self.focused is self.query_one("#search"):
            options = self.query_one("#list", OptionList)
            options.action_cursor_up() if event.key == "up" else options.action_cursor_down()
            event.stop()

    def action_delete(self) -> None:
        conv = self._highlighted() if self.conversations else None
        if conv is None:
            return
        self.deleted.append(conv)
        self._fill()
        self.notify(f"deleted {conv.title!r}; ctrl+z brings it back", timeout=5)

    def action_undo(self) -> None:
        if self.deleted:
            conv = self.deleted.pop()
            self._fill()
            self.notify(f"restored {conv.title!r}")

    def action_cancel(self) -> None:
        self._close(None)

    def _close(self, conv_id: str | None) -> None:
        self._apply_deletions()
        self.dismiss(conv_id)

    def on_unmount(self) -> None:
        self._apply_deletions()  # the app quit with the dialog open

    def _apply_deletions(self) -> None:
        if self.store is not None:
            for conv in self.deleted:
                self.store.delete_conversation(conv.id)
        self.deleted = []


def _ago(t: float) -> str:
    s = max(0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{int(s // n)} {unit} ago"
    return "just now"

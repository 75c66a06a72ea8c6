"""Pick a stored conversation to open in a new pane."""

from __future__ import annotations

import time

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from ...store import Conversation


class ConversationsScreen(ModalScreen[str | None]):
    """Dismisses with the chosen conversation id, or None."""

    DEFAULT_CSS = """
    ConversationsScreen { align: center middle; }
    ConversationsScreen > Vertical {
        width: 80; max-width: 100%; height: 70%; border: round $primary; background: $surface; padding: 1 2;
    }
    ConversationsScreen OptionList { height: 1fr; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, conversations: list[Conversation]):
        super().__init__()
        self.conversations = conversations

    def compose(self):
        with Vertical():
            if self.conversations:
                yield OptionList(*[Option(f"{c.title}  ·  {_ago(c.updated)}", id=c.id) for c in self.conversations])
            else:
                yield Label("No other stored conversations.")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "open a conversation"

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _ago(t: float) -> str:
    s = max(0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{int(s // n)} {unit} ago"
    return "just now"

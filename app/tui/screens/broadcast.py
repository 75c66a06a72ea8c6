"""Ask for one prompt to send to every pane at once."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label

from ..widgets.prompt_input import PromptInput


class BroadcastScreen(ModalScreen[str | None]):
    """Dismisses with the prompt text (Enter), or None (escape)."""

    DEFAULT_CSS = """
    BroadcastScreen { align: center middle; }
    BroadcastScreen > Vertical {
        width: 80; max-width: 100%; height: auto; border: round $accent; background: $surface; padding: 1 2;
    }
    BroadcastScreen Label { width: 1fr; color: $text-muted; margin-bottom: 1; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, n_panes: int):
        super().__init__()
        self.n_panes = n_panes

    def compose(self):
        with Vertical():
            yield Label(f"Send the same prompt to all {self.n_panes} panes\n"
                        "(Enter sends, ctrl+j newline, escape cancels)")
            yield PromptInput(placeholder="Prompt for every pane")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "broadcast"
        self.query_one(PromptInput).focus()

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        self.dismiss(event.text)

    def action_cancel(self) -> None:
        self.dismiss(None)

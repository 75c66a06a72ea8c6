"""The multi-line prompt box: Enter sends, ctrl+j (or shift+enter where the terminal
reports it) inserts a newline."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.geometry import Region
from textual.message import Message
from textual.strip import Strip
from textual.widgets import TextArea


class PromptInput(TextArea):
    """A TextArea that turns Enter into a `Submitted` message carrying the text."""

    DEFAULT_CSS = """
    PromptInput {
        height: auto;
        max-height: 6;
        min-height: 3;
        border: tall $surface-lighten-1;
        padding: 0 1;
    }
    PromptInput:focus { border: tall $accent; }
    """
    BINDINGS = [Binding("ctrl+j,shift+enter,alt+enter", "newline", "Newline", show=False)]

    class Submitted(Message):
        """The user pressed Enter on non-blank text."""

        def __init__(self, prompt_input: "PromptInput", text: str):
            super().__init__()
            self.prompt_input = prompt_input
            self.text = text

        @property
        def control(self) -> "PromptInput":
            return self.prompt_input

    def __init__(self, placeholder: str = "Message  (Enter sends, ctrl+j newline)", **kwargs):
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         highlight_cursor_line=False, placeholder=placeholder, **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self, self.text))
                self.clear()
            return
        await super()._on_key(event)

    def render_lines(self, crop: Region) -> list[Strip]:
        # Textual 8.2 can paint a TextArea whose component styles are gone, in the frame
        # after it was removed (closing a busy pane), and TextArea's theme then raises
        # KeyError (textual#6528). A detached input has nothing to show: paint it blank.
        if not self.is_attached:
            return [Strip.blank(crop.width)] * crop.height
        return super().render_lines(crop)

    def action_newline(self) -> None:
        self.insert("\n")

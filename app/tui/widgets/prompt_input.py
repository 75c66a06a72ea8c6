"""The multi-line prompt box: Enter sends, ctrl+j (or shift+enter where the terminal
reports it) inserts a newline.

Two things keep a large paste cheap. A terminal without bracketed paste delivers a paste
as one key event per character, and each TextArea edit re-wraps its line and posts
messages: typed characters are buffered and inserted once per burst. And a paste (or a
burst) longer than `PASTE_INLINE_MAX` characters is held aside and shown as one
`[pasted text #N: …]` chip, expanded when the prompt is sent: soft-wrapping a megabyte
in the box takes seconds, and every later key would pay for it again.
"""

from __future__ import annotations

import re

from textual import events
from textual.binding import Binding
from textual.geometry import Region
from textual.message import Message
from textual.strip import Strip
from textual.widgets import TextArea

#: Characters a paste may put in the box as text; a longer one becomes a chip.
PASTE_INLINE_MAX = 10_000
_CHIP = re.compile(r"\[pasted text #(\d+): [\d,]+ chars(?:, [\d,]+ lines)?\]")


class PromptInput(TextArea):
    """A TextArea that turns Enter into a `Submitted` message carrying the text (chips
    expanded). `value` is that text at any time; `restore(text)` puts a prompt back."""

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
        self._typed: list[str] = []  # printable keys not inserted yet
        self._pastes: dict[int, str] = {}  # chip number -> the text it stands for

    # -- what the box holds ------------------------------------------------------------------
    @property
    def value(self) -> str:
        """The prompt as it will be sent: pending keys inserted, chips expanded."""
        self.flush_typed()
        return _CHIP.sub(lambda m: self._pastes.get(int(m.group(1)), m.group(0)), self.text)

    def restore(self, text: str) -> None:
        """Put `text` back in the box (a prompt that was not sent), as a chip when it is long."""
        self._typed.clear()
        self._pastes.clear()
        self.load_text("")
        self._insert_chunk(text)

    def clear(self):
        self._typed.clear()
        self._pastes.clear()
        return super().clear()

    def flush_typed(self) -> None:
        """Insert the buffered keys in one edit."""
        if self._typed:
            text = "".join(self._typed)
            self._typed.clear()
            self._insert_chunk(text)

    def _insert_chunk(self, text: str) -> None:
        if len(text) > PASTE_INLINE_MAX:
            n = max(self._pastes, default=0) + 1
            self._pastes[n] = text
            lines = text.count("\n") + (not text.endswith("\n"))
            text = f"[pasted text #{n}: {len(text):,} chars" + (f", {lines:,} lines]" if lines > 1 else "]")
        if text and not self.read_only:
            result = self._replace_via_keyboard(text, *self.selection)
            if result is not None:
                self.move_cursor(result.end_location)

    # -- events ---------------------------------------------------------------------------------
    def take_typed(self, event: events.Key) -> bool:
        """Buffer a printable key (True), to be inserted with the rest of its burst; False
        for any other key. The app hands printable keys here before its binding lookup,
        which costs more than the insert (no binding of this app is a printable key)."""
        if not (event.is_printable and event.character and event.key != "enter") or self.read_only:
            return False
        event.stop()
        event.prevent_default()
        if not self._typed:  # the rest of a burst queues behind this call
            self.call_later(self.flush_typed)
        self._typed.append(event.character)
        return True

    async def _on_key(self, event: events.Key) -> None:
        if self.take_typed(event):
            return
        self.flush_typed()  # any other key (and the bindings after it) sees every earlier one
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.value
            if text.strip():
                self.post_message(self.Submitted(self, text))
                self.clear()
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        event.stop()
        event.prevent_default()
        self.flush_typed()
        self._insert_chunk(event.text)
        self.focus()

    def render_lines(self, crop: Region) -> list[Strip]:
        # Textual 8.2 can paint a TextArea whose component styles are gone, in the frame
        # after it was removed (closing a busy pane), and TextArea's theme then raises
        # KeyError (textual#6528). A detached input has nothing to show: paint it blank.
        if not self.is_attached:
            return [Strip.blank(crop.width)] * crop.height
        return super().render_lines(crop)

    def action_newline(self) -> None:
        self.flush_typed()
        self.insert("\n")

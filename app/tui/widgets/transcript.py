"""The scrolling list of a conversation's messages.

The growing lists hook `MarkdownBlock._update_from_block` and rely on how Textual's list
blocks compose (one `Horizontal(MarkdownBullet, Vertical)` per item): no public API
offers that, so pyproject.toml holds Textual to the major version this was tested on, and
tests/tui/test_widgets.py checks streamed lists against a full parse.
"""

from __future__ import annotations

from textual.containers import Horizontal, VerticalScroll
from textual.content import Content
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownBlock

# Textual's own list blocks, taken from the public block table (their module is private)
MarkdownBulletList = Markdown.BLOCKS["bullet_list_open"]
MarkdownOrderedList = Markdown.BLOCKS["ordered_list_open"]


#: Characters of a user turn the transcript shows; the rest is summed up in one line (a
#: pasted megabyte would take seconds to wrap at every layout). The turn is kept whole.
USER_SHOWN_MAX = 4_000


class UserMessage(Static):
    """A user turn, shown verbatim (no markup, no Markdown), its first `USER_SHOWN_MAX`
    characters when it is longer."""

    DEFAULT_CSS = """
    UserMessage {
        margin: 1 0 0 0;
        padding: 0 1;
        border-left: thick $accent;
        background: $boost;
        color: $text;
    }
    UserMessage.-selected { border-left: thick $warning; background: $boost 200%; }
    """

    def __init__(self, text: str, **kwargs):
        kwargs["classes"] = f"message {kwargs.get('classes', '')}".strip()
        shown = text
        if len(text) > USER_SHOWN_MAX:
            shown = f"{text[:USER_SHOWN_MAX]}\n[… {len(text) - USER_SHOWN_MAX:,} more characters, sent in full]"
        super().__init__(Content(shown), **kwargs)
        self.text = text


class ContextNotice(Static):
    """A line in the transcript saying the oldest turns were left out of a reply's prompt."""

    DEFAULT_CSS = """
    ContextNotice {
        margin: 1 0 0 0;
        padding: 0 1;
        color: $warning;
        text-style: italic;
    }
    """


class BranchLabel(Static):
    """`< 1/2 >` above a message that has other branches (app/tui/branches.py)."""

    DEFAULT_CSS = """
    BranchLabel {
        margin: 1 0 0 0;
        padding: 0 1;
        color: $text-muted;
        text-align: right;
    }
    """


#: What a reply cut off by quitting ends with on screen (the stored text stays as generated).
CUT_OFF_MARK = "\n\n*[cut off]*"


class _GrowingList:
    """A list block that, when a streamed append re-parses it, keeps the items it already
    shows and rebuilds only the last one (Textual's default remounts the whole list on
    every append, so a long list costs O(items) widget mounts per flush)."""

    async def _update_from_block(self, block: MarkdownBlock) -> None:
        rows = list(self.query_children(Horizontal))
        if type(block) is not type(self) or not rows:
            return await super()._update_from_block(block)
        new_rows = list(block.compose())  # one Horizontal per item (consumes block._blocks)
        keep = len(rows) - 1
        if len(new_rows) < len(rows) or self._wider(rows, len(new_rows)):
            keep = 0  # shrank, or the numbers got wider (9 -> 10 items): rebuild them all
        await self.remove_children(rows[keep:])
        await self.mount_all(new_rows[keep:])


    def _wider(self, rows: list, n_items: int) -> bool:
        return False


class GrowingBulletList(_GrowingList, MarkdownBulletList):
    """A bullet list that grows in place while streaming."""


class GrowingOrderedList(_GrowingList, MarkdownOrderedList):
    """An ordered list that grows in place while streaming."""

    def _wider(self, rows: list, n_items: int) -> bool:
        """Would `n_items` numbers need wider bullets than the ones shown (all right-aligned)?"""
        bullet = next(iter(rows[0].query_children("MarkdownBullet")), None)
        first = bullet.symbol if bullet is not None else ""
        try:
            start = int(first.strip().rstrip("."))
        except ValueError:
            return True
        return len(first) != len(f"{start + n_items - 1}. ") + 1


class AssistantMessage(Markdown):
    """An assistant turn, rendered as Markdown (streamed in while it is generated)."""

    BLOCKS = {**Markdown.BLOCKS, "bullet_list_open": GrowingBulletList, "ordered_list_open": GrowingOrderedList}

    DEFAULT_CSS = """
    AssistantMessage {
        margin: 1 0 0 0;
        padding: 0 1;
        background: transparent;
    }
    AssistantMessage.-error { border-left: thick $error; }
    AssistantMessage.-selected { border-left: thick $warning; background: $boost; }
    AssistantMessage > MarkdownBlock:last-child { margin-bottom: 0; }
    """

    def __init__(self, markdown: str = "", **kwargs):
        kwargs["classes"] = f"message {kwargs.get('classes', '')}".strip()
        super().__init__(markdown, **kwargs)


class Transcript(VerticalScroll, can_focus=False):
    """Messages, anchored to the bottom until the user scrolls up to read back."""

    DEFAULT_CSS = """
    Transcript {
        height: 1fr;
        padding: 0 1 0 0;
        scrollbar-size-vertical: 1;
    }
    """

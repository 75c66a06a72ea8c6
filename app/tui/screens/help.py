"""F1: the app's own keys, by group, read from the real BINDINGS (so the list cannot
drift from what the keys do)."""

from __future__ import annotations

from typing import Iterable

from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from ..commands import Command

def key_groups(sources: Iterable[tuple[str, Iterable[Binding]]]) -> dict[str, list[tuple[str, str]]]:
    """(keys, what they do) per group, in the sources' order: each source is a default
    group and its bindings. A Command is listed under its `group_name` (else the default)
    with its title; another binding with its description, else its tooltip."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for default, bindings in sources:
        for b in bindings:
            text = (b.title if isinstance(b, Command) and b.title else "") or b.description or b.tooltip
            if text:
                group = (b.group_name if isinstance(b, Command) else "") or default
                groups.setdefault(group, []).append((_keys(b.key), text))
    return groups


def _keys(key: str) -> str:
    return " / ".join(k.strip() for k in key.split(","))


KEY_COLUMN = 12  # longer keys get a line of their own


def _rows(rows: list[tuple[str, str]]) -> str:
    return "\n".join(f"{k:<{KEY_COLUMN}}{t}" if len(k) < KEY_COLUMN else f"{k}\n{'':<{KEY_COLUMN}}{t}"
                     for k, t in rows)


class HelpScreen(ModalScreen[None]):
    """The key list in two columns (it fits 80x24 whole); Escape, F1 or q closes it."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical {
        width: 100; max-width: 100%; height: auto; max-height: 100%;
        border: round $primary; background: $surface; padding: 0 1;
    }
    HelpScreen Horizontal { height: auto; }
    HelpScreen Horizontal > Vertical { width: 1fr; height: auto; padding-right: 1; }
    HelpScreen .group { text-style: bold; color: $accent; margin-top: 1; }
    HelpScreen .keys { width: 1fr; }
    """
    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def __init__(self, groups: dict[str, list[tuple[str, str]]]):
        super().__init__()
        self.groups = groups

    def compose(self):
        names = list(self.groups)
        half = (sum(len(r) for r in self.groups.values()) + 1) // 2
        split, count = len(names), 0
        for i, name in enumerate(names):  # the first groups holding about half the rows go left
            count += len(self.groups[name])
            if count >= half:
                split = i + 1
                break
        with Vertical():
            with Horizontal():
                for column in (names[:split], names[split:]):
                    with Vertical():
                        for name in column:
                            yield Static(name, classes="group", markup=False)
                            yield Static(_rows(self.groups[name]), classes="keys", markup=False)

    def on_mount(self) -> None:
        box = self.query_one(Vertical)
        box.border_title = "keys"
        box.border_subtitle = "escape, F1 or q closes"

    def action_close(self) -> None:
        self.dismiss(None)

"""Key bindings that are also command-palette entries, so the palette is built from the
bindings instead of from a second list that can drift from them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator

from textual.app import SystemCommand
from textual.binding import Binding
from textual.dom import DOMNode


@dataclass(frozen=True)
class Command(Binding):
    """A key binding the command palette lists too: as `title`, with `tooltip` and the key
    as its help line; the F1 help lists it under `group_name`."""

    title: str = ""
    group_name: str = ""


def binding_commands(node: DOMNode) -> Iterator[SystemCommand]:
    """A palette entry for each Command in `node`'s BINDINGS, in their order; choosing one
    runs the binding's action on `node`, as its key does."""
    for b in node.BINDINGS:
        if isinstance(b, Command):
            yield SystemCommand(b.title, f"{b.tooltip} ({b.key})", partial(node.run_action, b.action))

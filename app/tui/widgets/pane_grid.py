"""The grid that holds 1 to 8 panes and reflows as they open and close."""

from __future__ import annotations

from textual.containers import Container

MAX_PANES = 8
# columns x rows for each pane count: wide before tall, terminals are wider than high
GRID_SHAPES = {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (2, 2), 5: (3, 2), 6: (3, 2), 7: (4, 2), 8: (4, 2)}


class PaneGrid(Container, can_focus=False):
    """A CSS grid of ChatPanes; `zoomed` shows one pane alone."""

    DEFAULT_CSS = """
    PaneGrid {
        layout: grid;
        grid-gutter: 0 0;
        height: 1fr;
        width: 1fr;
    }
    PaneGrid.-zoomed > ChatPane { display: none; }
    PaneGrid.-zoomed > ChatPane.-zoomed { display: block; }
    """

    def reflow(self, n_panes: int, zoomed: bool = False) -> None:
        cols, rows = (1, 1) if zoomed else GRID_SHAPES.get(max(1, min(n_panes, MAX_PANES)), (4, 2))
        self.styles.grid_size_columns = cols
        self.styles.grid_size_rows = rows
        self.set_class(zoomed, "-zoomed")

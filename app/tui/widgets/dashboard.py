"""The always-visible batch dashboard: backend, occupancy, tok/s, queue, KV slots, streams.

It pulls `backend.stats()` (the engine snapshot, or the server's pushed stats) a few
times a second and only touches a widget when what it shows has changed.
"""

from __future__ import annotations

import time
from collections import deque

from rich.text import Text
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import DataTable, Static

from ...clients.base import ChatBackend
from ..perf import UI_COST

BARS = " ▁▂▃▄▅▆▇█"
WRAPPING = {"dash-backend", "dash-model", "dash-share"}  # may take several lines; the rest take one
REFRESH_HZ = 4
WINDOW_S = 60


def sparkline(values: list[float], width: int, vmax: float) -> str:
    """`values` squeezed into `width` columns (max per column) as block characters, 0..vmax."""
    if width <= 0:
        return ""
    n = len(values)
    cols = []
    for c in range(width):
        lo, hi = c * n // width, max(c * n // width + 1, (c + 1) * n // width)
        v = max(values[lo:hi]) if lo < n else 0.0
        level = 0 if vmax <= 0 else min(8, round(8 * v / vmax))
        if v > 0 and level == 0:
            level = 1
        cols.append(BARS[level])
    return "".join(cols)


class Dashboard(Vertical, can_focus=False):
    """Set `backend` and `pane_names` (conversation id -> label) from above; it does the rest."""

    DEFAULT_CSS = """
    Dashboard {
        width: 46;
        height: 1fr;
        border: round $surface-lighten-2;
        border-title-color: $text-muted;
        padding: 0 1;
    }
    Dashboard Static { height: 1; }
    Dashboard #dash-backend, Dashboard #dash-model, Dashboard #dash-share { height: auto; }
    Dashboard #dash-backend { text-style: bold; }
    Dashboard .dash-dim { color: $text-muted; }
    Dashboard .dash-spark { color: $accent; }
    Dashboard #dash-streams-title { margin-top: 1; }
    Dashboard #dash-batch { margin-top: 1; }
    Dashboard DataTable { height: 1fr; scrollbar-size: 1 1; }
    """

    def __init__(self, backend: ChatBackend, **kwargs):
        super().__init__(**kwargs)
        self.backend = backend
        self.pane_names: dict[str, str] = {}
        n = WINDOW_S * REFRESH_HZ
        self.occupancy: deque[float] = deque([0.0] * n, maxlen=n)
        self.tok_s: deque[float] = deque([0.0] * n, maxlen=n)
        self.peak_batch = 0
        self.last_stats: dict | None = None
        self._step_hist: list[int] | None = None
        self._shown: dict[str, object] = {}
        self.status_line = "starting…"
        self.share_line = ""

    def compose(self):
        yield Static(id="dash-backend")
        yield Static(id="dash-model", classes="dash-dim")
        yield Static(id="dash-share", classes="dash-dim")
        yield Static(id="dash-batch")
        yield Static(id="dash-kv")
        yield Static(id="dash-occ-label", classes="dash-dim")
        yield Static(id="dash-occ", classes="dash-spark")
        yield Static(id="dash-tps-label", classes="dash-dim")
        yield Static(id="dash-tps", classes="dash-spark")
        yield Static("streams", id="dash-streams-title", classes="dash-dim")
        table = DataTable(id="dash-streams", cursor_type="none", zebra_stripes=False, show_cursor=False)
        table.can_focus = False
        yield table

    def on_mount(self) -> None:
        self.border_title = "batch"
        table = self.query_one(DataTable)
        table.add_columns("stream", "state", "tok", "tok/s")
        self.refresh_stats()
        self.set_interval(1 / REFRESH_HZ, self.refresh_stats)

    def _show(self, widget_id: str, value: str, markup: bool = False) -> None:
        if self._shown.get(widget_id) != value:
            self._shown[widget_id] = value
            # one-line fields have a fixed height: no layout pass (a whole-screen reflow) per update
            fixed = widget_id not in WRAPPING
            self.query_one(f"#{widget_id}", Static).update(Content.from_markup(value) if markup else Content(value),
                                                           layout=not fixed)

    def refresh_stats(self) -> None:
        t0 = time.perf_counter()
        info = self.backend.info
        kind = {"local": "local engine", "remote": "panechat server", "openai": "OpenAI API"}.get(info.kind, info.kind)
        where = f" {info.url}" if info.url else ""
        self._show("dash-backend", f"{kind}{where}" + (f" · {info.backend}" if info.backend else ""))
        self._show("dash-model", info.model or self.status_line)
        if self._shown.get("detail") != info.detail:
            self._shown["detail"] = info.detail
            self.query_one("#dash-backend").tooltip = info.detail or None
        self._show("dash-share", self.share_line)
        s = self.backend.stats()
        self.last_stats = s
        width = max(10, self.content_size.width)
        if s is None:
            self._show("dash-batch", "batch -")
            self._show("dash-kv", "")
        else:
            self._update_numbers(s, width)
        if s is not None:
            self._update_streams(s.get("streams") or [])
        UI_COST.add("dashboard", time.perf_counter() - t0)

    def _update_numbers(self, s: dict, width: int) -> None:
        now, cap = s.get("batch_now"), s.get("batch_max")
        tok_s = float(s.get("tok_s") or 0.0)
        streams = s.get("streams") or []
        if now is None:  # an OpenAI API: only our own streams are known
            now = sum(1 for x in streams if x.get("state") == "decoding")
        busiest = max(now, self._busiest_step_since_last(s.get("step_hist")))
        self.peak_batch = max(self.peak_batch, busiest)
        self.occupancy.append(float(busiest))
        self.tok_s.append(tok_s)
        queue = s.get("queue_depth")
        cap_text = f"/{cap}" if cap else ""
        parts = [f"batch [b]{now}{cap_text}[/b]"]
        if queue is not None:
            parts.append(f"queue {queue}")
        self._show("dash-batch", "  ".join(parts), markup=True)
        kv = f"KV slots {s['kv_in_use']}/{s['kv_total']}" if s.get("kv_total") else "KV slots -"
        cached = (s.get("kv_resident") or 0) - (s.get("kv_in_use") or 0)  # idle conversations kept warm
        if s.get("kv_total") and cached > 0:
            kv += f" ({cached} cached)"
        terms = s.get("terminals")
        self._show("dash-kv", f"{kv}  terminals {terms if terms is not None else 1}")
        occ = list(self.occupancy)
        tps = list(self.tok_s)
        self._show("dash-occ-label", f"occupancy, last {WINDOW_S} s (peak {self.peak_batch})")
        self._show("dash-occ", sparkline(occ, width, float(cap or max(occ) or 1)))
        self._show("dash-tps-label", f"tok/s, last {WINDOW_S} s (now {tok_s:.1f})")
        self._show("dash-tps", sparkline(tps, width, max(tps) or 1.0))

    def _busiest_step_since_last(self, hist: list[int] | None) -> int:
        """The largest batch among the engine steps since the previous refresh (from the
        step histogram), so a short burst between two samples still shows."""
        if not hist:
            return 0
        prev, self._step_hist = self._step_hist, list(hist)
        if prev is None or len(prev) != len(hist):
            return 0
        return max((n for n, (a, b) in enumerate(zip(prev, hist)) if b > a), default=0)

    def _update_streams(self, streams: list[dict]) -> None:
        rows: dict[str, tuple[str, ...]] = {}
        for x in streams:
            conv = str(x.get("conversation", ""))
            name = self.pane_names.get(conv) or f"other {conv[-6:]}"
            tok_s = x.get("tok_s") or 0.0
            rows[str(x.get("id"))] = (name[:14], str(x.get("state", ""))[:11], str(x.get("tokens", 0)), f"{tok_s:.1f}")
        old: dict[str, tuple[str, ...]] = self._shown.get("rows") or {}  # type: ignore[assignment]
        if rows == old:
            return
        self._shown["rows"] = rows
        table = self.query_one(DataTable)
        if list(rows) == list(old):  # same streams: change the cells that changed, in place
            for key, row in rows.items():
                for col, (a, b) in enumerate(zip(old[key], row)):
                    if a != b:
                        table.update_cell_at((table.get_row_index(key), col), Text(b))
            return
        table.clear()
        for key, row in rows.items():
            table.add_row(*(Text(c) for c in row), key=key)

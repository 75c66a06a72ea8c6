"""The always-visible batch dashboard: backend, occupancy, tok/s, queue, KV blocks, streams
(with each speculating stream's draft acceptance).

It pulls `backend.stats()` (an `EngineStats`: the engine's snapshot, the server's pushed
stats, or what an OpenAI API lets us measure) a few times a second and shows it with
`show_stats`; the words for stream states are chosen here. It only touches a widget when
what it shows has changed.
"""

from __future__ import annotations

import time
from collections import deque

from rich.text import Text
from textual.containers import Vertical
from textual.content import Content
from textual.reactive import var
from textual.widgets import DataTable, Static

from panechat.engine.serving.stats import EngineStats, StreamState, StreamStats
from ...clients.base import ChatBackend
from ..perf import UI_COST

BARS = " ▁▂▃▄▅▆▇█"
WRAPPING = {"dash-backend", "dash-model", "dash-share", "dash-models"}  # may take several lines; the rest take one
# the model line names a chat template only when it is not the file's own (a base model)
_TEMPLATE_NOTE = {"chatml-fallback": "\ntemplate: chatml (fallback)"}
REFRESH_HZ = 4
WINDOW_S = 60
KV_LINES = 2  # the KV words wrap onto this many lines (a fixed height: no layout pass per change)
COLUMNS = ("stream", "state", "tok", "tok/s")
TABLE_EXTRA = 2 * len(COLUMNS) + 1  # one cell's padding each side, and the scrollbar


def cut(text: str, width: int) -> str:
    """`text` in at most `width` columns, its end replaced by '…' when it is cut."""
    return text if len(text) <= width else text[:max(0, width - 1)] + "…"


def wrap_parts(parts: list[str], width: int, lines: int) -> str:
    """`parts` joined with ', ' into at most `lines` lines of `width`, breaking only
    between parts (the last line is cut when they do not fit)."""
    out: list[str] = []
    for part in parts:
        if out and (len(out[-1]) + 2 + len(part) <= width or len(out) == lines):
            out[-1] += ", " + part
        else:
            if out:
                out[-1] += ","
            out.append(part)
    return "\n".join(cut(line, width) for line in out)


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


def kv_words(s: EngineStats) -> str:
    """'KV 12/800 2%, 20 cached, 4 shared, hits 76%': KV blocks held by running generations
    of the budget, then (when there are any) idle blocks kept cached, blocks shared between
    generations, the prefix cache's hit rate in tokens and the KV snapshots written to and
    restored from disk. Bytes are in /metrics."""
    if not s.kv_total:
        return "KV -"
    used = s.kv_in_use or 0
    parts = [f"KV {used}/{s.kv_total} {100 * used / s.kv_total:.0f}%"]
    cached = (s.kv_resident or 0) - used  # idle conversations' blocks kept warm
    if cached > 0:
        parts.append(f"{cached} cached")
    if s.kv_shared:
        parts.append(f"{s.kv_shared} shared")
    if s.prefix_cache_queries:
        parts.append(f"hits {100 * s.prefix_cache_hits / s.prefix_cache_queries:.0f}%")
    if s.kv_snapshots_written or s.kv_snapshots_restored:
        parts.append(f"snapshots {s.kv_snapshots_written} saved {s.kv_snapshots_restored} restored")
    return ", ".join(parts)


def state_words(s: StreamStats) -> str:
    """How the streams table words a stream's state; a decoding stream that has tried
    speculative drafts shows the share of them that stood ("spec 71%", "spec all"): as
    wide as "decoding", so the names keep their width while streams start drafting."""
    if s.state == StreamState.PREFILLING:
        return f"prefill {100 * s.prefill_done // max(1, s.prefill_total)}%"
    if s.state == StreamState.DECODING and s.spec_acceptance is not None:
        pct = int(100 * s.spec_acceptance)  # rounded down: "all" only when every draft stood
        return "spec all" if pct >= 100 else f"spec {pct}%"
    return s.state.value  # queued, decoding, waiting


def spec_words(s: EngineStats) -> str:
    """'spec 2.4 tok/step': the tokens one verify step gives, averaged over the decoding
    streams that speculate ("" when none does): how many tokens a read of the weights
    yields for them."""
    rates = [x.spec_tokens_per_step for x in s.streams
             if x.state == StreamState.DECODING and x.spec_tokens_per_step is not None]
    return f"spec {sum(rates) / len(rates):.1f} tok/step" if rates else ""


class Dashboard(Vertical, can_focus=False):
    """Give it the `backend` at construction; from above, call `set_status`, `set_share`
    and `set_pane_names` (conversation id -> label). It samples `backend.stats()` itself
    and shows each sample with `show_stats`."""

    status_line: var[str] = var("starting…", init=False)  # under the backend, until it names its model
    share_line: var[str] = var("", init=False)  # how teammates connect (--share)
    pane_names: var[dict[str, str]] = var(dict, init=False)
    stats: var[EngineStats | None] = var(None, init=False, always_update=True)  # the latest sample
    model_stats: var[dict[str, EngineStats]] = var(dict, init=False)  # per model, when several

    DEFAULT_CSS = """
    Dashboard {
        width: 46;
        height: 1fr;
        border: round $surface-lighten-2;
        border-title-color: $text-muted;
        padding: 0 1;
    }
    Dashboard Static { height: 1; }
    Dashboard #dash-backend, Dashboard #dash-model, Dashboard #dash-share, Dashboard #dash-models { height: auto; }
    Dashboard #dash-backend { text-style: bold; }
    Dashboard #dash-kv { height: 2; }
    Dashboard.-wide { width: 56; }
    Dashboard #dash-line { display: none; }
    Dashboard.-line { width: 1fr; height: 1; border: none; padding: 0 1; }
    Dashboard.-line > * { display: none; }
    Dashboard.-line > #dash-line { display: block; }
    Dashboard .dash-dim { color: $text-muted; }
    Dashboard .dash-spark { color: $accent; }
    Dashboard #dash-streams-title { margin-top: 1; }
    Dashboard #dash-batch { margin-top: 1; }
    Dashboard DataTable { height: 1fr; scrollbar-size: 1 1; }
    """

    def __init__(self, backend: ChatBackend, **kwargs):
        super().__init__(**kwargs)
        self.backend = backend
        n = WINDOW_S * REFRESH_HZ
        self.occupancy: deque[float] = deque([0.0] * n, maxlen=n)
        self.tok_s: deque[float] = deque([0.0] * n, maxlen=n)
        self.peak_batch = 0
        self._step_hist: tuple[int, ...] | None = None
        self._shown: dict[str, object] = {}
        self._ready = False  # children composed: watchers may draw

    # -- data down ---------------------------------------------------------------------------
    def set_status(self, line: str) -> None:
        """What the backend is doing before it names its model ("loading the model…")."""
        self.status_line = line

    def set_share(self, line: str) -> None:
        """The line telling teammates how to connect (--share)."""
        self.share_line = line

    def set_pane_names(self, names: dict[str, str]) -> None:
        """Labels for this terminal's conversations; other streams show as "alice …" (the
        name the server attributes them to, a --tokens name) or "other …"."""
        self.pane_names = dict(names)

    def show_stats(self, stats: EngineStats | None) -> None:
        """One sample: numbers, sparklines (one column per sample) and the streams table.
        None: no stats yet (still loading or connecting)."""
        self.stats = stats

    def compose(self):
        yield Static(id="dash-line")  # the whole dashboard in one line, on a narrow screen (-line)
        yield Static(id="dash-backend")
        yield Static(id="dash-model", classes="dash-dim")
        yield Static(id="dash-share", classes="dash-dim")
        yield Static(id="dash-batch")
        yield Static(id="dash-models")  # one batch line per model, when several are loaded
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
        self._ready = True
        self.border_title = "batch"
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        self.refresh_stats()
        self.set_interval(1 / REFRESH_HZ, self.refresh_stats)

    def refresh_stats(self) -> None:
        """The periodic sample: the backend's description and its latest stats (per model
        too, when it holds several)."""
        self._show_backend()
        self.model_stats = self.backend.model_stats()
        self.show_stats(self.backend.stats())

    def model_lines(self, width: int = 0) -> list[str]:
        """One batch line per loaded model (none with a single model: the batch line is it),
        each fitting `width` (the name is cut first; 0: the content width)."""
        width = width or max(10, self.content_size.width)
        lines = []
        for name, s in self.model_stats.items():
            cap = f"/{s.batch_max}" if s.batch_max else ""
            rest = f"  {s.batch_now or 0}{cap}  queue {s.queue_depth or 0}  {s.tok_s:.0f} tok/s"
            lines.append(cut(cut(name, max(4, width - len(rest))) + rest, width))
        return lines

    def watch_status_line(self) -> None:
        if self._ready:
            self._show_backend()

    def watch_share_line(self) -> None:
        if self._ready:
            self._show("dash-share", self.share_line)

    def watch_pane_names(self) -> None:
        if self._ready and self.stats is not None:
            self._update_streams(self._all_streams(self.stats))

    def _all_streams(self, s: EngineStats) -> tuple[tuple[str, StreamStats], ...]:
        """(row key, stream) for every model's streams (each Engine numbers its own)."""
        if len(self.model_stats) < 2:
            return tuple((x.id, x) for x in s.streams)
        return tuple((f"{name}/{x.id}", x) for name, ms in self.model_stats.items() for x in ms.streams)

    def watch_stats(self, s: EngineStats | None) -> None:
        if not self._ready:
            return
        t0 = time.perf_counter()
        if s is None:  # not connected (yet, or any more): no figure stays on screen
            self._show("dash-batch", self.backend.trouble() or "batch -")
            self._show("dash-kv", "")
            self._show("dash-line", self.backend.trouble() or self.status_line)
        else:
            self._update_numbers(s, max(10, self.content_size.width))
            self._update_streams(self._all_streams(s))
        UI_COST.add("dashboard", time.perf_counter() - t0)

    def _show(self, widget_id: str, value: str, markup: bool = False) -> None:
        if self._shown.get(widget_id) != value:
            self._shown[widget_id] = value
            # one-line fields have a fixed height: no layout pass (a whole-screen reflow) per update
            fixed = widget_id not in WRAPPING
            self.query_one(f"#{widget_id}", Static).update(Content.from_markup(value) if markup else Content(value),
                                                           layout=not fixed)

    def _show_backend(self) -> None:
        t0 = time.perf_counter()
        info = self.backend.info
        kind = {"local": "local engine", "remote": "panechat server", "openai": "OpenAI API"}.get(info.kind, info.kind)
        where = f" {info.url}" if info.url else ""
        ready = f" · ready in {info.ready_s:.1f} s" if info.ready_s is not None else ""
        self._show("dash-backend", f"{kind}{where}" + (f" · {info.backend}" if info.backend else "") + ready)
        self._show("dash-model", (info.model + _TEMPLATE_NOTE.get(info.chat_template, "")) if info.model
                   else self.status_line)
        if self._shown.get("detail") != info.detail:
            self._shown["detail"] = info.detail
            self.query_one("#dash-backend").tooltip = info.detail or None
        self._show("dash-share", self.share_line)
        UI_COST.add("dashboard", time.perf_counter() - t0)

    def _update_numbers(self, s: EngineStats, width: int) -> None:
        now, cap, tok_s = s.batch_now, s.batch_max, s.tok_s
        if now is None:  # an OpenAI API: only our own streams are known
            now = sum(1 for x in s.streams if x.state == StreamState.DECODING)
        busiest = max(now, self._busiest_step_since_last(s.step_hist))
        self.peak_batch = max(self.peak_batch, busiest)
        self.occupancy.append(float(busiest))
        self.tok_s.append(tok_s)
        cap_text = f"/{cap}" if cap else ""
        parts = [f"batch [b]{now}{cap_text}[/b]"]
        if s.queue_depth is not None:
            parts.append(f"queue {s.queue_depth}")
        if spec := spec_words(s):
            parts.append(spec)
        self._show("dash-batch", "  ".join(parts), markup=True)
        self._show("dash-models", "\n".join(self.model_lines(width)))
        terminals = f"terminals {s.terminals if s.terminals is not None else 1}  "
        self._show("dash-kv", wrap_parts((terminals + kv_words(s)).split(", "), width, KV_LINES))
        kv = kv_words(s).split(", ")[0]
        self._show("dash-line", f"batch [b]{now}{cap_text}[/b]  queue {s.queue_depth or 0}  {tok_s:.1f} tok/s  "
                   f"{terminals}{kv}", markup=True)
        occ = list(self.occupancy)
        tps = list(self.tok_s)
        self._show("dash-occ-label", f"occupancy, last {WINDOW_S} s (peak {self.peak_batch})")
        self._show("dash-occ", sparkline(occ, width, float(cap or max(occ) or 1)))
        self._show("dash-tps-label", f"tok/s, last {WINDOW_S} s (now {tok_s:.1f})")
        self._show("dash-tps", sparkline(tps, width, max(tps) or 1.0))

    def _busiest_step_since_last(self, hist: tuple[int, ...]) -> int:
        """The largest batch among the engine steps since the previous refresh (from the
        step histogram), so a short burst between two samples still shows."""
        if not hist:
            return 0
        prev, self._step_hist = self._step_hist, hist
        if prev is None or len(prev) != len(hist):
            return 0
        return max((n for n, (a, b) in enumerate(zip(prev, hist)) if b > a), default=0)

    def _update_streams(self, streams: tuple[tuple[str, StreamStats], ...]) -> None:
        rows: dict[str, tuple[str, ...]] = {}
        for key, x in streams:
            name = self.pane_names.get(x.conversation) or f"{(x.client or 'other')[:7]} {x.conversation[-6:]}"
            rows[key] = (name, state_words(x)[:11], str(x.tokens), f"{x.tok_s:.1f}")
        # the names take the width the other columns leave (cut with '…')
        others = sum(max(len(head), *(len(r[i]) for r in rows.values())) if rows else len(head)
                     for i, head in enumerate(COLUMNS) if i)
        name_width = max(8, self.content_size.width - others - TABLE_EXTRA)
        rows = {key: (cut(r[0], name_width), *r[1:]) for key, r in rows.items()}
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

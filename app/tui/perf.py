"""What the UI itself costs: time spent in the pane and dashboard update code.

The panes and the dashboard add the time of their hot paths (per-event handling,
throttled Markdown flushes, dashboard refresh) with `UiCost.add`, so a run with 8 streaming
panes can report UI milliseconds per second next to the engine's step time
(docs/benchmarks.md). `main_thread_cpu_s` adds everything else on the UI thread
(Textual layout, Markdown parsing, rendering) via `time.thread_time`.
"""

from __future__ import annotations

import time
from collections import defaultdict


class UiCost:
    """Seconds and call counts per category; cheap enough to leave on."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.t0 = time.perf_counter()
        self.cpu0 = time.thread_time()

    def reset(self) -> None:
        self.__init__()

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds
        self.calls[category] += 1

    def report(self) -> dict:
        """Totals since the last reset; call on the UI thread (thread_time is per thread)."""
        wall = time.perf_counter() - self.t0
        total = sum(self.seconds.values())
        return {"wall_s": wall, "ui_code_s": total, "ui_code_ms_per_s": 1000 * total / wall if wall else 0.0,
                "main_thread_cpu_s": time.thread_time() - self.cpu0,
                "by_category_s": dict(self.seconds), "calls": dict(self.calls)}


UI_COST = UiCost()
"""The process-wide counters the panes and the dashboard add to."""

"""The dashboard at 160x45 under Pilot says what is true, in full: a pane's title during
its first reply, long names, one line per model, every KV figure."""

from __future__ import annotations

from textual.widgets import DataTable

from panechat.app.clients.base import BackendInfo, ChatBackend
from panechat.app.tui.widgets.dashboard import Dashboard, kv_words
from panechat.engine.serving.stats import EngineStats, StreamState, StreamStats

from .conftest import make_app, type_and_send, wait_for

SIZE = (160, 45)
MODELS = ("SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-q4_k_m")


class FixedStats(ChatBackend):
    """A backend showing the stats the test gives (one model, or several)."""

    profile = "test"

    def __init__(self, stats: EngineStats, per_model: dict[str, EngineStats]):
        self.info = BackendInfo(kind="local", model=MODELS[0], backend="numpy")
        self.current, self.per_model = stats, per_model

    async def start(self):
        return self.info

    def stream(self, conversation, messages, params, system="", model=""):
        raise NotImplementedError

    def stats(self):
        return self.current

    def model_stats(self):
        return self.per_model


def _lines(widget) -> list[str]:
    return str(widget.render()).splitlines()


def _fits(widget) -> bool:
    """Every line of `widget` shows whole: no more lines than its height, none wider than it."""
    lines = _lines(widget)
    return len(lines) <= widget.size.height and all(len(x) <= widget.size.width for x in lines)


async def test_every_figure_and_name_shows_whole_at_160x45(store):
    title, long_title = "1 Harbour poems at dawn", "2 " + "A title much longer than the panel is wide" * 2
    stats = EngineStats(batch_now=3, batch_max=8, queue_depth=2, kv_in_use=812, kv_resident=1650, kv_total=4096,
                        kv_shared=96, prefix_cache_queries=1000, prefix_cache_hits=760, kv_snapshots_written=12,
                        kv_snapshots_restored=3, terminals=3)
    streams = (StreamStats("r1", "conv-a", StreamState.DECODING, tokens=120, tok_s=31.5),
               StreamStats("r2", "conv-b", StreamState.DECODING, tokens=9, tok_s=30.0))
    per = {MODELS[0]: EngineStats(batch_now=2, batch_max=4, queue_depth=1, tok_s=41.0, streams=streams),
           MODELS[1]: EngineStats(batch_now=1, batch_max=4, queue_depth=0, tok_s=12.0)}
    app = make_app(FixedStats(stats, per), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        dash = app.main.query_one(Dashboard)
        dash.set_pane_names({"conv-a": title, "conv-b": long_title})
        await pilot.pause(0.6)  # two samples
        kv = dash.query_one("#dash-kv")
        shown = " ".join(_lines(kv))
        assert "terminals 3" in shown and all(part in shown for part in kv_words(stats).split(", ")), shown
        assert _fits(kv), _lines(kv)
        models = dash.query_one("#dash-models")
        assert models.size.height == len(MODELS) and _fits(models), _lines(models)  # one line each, no wrap
        assert [line.split("  ")[0] for line in _lines(models)] == list(MODELS)  # names in full here
        table = dash.query_one(DataTable)
        assert str(table.get_row_at(0)[0]) == title  # longer than 12 characters, whole
        cut = str(table.get_row_at(1)[0])  # too long for the panel: as much as fits, marked as cut
        assert cut.endswith("…") and long_title.startswith(cut[:-1]) and len(cut) >= 24, cut
        assert table.virtual_size.width <= table.size.width  # no column runs off the panel


async def test_a_pane_is_listed_by_its_title_during_its_first_reply(tui_engine, store):
    # long enough to be sampled while it runs: Pilot's Enter returns only once the app is idle
    # enough, which a streaming pane delays (472 tokens were out by then at 240 tok/s; 200 ended first)
    store.set_setting("default_max_tokens", "900")
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the model")
        pane = app.main.panes[0]
        dash = app.main.query_one(Dashboard)
        table = dash.query_one(DataTable)
        await type_and_send(pilot, pane, "Write a long poem about the quiet harbour")
        await wait_for(pilot, lambda: table.row_count > 0, timeout=60, what="the stream in the table")
        name = str(table.get_row_at(0)[0])
        assert pane.busy and name.startswith("1 Write a long poem about"), name
        pane.stop()
        await wait_for(pilot, lambda: not pane.busy, timeout=30, what="the stop")

"""The app at 80x24 under Pilot: the dashboard becomes one line under the panes, the panes
get the width, the footer keeps F2-F5, and every screen and dialog lies inside the screen."""

from __future__ import annotations

from textual.widgets import Footer
from textual.widgets._footer import FooterKey

from panechat.app.tui.widgets.dashboard import Dashboard
from panechat.engine.serving.stats import EngineStats

from .conftest import make_app, wait_for
from .test_dashboard_fit import FixedStats

SMALLEST = (80, 24)


def _outside(screen) -> list[str]:
    """The shown widgets of `screen` whose region is not wholly inside the screen."""
    return [f"{w!r} at {w.region}" for w in screen.query("*")
            if w.display and w.region.area and not screen.region.contains_region(w.region)]


def _footer_keys(app) -> list[str]:
    """The keys the footer shows whole."""
    footer = app.main.query_one(Footer)
    return [k.key for k in footer.query(FooterKey) if k.region.area and app.screen.region.contains_region(k.region)]


def _app(store):
    stats = EngineStats(batch_now=1, batch_max=4, queue_depth=0, kv_in_use=12, kv_total=800, terminals=1)
    return make_app(FixedStats(stats, {}), store)


async def test_the_main_screen_adapts_to_80x24(store):
    app = _app(store)
    async with app.run_test(size=SMALLEST) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await pilot.pause(0.3)
        dash = app.main.query_one(Dashboard)
        assert dash.has_class("-line") and dash.region.height == 1, dash.region
        line = dash.query_one("#dash-line")
        assert line.display and line.region.width >= 76 and line.region.height == 1, line.region
        assert str(line.render()) == "batch 1/4  queue 0  0.0 tok/s  terminals 1  KV 12/800 2%"
        (pane,) = app.main.panes
        assert pane.region.width == 80, pane.region
        assert {"ctrl+n", "ctrl+w", "ctrl+s", "f2", "f3", "f4", "f5"} <= set(_footer_keys(app)), _footer_keys(app)
        await pilot.press("ctrl+n", "ctrl+n")
        await pilot.pause()
        assert [p.region.width >= 26 for p in app.main.panes] == [True] * 3, [p.region for p in app.main.panes]
        await pilot.press("ctrl+o")
        await pilot.pause()
        zoomed = [p for p in app.main.panes if p.display and p.region.area]
        assert len(zoomed) == 1 and zoomed[0].region.width == 80
        assert _outside(app.screen) == []
        await pilot.press("f6")  # the panel on demand
        await pilot.pause()
        assert not dash.has_class("-line") and dash.region.height > 1
        assert _outside(app.screen) == []


async def test_every_screen_and_dialog_lies_inside_80x24(store):
    app = _app(store)
    async with app.run_test(size=SMALLEST) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        store.new_conversation("A forty-character conversation title 001")
        assert _outside(app.screen) == []
        for key in ("f2", "f4", "f5", "ctrl+t", "ctrl+p"):
            app.main.panes[0].focus_input()
            await pilot.press(key)
            await wait_for(pilot, lambda: app.screen is not app.main, what=f"the {key} screen")
            await pilot.pause(0.2)
            assert _outside(app.screen) == [], key
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen is app.main, what=f"the {key} screen to close")

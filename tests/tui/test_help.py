"""F1's help screen, the palette's Keys and Maximize entries and the footer's quit key
(issue 24 item 9), under Pilot at 160x45 and 80x24."""

from __future__ import annotations

import pytest
from textual.widgets import Static

from panechat.app.tui.app import PanechatApp
from panechat.app.tui.commands import Command
from panechat.app.tui.screens.help import HelpScreen
from panechat.app.tui.screens.main import MainScreen

from .conftest import wait_for
from .test_small_terminal import _app, _footer_keys, _outside

SIZES = [(160, 45), (80, 24)]


def _help_text(screen: HelpScreen) -> str:
    return "\n".join(str(s.render()) for s in screen.query(Static))


@pytest.mark.parametrize("size", SIZES)
async def test_f1_lists_the_apps_keys_by_group_and_closes_with_escape_f1_or_q(store, size):
    app = _app(store)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        for close in ("escape", "f1", "q"):
            app.main.panes[0].focus_input()
            await pilot.press("f1")
            await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help screen")
            await pilot.pause(0.2)
            screen = app.screen
            assert _outside(screen) == [], size
            text = _help_text(screen)
            # every key of the main screen and the app, under its group, from the real bindings
            for b in [*MainScreen.BINDINGS, *PanechatApp.BINDINGS]:
                assert (b.title if isinstance(b, Command) else b.description) in text, b
                if isinstance(b, Command):
                    assert b.group_name in screen.groups and any(
                        t == b.title for _, t in screen.groups[b.group_name]), b
            assert "ctrl+p" in text and "ctrl+q" in text and "enter" in text
            assert list(screen.groups)[:2] == ["Panes", "Replies"]  # the app's keys first, not cursor keys
            await pilot.press(close)
            await wait_for(pilot, lambda: app.screen is app.main, what=f"{close} to close the help")


async def test_the_palette_has_one_maximize_and_its_keys_entry_opens_the_help(store):
    app = _app(store)
    async with app.run_test(size=SIZES[0]) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        app.main.panes[0].focus_input()
        await pilot.pause()
        commands = list(app.get_system_commands(app.main))
        titles = [c.title for c in commands]
        assert [t for t in titles if "Maximize" in t] == ["Maximize / restore pane"], titles
        keys = [c for c in commands if c.title == "Keys"]
        assert len(keys) == 1 and "f1" in keys[0].help
        keys[0].callback()
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help screen")
        assert not app.main.query("HelpPanel")  # not Textual's generic panel
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.main, what="the help to close")


@pytest.mark.parametrize("size", SIZES)
async def test_the_footer_shows_the_quit_key_with_f2_to_f5(store, size):
    app = _app(store)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await pilot.pause(0.3)
        shown = set(_footer_keys(app))
        assert {"ctrl+q", "ctrl+n", "ctrl+w", "ctrl+s", "f2", "f3", "f4", "f5"} <= shown, shown

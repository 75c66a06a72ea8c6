"""SVG snapshots of every screen and dialog at 80x24 and 160x45 (issue 24, "Must show").

Each opens the real app on a real (idle, freshly started) engine over a store of fixed
conversations, presses the key a user would, and compares the whole screen with the stored
SVG. Nothing is generated, the dashboard's start-up time is pinned and cursors do not
blink, so the screens are the same on every run. Update with --snapshot-update and look at
the SVGs: at 80x24 each dialog must lie wholly on screen.

F3 (export) and F7 (take over) open no dialog: F3 is a notice naming a temporary path and
F7 needs a second terminal (tests/tui/test_two_terminals.py); they are not here."""

from __future__ import annotations

import pytest

from panechat.app.clients.local import LocalBackend

from .conftest import make_app, running_engine, wait_engine_idle
from .test_snapshots import READY_S, fill

SIZES = {"80x24": (80, 24), "160x45": (160, 45)}
STORED_ONLY = [("Old recipe", "How long do I boil an egg?", "About 9 minutes for a firm yolk."),
               ("Trip notes", "Best time to visit Lisbon?", "Spring or early autumn.")]


@pytest.fixture(scope="module")
def idle_engine(loaded_model):
    """A fresh engine for this module: no other test's conversation in its KV slots."""
    with running_engine(loaded_model) as engine:
        yield engine


def _store_only(store) -> None:
    """Two stored conversations that no pane shows (what F4 lists)."""
    for title, q, a in STORED_ONLY:
        c = store.new_conversation(title, max_tokens=64)
        store.add_message(c.id, "user", q)
        store.add_message(c.id, "assistant", a, {"reason": "stop"})


async def _steady(pilot) -> None:
    """Text cursors blink on a timer: make every one on the screen steady, then let it draw
    until two screenshots 0.1 s apart are the same (a loaded machine draws a dialog's text
    area in more than one refresh)."""
    for _ in range(30):  # a dialog focuses its input on mount: a loaded machine does it late
        focused = pilot.app.focused
        if focused is not None and focused.screen is pilot.app.screen:
            break
        await pilot.pause(0.1)
    for box in pilot.app.screen.query("PromptInput, Input, TextArea"):
        box.cursor_blink = False
    for box in pilot.app.query("PromptInput, TextArea"):  # the screens under a dialog too
        # a text area's blink stops where it was once its screen is not the active one (a
        # pane's input under a dialog showed its cursor in one run of three): only the
        # focused one on the active screen shows it (Textual's own pause, made explicit)
        box._pause_blink(visible=box.has_focus and box.screen is pilot.app.screen)
    last = None
    for _ in range(50):
        await pilot.pause(0.1)
        shot = pilot.app.export_screenshot()
        if shot == last:
            return
        last = shot


def _keys(*keys: str, pane: int = 0):
    """A run_before that focuses pane `pane`, presses `keys` and waits for the screen to settle."""
    async def run(pilot):
        await pilot.pause(0.3)
        pilot.app.main.panes[pane].focus_input()
        await pilot.pause()
        await pilot.press(*keys)
        await pilot.pause(0.3)
        await pilot.wait_for_scheduled_animations()  # a notice slides in; a loaded machine draws it late
        await _steady(pilot)
        await pilot.pause(0.2)
    return run


# name -> (keys, extra setup); the main screen at 160x45 is test_snapshots.test_four_pane_layout
SCREENS = {
    "main": ((), None),
    "help_f1": (("f1",), None),
    "settings_f2": (("f2",), None),
    "conversations_f4": (("f4",), _store_only),
    "model_picker_f5": (("f5",), None),
    "dashboard_toggled_f6": (("f6",), None),
    "broadcast_ctrl_t": (("ctrl+t",), None),
    "edit_prompt_ctrl_g": (("ctrl+g",), None),
    "selected_message_ctrl_up": (("ctrl+up", "ctrl+up"), None),
    "maximized_ctrl_o": (("ctrl+o",), None),
    "command_palette": (("ctrl+p",), None),
}
CASES = [(screen, size) for screen in SCREENS for size in SIZES if (screen, size) != ("main", "160x45")]


@pytest.mark.parametrize(("screen", "size"), CASES, ids=[f"{s}-{z}" for s, z in CASES])
def test_screen(snap_compare, idle_engine, store, screen, size):
    keys, setup = SCREENS[screen]
    fill(store)
    if setup is not None:
        setup(store)
    wait_engine_idle(idle_engine)
    app = make_app(LocalBackend(idle_engine, clock=lambda: READY_S), store)
    assert snap_compare(app, terminal_size=SIZES[size], run_before=_keys(*keys))

"""Every dialog at 80x24, the smallest terminal we support: nothing cut off or hidden."""

from __future__ import annotations

import pytest
from textual.app import App
from textual.widgets import Input, Label

from panechat.app.store import Conversation
from panechat.app.tui.screens.broadcast import BroadcastScreen
from panechat.app.tui.screens.conversations import ConversationsScreen
from panechat.app.tui.screens.pane_settings import PaneSettingsScreen

SMALLEST = (80, 24)


def _not_shown(dialog) -> list[str]:
    """What of `dialog` (a ModalScreen whose one child is its frame) is not wholly visible:
    a widget outside the frame's content area or the screen, or a label whose text needs
    more lines than it has."""
    frame = dialog.children[0]
    problems = [] if dialog.region.contains_region(frame.region) else [f"the frame {frame.region}"]
    for w in frame.query("*"):
        if not w.display:
            continue
        if not frame.content_region.contains_region(w.region):
            problems.append(f"{w!r} at {w.region} outside {frame.content_region}")
        if isinstance(w, Label):
            box = w.content_region
            need = w.get_content_height(box.size, dialog.size, box.width)
            if need > box.height:
                problems.append(f"{w!r} needs {need} lines, has {box.height}")
    return problems


def _conversations(n: int) -> list[Conversation]:
    return [Conversation(f"c-{i}", f"A forty-character conversation title {i:03d}") for i in range(n)]


@pytest.mark.parametrize("make", [
    lambda: BroadcastScreen(8),
    lambda: ConversationsScreen([]),
    lambda: ConversationsScreen(_conversations(30)),
    lambda: PaneSettingsScreen(Conversation("c-1", "New chat", system="Be brief.", seed=7)),
], ids=["broadcast", "conversations-none", "conversations-many", "settings"])
async def test_dialog_fits_at_80x24(make):
    app = App()
    async with app.run_test(size=SMALLEST) as pilot:
        await app.push_screen(make())
        await pilot.pause()
        assert _not_shown(app.screen) == []


async def test_settings_error_fits_at_80x24():
    app = App()
    async with app.run_test(size=SMALLEST) as pilot:
        await app.push_screen(PaneSettingsScreen(Conversation("c-1", "New chat")))
        await pilot.pause()
        app.screen.query_one("#seed", Input).value = "not a number"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "seed must be a whole number" in str(app.screen.query_one("#error", Label).content)
        assert _not_shown(app.screen) == []


async def test_model_picker_fits_at_80x24():
    """F5's dialog, with a long unloadable entry (it ran off the edge: 90 columns wide)."""
    from panechat.app.clients.base import ModelChoice
    from panechat.app.tui.screens.model_picker import ModelPickerScreen

    choices = [ModelChoice("SmolLM2-135M-Instruct.Q4_1", "loaded", loaded=True),
               ModelChoice("gemma-3-270m-q4_k_m", "gemma3 Q4_K_M 241 MiB ctx 32768"),
               ModelChoice("some-model-with-a-long-name-Q8_0", loadable=False,
                           reason="architecture 'mamba' is not supported")]
    app = App()
    async with app.run_test(size=SMALLEST) as pilot:
        await app.push_screen(ModelPickerScreen(choices))
        await pilot.pause()
        assert _not_shown(app.screen) == []

"""F4 under Pilot: search titles and message text, a preview of the highlighted
conversation, its model, delete with undo inside the dialog; fits at 80x24."""

from __future__ import annotations

from textual.widgets import Input, OptionList, Static

from panechat.app.tui.screens.conversations import ConversationsScreen

from .conftest import make_app, wait_for
from .test_dialogs import _not_shown


def _seed(store):
    a = store.new_conversation("Trip to Lisbon", model="other-model")
    store.add_message(a.id, "user", "Where should we eat near the river?")
    store.add_message(a.id, "assistant", "Try the grilled sardines at the market.")
    b = store.new_conversation("Python help")
    store.add_message(b.id, "user", "How do I reverse a list?")
    return a, b


async def _open_f4(pilot, app):
    await wait_for(pilot, app.backend_ready.is_set, what="the backend")
    await pilot.press("f4")
    await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen), what="the dialog")
    await pilot.pause()
    return app.screen


def _titles(dialog):
    options = dialog.query_one(OptionList)
    return [str(options.get_option_at_index(i).prompt).split("  ·  ")[0] for i in range(options.option_count)]


async def test_search_preview_model_and_open(tui_engine, store):
    a, b = _seed(store)
    app = make_app(tui_engine, store)
    async with app.run_test(size=(160, 45)) as pilot:
        dialog = await _open_f4(pilot, app)
        assert set(_titles(dialog)) >= {"Trip to Lisbon", "Python help"}
        lines = {str(dialog.query_one(OptionList).get_option_at_index(i).prompt)
                 for i in range(dialog.query_one(OptionList).option_count)}
        assert any("Trip to Lisbon" in ln and "other-model" in ln for ln in lines)  # the model each used
        assert any("Python help" in ln and app.backend.info.model in ln for ln in lines)
        await pilot.press(*"sardines")  # message text, not in any title
        await pilot.pause()
        assert _titles(dialog) == ["Trip to Lisbon"]
        preview = str(dialog.query_one("#preview", Static).render())
        assert "Where should we eat" in preview and "grilled sardines" in preview
        dialog.query_one("#search", Input).value = "PYTHON"  # titles, any case
        await pilot.pause()
        assert _titles(dialog) == ["Python help"]
        assert "reverse a list" in str(dialog.query_one("#preview", Static).render())
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is app.main, what="the dialog to close")
        await pilot.pause()
        assert app.main.panes[-1].conversation.id == b.id


async def test_delete_with_undo_then_delete_for_good(tui_engine, store):
    a, b = _seed(store)
    app = make_app(tui_engine, store)
    async with app.run_test(size=(160, 45)) as pilot:
        dialog = await _open_f4(pilot, app)
        dialog.query_one("#search", Input).value = "Lisbon"
        await pilot.pause()
        await pilot.press("f8")
        await pilot.pause()
        assert _titles(dialog) == []
        assert store.get_conversation(a.id) is not None  # nothing is gone until the dialog closes
        await pilot.press("ctrl+z")
        await pilot.pause()
        assert _titles(dialog) == ["Trip to Lisbon"]
        await pilot.press("f8", "escape")
        await wait_for(pilot, lambda: app.screen is app.main, what="the dialog to close")
        assert store.get_conversation(a.id) is None and store.messages(a.id) == []
        assert store.get_conversation(b.id) is not None


async def test_the_dialog_with_a_preview_fits_at_80x24(tui_engine, store):
    _seed(store)
    long = store.new_conversation("x" * 120)
    store.add_message(long.id, "user", "word " * 400)
    app = make_app(tui_engine, store)
    async with app.run_test(size=(80, 24)) as pilot:
        dialog = await _open_f4(pilot, app)
        assert _not_shown(dialog) == []
        dialog.query_one("#search", Input).value = "word"
        await pilot.pause()
        assert "word word" in str(dialog.query_one("#preview", Static).render())
        assert _not_shown(dialog) == []

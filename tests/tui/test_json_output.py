"""A pane's JSON output setting, driven with Pilot on the real engine: set in the settings
dialog to a JSON schema file, stored with the conversation, and the reply matches it."""

from __future__ import annotations

import json

import jsonschema
from textual.widgets import Input, Label

from panechat.app.tui.screens.pane_settings import PaneSettingsScreen

from .conftest import make_app, type_and_send, wait_for

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["colour", "count"], "additionalProperties": False}


async def test_a_pane_with_a_schema_file_replies_in_it(tui_engine, store, tmp_path):
    schema_file = tmp_path / "colour.json"
    schema_file.write_text(json.dumps(SCHEMA))
    store.set_setting("default_max_tokens", "40")
    app = make_app(tui_engine, store)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        pane.focus_input()
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, PaneSettingsScreen), what="settings")
        app.screen.query_one("#json_output", Input).value = str(tmp_path / "missing.json")
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "cannot read the JSON schema file" in str(app.screen.query_one("#error", Label).content)
        app.screen.query_one("#json_output", Input).value = str(schema_file)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.main, what="the dialog to close")
        assert store.get_conversation(pane.conversation.id).json_output == str(schema_file)
        await type_and_send(pilot, pane, "Pick a colour and a number.")
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, timeout=120, what="the reply")
        assert pane.last_finish.reason == "stop", pane.last_finish
        jsonschema.validate(json.loads(pane.last_finish.text), SCHEMA)

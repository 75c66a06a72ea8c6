"""The per-pane settings dialog: title, system prompt, temperature, max tokens, seed, JSON
output, and the request schema's other per-pane fields (top p/k, min p, stop, penalties,
speculative drafts)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, TextArea

from ...store import Conversation
from ..json_output import response_format_of
from ..sampling_fields import NUMBERS, changed, read_number, read_spec, read_stop, show_stop


@dataclass
class PaneSettings:
    """What the dialog returns (validated)."""

    title: str
    system: str
    temperature: float
    max_tokens: int
    seed: int | None
    json_output: str = ""  # app/tui/json_output.py
    sampling: dict | None = None  # the other fields away from their defaults (app/tui/sampling_fields.py)


class PaneSettingsScreen(ModalScreen[PaneSettings | None]):
    """Edit one conversation's settings; dismisses with PaneSettings, or None on cancel."""

    DEFAULT_CSS = """
    PaneSettingsScreen { align: center middle; }
    PaneSettingsScreen > Vertical {
        width: 76; max-width: 100%; height: auto; max-height: 100%;
        border: round $primary; background: $surface; padding: 0 1;
    }
    PaneSettingsScreen Grid {
        grid-size: 4; grid-columns: 15 1fr 15 1fr; grid-rows: auto; height: auto; grid-gutter: 0 1;
        margin-top: 1;
    }
    PaneSettingsScreen .wide { column-span: 3; }
    PaneSettingsScreen Label { padding: 0; }
    PaneSettingsScreen TextArea { height: 3; }
    PaneSettingsScreen #error { color: $error; height: auto; padding: 0; }
    PaneSettingsScreen Horizontal { height: auto; align: right middle; }
    PaneSettingsScreen Button { margin-left: 1; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, conversation: Conversation):
        super().__init__()
        self.conversation = conversation

    def compose(self):
        c = self.conversation
        with Vertical():
            with Grid():
                yield Label("Title")
                yield Input(c.title, id="title", classes="wide", compact=True)
                yield Label("System prompt")
                yield TextArea(c.system, id="system", soft_wrap=True, classes="wide", compact=True)
                yield Label("Temperature")
                yield Input(f"{c.temperature:g}", id="temperature", type="number", compact=True)
                yield Label("Max tokens")
                yield Input(str(c.max_tokens), id="max_tokens", type="integer", compact=True)
                yield Label("Seed")
                yield Input("" if c.seed is None else str(c.seed), id="seed", type="integer",
                            placeholder="random", compact=True)
                yield Label("JSON output")
                yield Input(c.json_output, id="json_output", placeholder="off; json; a schema file", compact=True)
                yield Label("Stop")
                yield Input(show_stop(c.sampling.get("stop") or []), id="stop", classes="wide", compact=True,
                            placeholder='none; a string, or a JSON list ["###", "\\n\\n"]')
                for name, label, default in NUMBERS:
                    yield Label(label)
                    yield Input(f"{c.sampling.get(name, default):g}", id=name, placeholder=f"{default:g}",
                                compact=True)
                yield Label("Drafts")  # speculative decoding: the same reply, sooner where it repeats
                yield Input("on" if c.sampling.get("spec", True) else "off", id="spec", placeholder="on",
                            compact=True)
            yield Label("", id="error")
            with Horizontal():
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Save", id="save", variant="primary", compact=True)

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "pane settings"
        self.query_one("#title", Input).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def on_input_submitted(self) -> None:
        self.action_save()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        try:
            result = self._read()
        except ValueError as e:
            self.query_one("#error", Label).update(str(e))
            return
        self.dismiss(result)

    def _read(self) -> PaneSettings:
        val = {w.id: w.value.strip() for w in self.query(Input)}
        try:
            temperature = float(val["temperature"] or 0)
        except ValueError:
            raise ValueError("temperature must be a number") from None
        if not 0.0 <= temperature <= 10.0:
            raise ValueError("temperature must be between 0 and 10")
        try:
            max_tokens = int(val["max_tokens"] or 0)
        except ValueError:
            raise ValueError("max tokens must be a whole number") from None
        if max_tokens < 1:
            raise ValueError("max tokens must be at least 1")
        try:
            seed = int(val["seed"]) if val["seed"] else None
        except ValueError:
            raise ValueError("seed must be a whole number, or empty for random") from None
        response_format_of(val["json_output"])  # a schema file that cannot be used is said now
        sampling = changed({**{name: read_number(name, val[name]) for name, _, _ in NUMBERS},
                            "stop": read_stop(val["stop"]), "spec": read_spec(val["spec"])})
        return PaneSettings(val["title"] or self.conversation.title, self.query_one("#system", TextArea).text,
                            temperature, max_tokens, seed, val["json_output"], sampling)

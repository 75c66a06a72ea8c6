"""Pick a model for a pane: the loaded ones first, then what `panechat models` finds
(those panechat cannot load are listed, greyed out, with the reason)."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from ...clients.base import ModelChoice
from ..widgets.pane import BASE_NOTE


class ModelPickerScreen(ModalScreen[str | None]):
    """Dismisses with the chosen model's name, or None."""

    DEFAULT_CSS = """
    ModelPickerScreen { align: center middle; }
    ModelPickerScreen > Vertical {
        width: 90; max-width: 100%; height: 70%; border: round $primary; background: $surface; padding: 1 2;
    }
    ModelPickerScreen OptionList { height: 1fr; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, choices: list[ModelChoice]):
        super().__init__()
        self.choices = choices

    def compose(self):
        with Vertical():
            if self.choices:
                yield OptionList(*[Option(_line(c), id=f"m{i}", disabled=not c.loadable)
                                   for i, c in enumerate(self.choices)])
            else:
                yield Label("No models found; `panechat models` says where panechat looks.")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "open a pane on a model"

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.choices[int(event.option.id[1:])].name)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _line(c: ModelChoice) -> str:
    if not c.loadable:
        return f"{c.name}  ·  cannot load: {c.reason}"
    parts = [c.name, BASE_NOTE if c.base else "", c.detail]
    return "  ·  ".join(p for p in parts if p)

"""The request fields a pane's settings offer beyond temperature, max tokens and seed:
named as in the one request schema (app/server/request_schema.py), with its websocket
defaults and the engine's bounds (engine/serving/sampling.py BOUNDS), so the dialog
refuses what a server would. A conversation stores only those set away from the default
(`Conversation.sampling`)."""

from __future__ import annotations

import json

from panechat.engine.serving.sampling import BOUNDS

#: (field, label, default): the numbers, in the dialog's order (tests check the defaults
#: against the request schema's `/ws` column)
NUMBERS: tuple[tuple[str, str, float | int], ...] = (
    ("top_p", "Top p", 1.0),
    ("top_k", "Top k", 0),
    ("min_p", "Min p", 0.0),
    ("presence_penalty", "Presence pen.", 0.0),
    ("frequency_penalty", "Frequency pen.", 0.0),
    ("repeat_penalty", "Repeat pen.", 1.0),
    ("repeat_last_n", "Repeat last n", 64),
)
DEFAULTS: dict[str, float | int | bool] = {name: default for name, _, default in NUMBERS}
DEFAULTS["spec"] = True  # speculative drafts (issue 27): "on" or "off" in the dialog
MAX_STOP, MAX_STOP_LEN = 16, 256  # the schema's stop limits (app/server/request_fields.py)


def read_number(name: str, text: str) -> float | int:
    """The field's value from the dialog's text (empty: the default); ValueError names the
    field and its range, as the server words it."""
    text = text.strip()
    if not text:
        return DEFAULTS[name]
    bound = BOUNDS[name]
    try:
        value = int(text) if bound.integer else float(text)
    except ValueError:
        raise ValueError(f"{name} must be {bound.range}") from None
    why = bound.problem(value)
    if why is not None:
        raise ValueError(f"{name} {why}")
    return value


def read_stop(text: str) -> list[str]:
    """Stop strings: a JSON list of strings (`["###", "\\n\\n"]`), or one plain string."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            stops = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError('stop must be a JSON list of strings, e.g. ["###", "\\n\\n"], or one string') from None
    else:
        stops = [text]
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a JSON list of strings, or one string")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_LEN for s in stops):
        raise ValueError(f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_LEN} characters")
    return [s for s in stops if s]


def read_spec(text: str) -> bool:
    """Speculative drafts from the dialog's text: on (also empty) or off."""
    word = text.strip().lower()
    if word not in ("", "on", "off"):
        raise ValueError("drafts must be on or off (speculative decoding; the reply is the same either way)")
    return word != "off"


def show_stop(stops: list[str]) -> str:
    """The dialog's text for stored stop strings (read_stop reads it back)."""
    if not stops:
        return ""
    if len(stops) == 1 and stops[0].strip() == stops[0] and not stops[0].startswith("[") and stops[0].isprintable():
        return stops[0]
    return json.dumps(stops)


def changed(values: dict) -> dict:
    """Only the fields set away from their defaults (what a conversation stores)."""
    out = {k: v for k, v in values.items() if k in DEFAULTS and v != DEFAULTS[k]}
    if values.get("stop"):
        out["stop"] = list(values["stop"])
    return out

"""A pane's JSON output setting as OpenAI's `response_format`: empty (free text), `json`
(any JSON object) or the path of a JSON schema file (the reply matches the schema)."""

from __future__ import annotations

import json
from pathlib import Path


def response_format_of(setting: str) -> dict | None:
    """The `response_format` a pane's JSON output setting asks for; ValueError (one line)
    for a schema file that cannot be read or is not a JSON object."""
    setting = setting.strip()
    if not setting:
        return None
    if setting.lower() == "json":
        return {"type": "json_object"}
    path = Path(setting).expanduser()
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read the JSON schema file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"the JSON schema file {path} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema file {path} must hold a JSON object")
    return {"type": "json_schema", "json_schema": {"name": path.stem or "schema", "schema": schema, "strict": True}}

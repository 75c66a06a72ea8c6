"""Typed reads of the fields that shape a reply rather than sample it: `response_format`,
`grammar`, `tools` and `tool_choice` (OpenAI's chat request; `grammar` as llama.cpp's
server). Each returns the value checked, or raises FieldError naming the field, as the
readers of request_fields.py do; what they ask for is built in structured_output.py."""

from __future__ import annotations

from .request_fields import FieldError

FORMAT_TYPES = ("text", "json_object", "json_schema")
MAX_GRAMMAR = 64 * 1024  # characters: a grammar is compiled at submit


def response_format(key: str, v) -> dict | None:
    """{"type": "text" | "json_object" | "json_schema"}; json_schema needs `json_schema.schema`
    (an object; `strict` is taken either way: the grammar always holds the reply to it).
    "text" asks for nothing: None."""
    if not isinstance(v, dict):
        raise FieldError(key, "must be an object", code=None)
    kind = v.get("type")
    if kind not in FORMAT_TYPES:
        raise FieldError(key, f"type must be one of {', '.join(FORMAT_TYPES)} (got {str(kind)[:40]!r})",
                         code="invalid_value")
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise FieldError(key, 'json_schema must be {"name": ..., "schema": {...}}', code="invalid_value")
    return None if kind == "text" else v


def grammar_text(key: str, v) -> str:
    """A Lark or GBNF grammar, as text."""
    if not isinstance(v, str) or not v.strip():
        raise FieldError(key, "must be a Lark or GBNF grammar (a non-empty string)", code=None)
    if len(v) > MAX_GRAMMAR:
        raise FieldError(key, f"is longer than {MAX_GRAMMAR} characters", code="invalid_value")
    return v


def tool_list(key: str, v) -> list[dict] | None:
    """OpenAI function tools: [{"type": "function", "function": {"name", "description"?,
    "parameters"?}}], names unique; an empty list asks for nothing: None."""
    if not isinstance(v, list):
        raise FieldError(key, "must be a list of tools", code=None)
    seen = set()
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise FieldError(key, f'[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', code=None)
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in seen:
            raise FieldError(key, f"[{i}].function.name must be a non-empty string, unique", code=None)
        if not isinstance(fn.get("parameters", {}), dict):
            raise FieldError(key, f"[{i}].function.parameters must be a JSON schema object", code=None)
        seen.add(name)
    return v or None


def tool_choice(key: str, v) -> str:
    """"none", "auto", "required", or {"type": "function", "function": {"name": ...}}, read as
    that function's name."""
    if v in ("none", "auto", "required"):
        return v
    fn = v.get("function") if isinstance(v, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"] not in ("none", "auto", "required"):
        return fn["name"]
    raise FieldError(key, 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                     code="invalid_value")

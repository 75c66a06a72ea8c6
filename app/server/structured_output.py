"""What a request asks its reply to be, from OpenAI-shaped fields: a grammar
(`response_format`, llama.cpp's `grammar`) and tools (`tools`, `tool_choice`,
`parallel_tool_calls`). Any protocol that maps its own fields onto these names (the Ollama
API's `format` and `tools`) gets the same behaviour from `output_plan`.

Tools are rendered by the model's own chat template when it knows them (`tool_choice`
"auto"), and its reply is parsed in that template's format. Otherwise (SmolLM2's template
knows no tools, and for "required" or a named function with any template) the tools are
described in the system prompt and a grammar holds the reply to llama.cpp's generic JSON
format: one call whose arguments match the function's parameters schema, or under "auto"
also `{"response": text}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from panechat.engine.serving.grammar import json_schema_grammar, response_format_grammar, text_grammar
from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.text.tool_calls import (GENERIC, ToolCall, generic_history, generic_instructions,
                                             generic_schema, native_history, parse_reply, template_format)

from .request_fields import FieldError


@dataclass(frozen=True)
class OutputPlan:
    """How to prompt for and read one reply. `grammar`: the llguidance grammar its tokens
    are held to (None: free text). `tool_format`: the format its tool calls are read in
    (None: no tools offered); `template_tools`: the tools the chat template renders itself;
    `instructions`: the system text describing them otherwise."""

    grammar: str | None = None
    tool_format: str | None = None
    template_tools: list[dict] | None = None
    instructions: str | None = None
    parallel: bool = True

    def prompt_messages(self, messages: list[dict]) -> list[dict]:
        """`messages` as the template takes them: tool calls and results in the template's
        own shape, or as generic JSON text with the tool instructions in the system message."""
        if self.template_tools is not None:
            return [native_history(m) for m in messages]
        out = [generic_history(m) for m in messages]
        if self.instructions is None:
            return out
        if out and out[0]["role"] == "system":
            return [{**out[0], "content": f"{out[0]['content']}\n\n{self.instructions}"}, *out[1:]]
        return [{"role": "system", "content": self.instructions}, *out]

    def reply(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole reply's text; content None when it is only calls."""
        if self.tool_format is None:
            return text, []
        content, calls = parse_reply(text, self.tool_format)
        calls = [c.with_id() for c in (calls if self.parallel else calls[:1])]
        return (content or None) if calls else content, calls


def output_plan(fields: Mapping, template_source: str) -> OutputPlan:
    """The plan the fields ask for (`response_format`, `grammar`, `tools`, `tool_choice`,
    `parallel_tool_calls`, as request_schema.py reads them; absent ones ask for nothing)
    under a chat template of `template_source`. FieldError naming the field for a request
    that contradicts itself or a schema that does not compile."""
    tools, choice = fields.get("tools"), fields.get("tool_choice") or "auto"
    parallel = fields.get("parallel_tool_calls", True) is not False
    if not tools:
        if choice not in ("auto", "none"):
            raise FieldError("tool_choice", f"{choice!r} needs `tools`", code="invalid_value")
        return OutputPlan(grammar=_format_grammar(fields), parallel=parallel)
    if choice == "none":
        return OutputPlan(grammar=_format_grammar(fields), parallel=parallel)
    if choice not in ("auto", "required") and choice not in {t["function"]["name"] for t in tools}:
        raise FieldError("tool_choice", f"names the function {choice!r}, which is not in `tools`",
                         code="invalid_value")
    fmt = template_format(template_source)
    if choice == "auto" and fmt != GENERIC:
        return OutputPlan(grammar=_format_grammar(fields), tool_format=fmt, template_tools=tools, parallel=parallel)
    grammar = _compiled(lambda: json_schema_grammar(generic_schema(tools, choice), "tools"), "tools")
    return OutputPlan(grammar=grammar, tool_format=GENERIC, parallel=parallel,
                      instructions=generic_instructions(tools, choice))


def _format_grammar(fields: Mapping) -> str | None:
    """The grammar of `response_format` or of `grammar` (not both)."""
    fmt, text = fields.get("response_format"), fields.get("grammar")
    if fmt is not None and text is not None:
        raise FieldError("grammar", "cannot be combined with response_format; send one of them", code="invalid_value")
    if text is not None:
        return _compiled(lambda: text_grammar(text), "grammar")
    return _compiled(lambda: response_format_grammar(fmt), "response_format")


def _compiled(build, key: str) -> str:
    try:
        return build()
    except InvalidRequest as e:
        raise FieldError(key, "", code="invalid_value", sentence=str(e)) from None

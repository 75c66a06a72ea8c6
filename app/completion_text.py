"""A conversation as the one text a base model continues (the TUI's base-model panes).

A base model has no chat template: like `panechat run --raw`, it is given plain text, no
template, BOS as the file says. The text is the system prompt (if any) and every turn as
written, each reply right after the text it continued; a later prompt starts a new line
unless the text before it already ends in whitespace.
"""

from __future__ import annotations


def completion_text(messages: list[dict]) -> str:
    """The text of `messages` (system first if any) for a raw completion."""
    parts: list[str] = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("role") == "assistant" or not parts or parts[-1][-1:].isspace():
            parts.append(content)
        else:  # a system prompt or a prompt after a reply: on its own line
            parts.append("\n" + content)
    return "".join(parts)

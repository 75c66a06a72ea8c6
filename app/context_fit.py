"""Fitting a conversation into the context: the one rule the TUI's local engine and the
websocket server both apply before they submit a chat turn.

A conversation whose prompt fits is sent as it is (the reply may then run into the
context's end, as before). One that does not fit loses its oldest turns after the system
prompt, whole user turns with what followed them, until the prompt leaves `reserve`
tokens for the reply (llama.cpp's context shift and Open WebUI drop the same turns). The
caller says how many were dropped; the stored history keeps them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Tokenize = Callable[[list[dict]], Sequence[int]]


@dataclass(frozen=True)
class ContextFit:
    """The messages to send, how many earlier ones were left out, and their token ids."""

    messages: list[dict]
    dropped: int
    ids: Sequence[int]


def reply_room(max_tokens: int, ctx: int) -> int:
    """Tokens a trimmed prompt leaves for the reply: max_tokens, at most a quarter of the context."""
    return max(1, min(max_tokens, ctx // 4))


def fit_context(messages: list[dict], tokenize: Tokenize, ctx: int, reserve: int) -> ContextFit:
    """`messages` (system first if any, the new user turn last) as they fit `ctx` tokens.

    When the whole prompt fits (fewer than `ctx` tokens) it is returned unchanged. Else the
    fewest oldest turns are dropped that bring it to `ctx - reserve` tokens; when even the
    last user turn alone does not fit, that turn (with the system prompt) is returned, for
    the engine to refuse with its own message. Tokenizes O(log turns) times."""
    ids = tokenize(messages)
    if len(ids) < ctx:
        return ContextFit(messages, 0, ids)
    head = messages[:1] if messages and messages[0].get("role") == "system" else []
    turns = messages[len(head):]
    starts = [i for i, m in enumerate(turns) if m.get("role") == "user" and i > 0]
    if not starts:
        return ContextFit(messages, 0, ids)
    budget = ctx - reserve
    best: ContextFit | None = None
    lo, hi = 0, len(starts) - 1
    while lo <= hi:  # the earliest start whose tail fits the budget (drops grow with the start)
        mid = (lo + hi) // 2
        kept = head + turns[starts[mid]:]
        kept_ids = tokenize(kept)
        if len(kept_ids) <= budget:
            best, hi = ContextFit(kept, starts[mid], kept_ids), mid - 1
        else:
            lo = mid + 1
    if best is None:  # not even the last turn leaves the reserve: send it alone if it fits at all
        kept = head + turns[starts[-1]:]
        best = ContextFit(kept, starts[-1], tokenize(kept))
    return best

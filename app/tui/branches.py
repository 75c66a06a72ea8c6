"""A conversation's branches: the other continuations kept at a point of its history.

A branch point at position p (an index into the history) holds every continuation that
started there, `{"alts": [{"messages": [...], "branches": {...}}, ...], "current": i}`:
alternative i is what the history holds from p on (its stored copy is refreshed when
another is flipped in). Branch points deeper than p belong to a continuation and travel
with it. Messages are `{"role", "content", "meta"}` dicts, as JSON stores them.
"""

from __future__ import annotations

from ..store import Message

Branches = dict[int, dict]


def _dump(messages: list[Message]) -> list[dict]:
    return [{"role": m.role, "content": m.content, "meta": m.meta} for m in messages]


def _load(messages: list[dict]) -> list[Message]:
    return [Message(m["role"], m["content"], dict(m.get("meta") or {})) for m in messages]


def _split(branches: Branches, pos: int) -> tuple[Branches, Branches]:
    """(points at or before `pos`, points after it, their positions as they are)."""
    return ({p: s for p, s in branches.items() if p <= pos}, {p: s for p, s in branches.items() if p > pos})


def fork(history: list[Message], branches: Branches, pos: int) -> tuple[list[Message], Branches]:
    """Keep history[pos:] as a branch at `pos` and start a new, empty continuation there:
    returns the history cut to `pos` and the branch points."""
    keep, deeper = _split(branches, pos)
    tail = {"messages": _dump(history[pos:]), "branches": {str(p): s for p, s in deeper.items()}}
    state = keep.get(pos)
    if state is None:
        state = {"alts": [tail], "current": 0}
    else:
        state["alts"][state["current"]] = tail
    state["alts"].append({"messages": [], "branches": {}})
    state["current"] = len(state["alts"]) - 1
    return history[:pos], {**keep, pos: state}


def flip(history: list[Message], branches: Branches, pos: int, step: int) -> tuple[list[Message], Branches]:
    """Show the continuation `step` places along at branch point `pos` (wrapping around)."""
    keep, deeper = _split(branches, pos)
    state = keep[pos]
    state["alts"][state["current"]] = {"messages": _dump(history[pos:]),
                                       "branches": {str(p): s for p, s in deeper.items()}}
    state["current"] = (state["current"] + step) % len(state["alts"])
    alt = state["alts"][state["current"]]
    restored = {int(p): s for p, s in alt["branches"].items()}
    return history[:pos] + _load(alt["messages"]), {**keep, **restored}


def after_delete(branches: Branches, index: int) -> Branches:
    """The branch points once message `index` is deleted: those after it move up one."""
    return {p - 1 if p > index else p: s for p, s in branches.items()}


def label(branches: Branches, pos: int) -> str:
    """`< 2/3 >` for a branch point, '' where there is none."""
    state = branches.get(pos)
    if state is None or len(state["alts"]) < 2:
        return ""
    return f"< {state['current'] + 1}/{len(state['alts'])} >"


def from_store(stored: dict[int, dict]) -> Branches:
    """The store's rows as branch points (JSON keys of deeper points are strings)."""
    return {int(p): s for p, s in stored.items()}

"""Resident KV slots: which conversation's tokens each cache slot holds.

A slot keeps its tokens between turns, so the next turn of the same conversation (or any
request whose prompt starts with them) prefills only the new tokens. When every slot is
taken, the least recently used idle slot is evicted; its owner is rebuilt by prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is cached, in order
    conversation: str | None = None
    busy: bool = False
    last_used: float = 0.0


@dataclass(frozen=True)
class Grant:
    """A slot given to a request: the first `reuse` prompt tokens are cached in it once
    the KV of that many positions is copied from slot `copy_from` (when not None)."""

    slot: Slot
    reuse: int
    copy_from: int | None


class SlotPool:
    """Bookkeeping for `n` KV slots; the arrays live in the backend's KV store."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError("kv-sessions must be at least 1")
        self.slots = [Slot(i) for i in range(n)]
        self.evictions = 0
        # (slot index, tokens) of each eviction since the engine last took them: their KV is
        # still in the slot until the step's copies and forward pass (kv_persistence.py)
        self.evicted: list[tuple[int, list[int]]] = []

    @property
    def in_use(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    @property
    def resident(self) -> int:
        return sum(1 for s in self.slots if s.tokens or s.busy)

    def acquire(self, conversation: str, prompt: list[int]) -> Grant | None:
        """Choose a slot for `prompt`, or None when every slot is busy.

        1. An idle slot whose whole content starts the prompt: continue in it (longest wins,
           the conversation's own slot breaks ties); nothing cached is lost.
        2. Otherwise an empty slot, else the least recently used idle one (an eviction);
           the longest prefix shared with any slot is copied into it rather than taken
           from a slot that still holds another conversation's history.
        At least one prompt token is always left to compute, so the step yields logits."""
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        limit = len(prompt) - 1
        whole = [s for s in idle if s.tokens and _common_prefix(s.tokens, prompt) == len(s.tokens)]
        if whole:
            slot = max(whole, key=lambda s: (len(s.tokens), s.conversation == conversation))
            return self._grant(slot, conversation, min(len(slot.tokens), limit), None)
        empty = [s for s in idle if not s.tokens]
        if empty:
            slot = empty[0]
        else:
            slot = min(idle, key=lambda s: s.last_used)
            self.evictions += 1
            self.evicted.append((slot.index, list(slot.tokens)))
        source, shared = None, 0
        for s in self.slots:
            n = _common_prefix(s.tokens, prompt)
            if n > shared:
                source, shared = s, n
        shared = min(shared, limit)
        if source is slot or shared == 0:
            return self._grant(slot, conversation, shared if source is slot else 0, None)
        slot.tokens = list(prompt[:shared])
        return self._grant(slot, conversation, shared, source.index)

    def _grant(self, slot: Slot, conversation: str, reuse: int, copy_from: int | None) -> Grant:
        del slot.tokens[reuse:]
        slot.busy, slot.conversation, slot.last_used = True, conversation, time.monotonic()
        return Grant(slot, reuse, copy_from)

    def take_evicted(self) -> list[tuple[int, list[int]]]:
        """The evictions since the last call, (slot index, tokens it held), oldest first."""
        out, self.evicted = self.evicted, []
        return out

    def release(self, slot: Slot, tokens: list[int] | None) -> None:
        """Return a slot; `tokens` are those now cached in it (None drops its contents)."""
        slot.busy = False
        slot.last_used = time.monotonic()
        slot.tokens = list(tokens) if tokens else []
        if not slot.tokens:
            slot.conversation = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

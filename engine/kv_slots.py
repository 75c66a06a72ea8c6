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


class SlotPool:
    """Bookkeeping for `n` KV slots; the arrays live in the backend's KV store."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError("kv-sessions must be at least 1")
        self.slots = [Slot(i) for i in range(n)]
        self.evictions = 0

    @property
    def in_use(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    @property
    def resident(self) -> int:
        return sum(1 for s in self.slots if s.tokens or s.busy)

    def acquire(self, conversation: str, prompt: list[int]) -> tuple[Slot, int] | None:
        """Take the idle slot sharing the longest prefix with `prompt` (the conversation's
        own slot wins ties), else an empty one, else evict the LRU idle one.

        Returns (slot, reusable prefix length) or None when every slot is busy. At least
        one prompt token is always left to compute, so the step yields its logits."""
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        best, best_len = None, 0
        for s in idle:
            n = _common_prefix(s.tokens, prompt)
            if n > best_len or (n == best_len and n > 0 and s.conversation == conversation):
                best, best_len = s, n
        if best is None:
            empty = [s for s in idle if not s.tokens]
            if empty:
                best = empty[0]
            else:
                best = min(idle, key=lambda s: s.last_used)
                self.evictions += 1
        reuse = min(best_len, len(prompt) - 1)
        del best.tokens[reuse:]
        best.busy, best.conversation, best.last_used = True, conversation, time.monotonic()
        return best, reuse

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

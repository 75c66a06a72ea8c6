"""In-memory conversations for the websocket protocol: any terminal can resume one.

Everything runs on the server's event loop, so no locking. Bounded: past `max_items`
the least recently touched idle conversation is dropped.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field


@dataclass
class Conversation:
    id: str
    messages: list[dict] = field(default_factory=list)  # [{"role", "content"}], system first
    busy: str | None = None  # id of the generation in flight, if any
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def set_system(self, text: str) -> None:
        """Replace (or add, or with "" remove) the leading system message."""
        if self.messages and self.messages[0]["role"] == "system":
            self.messages.pop(0)
        if text:
            self.messages.insert(0, {"role": "system", "content": text})
        self.updated = time.time()

    @property
    def has_turns(self) -> bool:
        return any(m["role"] != "system" for m in self.messages)

    def seed(self, turns: list[dict]) -> None:
        """Give a conversation without turns the earlier turns a client kept."""
        self.messages.extend(dict(m) for m in turns)
        self.updated = time.time()

    def append(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})
        self.updated = time.time()

    def summary(self) -> dict:
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        return {"conversation": self.id, "title": first[:60], "messages": len(self.messages),
                "busy": self.busy is not None, "updated": self.updated}

    def snapshot(self) -> list[dict]:
        return [dict(m) for m in self.messages]


class ConversationStore:
    """Conversations by id; ids the server makes are `c-1`, `c-2`, ..."""

    def __init__(self, max_items: int = 10_000):
        self.max_items = max_items
        self._items: dict[str, Conversation] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._items)

    def get(self, cid: str) -> Conversation | None:
        return self._items.get(cid)

    def open(self, cid: str | None = None) -> tuple[Conversation, bool]:
        """The conversation `cid` (created when unknown, or a new id when None);
        returns (conversation, created)."""
        if cid is None:
            cid = f"c-{next(self._ids)}"
            while cid in self._items:
                cid = f"c-{next(self._ids)}"
        conv = self._items.get(cid)
        if conv is not None:
            return conv, False
        self._evict()
        conv = self._items[cid] = Conversation(cid)
        return conv, True

    def list(self) -> list[dict]:
        return [c.summary() for c in sorted(self._items.values(), key=lambda c: -c.updated)]

    def _evict(self) -> None:
        while len(self._items) >= self.max_items:
            idle = [c for c in self._items.values() if c.busy is None]
            if not idle:
                return
            del self._items[min(idle, key=lambda c: c.updated).id]

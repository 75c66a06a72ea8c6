"""In-memory conversations for the websocket protocol: any terminal can resume one.

Everything runs on the server's event loop, so no locking. Bounded twice: by count
(`max_items`) and by bytes (`max_bytes`, `--history-memory`). Past either, the least
recently used idle conversation is dropped, first among those no open socket has opened,
then any idle one; a conversation with a generation running is never dropped. A terminal
keeps its own copy of every conversation and sends it back with `open` (docs/protocol.md),
so a dropped conversation comes back when its terminal reopens it.

With a `ConversationDB` (conversation_db.py, `panechat serve`'s state folder) every change
is written through as it happens and the conversations are loaded back at start, within
the same limits: a dropped conversation is deleted there too.

Sizes are what Python holds: each string's `sys.getsizeof` (1, 2 or 4 bytes a character,
as the widest character needs: counting UTF-8 bytes would take a text with one emoji for a
quarter of its size) plus the message dict.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .conversation_db import ConversationDB

#: Bytes a message's dict costs beyond its strings (a two-key dict).
MESSAGE_OVERHEAD = sys.getsizeof({"role": "", "content": ""})
#: Bytes a conversation costs with no messages (its object, list, id and the store's entry).
CONVERSATION_OVERHEAD = 1024


def message_bytes(role: str, content: str) -> int:
    """What one stored message costs in memory, by the rule above."""
    return MESSAGE_OVERHEAD + sys.getsizeof(role) + sys.getsizeof(content)


class HistoryTooLarge(ValueError):
    """A conversation would outgrow the whole history budget on its own."""


@dataclass(eq=False)
class Conversation:
    id: str
    messages: list[dict] = field(default_factory=list)  # [{"role", "content"}], system first
    busy: str | None = None  # id of the generation in flight, if any
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    nbytes: int = CONVERSATION_OVERHEAD  # memory held, by message_bytes
    # the open sockets (websocket.Connection) that show it, oldest first; `holder` is the one
    # of them that may send to it: the others follow it read-only (docs/protocol.md, "Holding")
    viewers: list = field(default_factory=list, repr=False)
    holder: object | None = field(default=None, repr=False)
    replying: list[str] = field(default_factory=list, repr=False)  # the reply in flight's text so far
    # called after each change with the bytes added and the message appended (None: the
    # messages were rewritten: system prompt, seeded turns)
    resized: Callable[["Conversation", int, dict | None], None] | None = field(default=None, repr=False)

    def set_system(self, text: str) -> None:
        """Replace (or add, or with "" remove) the leading system message."""
        delta = 0
        if self.messages and self.messages[0]["role"] == "system":
            old = self.messages.pop(0)
            delta -= message_bytes(old["role"], old["content"])
        if text:
            self.messages.insert(0, {"role": "system", "content": text})
            delta += message_bytes("system", text)
        self._grew(delta)

    def system_delta(self, text: str | None) -> int:
        """Bytes `set_system(text)` would add (None: no change)."""
        if text is None:
            return 0
        old = self.messages[0] if self.messages and self.messages[0]["role"] == "system" else None
        return (message_bytes("system", text) if text else 0) - (
            message_bytes(old["role"], old["content"]) if old else 0)

    @property
    def sockets(self) -> int:
        """How many open sockets show it (those it is dropped for memory last)."""
        return len(self.viewers)

    def show_to(self, sock, take: bool = False) -> bool:
        """`sock` opened it: it holds it when nobody does, or when `take`; True when the
        holder changed (the viewers are told)."""
        if sock not in self.viewers:
            self.viewers.append(sock)
        if self.holder is sock or (self.holder is not None and not take):
            return False
        self.holder = sock
        return True

    def hide_from(self, sock) -> bool:
        """`sock` closed it (or went away): the oldest other viewer holds it if `sock` did;
        True when the holder changed."""
        if sock in self.viewers:
            self.viewers.remove(sock)
        if self.holder is not sock:
            return False
        self.holder = self.viewers[0] if self.viewers else None
        return True

    @property
    def has_turns(self) -> bool:
        return any(m["role"] != "system" for m in self.messages)

    @property
    def unanswered(self) -> bool:
        """It ends on a user turn no reply follows (the server was killed mid-reply, or the
        reply was cancelled or failed before any text): the next `send` answers or replaces
        it, so two user turns never follow each other (docs/protocol.md)."""
        return self.busy is None and bool(self.messages) and self.messages[-1]["role"] == "user"

    def drop_last_user_turn(self) -> None:
        """Remove the last message if it is a user turn (a `send` replacing an unanswered one)."""
        if self.messages and self.messages[-1]["role"] == "user":
            old = self.messages.pop()
            self._grew(-message_bytes(old["role"], old["content"]))

    def turns(self) -> list[dict]:
        """The user and assistant messages (the system prompt left out)."""
        return [m for m in self.messages if m["role"] != "system"]

    def set_turns(self, turns: list[dict]) -> None:
        """Make the turns after the system prompt exactly `turns` (a `send` with `keep` or
        `messages`: an edit, a regenerate or a delete on the terminal)."""
        old = sum(message_bytes(m["role"], m["content"]) for m in self.turns())
        self.messages[:] = [m for m in self.messages if m["role"] == "system"] + [dict(m) for m in turns]
        self._grew(sum(message_bytes(m["role"], m["content"]) for m in turns) - old)

    def seed(self, turns: list[dict]) -> None:
        """Give a conversation without turns the earlier turns a client kept."""
        self.messages.extend(dict(m) for m in turns)
        self._grew(sum(message_bytes(m["role"], m["content"]) for m in turns))

    def append(self, role: str, content: str, cut_off: bool = False) -> None:
        """Add a message; `cut_off` marks a reply that ended because its terminal left (or
        the server stopped), kept as far as it got."""
        self.messages.append({"role": role, "content": content, **({"cut_off": True} if cut_off else {})})
        self._grew(message_bytes(role, content), self.messages[-1])

    def _grew(self, delta: int, appended: dict | None = None) -> None:
        self.nbytes += delta
        self.updated = time.time()
        if self.resized is not None:
            self.resized(self, delta, appended)

    def summary(self) -> dict:
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        return {"conversation": self.id, "title": first[:60], "messages": len(self.messages),
                "busy": self.busy is not None, "unanswered": self.unanswered, "updated": self.updated,
                "holder": getattr(self.holder, "terminal", None)}

    def snapshot(self) -> list[dict]:
        return [dict(m) for m in self.messages]


class ConversationStore:
    """Conversations by id, least recently used first; ids the server makes are `c-1`, ...

    `nbytes` is the memory the stored messages hold (see the module docstring); after each
    change the store drops idle conversations until it is within `max_bytes` again (a
    running generation's conversation may hold it over until it ends)."""

    def __init__(self, max_items: int = 10_000, max_bytes: int = 256 << 20, db: "ConversationDB | None" = None):
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self._items: OrderedDict[str, Conversation] = OrderedDict()
        self._ids = itertools.count(1)
        self.db = db
        if db is not None:
            self._load(db)

    def _load(self, db: "ConversationDB") -> None:
        """Take back the stored conversations, least recently used first, then drop what
        is over the limits (deleted from the file too); server ids continue after the
        highest stored one."""
        top = 0
        for stored in db.load():
            conv = Conversation(stored.id, stored.messages, created=stored.created, updated=stored.updated)
            conv.nbytes += sum(message_bytes(m["role"], m["content"]) for m in stored.messages)
            conv.resized = self._resized
            self._items[conv.id] = conv
            self.nbytes += conv.nbytes
            if conv.id.startswith("c-") and conv.id[2:].isdigit():
                top = max(top, int(conv.id[2:]))
        self._ids = itertools.count(top + 1)
        self._evict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, cid: str) -> Conversation | None:
        """The conversation `cid` (now the most recently used), or None."""
        conv = self._items.get(cid)
        if conv is not None:
            self._items.move_to_end(cid)
        return conv

    def open(self, cid: str | None = None) -> tuple[Conversation, bool]:
        """The conversation `cid` (created when unknown, or a new id when None);
        returns (conversation, created)."""
        if cid is None:
            cid = f"c-{next(self._ids)}"
            while cid in self._items:
                cid = f"c-{next(self._ids)}"
        conv = self.get(cid)
        if conv is not None:
            return conv, False
        self._evict(count=1)
        conv = self._items[cid] = Conversation(cid, resized=self._resized)
        self.nbytes += conv.nbytes
        if self.db is not None:
            self.db.created(conv.id, conv.created, conv.updated)
        self._evict(keep=conv)
        return conv, True

    def check_fits(self, conv: Conversation, more: int) -> None:
        """HistoryTooLarge unless `conv` grown by `more` bytes fits the budget on its own."""
        if more > 0 and conv.nbytes + more > self.max_bytes:
            raise HistoryTooLarge(
                f"conversation {conv.id!r} would hold {conv.nbytes + more} bytes of history, more than "
                f"the server keeps for all conversations together (--history-memory {self.max_bytes}); "
                "start a new conversation or send less")

    def discard(self, conv: Conversation) -> None:
        """Forget `conv` (one just created whose opening was refused)."""
        if self._items.get(conv.id) is conv:
            del self._items[conv.id]
            self.nbytes -= conv.nbytes
            conv.resized = None
            if self.db is not None:
                self.db.deleted(conv.id)

    def list(self) -> list[dict]:
        return [c.summary() for c in sorted(self._items.values(), key=lambda c: -c.updated)]

    def _resized(self, conv: Conversation, delta: int, appended: dict | None = None) -> None:
        self.nbytes += delta
        if conv.id in self._items:
            self._items.move_to_end(conv.id)
            if self.db is not None:  # written through before any eviction it causes
                if appended is not None:
                    self.db.appended(conv.id, appended["role"], appended["content"], conv.updated,
                                     bool(appended.get("cut_off")))
                else:
                    self.db.rewritten(conv.id, conv.messages, conv.created, conv.updated)
        if delta > 0:
            self._evict(keep=conv)

    def _evict(self, keep: Conversation | None = None, count: int = 0) -> None:
        """Drop least recently used idle conversations (not `keep`) until there is room for
        `count` more and the bytes are within the budget: those no socket has open first."""
        def over() -> bool:
            return len(self._items) + count > self.max_items or self.nbytes > self.max_bytes

        for attached_too in (False, True):
            if not over():
                return
            for conv in [c for c in self._items.values()
                         if c is not keep and c.busy is None and (attached_too or not c.sockets)]:
                self._drop(conv)
                if not over():
                    return

    def _drop(self, conv: Conversation) -> None:
        del self._items[conv.id]
        self.nbytes -= conv.nbytes
        conv.resized = None
        self.evictions += 1
        if self.db is not None:
            self.db.deleted(conv.id)

"""The waiting queue, fair across clients: one FIFO per client, and the next request is
the head of the client with the fewest running requests, ties going to the client served
longest ago (round robin). vLLM's fair scheduling across users and nginx's per-client
queues follow the same idea: a client sending many requests waits behind its own, not in
front of everyone else's.

A client is whatever string the server attributes a request to (a --tokens name, a
websocket terminal, a remote address; "" for the embedded engine). The queue only picks
who is admitted when; it never touches what a request computes.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Iterator, Mapping

from panechat.engine.serving.request import Request

__all__ = ["FairQueue"]


class _ClientQueue:
    __slots__ = ("requests", "served")

    def __init__(self) -> None:
        self.requests: deque[Request] = deque()
        self.served = 0  # serial of its latest admission; 0: none since it last had a queue


class FairQueue:
    """Waiting requests by client. Not thread-safe: the scheduler holds its queue lock."""

    def __init__(self) -> None:
        self._clients: dict[str, _ClientQueue] = {}  # in order of arrival (the last tie-break)
        self._serials = itertools.count(1)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, client by client (FIFO within each)."""
        for q in list(self._clients.values()):
            yield from q.requests

    def __contains__(self, req: Request) -> bool:
        q = self._clients.get(req.client)
        return q is not None and req in q.requests

    def count(self, client: str) -> int:
        """Requests of `client` waiting."""
        q = self._clients.get(client)
        return len(q.requests) if q is not None else 0

    def clients(self) -> int:
        """Clients with a request waiting."""
        return len(self._clients)

    def append(self, req: Request) -> None:
        """Queue `req` behind its client's other waiting requests."""
        self._queue_of(req.client).requests.append(req)
        self._n += 1

    def appendleft(self, req: Request) -> None:
        """Queue `req` ahead of its client's other waiting requests (a preempted one)."""
        self._queue_of(req.client).requests.appendleft(req)
        self._n += 1

    def remove(self, req: Request) -> None:
        """Take `req` out (cancelled while waiting); ValueError when it is not queued."""
        q = self._clients.get(req.client)
        if q is None:
            raise ValueError(f"{req.id} is not waiting")
        q.requests.remove(req)
        self._n -= 1
        self._drop_if_empty(req.client, q)

    def head(self, running: Mapping[str, int]) -> Request | None:
        """The request to admit next: the head of the client with the fewest `running`
        requests (client -> count), ties to the one served longest ago."""
        best, key = None, None
        for i, (client, q) in enumerate(self._clients.items()):
            k = (running.get(client, 0), q.served, i)
            if key is None or k < key:
                best, key = q, k
        return best.requests[0] if best is not None else None

    def pop(self, req: Request) -> None:
        """Take `req`, the head of its client's queue, out: it was admitted."""
        q = self._clients[req.client]
        assert q.requests[0] is req
        q.requests.popleft()
        q.served = next(self._serials)
        self._n -= 1
        self._drop_if_empty(req.client, q)

    def _queue_of(self, client: str) -> _ClientQueue:
        q = self._clients.get(client)
        if q is None:
            q = self._clients[client] = _ClientQueue()
        return q

    def _drop_if_empty(self, client: str, q: _ClientQueue) -> None:
        if not q.requests:  # a client with nothing waiting holds no state (clients come and go)
            del self._clients[client]

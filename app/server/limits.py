"""Timeouts and caps that keep one client from starving the others (docs/protocol.md,
"Limits and timeouts").

uvicorn (0.54, h11) has a keep-alive timeout but no header or body read timeout, and its
`limit_concurrency` counts only HTTP connections once their headers are in. So the server
runs uvicorn's h11 protocol through `GuardedH11Protocol`, which adds, per connection (it
subclasses a private class, so pyproject.toml holds uvicorn to the 0.54 it was tested on):

- a header deadline (nginx's `client_header_timeout`): the request line and headers must
  arrive within `header_timeout` of the connection (or of a kept-alive request's first
  byte), else 408 and close; a half-open connection cannot hold a slot for long;
- a body deadline (`client_body_timeout`, but for the whole body): the rest of the request
  within `body_timeout` of its headers, else 408 and close;
- the connection cap (nginx's `worker_connections`): a request whose head is complete
  while over `max_connections` connections are open (HTTP and websockets alike) first
  closes the connections still waiting for their headers, oldest first, until it fits:
  a stalled client gives way to one that has sent its request. With none to close it
  gets 503 (GET /health still answers). At twice the cap, or near the process's file
  limit, a new connection closes the longest-waiting one at once; with none waiting, the
  new one is closed. Should descriptors run out all the same (a burst accepted before any
  of it is closed), `Listener` drops connections quietly at `accept()`;
- the header size: a request head over `MAX_HEAD` bytes gets 400, even when it arrives
  whole (h11 bounds only a head still incomplete).

Websockets get `GuardedWebSocket`: until the app lifts it at a good `hello`, a frame over
`preauth_frame` bytes closes the socket (1009) as soon as its header is read, before its
payload is buffered, decoded or parsed. At `max_unauthed` sockets waiting for their hello,
the oldest of them gives way to a new handshake (`Guard.evict_preauth`).

Every refusal is counted, and `LimitLog` writes one warning line per interval with the
counts: a flood costs the log one line per 10 s, never a line (or traceback) per event.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass

import h11
from uvicorn.config import WS_PROTOCOLS
from uvicorn.importer import import_from_string
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from . import errors
from .security import Origins, PreAuth

__all__ = ["Limits", "Guard", "LimitLog", "Listener", "raise_fd_limit", "run_server"]

#: accept() errors meaning "out of descriptors or memory"; asyncio logs each with a traceback.
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
#: descriptors kept free for the engine, model files, logs and the listening socket.
_FD_RESERVE = 64
#: bytes: the largest request line plus headers (docs/protocol.md; h11's bound on an incomplete head)
MAX_HEAD = 16 << 10


@dataclass(frozen=True)
class Limits:
    """The server's timeouts (seconds) and caps; the CLI flag named in each error sets it."""

    header_timeout: float = 10.0  # --header-timeout
    body_timeout: float = 30.0  # --body-timeout
    max_connections: int = 512  # --max-connections (HTTP and websocket connections together)
    auth_grace: float = 5.0  # --auth-grace: a websocket's time to complete its hello
    keep_alive: float = 5.0  # idle time between requests on a kept-alive connection (uvicorn's)
    max_unauthed: int = 64  # websockets open at once that have not completed hello
    preauth_frame: int = 4096  # bytes: the largest frame before hello
    log_interval: float = 10.0  # seconds between two `limits` log lines
    history_memory: int = 256 << 20  # --history-memory: bytes of websocket conversation history kept
    shutdown_grace: float = 5.0  # --shutdown-grace: seconds running generations get to finish at shutdown

    MIN_HISTORY_MEMORY = 64 << 10  # less is surely a unit mistake (--history-memory 256 for 256M)

    def __post_init__(self):
        for flag, v in (("--header-timeout", self.header_timeout), ("--body-timeout", self.body_timeout),
                        ("--auth-grace", self.auth_grace), ("keep_alive", self.keep_alive),
                        ("log_interval", self.log_interval)):
            if not 0 < v <= 3600:
                raise ValueError(f"{flag} must be between 0 and 3600 seconds (got {v})")
        for flag, n in (("--max-connections", self.max_connections), ("max_unauthed", self.max_unauthed),
                        ("preauth_frame", self.preauth_frame)):
            if n < 1:
                raise ValueError(f"{flag} must be at least 1 (got {n})")
        if self.history_memory < self.MIN_HISTORY_MEMORY:
            raise ValueError(f"--history-memory must be at least {self.MIN_HISTORY_MEMORY >> 10}K "
                             f"(got {self.history_memory} bytes)")
        if not 0 <= self.shutdown_grace <= 3600:
            raise ValueError(f"--shutdown-grace must be between 0 and 3600 seconds (got {self.shutdown_grace})")

    @classmethod
    def from_args(cls, args) -> "Limits":
        """From `panechat serve` / `--share` flags (missing ones keep the defaults)."""
        flags = ("header_timeout", "body_timeout", "max_connections", "auth_grace", "history_memory",
                 "shutdown_grace")
        return cls(**{k: getattr(args, k) for k in flags if getattr(args, k, None) is not None})


def fd_limit() -> int | None:
    """The soft limit on open files (None where unknown, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit() -> tuple[int, int] | None:
    """Raise the soft open-file limit to the hard limit where allowed; (before, after), or
    None where there is no such limit. Idempotent."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = hard if hard != resource.RLIM_INFINITY else 1 << 20
    for want in (top, 65536, 10240):  # macOS refuses more than OPEN_MAX (10240)
        if want <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return soft, want
        except (ValueError, OSError):
            continue
    return soft, soft


class LimitLog:
    """Counts refusals and writes them as one warning line per `limits.log_interval`."""

    LABELS = {
        "header_timeout": "headers not in within {header_timeout:g} s: {n} closed",
        "body_timeout": "body not in within {body_timeout:g} s: {n} closed",
        "evicted": "at --max-connections {max_connections}: {n} stalled connections closed for new ones",
        "over_capacity": "over --max-connections {max_connections}: {n} answered 503",
        "refused": "over {hard_cap} open connections: {n} closed at accept",
        "accept_failed": "out of file descriptors (limit {fd_limit}): {n} dropped at accept",
        "ws_auth_grace": "no websocket hello within {auth_grace:g} s: {n} closed",
        "ws_preauth_frame": "websocket frame over {preauth_frame} bytes before hello: {n} closed",
        "ws_unauthed_cap": "{max_unauthed} websockets awaiting hello: {n} more refused",
        "ws_preauth_evicted": "{max_unauthed} websockets awaiting hello: {n} oldest closed for new ones",
        "head_too_large": "request headers over 16 KiB: {n} answered 400",
        "origin": "foreign web origin: {n} refused",
    }

    def __init__(self, logger: logging.Logger, guard: "Guard"):
        self.logger, self.guard = logger, guard
        self.counts: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    def count(self, kind: str, n: int = 1) -> None:
        """Count one event (call on the server's event loop)."""
        self.counts[kind] += n
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # flushed by the next count on the loop, or at shutdown
            self._timer = loop.call_later(self.guard.limits.log_interval, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.counts:
            return
        g, lim = self.guard, self.guard.limits
        fields = {**lim.__dict__, "hard_cap": g.hard_cap, "fd_limit": fd_limit()}
        parts = [self.LABELS.get(k, k + ": {n}").format(n=n, **fields) for k, n in self.counts.items()]
        self.counts.clear()
        self.logger.warning("limits in the last %g s: %s", lim.log_interval, "; ".join(parts))


class Listener(socket.socket):
    """A listening socket whose `accept()` survives running out of file descriptors.

    asyncio's accept loop meets EMFILE with a traceback per remaining backlog slot and a
    retry timer for each (thousands a second under a flood). Here the listener keeps one
    spare descriptor: out of descriptors, it frees the spare, accepts the oldest waiting
    connection and closes it at once (its client sees the connection end, instead of
    hanging in the backlog), takes the spare back and reports "nothing to accept", which
    asyncio handles quietly (libuv's and nginx's EMFILE trick). `guard` counts the drops."""

    guard: "Guard | None" = None

    def __init__(self, family: int = socket.AF_INET):
        super().__init__(family, socket.SOCK_STREAM)
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY)

    def accept(self):
        try:
            return super().accept()
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE) or self._spare is None:
                raise
        os.close(self._spare)
        self._spare = None
        try:
            super().accept()[0].close()
        except OSError:
            pass
        finally:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY)
            except OSError:  # taken meanwhile: the next EMFILE goes to asyncio's handler
                pass
        if self.guard is not None:
            self.guard.log.count("accept_failed")
        raise BlockingIOError(errno.EAGAIN, "out of file descriptors")

    def close(self) -> None:
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        super().close()


def _raw_error(status: int, message: str, code: str, headers: tuple[str, ...] = ()) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-shaped JSON body, ending the connection."""
    body = json.dumps(errors.error_body(message, "server_error" if status >= 500 else "invalid_request_error",
                                        None, code)).encode()
    head = [f"HTTP/1.1 {status} {STATUS_PHRASES[status].decode()}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body deadlines and the connection cap.

    `guard` is set on the subclass `Guard.http_protocol()` makes for one server."""

    guard: "Guard"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "header" | "body" | None: what the timer waits for
        self._admitted = False  # within the cap since its first complete request head
        self._upgraded = False
        self._evicted = False

    # -- connection life ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        g = self.guard
        others = len(self.server_state.connections) - g.closing
        super().connection_made(transport)
        if others >= g.hard_cap and g.evict_stalled():
            others -= 1
        if others >= g.hard_cap:
            g.log.count("refused")
            transport.abort()
            return
        self.app = self._make_gated_app(self.app)
        self._set_phase("header")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._upgraded or self.transport.is_closing():
            return
        state = self.conn.their_state
        # IDLE: a request's headers are (partly) in; SEND_BODY: its body is on the way
        self._set_phase("header" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        if self._evicted:
            self.guard.closing -= 1
        super().connection_lost(exc)

    def evict(self) -> None:
        """Close this connection (stalled in its headers) to make room for another."""
        self._set_phase(None)
        if not self.transport.is_closing():
            self._evicted = True
            self.guard.closing += 1
            self.transport.close()

    def admit(self) -> bool:
        """Whether this connection, its request head complete, is within --max-connections
        (stalled connections closed to make room); once admitted, for its whole life."""
        if not self._admitted:
            self._admitted = self.guard.make_room(self, self.server_state.connections)
        return self._admitted

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._set_phase(None)
        self._upgraded = True
        refusal = (_HEAD_TOO_LARGE if _head_over_limit(self.scope) else None if self.admit() else _OVER_CAPACITY)
        if refusal is not None:
            self.guard.log.count(refusal.kind)
            self.transport.write(_raw_error(refusal.status, refusal.message, refusal.code, refusal.headers))
            self.transport.close()
            return
        super().handle_websocket_upgrade(event)

    # -- deadlines ----------------------------------------------------------------------------
    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.guard.waiting.pop(self, None)
        self._phase = phase
        if phase == "header":
            self.guard.waiting[self] = time.monotonic()
            self._timer = self.loop.call_later(self.guard.limits.header_timeout, self._header_timeout)
        elif phase == "body":
            self._timer = self.loop.call_later(self.guard.limits.body_timeout, self._body_timeout)

    def _header_timeout(self) -> None:
        self._timer = None
        self._set_phase(None)
        if self.transport.is_closing():
            return
        self.guard.log.count("header_timeout")
        if self.conn.trailing_data[0]:  # a partial request: say why it ends
            self.transport.write(_raw_error(408, f"request headers not received within "
                                            f"{self.guard.limits.header_timeout:g} s", "header_timeout"))
        self.transport.close()

    def _body_timeout(self) -> None:
        self._timer = None
        self._set_phase(None)
        if self.transport.is_closing():
            return
        self.guard.log.count("body_timeout")
        if self.cycle is not None and not self.cycle.response_started:
            self.cycle.scope["panechat.body_timeout"] = self.guard.limits.body_timeout  # for the log line
            self.transport.write(_raw_error(408, f"request body not received within "
                                            f"{self.guard.limits.body_timeout:g} s", "body_timeout"))
        self.transport.close()  # the app's receive() then reports a disconnect

    # -- the cap ----------------------------------------------------------------------------------
    def _make_gated_app(self, app):
        """`app` behind the checks a complete request head gets: its size, then the cap."""
        guard = self.guard

        async def gated(scope, receive, send):
            if _head_over_limit(scope):
                refusal = _HEAD_TOO_LARGE
            elif self.admit() or (scope["method"] in ("GET", "HEAD") and scope["path"] == "/health"):
                return await app(scope, receive, send)  # monitoring still sees the server at the cap
            else:
                refusal = _OVER_CAPACITY
            guard.log.count(refusal.kind)
            body = errors.error_body(refusal.message, "server_error" if refusal.status >= 500 else
                                     "invalid_request_error", None, refusal.code)
            headers = dict(h.split(": ", 1) for h in refusal.headers)
            await errors.ErrorJSON(body, status_code=refusal.status, headers={**headers, "Connection": "close"})(
                scope, receive, send)
        return gated


@dataclass(frozen=True)
class _Refusal:
    """A request refused by the connection layer: counted as `kind`, answered `status`."""

    kind: str
    status: int
    message: str
    code: str
    headers: tuple[str, ...] = ()


_OVER_CAPACITY = _Refusal("over_capacity", 503, "the server is at its connection limit; retry shortly",
                          "too_many_connections", ("retry-after: 1",))
_HEAD_TOO_LARGE = _Refusal("head_too_large", 400, f"request line and headers are over {MAX_HEAD >> 10} KiB; "
                           "send less in headers", "request_header_too_large")


def _head_over_limit(scope: dict) -> bool:
    """Whether a request's line and headers (as parsed) exceed MAX_HEAD bytes."""
    size = len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"]) + 12
    return size + sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > MAX_HEAD


def _guarded_websocket(base: type, guard: "Guard") -> type:
    """`base` (uvicorn's websockets-sansio protocol) with `preauth_frame` as the message size
    limit until the app calls `scope["panechat.lift_frame_limit"]()`."""

    class GuardedWebSocket(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._full_size = self.conn.max_message_size
            self.conn.max_message_size = guard.limits.preauth_frame

        def handle_connect(self, event) -> None:
            super().handle_connect(event)
            scope = getattr(self, "scope", None)
            if scope is not None:
                scope["panechat.lift_frame_limit"] = self._lift

        def _lift(self) -> None:
            self.conn.max_message_size = self._full_size

        def handle_parser_exception(self) -> None:
            sent = self.conn.close_sent
            if sent is not None and sent.code == 1009 and self.conn.max_message_size == guard.limits.preauth_frame:
                guard.log.count("ws_preauth_frame")
            super().handle_parser_exception()

        async def send(self, message) -> None:
            await super().send(message)
            if message["type"] == "websocket.http.response.body" and not message.get("more_body"):
                self.handshake_complete = True  # uvicorn 0.54 omits it, then logs a false error

    return GuardedWebSocket


class Guard:
    """Everything the server's defences share: the limits, the refusal counts, the Origin
    policy and the websockets that have not completed `hello`.

    One per app (`app.state.guard`); the server reads its protocol classes from it."""

    def __init__(self, limits: Limits | None = None, logger: logging.Logger | None = None,
                 public_url: str | None = None):
        self.limits = limits or Limits()
        self.origins = Origins(public_url)
        self.log = LimitLog(logger or logging.getLogger("panechat.server"), self)
        self.preauth: dict[PreAuth, None] = {}  # websockets awaiting hello, oldest first
        self.hard_cap = 2 * self.limits.max_connections
        self.waiting: dict[GuardedH11Protocol, float] = {}  # waiting for headers since; oldest first
        self.closing = 0  # connections evicted whose close is still under way

    def evict_stalled(self) -> bool:
        """Close the connection that has waited longest for its request headers; False
        when none waits."""
        oldest = next(iter(self.waiting), None)
        if oldest is None:
            return False
        oldest.evict()
        self.log.count("evicted")
        return True

    def make_room(self, conn: GuardedH11Protocol, connections: set) -> bool:
        """Whether `conn`, its request head complete, fits --max-connections among the open
        `connections` (itself included), once connections still waiting for their headers
        are closed, oldest first, to make room: a stalled client gives way to a real one."""
        while len(connections) - self.closing > self.limits.max_connections:
            if not self.evict_stalled():
                return False
        return True

    def evict_preauth(self) -> bool:
        """Close the websocket that has waited longest for its `hello` (one whose app has
        started), to make room for a new handshake; False when there is none."""
        for ticket in self.preauth:
            if ticket.give_way is not None:
                ticket.done()
                ticket.give_way()
                self.log.count("ws_preauth_evicted")
                return True
        return False

    @property
    def unauthed(self) -> int:
        """Websockets open that have not completed `hello`."""
        return len(self.preauth)

    def uvicorn_options(self, ws_impl: str) -> dict:
        """`uvicorn.Config` keyword arguments: the guarded protocols and the keep-alive.
        Call after `raise_fd_limit()`: the accept-time cap stays below the file limit."""
        fds = fd_limit()
        cap = 2 * self.limits.max_connections
        self.hard_cap = max(1, min(cap, fds - _FD_RESERVE)) if fds else cap
        http = type("GuardedH11", (GuardedH11Protocol,), {"guard": self})
        ws = import_from_string(WS_PROTOCOLS[ws_impl])
        if ws_impl == "websockets-sansio":
            ws = _guarded_websocket(ws, self)
        return {"http": http, "ws": ws, "timeout_keep_alive": self.limits.keep_alive}

    def loop_exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """asyncio's handler, except that accept() running out of descriptors or memory
        (where `Listener` cannot help) is counted instead of logged with a traceback
        each time (asyncio retries the accept a second later by itself)."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            self.log.count("accept_failed")
            return
        loop.default_exception_handler(context)


async def run_server(server, sockets: list, guard: Guard) -> None:
    """`server.serve(sockets)` with the guard's loop exception handler; flushes the counts."""
    asyncio.get_running_loop().set_exception_handler(guard.loop_exception_handler)
    try:
        await server.serve(sockets=sockets)
    finally:
        guard.log.flush()

"""What a browser page may do to the server: the Origin policy, JSON-only POSTs, and the
start-up warning for an open bind (docs/protocol.md, "Threat model").

A web page can make a visitor's browser send requests to any address it knows, including
127.0.0.1. Two rules keep such pages out:

- a request or websocket handshake carrying an `Origin` (browsers send one) is refused
  (403) unless the origin is loopback or the configured public URL. The client's `Host`
  header is not consulted: a DNS-rebinding page controls it.
- POST/PUT/PATCH bodies must be `Content-Type: application/json` (415 otherwise). That
  type cannot be sent cross-site without a CORS preflight, which this server never grants,
  so an HTML form or `fetch(..., {mode: "no-cors"})` cannot start a generation blind.
  Under the `untyped_json` prefixes (Ollama's API) a body with no Content-Type at all is
  taken as JSON, as Ollama does (browsers send such a request with an Origin: the rule above holds).
  A route that does not exist answers 404 (or 405) whatever the type: the body is never read.

Terminal clients and OpenAI client libraries send no Origin and do send JSON.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from starlette.routing import Match

from . import errors

__all__ = ["Origins", "BrowserGuard", "is_loopback", "bind_warning", "PreAuth"]

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_BODY_METHODS = {"POST", "PUT", "PATCH"}
_CURL_DEFAULT = "application/x-www-form-urlencoded"


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin or URL; None when it is not one (`null`, junk)."""
    try:
        parts = urlsplit(url.strip())
        scheme, host, port = parts.scheme.lower(), (parts.hostname or "").lower(), parts.port
    except ValueError:  # a bad port number
        return None
    if not scheme or not host:
        return None
    return scheme, host, port if port is not None else _DEFAULT_PORTS.get(scheme, 0)


def default_public_url(host: str, port: int) -> str:
    """The URL the server is reached at when `--public-url` is not given: loopback when
    bound to loopback, the machine's name when bound to every interface, else the bind address."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif is_loopback(host):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Origins:
    """Which browser origins may use the server: loopback pages (any port) and the public URL.

    `public_url` is `--public-url` (e.g. https://chat.example.com behind a TLS proxy); when
    None, `bound(host, port)` derives it from the bind address once the port is known."""

    def __init__(self, public_url: str | None = None):
        self.explicit = public_url is not None
        self.public = _origin(public_url) if public_url else None
        if self.explicit and self.public is None:
            raise ValueError(f"--public-url must be an absolute URL such as https://chat.example.com "
                             f"(got {public_url!r})")
        # an explicit public URL for the https scheme is also reached as wss (and http as ws)
        self._also = None
        if self.public is not None:
            swap = {"http": "ws", "https": "wss", "ws": "http", "wss": "https"}.get(self.public[0])
            self._also = (swap, *self.public[1:]) if swap else None

    def bound(self, host: str, port: int) -> None:
        if not self.explicit:
            self.public = _origin(default_public_url(host, port))
            self._also = None

    @property
    def public_url(self) -> str | None:
        if self.public is None:
            return None
        scheme, host, port = self.public
        return f"{scheme}://{host}" + ("" if _DEFAULT_PORTS.get(scheme) == port else f":{port}")

    def allowed(self, origin: str | None) -> bool:
        """True for no Origin (not a browser), a loopback origin or the public URL's."""
        if origin is None:
            return True
        o = _origin(origin)
        if o is None:  # "null" (sandboxed frames, file://) or garbage
            return False
        return is_loopback(o[1]) or o == self.public or o == self._also


class PreAuth:
    """One websocket that has not yet completed its `hello`: counted against the cap on
    unauthenticated sockets until `done()`. `give_way`, set once the socket's app runs,
    closes it to make room for a newer one (limits.Guard.evict_preauth)."""

    def __init__(self, guard):  # guard: limits.Guard (which imports this module)
        self.guard, self.open = guard, True
        self.give_way = None
        guard.preauth[self] = None

    def done(self) -> None:
        if self.open:
            self.open = False
            self.guard.preauth.pop(self, None)


def _media_type(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"content-type":
            return value.decode("latin-1").split(";", 1)[0].strip().lower()
    return None


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """HTTP/1.1: a request has a body when it says how long (non-zero) or that it is chunked."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


class BrowserGuard:
    """Pure ASGI middleware: the Origin policy for HTTP and /ws, JSON-only request bodies,
    and the cap on websockets that have not said `hello` yet (at it, the oldest of them
    gives way to the new handshake)."""

    def __init__(self, app, guard, routes=(), untyped_json: tuple[str, ...] = ()):
        # guard: limits.Guard (which imports this module); routes: the app's, to tell a
        # missing route (404 from the router) from a body of the wrong type (415)
        self.app, self.guard, self.routes, self.untyped_json = app, guard, tuple(routes), untyped_json

    def _routed(self, scope) -> bool:
        """True when some route takes this path and method (or when no routes were given)."""
        return not self.routes or any(r.matches(scope)[0] == Match.FULL for r in self.routes)

    def _type_ok(self, scope, media: str | None) -> bool:
        if media == "application/json":
            return True
        return media is None and scope["path"].startswith(self.untyped_json)

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), None)
        if not self.guard.origins.allowed(origin):
            self.guard.log.count("origin")
            msg = (f"requests from web pages at {origin[:200]} are not allowed; only loopback pages "
                   f"and {self.guard.origins.public_url} (panechat serve --public-url) may use this server")
            return await _refuse(scope, receive, send, 403, msg, "permission_error", "origin_not_allowed")
        if kind == "http":
            if scope["method"] in _BODY_METHODS and _has_body(scope["headers"]):
                media = _media_type(scope["headers"])
                if not self._type_ok(scope, media) and self._routed(scope):
                    msg = (f"Content-Type must be application/json (got {media[:100]!r})" if media else
                           "Content-Type must be application/json (the request has none)")
                    if media == _CURL_DEFAULT:  # what `curl -d` sends, as in Ollama's own examples
                        msg += "; with curl, add -H 'Content-Type: application/json'"
                    return await _refuse(scope, receive, send, 415, msg, "invalid_request_error",
                                         "unsupported_media_type")
            return await self.app(scope, receive, send)
        limits = self.guard.limits
        if self.guard.unauthed >= limits.max_unauthed and not self.guard.evict_preauth():
            self.guard.log.count("ws_unauthed_cap")
            return await _refuse(scope, receive, send, 503, f"{limits.max_unauthed} websockets are waiting "
                                 "for their hello; retry shortly", "server_error", "too_many_unauthenticated",
                                 {"Retry-After": "1"})
        ticket = scope["panechat.preauth"] = PreAuth(self.guard)
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.done()


async def _refuse(scope, receive, send, status: int, message: str, type: str, code: str,
                  headers: dict[str, str] | None = None) -> None:
    """An OpenAI-shaped error; for a websocket, an HTTP denial of the handshake (or a
    close before accept, which uvicorn turns into 403, where denials are unsupported)."""
    response = errors.shaped(scope.get("path", ""), status, errors.error_body(message, type, None, code), headers)
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 4000 + status})
        return
    await response(scope, receive, send)


def bind_warning(host: str, token: str | None) -> str | None:
    """The one start-up line for a bind beyond loopback without a token, else None."""
    if token or is_loopback(host):
        return None
    return (f"panechat serve: warning: listening on {host} without --token: anyone who can reach "
            "this port can use the model (set --token, or bind 127.0.0.1)")

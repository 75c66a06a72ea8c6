"""textual-serve's Server behind panechat's token and a cap on browser sessions.

Each browser tab that opens the websocket gets its own `panechat --connect` process (a
terminal of the engine's server); the page and the websocket answer only with the token,
and the websocket only to the page's own origin."""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from urllib.parse import quote, urlsplit

from aiohttp import WSCloseCode, web
from textual_serve.app_service import AppService
from textual_serve.server import Server, to_int

COOKIE = "panechat_token"
log = logging.getLogger("panechat.web")


class BrowserServer(Server):
    """Serves `command` (a shell line running the TUI) to browsers on host:port.

    With a `token`, the page needs `?token=T` once (it is then kept in a same-site cookie,
    which the page's websocket sends) or `Authorization: Bearer T`; without it, the page
    answers 401. At most `max_sessions` browser sessions run at once (a process each);
    one more gets 503."""

    def __init__(self, command: str, host: str, port: int, *, token: str | None, max_sessions: int,
                 public_url: str | None = None):
        super().__init__(command, host=host, port=port, title="panechat", public_url=public_url)
        self.fixed_url = public_url  # None: the page's links use the address the browser asked for
        self.token = token
        self.max_sessions = max_sessions
        self.sessions = 0  # sessions open or opening
        self.sockets: set[web.WebSocketResponse] = set()
        self.on_ready = None  # called with the page's URL once listening

    def page_url(self) -> str:
        """The address a browser opens (with the token when one is set)."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host  # all interfaces: a name
        base = self.fixed_url or f"http://{host}:{self.port}"
        return f"{base}/" + (f"?token={quote(self.token)}" if self.token else "")

    def _allowed(self, request: web.Request) -> bool:
        if self.token is None:
            return True
        bearer = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        given = request.query.get("token") or request.cookies.get(COOKIE) or bearer
        return bool(given) and hmac.compare_digest(given.encode(), self.token.encode())

    def _same_origin(self, request: web.Request) -> bool:
        """A browser's websocket from another site's page is refused (it would carry the cookie)."""
        origin = request.headers.get("Origin")
        if origin is None:  # not a browser
            return True
        return urlsplit(origin).netloc == request.host or (
            self.fixed_url is not None and urlsplit(origin).netloc == urlsplit(self.fixed_url).netloc)

    async def handle_index(self, request: web.Request) -> web.StreamResponse:
        if not self._allowed(request):
            return web.Response(status=401, text="panechat web: a token is required: open the address "
                                                 "`panechat web` printed (it ends with ?token=...)\n")
        if self.fixed_url is None:  # (read by the handler below before it yields: no other request interleaves)
            self.public_url = f"{request.scheme}://{request.host}"
        response = await super().handle_index(request)
        if self.token is not None:
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="Strict")
        return response

    async def handle_websocket(self, request: web.Request) -> web.StreamResponse:
        # textual-serve's handler, plus the token, the cap, and the socket kept to close at shutdown
        if not self._allowed(request):
            return web.Response(status=401, text="panechat web: a token is required\n")
        if not self._same_origin(request):
            return web.Response(status=403, text="panechat web: a page from another site may not open a session\n")
        if self.sessions >= self.max_sessions:
            return web.Response(status=503, text=f"panechat web: {self.max_sessions} browser sessions are open "
                                                 "(--max-sessions); close one and reload\n")
        self.sessions += 1
        socket = web.WebSocketResponse(heartbeat=15)
        service = None
        try:
            await socket.prepare(request)
            self.sockets.add(socket)
            service = AppService(self.command, write_bytes=socket.send_bytes, write_str=socket.send_str,
                                 close=socket.close, download_manager=self.download_manager, debug=self.debug)
            await service.start(to_int(request.query.get("width", "80"), 80),
                                to_int(request.query.get("height", "24"), 24))
            await self._process_messages(socket, service)
        except asyncio.CancelledError:
            await socket.close()
        except Exception:  # noqa: BLE001 - one session's failure must not end the server
            log.exception("browser session failed")
        finally:
            self.sessions -= 1
            self.sockets.discard(socket)
            if service is not None:
                await service.stop()  # the session's TUI quits
        return socket

    async def on_shutdown(self, app: web.Application) -> None:
        # aiohttp waits for open handlers at shutdown: end each session instead of waiting
        for socket in list(self.sockets):
            await socket.close(code=WSCloseCode.GOING_AWAY, message=b"panechat web is shutting down")

    async def on_startup(self, app: web.Application) -> None:
        if self.on_ready is not None:
            self.on_ready(self.page_url())

    def initialize_logging(self) -> None:
        pass  # textual-serve's rich log handler would take over the root logger

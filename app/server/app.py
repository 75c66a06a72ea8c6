"""The ASGI app: OpenAI-compatible HTTP, the `/ws` protocol, `/health` and `/metrics`.

`create_app(engine)` serves a running `Engine`; `create_app(None)` serves `/health` with
503 until `state.attach(engine)` is called (the model loads while the port already
answers). Everything the handlers share lives on one `ServerState` (`app.state.panechat`).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from . import errors
from .conversations import ConversationStore
from .errors import APIError
from .limits import Guard, Limits
from .prometheus import CONTENT_TYPE, make_registry, render
from .security import BrowserGuard

if TYPE_CHECKING:
    from ...engine.engine import Engine, Generation
    from ...engine.sampling import SamplingParams

__all__ = ["create_app", "ServerState", "MAX_BODY", "SERVER_NAME"]

MAX_BODY = 1 << 20  # bytes: larger request bodies (and websocket frames) are refused
SERVER_NAME = "panechat/0.1"

log = logging.getLogger("panechat.server")


class ServerState:
    """What every handler shares: the engine (None while loading), the token, the
    websocket conversations and the terminal count."""

    def __init__(self, engine: "Engine | None", token: str | None, max_body: int, logger: logging.Logger):
        self.engine = engine
        self.token = token or None
        self.max_body = max_body
        self.log = logger
        self.load_error: str | None = None
        self.conversations = ConversationStore()
        self.terminals = 0
        self.terminal_ids = itertools.count(1)
        self.started = time.time()
        self.registry = make_registry(self)

    # -- engine life cycle ----------------------------------------------------------
    def attach(self, engine: "Engine") -> None:
        """Start serving `engine` (already started); /health turns 200."""
        self.engine = engine

    def fail(self, message: str) -> None:
        """Loading failed: /health reports it (503) instead of 'loading'."""
        self.load_error = message

    def require_engine(self) -> "Engine":
        if self.engine is None:
            if self.load_error:
                raise APIError(503, f"the model failed to load: {self.load_error}", type="server_error",
                               code="model_load_failed")
            raise errors.loading()
        return self.engine

    async def wait_engine(self, timeout: float | None = None) -> "Engine | None":
        """The engine, waiting for it to load (None on timeout or failed load)."""
        t0 = time.monotonic()
        while self.engine is None and self.load_error is None:
            if timeout is not None and time.monotonic() - t0 > timeout:
                return None
            await asyncio.sleep(0.1)
        return self.engine

    # -- model names ----------------------------------------------------------------
    def model_id(self) -> str:
        return self.require_engine().lm.name

    def model_ids(self) -> set[str]:
        """Names a request may use for the served model: the file name and its stem."""
        name = self.model_id()
        return {name, Path(name).stem, "panechat"}

    # -- auth -------------------------------------------------------------------------
    def token_ok(self, presented: str | None) -> bool:
        if self.token is None:
            return True
        if not isinstance(presented, str):
            return False
        return hmac.compare_digest(presented.encode("utf-8", "replace"), self.token.encode("utf-8"))

    def check_bearer(self, request: Request) -> None:
        """401 unless the request carries `Authorization: Bearer <token>` (when set)."""
        if self.token is None:
            return
        scheme, _, cred = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not self.token_ok(cred.strip()):
            raise errors.unauthorized()

    # -- generation -------------------------------------------------------------------
    async def submit(self, messages: list[dict], params: "SamplingParams", stop: list[str] | tuple = (),
                     conversation: str | None = None) -> "Generation":
        """Render and tokenize `messages` off the event loop, then queue the generation.

        Raises ValueError (bad messages/params), PromptTooLong or QueueFull, as
        `Engine.submit`. Must be called on the event loop (the Generation is async)."""
        engine = self.require_engine()
        prompt_ids = await asyncio.to_thread(engine.lm.prompt_ids, messages)
        return engine.submit(prompt_ids=prompt_ids, params=params, conversation=conversation, stop=list(stop))


def state_of(request) -> ServerState:
    return request.app.state.panechat


# -- plain routes ---------------------------------------------------------------------------
async def health(request: Request) -> Response:
    st = state_of(request)
    if st.engine is None:
        status = "error" if st.load_error else "loading"
        msg = f"the model failed to load: {st.load_error}" if st.load_error else "the model is loading"
        body = {"status": status, **errors.error_body(msg, "server_error", None, f"model_{status}")}
        return errors.ErrorJSON(body, status_code=503, headers={"Retry-After": "1"})
    s = st.engine.stats()
    return JSONResponse({
        "status": "ok", "model": st.engine.lm.name, "batching": s.get("batching"),
        "running": s.get("batch_now"), "queue_depth": s.get("queue_depth"),
        "kv_in_use": s.get("kv_in_use"), "kv_total": s.get("kv_total"),
        "terminals": st.terminals, "uptime_s": round(time.time() - st.started, 1),
    })


async def metrics(request: Request) -> Response:
    st = state_of(request)
    st.check_bearer(request)
    return Response(render(st.registry), media_type=CONTENT_TYPE)


# -- errors -----------------------------------------------------------------------------------
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        msg = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/chat/completions"
        code = "not_found"
    elif exc.status_code == 405:
        msg = f"method {request.method} not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        msg, code = str(exc.detail), None
    return errors.ErrorJSON(errors.error_body(msg, _TYPES.get(exc.status_code, "server_error"), None, code),
                        status_code=exc.status_code, headers=dict(exc.headers or {}))


async def _client_left(request: Request, exc: ClientDisconnect) -> Response:
    """The client went away while sending its body (or was cut off by the body timeout):
    nothing to answer, one log line (status 499 as in nginx, or 408)."""
    timeout = request.scope.get("panechat.body_timeout")
    set_log_detail(request, f"body not received within {timeout:g} s" if timeout else "client left mid-upload")
    return Response(status_code=408 if timeout else 499)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return errors.ErrorJSON(errors.error_body(f"internal server error: {type(exc).__name__}", "server_error",
                                          None, "internal_error"), status_code=500)


# -- per-request log line (pure ASGI, so streaming is not buffered) ------------------------
class RequestLog:
    """Logs one line per HTTP request when its response is complete; handlers may add
    detail by setting `request.scope["panechat.log"]["detail"]`."""

    def __init__(self, app, logger: logging.Logger):
        self.app = app
        self.log = logger

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        holder = scope["panechat.log"] = {"status": 0, "detail": ""}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                holder["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            client = scope.get("client") or ("-", 0)
            detail = holder["detail"]
            self.log.info('%s:%s "%s %s" %s %.2fs%s', client[0], client[1], scope["method"], scope["path"],
                          holder["status"] or "-", time.perf_counter() - t0, f" {detail}" if detail else "")


def set_log_detail(request: Request, detail: str) -> None:
    holder = request.scope.get("panechat.log")
    if holder is not None:
        holder["detail"] = detail


# -- the app ------------------------------------------------------------------------------------
def create_app(engine: "Engine | None" = None, *, token: str | None = None, max_body: int = MAX_BODY,
               logger: logging.Logger | None = None, limits: Limits | None = None,
               public_url: str | None = None) -> Starlette:
    """The ASGI app serving `engine` (or `/health` 503 until `app.state.panechat.attach(engine)`).

    token: require `Authorization: Bearer <token>` on /v1/* and /metrics, and `token` in
    the websocket `hello`. max_body: the largest request body or websocket frame in bytes.
    logger: where the per-request lines go (default logging.getLogger("panechat.server"),
    which prints nothing unless configured). limits: timeouts and caps (limits.Limits).
    public_url: the address browsers reach the server at (default: from the bind address);
    pages from other origins than it and loopback are refused."""
    from .openai_api import chat_completions, get_model, list_models
    from .websocket import websocket_endpoint

    lg = logger or log
    state = ServerState(engine, token, max_body, lg)
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/models", list_models, methods=["GET"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        WebSocketRoute("/ws", websocket_endpoint),
    ]
    app = Starlette(routes=routes, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_left,
        Exception: _internal_error,
    })
    app.state.panechat = state
    app.state.guard = Guard(limits, lg, public_url)
    app.add_middleware(BrowserGuard, guard=app.state.guard)
    app.add_middleware(RequestLog, logger=lg)  # outermost: refusals get their log line too
    return app


def parse_json(raw: bytes | str):
    """json.loads without NaN/Infinity and without lone surrogates (`"\\ud800"`, which
    cannot be encoded or tokenized); ValueError for anything malformed."""
    def _no_constants(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        obj = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    stack = [obj]
    while stack:  # iterative: nesting depth is bounded only by json.loads
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate (invalid Unicode)") from None
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return obj

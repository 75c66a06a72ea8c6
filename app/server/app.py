"""The ASGI app: OpenAI-compatible HTTP, Ollama's API (`/api/*`), the `/ws` protocol,
`/health` and `/metrics`.

`create_app(engine)` serves a running `Engine`; `create_app(None)` serves `/health` with
503 until `state.attach(engine)` is called (the model loads while the port already
answers). Everything the handlers share lives on one `ServerState` (`app.state.panechat`,
see state.py).
"""

from __future__ import annotations

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
from .errors import APIError
from .limits import Guard, Limits
from .completions_api import completions
from .ollama_api import OLLAMA_ROUTES, ollama_routes
from .openai_api import chat_completions, get_model, list_models
from .prometheus import CONTENT_TYPE, make_registry, render
from .request_log import RequestLog, set_log_detail
from .security import BrowserGuard
from .state import ServerState, state_of
from .websocket import websocket_endpoint

if TYPE_CHECKING:
    from panechat.engine.serving.engine import Engine
    from .tokens import NamedTokens

__all__ = ["create_app", "MAX_BODY"]

MAX_BODY = 1 << 20  # bytes: larger request bodies (and websocket frames) are refused

log = logging.getLogger("panechat.server")


# -- plain routes ---------------------------------------------------------------------------
async def health(request: Request) -> Response:
    st = state_of(request)
    if st.draining:  # load balancers: take this instance out of rotation
        body = {"status": "draining", **errors.error_body("the server is shutting down", "server_error", None,
                                                           "shutting_down")}
        return errors.ErrorJSON(body, status_code=503, headers={"Retry-After": "1"})
    if st.engine is None:
        status = "error" if st.load_error else "loading"
        msg = f"the model failed to load: {st.load_error}" if st.load_error else "the model is loading"
        body = {"status": status, **errors.error_body(msg, "server_error", None, f"model_{status}")}
        return errors.ErrorJSON(body, status_code=503, headers={"Retry-After": "1"})
    s = st.engine.stats()
    per_model = {name: {"file": str(e.lm.name), "batching": t.batching, "running": t.batch_now,
                        "queue_depth": t.queue_depth, "kv_in_use": t.kv_in_use, "kv_total": t.kv_total}
                 for (name, e), t in ((item, item[1].stats()) for item in st.models.engines().items())}
    return JSONResponse({  # the top-level fields are the default model's; `models` has one entry per model
        "status": "ok", "model": st.engine.lm.name, "batching": s.batching,
        "running": s.batch_now, "queue_depth": s.queue_depth,
        "kv_in_use": s.kv_in_use, "kv_total": s.kv_total,
        "terminals": st.terminals, "uptime_s": round(time.time() - st.started, 1),
        "models": per_model,
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
    return errors.shaped(request.url.path, exc.status, exc.body(), exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        see = OLLAMA_ROUTES if request.url.path.startswith(errors.OLLAMA_PREFIX) else \
            "GET /v1/models, POST /v1/chat/completions"
        msg = f"no route {request.method} {request.url.path}; see {see}"
        code = "not_found"
    elif exc.status_code == 405:
        msg = f"method {request.method} not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        msg, code = str(exc.detail), None
    return errors.shaped(request.url.path, exc.status_code,
                         errors.error_body(msg, _TYPES.get(exc.status_code, "server_error"), None, code),
                         headers=dict(exc.headers or {}))


async def _client_left(request: Request, exc: ClientDisconnect) -> Response:
    """The client went away while sending its body (or was cut off by the body timeout):
    nothing to answer, one log line (status 499 as in nginx, or 408)."""
    timeout = request.scope.get("panechat.body_timeout")
    set_log_detail(request, f"body not received within {timeout:g} s" if timeout else "client left mid-upload")
    return Response(status_code=408 if timeout else 499)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return errors.shaped(request.url.path, 500, errors.error_body(f"internal server error: {type(exc).__name__}",
                                                                  "server_error", None, "internal_error"))


# -- the app ------------------------------------------------------------------------------------
def create_app(engine: "Engine | None" = None, *, token: str | None = None, max_body: int = MAX_BODY,
               logger: logging.Logger | None = None, limits: Limits | None = None,
               public_url: str | None = None, state_dir: Path | None = None,
               tokens: "NamedTokens | None" = None) -> Starlette:
    """The ASGI app serving `engine` (or `/health` 503 until `app.state.panechat.attach(engine)`).

    token: require `Authorization: Bearer <token>` on /v1/*, /api/* (but /api/version, and /) and
    /metrics, and `token` in the websocket `hello`. max_body: the largest request body or
    websocket frame in bytes.
    logger: where the per-request lines go (default logging.getLogger("panechat.server"),
    which prints nothing unless configured). limits: timeouts and caps (limits.Limits).
    public_url: the address browsers reach the server at (default: from the bind address);
    pages from other origins than it and loopback are refused. state_dir: where the
    websocket conversations persist (conversation_db.py; None: in memory only). tokens:
    named tokens (--tokens FILE, tokens.py) instead of `token`: requests and terminals are
    attributed to the name."""
    lg = logger or log
    limits = limits or Limits()
    if token and tokens is not None:
        raise ValueError("give --token or --tokens, not both (put the shared token in the file under a name)")
    state = ServerState(engine, token, max_body, lg, history_memory=limits.history_memory, state_dir=state_dir,
                        tokens=tokens)
    state.registry = make_registry(state)
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/models", list_models, methods=["GET"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        WebSocketRoute("/ws", websocket_endpoint),
        *ollama_routes(),
    ]
    app = Starlette(routes=routes, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_left,
        Exception: _internal_error,
    })
    app.state.panechat = state
    app.state.guard = Guard(limits, lg, public_url)
    # Ollama's clients (litellm's ollama/ provider) send JSON with no Content-Type, as Ollama takes it
    app.add_middleware(BrowserGuard, guard=app.state.guard, routes=routes, untyped_json=(errors.OLLAMA_PREFIX,))
    app.add_middleware(RequestLog, logger=lg)  # outermost: refusals get their log line too
    return app

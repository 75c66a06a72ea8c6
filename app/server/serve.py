"""Run the server: `panechat serve`, and `ServerThread` for hosting it inside any process.

Hosting in-process (what `panechat --share` does)::

    from panechat.app.server.serve import start_in_background
    srv = start_in_background(engine, host="127.0.0.1", port=8765, token=None)
    print(srv.url, srv.ws_url)      # http://127.0.0.1:8765  ws://127.0.0.1:8765/ws
    srv.state.terminals             # websocket terminals connected right now
    ...
    srv.stop()                      # remote generations end (reason shutdown); the engine keeps
                                    # running: stop it yourself

The server runs uvicorn on its own thread and event loop; the engine runs on its own
thread, so hosting costs the host's event loop nothing. Request log lines go to the
`panechat.server` logger (silent unless configured).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from panechat.backends.errors import one_line
from panechat.engine.default_model import resolve_model_path
from ..engine_factory import build_models, engine_config
from ..startup_clock import since_start
from ..store import data_dir
from .app import MAX_BODY, create_app
from .state import ServerState
from .limits import Guard, Limits, Listener, raise_fd_limit, run_server
from .security import bind_warning
from .shutdown import DrainingServer
from .tokens import NamedTokens

__all__ = ["ServerThread", "start_in_background", "serve", "banner_urls"]

#: uvicorn's websocket implementation on the `websockets` library (its legacy "websockets"
#: protocol class is deprecated in uvicorn >= 0.35 in favour of the sans-I/O one).
WS_IMPL = "websockets-sansio" if "websockets-sansio" in uvicorn.config.WS_PROTOCOLS else "websockets"
#: Frames above MAX_BODY get an error frame; frames above this close the socket (1009).
WS_MAX_SIZE = 16 * MAX_BODY


def _bind(host: str, port: int) -> Listener:
    """A listening TCP socket (port 0: a free port). OSError names host:port and the fix."""
    sock = Listener(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                      "pass another --port (or stop the process using it)") from None
    sock.setblocking(False)
    return sock


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _config(app, guard: Guard, graceful_s: float, log_config: dict | None = None) -> uvicorn.Config:
    """uvicorn's settings for `app`: the guard's protocols (timeouts, caps), no access log."""
    raise_fd_limit()  # before the guard sizes its accept-time cap from the file limit
    return uvicorn.Config(app, ws_max_size=WS_MAX_SIZE, lifespan="off", access_log=False,
                          log_config=log_config, log_level="warning", timeout_graceful_shutdown=graceful_s,
                          **guard.uvicorn_options(WS_IMPL))


class ServerThread:
    """uvicorn serving an ASGI app on a background thread.

    The port is bound in the constructor (so errors raise in the caller, and port 0 picks
    a free port: read `.port`). `start()` returns once the server accepts connections;
    `stop()` drains it and shuts it down (shutdown.py: generations this server started
    get `grace` seconds, then end with reason `shutdown`, each client told)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8765, *,
                 log_config: dict | None = None, graceful_s: float = 3.0):
        self.app = app
        self.host = host
        self._sock = _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        self.guard: Guard = app.state.guard
        self._sock.guard = self.guard
        self.guard.origins.bound(host, self.port)
        self.server = DrainingServer(_config(app, self.guard, graceful_s, log_config), app.state.panechat,
                                     self.guard.limits.shutdown_grace)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def state(self) -> ServerState:
        """The app's shared state (engine, terminals, conversations)."""
        return self.app.state.panechat

    @property
    def url(self) -> str:
        """Base HTTP URL, e.g. http://127.0.0.1:8765 (the OpenAI base URL is url + '/v1')."""
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{_url_host(self.host)}:{self.port}/ws"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="panechat-server", daemon=True)
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the server failed to start: {self._error!r}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start in time")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        try:
            asyncio.run(run_server(self.server, [self._sock], self.guard))
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e

    def stop(self, timeout: float = 10.0, grace: float = 0.0) -> None:
        """Stop serving after a drain with `grace` seconds (0: end what runs at once, each
        client told); the engine is not stopped."""
        self.server.request_drain(grace)
        if self._thread is not None:
            self._thread.join(timeout + grace)
            if self._thread.is_alive():
                self.server.force_exit = True
                self._thread.join(timeout)
            self._thread = None
        self._sock.close()
        self.state.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_in_background(engine, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
                        *, logger: logging.Logger | None = None, limits: Limits | None = None,
                        public_url: str | None = None) -> ServerThread:
    """Serve a started `Engine` (or a ModelSet of them) on host:port from a background thread; returns the
    running ServerThread (`.url`, `.ws_url`, `.port`, `.state.terminals`, `.stop()`).

    Raises OSError (one line: host, port, fix) when the port cannot be bound."""
    app = create_app(engine, token=token, logger=logger, limits=limits, public_url=public_url)
    return ServerThread(app, host, port).start()


def banner_urls(host: str, port: int, token: str | None) -> list[str]:
    h = _url_host(host)
    lines = [
        f"OpenAI API: http://{h}:{port}/v1  (OPENAI_BASE_URL=http://{h}:{port}/v1)",
        f"websocket:  ws://{h}:{port}/ws  (panechat --connect ws://{h}:{port})",
        f"health:     http://{h}:{port}/health   metrics: http://{h}:{port}/metrics",
    ]
    if token:
        lines.append("auth:       token required (HTTP: Authorization: Bearer <token>; websocket: hello.token)")
    return lines


def named_tokens(path: str | None, logger: logging.Logger) -> NamedTokens | None:
    """--tokens FILE read (TokensFileError or OSError, one line, for a bad or missing file)."""
    if path is None:
        return None
    try:
        return NamedTokens(Path(path).expanduser(), logger)
    except OSError as e:
        raise OSError(f"--tokens {path}: {e.strerror or e}; give a file of 'name token' lines") from None


def state_folder(flag: str | None) -> Path | None:
    """--state-dir: where `/ws` conversations persist; default the panechat data folder
    ($PANECHAT_DATA_DIR, else the platform's), "none": memory only."""
    if flag is not None and flag.strip().lower() == "none":
        return None
    return Path(flag).expanduser() if flag else data_dir()


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is when a record is emitted, so a server
    started again in one process (tests, the TUI's server) never writes to a stderr that
    has since been replaced and closed."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def server_logger() -> logging.Logger:
    """The access and event log of `panechat serve`: time-stamped lines on stderr."""
    logger = logging.getLogger("panechat.server")
    if not logger.handlers:
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(h)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def serve(args: argparse.Namespace) -> int:
    """`panechat serve`: listen at once (/health answers 503 while the model loads), load
    the model in the background, then serve until SIGTERM or Ctrl-C, which drain the
    generations in flight (--shutdown-grace) and exit 0."""
    engine_config(args)  # flag errors before anything else
    limits = Limits.from_args(args)
    resolve_model_path(getattr(args, "model", None))  # a missing default model: one line, exit 2
    logger = server_logger()
    token = getattr(args, "token", None)
    tokens = named_tokens(getattr(args, "tokens", None), logger)
    app = create_app(None, token=token, logger=logger, limits=limits, public_url=getattr(args, "public_url", None),
                     state_dir=state_folder(getattr(args, "state_dir", None)), tokens=tokens)
    state: ServerState = app.state.panechat
    guard: Guard = app.state.guard
    sock = _bind(args.host, args.port)
    sock.guard = guard
    port = sock.getsockname()[1]
    guard.origins.bound(args.host, port)
    # SIGTERM / Ctrl-C: drain first (shutdown.py), then exit 0
    server = DrainingServer(_config(app, guard, 3), state, limits.shutdown_grace)
    print(f"panechat serve: listening on http://{_url_host(args.host)}:{port} (loading the model ...)",
          file=sys.stderr, flush=True)
    warning = bind_warning(args.host, token or tokens)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    result = {"rc": 0, "engine": None}

    def load() -> None:
        try:
            engine = build_models(args, quiet=True)  # every --model; others load on first request
        except Exception as e:  # noqa: BLE001 - reported as one line, exit 2
            msg = one_line(e)
            state.fail(msg)
            print(f"panechat: error: {msg}", file=sys.stderr, flush=True)
            result["rc"] = 2
            server.should_exit = True
            return
        result["engine"] = engine
        for name, e in engine.engines().items():
            for line in e.startup_lines():
                print(line, file=sys.stderr)
        for line in banner_urls(args.host, port, token or tokens):
            print(line, file=sys.stderr)
        engine.on_load = lambda name, e: print("\n".join(e.startup_lines()), file=sys.stderr, flush=True)
        engine.on_unload = lambda name, why: logger.info("model %s unloaded (%s)", name, why)
        state.attach(engine)
        print(f"ready in {since_start():.2f} s (from the process's start; weights prepared in "
              f"{max(e.lm.model.load_seconds for e in engine.engines().values()):.2f} s)", file=sys.stderr, flush=True)

    loader = threading.Thread(target=load, name="panechat-load", daemon=True)
    loader.start()
    try:
        asyncio.run(run_server(server, [sock], guard))
    finally:
        server.should_exit = True
        loader.join(timeout=1)  # still loading: not worth waiting for (a daemon thread)
        if result["engine"] is not None:
            result["engine"].stop()
        sock.close()
        state.close()
    return result["rc"]

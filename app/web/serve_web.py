"""`panechat web`: the engine's server on loopback, and the TUI served to browsers.

Each browser session runs `panechat --connect <the engine's ws URL>` with the token, so it
is a terminal like any other: its panes join the engine's batch, and the server's token,
limits and per-client queues apply to it. With `--connect URL` no engine starts here: the
sessions join that server instead."""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import sys
import threading
from pathlib import Path

from panechat.backends.errors import one_line

TOKEN_ENV = "PANECHAT_WEB_TOKEN"  # the sessions read the token here, not from their command line


def session_command(ws_url: str) -> str:
    """The shell line each browser session runs: the TUI joined to `ws_url`."""
    exe = Path(sys.executable).with_name("panechat")
    panechat = shlex.quote(str(exe)) if exe.exists() else "panechat"
    return f'{panechat} --connect {shlex.quote(ws_url)} --token "${TOKEN_ENV}"'


class EngineServer:
    """The panechat server on 127.0.0.1 (a free port), its engine loading in the background
    (/health answers 503 and the sessions show `connecting` until it is up)."""

    def __init__(self, args: argparse.Namespace, token: str):
        from ..engine_factory import build_models, engine_config
        from ..server.app import create_app
        from ..server.limits import Limits
        from ..server.serve import ServerThread, server_logger, state_folder

        engine_config(args)  # flag errors before anything listens
        app = create_app(None, token=token, logger=server_logger(), limits=Limits.from_args(args),
                         state_dir=state_folder(getattr(args, "state_dir", None)))
        self.srv = ServerThread(app, "127.0.0.1", 0).start()
        self.engine = None
        self.error: str | None = None
        self._build = lambda: build_models(args, quiet=True)
        self._loader = threading.Thread(target=self._load, name="panechat-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        try:
            self.engine = self._build()
        except Exception as e:  # noqa: BLE001 - a model that will not load: one line
            self.error = one_line(e)
            self.srv.state.fail(self.error)
            print(f"panechat: error: {self.error}", file=sys.stderr, flush=True)
            return
        self.srv.state.attach(self.engine)
        print(f"panechat web: model ready ({', '.join(self.engine.names())})", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self.srv.stop(grace=self.srv.guard.limits.shutdown_grace)
        self._loader.join(timeout=1)
        if self.engine is not None:
            self.engine.stop()


def web(args: argparse.Namespace) -> int:
    """Serve the TUI to browsers on --host:--port until Ctrl-C or SIGTERM."""
    from ..server.security import bind_warning
    from ..usage import UsageError
    from .browser_server import BrowserServer

    if args.max_sessions < 1:
        raise UsageError(f"--max-sessions must be at least 1 (got {args.max_sessions})")
    engine = None
    if args.connect:
        if not args.connect.startswith(("ws://", "wss://")):
            raise UsageError(f"panechat web --connect needs a panechat server's ws://HOST:PORT, got {args.connect!r}")
        ws_url, inner_token = args.connect, args.token or ""
    else:
        from panechat.engine.default_model import resolve_model_path

        resolve_model_path(args.model)  # a missing default model: one line, exit 2
        inner_token = args.token or secrets.token_urlsafe(24)  # the loopback server is never open
        engine = EngineServer(args, inner_token)
        ws_url = engine.srv.ws_url
    os.environ[TOKEN_ENV] = inner_token
    server = BrowserServer(session_command(ws_url), args.host, args.port, token=args.token,
                           max_sessions=args.max_sessions, public_url=args.public_url)
    server.on_ready = lambda url: print(f"panechat web: open {url}", file=sys.stderr, flush=True)
    warning = bind_warning(args.host, args.token)
    if warning:
        print(warning.replace("panechat serve", "panechat web"), file=sys.stderr, flush=True)
    try:
        server.serve()
    finally:
        if engine is not None:
            engine.stop()
    return 0

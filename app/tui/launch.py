"""`panechat` with no subcommand: open the TUI on the embedded engine, a panechat server
(--connect ws://), an OpenAI-compatible API (--connect http(s)://), or the embedded engine
served to teammates as well (--share)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from ..clients import backend_for_url
from ..clients.local import LocalBackend
from ..store import Store


def make_backend(args: argparse.Namespace):
    """The ChatBackend the flags ask for (validates flags; loads nothing yet)."""
    from ..cli import UsageError

    if args.connect:
        if args.share:
            raise UsageError("--share serves this terminal's own engine; it cannot be combined with --connect")
        return backend_for_url(args.connect, token=args.token, api_key=args.api_key, model=args.model)
    from ...engine.default_model import resolve_model_path
    from ...engine.gguf_file import ModelFileError
    from ..engine_factory import build_engine, engine_config

    engine_config(args)  # flag errors before the screen opens
    path = resolve_model_path(args.model)  # a missing default model: one line, exit 2
    if not path.is_file():  # the rest of the checks run while loading, on screen
        raise ModelFileError(f"model file not found: {path}" if not path.exists() else f"model path is not a file: {path}")
    return LocalBackend(build=lambda: build_engine(args, quiet=True), own_engine=True)


class ShareServer:
    """`--share`: the panechat server hosted in this process, serving this TUI's engine.

    The port is bound in the constructor (a busy port fails before the screen opens); the
    engine is attached once it has loaded, so teammates' requests join the panes' batch."""

    def __init__(self, backend: LocalBackend, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
                 limits=None, public_url: str | None = None):
        from ..server.app import create_app
        from ..server.serve import ServerThread

        self.backend, self.host, self.token = backend, host, token
        app = create_app(None, token=token, limits=limits, public_url=public_url)
        self.srv = ServerThread(app, host, port).start()

    @property
    def ws_url(self) -> str:
        return self.srv.ws_url

    async def attach(self, app) -> str:
        """Serve the loaded engine; returns the line to show (how teammates connect)."""
        self.srv.state.attach(self.backend.engine)
        self.backend.terminals = lambda: self.srv.state.terminals + 1  # the others, and this one
        line = f"sharing: panechat --connect ws://{self.host}:{self.srv.port}" + (" --token …" if self.token else "")
        app.main.query_one("Dashboard").share_line = line
        return line

    async def close(self) -> None:
        await asyncio.to_thread(self.srv.stop)


def launch(args: argparse.Namespace) -> int:
    """Run the TUI until the user quits; returns the exit code."""
    from .app import PanechatApp

    backend = make_backend(args)
    sharing = None
    if args.share:
        from ..server.limits import Limits

        sharing = ShareServer(backend, args.host, args.port, args.token, Limits.from_args(args), args.public_url)
    store = Store.open()
    try:
        app = PanechatApp(backend, store, share=sharing.attach if sharing else None,
                          close_share=sharing.close if sharing else None)
        app.run()
    finally:
        store.close()
    if app.fatal_error:
        print(f"panechat: error: {app.fatal_error}", file=sys.stderr)
        return 2
    return app.return_code or 0

"""`panechat` with no subcommand: open the TUI on the embedded engine, a panechat server
(--connect ws://), an OpenAI-compatible API (--connect http(s)://), or the embedded engine
served to teammates as well (--share)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from panechat.engine.default_model import resolve_model_path
from panechat.engine.gguf.file import ModelFileError
from ..clients import backend_for_url
from ..clients.local import LocalBackend
from ..engine_factory import build_models, engine_config
from ..store import Store, StoreError
from ..usage import UsageError

STORE_NOTICE_S = 30  # seconds a store notice stays on screen (the app goes on; the user should read it)


def make_backend(args: argparse.Namespace):
    """The ChatBackend the flags ask for (validates flags; loads nothing yet)."""
    if args.connect:
        if args.share:
            raise UsageError("--share serves this terminal's own engine; it cannot be combined with --connect")
        return backend_for_url(args.connect, token=args.token, api_key=args.api_key, model=args.model)
    engine_config(args)  # flag errors before the screen opens
    path = resolve_model_path(args.model)  # a missing default model: one line, exit 2 (every --model loads on screen)
    if not path.is_file():  # the rest of the checks run while loading, on screen
        raise ModelFileError(f"model file not found: {path}" if not path.exists() else f"model path is not a file: {path}")
    return LocalBackend(build=lambda: build_models(args, quiet=True), own_engine=True)


class ShareServer:
    """`--share`: the panechat server hosted in this process, serving this TUI's engine.

    The port is bound in the constructor (a busy port fails before the screen opens); the
    engine is attached once it has loaded, so teammates' requests join the panes' batch."""

    def __init__(self, backend: LocalBackend, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
                 limits=None, public_url: str | None = None):
        from ..server.app import create_app  # deferred: only --share needs starlette and uvicorn
        from ..server.serve import ServerThread

        self.backend, self.host, self.token = backend, host, token
        app = create_app(None, token=token, limits=limits, public_url=public_url)
        self.srv = ServerThread(app, host, port).start()

    @property
    def ws_url(self) -> str:
        return self.srv.ws_url

    async def attach(self, app) -> str:
        """Serve the loaded engine; returns the line to show (how teammates connect; the
        app puts it on the dashboard)."""
        st = self.srv.state
        st.attach(self.backend.models)  # every model the panes use
        st.hosted = 1  # this terminal: the host and its guests count the same terminals
        self.backend.terminals = lambda: st.terminals + st.hosted
        return f"sharing: panechat --connect ws://{self.host}:{self.srv.port}" + (" --token …" if self.token else "")

    async def close(self) -> None:
        """Drain (teammates' generations get --shutdown-grace, then end with reason
        'shutdown'), then stop serving."""
        await asyncio.to_thread(self.srv.stop, grace=self.srv.guard.limits.shutdown_grace)


def build_app(backend, store: Store, **kwargs):
    """The PanechatApp over `store`, with the store's lines (damage found at open, writing
    stopped later) shown as notifications; `kwargs` go to PanechatApp."""
    from .app import PanechatApp  # deferred: textual loads only when the TUI opens

    app = PanechatApp(backend, store, **kwargs)

    def show(line: str) -> None:
        app.notify(line, severity="warning", timeout=STORE_NOTICE_S, markup=False)

    for line in store.notices:
        show(line)
    store.report = show
    return app


def launch(args: argparse.Namespace) -> int:
    """Run the TUI until the user quits; returns the exit code."""
    backend = make_backend(args)
    try:
        store = Store.open()  # a damaged file is moved aside, said in one line on stderr
    except StoreError as e:
        print(f"panechat: error: {e}", file=sys.stderr)
        return 2
    try:
        sharing = None
        if args.share:
            from ..server.limits import Limits

            sharing = ShareServer(backend, args.host, args.port, args.token, Limits.from_args(args), args.public_url)
        app = build_app(backend, store, share=sharing.attach if sharing else None,
                        close_share=sharing.close if sharing else None)
        shown = len(store.notices)
        app.run()
    finally:
        store.close()
    for line in store.notices[shown:]:  # said on screen during the session; kept on stderr too
        print(f"panechat: {line}", file=sys.stderr)
    if app.fatal_error:
        print(f"panechat: error: {app.fatal_error}", file=sys.stderr)
        return 2
    return app.return_code or 0

"""panechat's server: OpenAI-compatible HTTP, the /ws protocol, /health and /metrics on
one port, all feeding one engine (see docs/protocol.md).

    from panechat.app.server import start_in_background
    srv = start_in_background(engine, "127.0.0.1", 8765, token=None)  # ServerThread
    srv.url, srv.ws_url, srv.port, srv.state.terminals
    srv.stop()
"""

from __future__ import annotations

from .app import create_app
from .serve import ServerThread, serve, start_in_background
from .state import ServerState

__all__ = ["create_app", "ServerState", "ServerThread", "start_in_background", "serve"]

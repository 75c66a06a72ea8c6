"""`--share` as two people use it, both under Pilot: the host's TUI serving its engine
(ShareServer, a real server on loopback) and a guest's TUI connected over the websocket.
Both dashboards count the same terminals; when the host quits the guest says so at once
and, once a server is back on that port, reconnects by itself and chats again."""

from __future__ import annotations

from panechat.app.clients.local import LocalBackend
from panechat.app.clients.remote_ws import RemoteBackend
from panechat.app.server import start_in_background
from panechat.app.store import Store
from panechat.app.tui.app import PanechatApp
from panechat.app.tui.launch import ShareServer
from panechat.app.tui.widgets.dashboard import Dashboard

from .conftest import make_app, type_and_send, wait_for

SIZE = (160, 45)


def _said(app, widget_id: str) -> str:
    return str(app.main.query_one(Dashboard).query_one(f"#{widget_id}").render())


async def test_host_and_guest_agree_and_the_guest_reconnects_by_itself(tui_engine, store, tmp_path):
    sharing = ShareServer(LocalBackend(tui_engine), "127.0.0.1", 0)
    port = sharing.srv.port
    host = PanechatApp(sharing.backend, store, share=sharing.attach, close_share=sharing.close)
    guest_store = Store(tmp_path / "guest.db")
    guest = make_app(RemoteBackend(sharing.ws_url), guest_store)
    srv = None
    host_run = host.run_test(size=SIZE)  # entered and left by hand: the host quits while the guest runs
    try:
        ph = await host_run.__aenter__()
        await wait_for(ph, lambda: host.share_line is not None, timeout=30, what="sharing")
        async with guest.run_test(size=SIZE) as pg:
            await wait_for(pg, guest.backend_ready.is_set, what="the guest's connection")
            await wait_for(pg, lambda: "terminals 2" in _said(guest, "dash-kv")
                           and "terminals 2" in _said(host, "dash-kv"), timeout=10,
                           what="host and guest both to count 2 terminals")
            await host_run.__aexit__(None, None, None)  # the host quits: its server drains and stops
            host_run = None
            await wait_for(pg, lambda: _said(guest, "dash-batch") == "disconnected, retrying", timeout=3,
                           what="the guest to say it is disconnected")
            assert "terminals" not in _said(guest, "dash-kv")  # no stale figure
            srv = start_in_background(tui_engine, "127.0.0.1", port)  # a server is back on that port
            await wait_for(pg, lambda: _said(guest, "dash-batch").startswith("batch")
                           and "terminals 1" in _said(guest, "dash-kv"), timeout=15,
                           what="the guest to reconnect by itself")
            pane = guest.main.panes[0]
            await type_and_send(pg, pane, "Name a fruit")
            await wait_for(pg, lambda: pane.last_finish is not None and not pane.busy, timeout=90,
                           what="a reply after the reconnect")
            assert pane.last_finish.reason in ("stop", "length"), pane.last_finish
    finally:
        if host_run is not None:
            await host_run.__aexit__(None, None, None)
        guest_store.close()
        if srv is not None:
            srv.stop()

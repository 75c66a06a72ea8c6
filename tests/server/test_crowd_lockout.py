"""A crowd of stalled sockets cannot lock real clients out (docs/protocol.md, "Limits and
timeouts"): at --max-connections, connections still waiting for their headers give way
to one that has sent a whole request, and websockets still waiting for their `hello`
give way to new handshakes. Each probe runs a live loopback server with long timeouts
(so no timeout frees a slot) and is bounded by a deadline."""

from __future__ import annotations

import asyncio
import json
import selectors
import socket
import threading
import time

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from .conftest import guarded_server

STALL = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never finished


class ReopeningAttacker(threading.Thread):
    """Holds `n` connections stalled inside their headers and reopens each one the server
    closes, at once, until stopped."""

    def __init__(self, port: int, n: int):
        super().__init__(daemon=True)
        self.port, self.n = port, n
        self.stop, self.ready = threading.Event(), threading.Event()
        self.sel = selectors.DefaultSelector()
        self.reopened = 0

    def _open(self) -> None:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.sendall(STALL)
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ)

    def run(self) -> None:
        try:
            for _ in range(self.n):
                self._open()
            self.ready.set()
            while not self.stop.is_set():
                for key, _ in self.sel.select(timeout=0.05):
                    s = key.fileobj
                    try:
                        if s.recv(4096):
                            continue
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        pass
                    self.sel.unregister(s)
                    s.close()
                    self._open()
                    self.reopened += 1
        finally:
            for key in list(self.sel.get_map().values()):
                key.fileobj.close()
            self.ready.set()


def test_stalled_crowd_and_a_reopening_attacker_do_not_lock_out_real_requests(server_engine):
    cap = 32
    with guarded_server(server_engine, max_connections=cap, header_timeout=60, log_interval=0.5) as (srv, log):
        attacker = ReopeningAttacker(srv.port, 2 * cap)
        attacker.start()
        try:
            assert attacker.ready.wait(10)
            time.sleep(0.5)  # the crowd has stalled well past any real client's header time
            statuses = []
            deadline = time.monotonic() + 30
            while len(statuses) < 20 and time.monotonic() < deadline:
                # a fresh connection per request: each has to get past the crowd on its own
                r = httpx.get(srv.url + "/v1/models", headers={"Connection": "close"}, timeout=5)
                statuses.append(r.status_code)
            reopened = attacker.reopened
        finally:
            attacker.stop.set()
            attacker.join(10)
        assert statuses == [200] * 20, statuses
        assert reopened >= 20, reopened  # the attacker did take back what was closed
        assert not log.bad(), log.bad()


HELLO = {"type": "hello", "protocol": 1, "client": "pytest/0", "token": "sekrit"}


async def test_sockets_that_never_say_hello_give_way_to_real_terminals(server_engine):
    cap = 64  # the default cap on websockets awaiting hello
    with guarded_server(server_engine, token="sekrit", auth_grace=60, max_unauthed=cap) as (srv, log):
        mute = []
        terminals = []
        try:
            async with asyncio.timeout(60):
                for _ in range(2 * cap):  # every handshake succeeds: the oldest mute ones give way
                    mute.append(await connect(srv.ws_url, open_timeout=5))
                for _ in range(16):
                    ws = await connect(srv.ws_url, open_timeout=5)
                    terminals.append(ws)
                    await ws.send(json.dumps(HELLO))
                    assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "welcome"
                closed, codes = [], set()
                for i, ws in enumerate(mute):
                    try:
                        frame = json.loads(await asyncio.wait_for(ws.recv(), 0.05))
                        assert frame["code"] == "hello_timeout", frame
                        await asyncio.wait_for(ws.recv(), 5)
                    except ConnectionClosed as e:
                        closed.append(i)
                        codes.add(e.rcvd.code if e.rcvd else None)
                    except TimeoutError:
                        pass
        finally:
            for ws in mute + terminals:
                await ws.close()
        assert len(terminals) == 16
        # the oldest went, in order: 64 for the newer mute ones, one for the first terminal (each
        # terminal leaves the count at its hello, so the next one finds a free place)
        assert closed == list(range(cap + 1)) and codes == {4408}, (closed, codes)
        log.wait_for("oldest closed for new ones")
        assert not log.bad(), log.bad()

"""One live server for all server tests: uvicorn on a free loopback port, in a background
thread, serving a real Engine on the default model (max-concurrent 4, 8 KV slots,
max-queue 8, 1024-token context)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest

from panechat.app.server import ServerThread, create_app
from panechat.engine.engine import Engine, EngineConfig
from panechat.engine.stats import EngineStats


@dataclass
class Live:
    engine: Engine
    srv: ServerThread

    @property
    def url(self) -> str:
        return self.srv.url

    @property
    def ws_url(self) -> str:
        return self.srv.ws_url

    @property
    def model(self) -> str:
        return self.engine.lm.name

    def wait_idle(self, timeout: float = 30.0) -> EngineStats:
        """Wait until nothing runs or waits and no KV slot is held; returns the stats."""
        return wait_idle(self.engine, timeout)


def wait_idle(engine: Engine, timeout: float = 30.0) -> EngineStats:
    t0 = time.monotonic()
    while True:
        s = engine.stats()
        if s.kv_in_use == 0 and s.queue_depth == 0 and not s.streams:
            return s
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"engine not idle after {timeout}s: {s}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def server_engine(loaded_model):
    engine = Engine(loaded_model, EngineConfig(max_concurrent=4, kv_sessions=8, max_queue=8,
                                               ctx_size=1024)).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def live(server_engine):
    """The shared server (no token)."""
    srv = ServerThread(create_app(server_engine), "127.0.0.1", 0).start()
    yield Live(server_engine, srv)
    srv.stop()


@pytest.fixture(scope="session")
def live_token(server_engine):
    """A second app on the same engine that requires the token 'sekrit'."""
    srv = ServerThread(create_app(server_engine, token="sekrit"), "127.0.0.1", 0).start()
    yield Live(server_engine, srv)
    srv.stop()


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, timeout=120) as c:
        yield c

"""One live server for all server tests: uvicorn on a free loopback port, in a background
thread, serving a real Engine on the default model (max-concurrent 4, 8 KV slots,
max-queue 8, 1024-token context). `guarded_server` starts a further one on the same
engine with limits of its own and a record of everything it logs."""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from panechat.app.server import ServerThread, create_app
from panechat.app.server.limits import Limits
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.stats import EngineStats


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


@pytest.fixture(scope="session", autouse=True)
def _private_state_folders(tmp_path_factory):
    """`panechat serve` subprocesses keep their conversations (--state-dir) and KV snapshots
    (--kv-snapshots) in folders of this session, never the user's."""
    keys = ("PANECHAT_DATA_DIR", "XDG_CACHE_HOME")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["PANECHAT_DATA_DIR"] = str(tmp_path_factory.mktemp("data"))
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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


class LogRecorder(logging.Handler):
    """Keeps every record of the loggers it is attached to."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, needle: str = "") -> list[str]:
        return [m for m in (r.getMessage() for r in self.records) if needle in m]

    def bad(self) -> list[str]:
        """Records with a traceback or at ERROR and above: a refusal must never log these."""
        return [r.getMessage() for r in self.records if r.exc_info or r.levelno >= logging.ERROR]

    def wait_for(self, needle: str, timeout: float = 5.0) -> list[str]:
        t0 = time.monotonic()
        while not self.lines(needle) and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
        return self.lines(needle)


_server_ids = itertools.count()


@contextmanager
def guarded_server(engine: Engine, *, token: str | None = None, public_url: str | None = None, **limits):
    """A loopback server of its own on `engine` with `Limits(**limits)`; yields (srv, log):
    `log` records its request and limit lines and whatever uvicorn and asyncio log meanwhile."""
    rec = LogRecorder()
    own = logging.getLogger(f"panechat.test.server{next(_server_ids)}")
    own.setLevel(logging.DEBUG)
    own.propagate = False
    watched = [own, logging.getLogger("uvicorn.error"), logging.getLogger("asyncio")]
    for lg in watched:
        lg.addHandler(rec)
    app = create_app(engine, token=token, logger=own, limits=Limits(**limits), public_url=public_url)
    srv = ServerThread(app, "127.0.0.1", 0).start()
    try:
        yield srv, rec
    finally:
        srv.stop()
        for lg in watched:
            lg.removeHandler(rec)

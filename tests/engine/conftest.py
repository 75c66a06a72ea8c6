"""Fixtures the engine tests share."""

import pytest

from panechat.engine.serving.engine import Engine, EngineConfig


@pytest.fixture
def make_engine(loaded_model):
    """Started Engines on the session's default model (ctx 512 unless given), stopped at the end."""
    engines = []

    def make(**kw):
        kw.setdefault("ctx_size", 512)
        e = Engine(loaded_model, EngineConfig(**kw)).start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.stop()

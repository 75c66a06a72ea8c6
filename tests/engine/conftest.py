"""Fixtures the engine tests share."""

import pytest

from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.engine.model.loader import load_model
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


@pytest.fixture(scope="module", params=["numpy", "cupy-emulated"])
def tiny_lm(request, tiny):
    """The tiny llama on the host-sampling numpy backend and the device-sampling CuPy one
    (its numpy emulation), for the tests of the per-row steps before the sampler."""
    path, _ = tiny("llama", "Q8_0")
    be = "numpy" if request.param == "numpy" else CupyBackend.emulated_on_cpu()
    lm = load_model(path, be, max_positions=64)
    assert lm.model.samples_on_device == (request.param != "numpy")
    return lm

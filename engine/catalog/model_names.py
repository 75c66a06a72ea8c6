"""What models are called, and the errors about them: light enough for the CLI to import
without loading the engine (engine/serving/model_set.py holds the models themselves)."""

from __future__ import annotations

from pathlib import Path

from panechat.engine.catalog.shipped_models import DEFAULT_MODEL


class UnknownModel(LookupError):
    """A request named a model this process neither holds nor can find (one line, naming
    the ones it can use)."""


class ModelDoesNotFit(RuntimeError):
    """Loading the model would take the loaded models past the memory budget, and the
    models that could make room are busy (one line: the budget and what is loaded)."""


def model_name(spec: str | Path | None) -> str:
    """The name a model goes by: a file's name without `.gguf`, a catalog name as given,
    the default model's name for None."""
    if not spec:
        return DEFAULT_MODEL.name
    path = Path(spec).expanduser()
    if path.is_file():
        return path.name[:-len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    return str(spec)


def parse_model_list(values: list[str] | str | None) -> list[str]:
    """`--model` given several times and/or as comma lists, in order, duplicates dropped."""
    if values is None:
        return []
    items = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out

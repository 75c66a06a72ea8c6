"""Reading GGUF model files: metadata, and tensors as stored (dequantized on demand).

Follows the GGUF spec (ggml docs/gguf.md) through the `gguf` package's memory-mapped
reader; every tensor type that `gguf.quants` can dequantize is supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.errors import one_line
from ..backends.gguf_tensor import GGUFTensor


class ModelFileError(Exception):
    """A model file that cannot be used; the message is one line naming problem and fix."""


@dataclass
class GGUFFile:
    """An opened GGUF file: `metadata` (key -> python value) and lazily read tensors."""

    path: Path
    metadata: dict[str, Any]
    _tensors: dict[str, GGUFTensor]

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        """Open and validate `path`; raises ModelFileError with a one-line reason."""
        path = Path(path)
        if not path.exists():
            raise ModelFileError(f"model file not found: {path}")
        if not path.is_file():
            raise ModelFileError(f"model path is not a file: {path}")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFileError(f"{path} is not a GGUF model file (bad magic); pass a .gguf file")
        import gguf  # deferred: importing gguf costs ~0.3 s

        try:
            reader = _plain_reader(gguf)(path, "r")
            metadata = {k: _field_value(f) for k, f in reader.fields.items()}
            tensors = {t.name: _lazy(t) for t in reader.tensors}
        except Exception as e:  # the reader raises many kinds on damaged files
            raise ModelFileError(
                f"{path} is a damaged or truncated GGUF file ({one_line(e, with_type=True)}); "
                "download it again"
            ) from None
        return cls(path, metadata, tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor as stored, a view of the memory map; nothing is read or converted
        until a backend asks (`GGUFTensor.dequantize`, or its blocks)."""
        return self._tensors[name]


def _plain_reader(gguf: Any) -> type:
    """gguf.GGUFReader parsing a plain ndarray view of its memory map: the same fields and
    tensors, without numpy.memmap's per-slice bookkeeping, which made a 262k-token
    vocabulary cost ~20 s to parse (gemma-3-270m: 23 s -> 5 s)."""

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)  # keeps the map alive through .base

    return PlainReader


def _lazy(t: Any) -> GGUFTensor:
    """A gguf ReaderTensor as a GGUFTensor: shape in row-major order (GGUF lists the
    dimensions innermost first), the data as a plain view of the memory map."""
    shape = tuple(int(d) for d in reversed(t.shape))
    return GGUFTensor(t.name, shape, t.tensor_type.name, t.data.view(np.ndarray))


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value

"""Reading GGUF model files: metadata and dequantized tensors.

Follows the GGUF spec (ggml docs/gguf.md) through the `gguf` package's memory-mapped
reader; every tensor type that `gguf.quants` can dequantize is supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.errors import one_line


class ModelFileError(Exception):
    """A model file that cannot be used; the message is one line naming problem and fix."""


@dataclass
class GGUFFile:
    """An opened GGUF file: `metadata` (key -> python value) and lazily read tensors."""

    path: Path
    metadata: dict[str, Any]
    _tensors: dict[str, Any]

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
            reader = gguf.GGUFReader(path, "r")
            metadata = {k: _field_value(f) for k, f in reader.fields.items()}
            tensors = {t.name: t for t in reader.tensors}
        except Exception as e:  # the reader raises many kinds on damaged files
            raise ModelFileError(
                f"{path} is a damaged or truncated GGUF file ({one_line(e, with_type=True)}); "
                "download it again"
            ) from None
        return cls(path, metadata, tensors)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 in row-major (rows = output features) order."""
        from gguf import quants

        t = self._tensors[name]
        try:
            data = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelFileError(
                f"{self.path}: tensor {name} has type {t.tensor_type.name}, which panechat cannot "
                "dequantize; use a file quantized as Q4_0/Q4_1/Q5_x/Q8_0/Q4_K/Q5_K/Q6_K/F16/F32"
            ) from None
        except Exception as e:
            raise ModelFileError(f"{self.path}: tensor {name} is unreadable ({one_line(e)})") from None
        return np.ascontiguousarray(data, dtype=np.float32)

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """The tensor as stored, not dequantized: quantized types as uint8 blocks
        [rows, bytes per row] (GGML block layout), plus the type name."""
        t = self._tensors[name]
        return np.asarray(t.data), t.tensor_type.name


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value

"""Fast GGUF header reading for model listings: scalar metadata and tensor types only.

The parsing is gguf_file.parse_header's, with arrays skipped, not decoded: fixed-size
elements by count x size, strings by their length prefixes, so a 262k-token vocabulary
costs one pass over lengths. Nothing past the tensor infos is read; the file's size is
compared with where the data must end.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from panechat.backends.quant import registry
from panechat.engine.gguf.file import GGUFFormatError, ModelFileError, TensorInfo, parse_header, type_name, type_size


class GGUFHeaderError(ModelFileError):
    """The file is not a usable GGUF; the message is a short reason for a listing."""


@dataclass(frozen=True)
class GGUFHeader:
    """What a listing needs from a GGUF file, read without touching tensor data.

    `metadata` holds the scalar and string KV pairs (arrays are skipped);
    `type_elements` maps each GGML tensor type name to its element count in the file;
    `data_end` is the size the file must have to hold every tensor (None when a tensor
    type is unknown to the installed `gguf` package); `file_size` the size it has."""

    version: int
    metadata: dict[str, Any]
    type_elements: dict[str, int]
    data_end: int | None
    file_size: int
    data_start: int = 0  # where the tensor data begins: bytes 0..data_start are the whole header

    @property
    def truncated(self) -> bool:
        """The header is whole but the tensor data stops early (an interrupted download)."""
        return self.data_end is not None and self.file_size < self.data_end

    @property
    def unread_types(self) -> list[str]:
        """Tensor types in the file that panechat does not read (a load refuses them)."""
        return sorted(t for t in self.type_elements if registry.get(t) is None)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return str(arch) if arch is not None else None

    @property
    def context_length(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.context_length")
        return int(value) if isinstance(value, int) else None

    @property
    def dominant_type(self) -> str | None:
        """The tensor type holding the most weights (llama.cpp's notion of "the" quant)."""
        if not self.type_elements:
            return None
        return max(self.type_elements.items(), key=lambda kv: kv[1])[0]

    @property
    def quant(self) -> str | None:
        """general.file_type as llama.cpp names it (Q4_K_M, F16, ...), else the dominant type."""
        from gguf import LlamaFileType  # deferred: importing gguf costs ~0.2 s

        ftype = self.metadata.get("general.file_type")
        try:
            name = LlamaFileType(int(ftype)).name if isinstance(ftype, int) else None
        except ValueError:
            name = None
        if name is None or name == "GUESSED":
            return self.dominant_type
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Read `path`'s GGUF header; raises GGUFHeaderError with a short reason ("not a GGUF
    file", "truncated file ...") when there is no whole header. A whole header over cut
    tensor data is returned with `truncated` set, so its facts can still be shown."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 4:
                raise GGUFHeaderError("not a GGUF file (too small)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                parsed = parse_header(buf, size, arrays=False)
    except OSError as e:
        raise GGUFHeaderError(f"unreadable ({e.strerror or type(e).__name__})") from None
    except GGUFFormatError as e:
        raise GGUFHeaderError(str(e)) from None
    type_elements, data_end = _tensor_extent(parsed.tensors, parsed.data_start)
    return GGUFHeader(parsed.version, parsed.metadata, type_elements, data_end, size, parsed.data_start)


def _tensor_extent(tensors: list[TensorInfo], data_start: int) -> tuple[dict[str, int], int | None]:
    """Elements per type name, and where the last tensor's bytes end (None: unknown type)."""
    elements: dict[str, int] = {}
    end: int | None = data_start
    for t in tensors:
        name, n_el = type_name(t.type_id), t.n_elements
        elements[name] = elements.get(name, 0) + n_el
        sizes = type_size(name)
        if sizes is None:
            end = None
        elif end is not None:
            block, block_bytes = sizes
            end = max(end, data_start + t.offset + n_el // block * block_bytes)
    return elements, end

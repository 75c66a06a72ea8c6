"""Fast GGUF header reading for model listings: scalar metadata and tensor types only.

Follows the GGUF spec (ggml docs/gguf.md, versions 2 and 3, either byte order): magic,
version, tensor count, KV count, the KV pairs, the tensor infos, then the aligned tensor
data. Arrays are skipped, not decoded: fixed-size elements by count x size, strings by
their length prefixes, so a 262k-token vocabulary costs one pass over lengths. Nothing
past the tensor infos is read; the file's size is compared with where the data must end.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf_file import ModelFileError

# GGUF value types (gguf.GGUFValueType) -> struct format of one element; 8 STRING, 9 ARRAY.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_MAX_COUNT = 1 << 40  # a count this large is a damaged header, not a model


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
                return _parse(buf, size)
    except OSError as e:
        raise GGUFHeaderError(f"unreadable ({e.strerror or type(e).__name__})") from None


def _parse(buf: mmap.mmap, size: int) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise GGUFHeaderError("not a GGUF file (bad magic)")
    cur = _Cursor(buf, size, "<")
    version = cur.scalar("I")
    if version & 0xFFFF == 0 and version >> 16:  # a big-endian file read little-endian
        cur = _Cursor(buf, size, ">")
        cur.pos = 4
        version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.count(), cur.count()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.scalar("I")
        if vtype == _ARRAY:
            cur.skip_array()
        else:
            metadata[key] = cur.value(vtype)
    tensors = [cur.tensor_info() for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        alignment = _DEFAULT_ALIGNMENT
    data_start = -(-cur.pos // alignment) * alignment
    type_elements, data_end = _tensor_extent(tensors, data_start)
    return GGUFHeader(version, metadata, type_elements, data_end, size, data_start)


def _tensor_extent(tensors: list[tuple[int, int, int]], data_start: int) -> tuple[dict[str, int], int | None]:
    """Elements per type name, and where the last tensor's bytes end (None: unknown type)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # deferred: ~0.2 s

    elements: dict[str, int] = {}
    end: int | None = data_start
    for n_el, type_id, offset in tensors:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            elements[f"type {type_id}"] = elements.get(f"type {type_id}", 0) + n_el
            end = None
            continue
        elements[qtype.name] = elements.get(qtype.name, 0) + n_el
        if end is not None:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            end = max(end, data_start + offset + n_el // block * block_bytes)
    return elements, end


class _Cursor:
    """A read position in the mapped header; running past the end means a truncated file."""

    def __init__(self, buf: mmap.mmap, size: int, order: str):
        self.buf, self.size, self.order, self.pos = buf, size, order, 4
        self._u64 = struct.Struct(order + "Q")

    def scalar(self, fmt: str) -> Any:
        s = struct.Struct(self.order + fmt)
        if self.pos + s.size > self.size:
            raise GGUFHeaderError("truncated file (the header ends early)")
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value

    def count(self) -> int:
        n = self.scalar("Q")
        if n > _MAX_COUNT:
            raise GGUFHeaderError("damaged GGUF header (impossible count)")
        return n

    def string(self) -> str:
        n = self.count()
        end = self.pos + n
        if end > self.size:
            raise GGUFHeaderError("truncated file (the header ends early)")
        text = self.buf[self.pos:end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype not in _SCALAR:
            raise GGUFHeaderError(f"damaged GGUF header (unknown value type {vtype})")
        return self.scalar(_SCALAR[vtype])

    def skip_array(self) -> None:
        etype, n = self.scalar("I"), self.count()
        if etype == _STRING:  # each element is a u64 length and its bytes
            pos, size, u64 = self.pos, self.size, self._u64
            for _ in range(n):
                if pos + 8 > size:
                    raise GGUFHeaderError("truncated file (the header ends early)")
                pos += 8 + u64.unpack_from(self.buf, pos)[0]
            self.pos = pos
        elif etype == _ARRAY:
            for _ in range(n):
                self.skip_array()
        elif etype in _SCALAR:
            self.pos += n * struct.calcsize(_SCALAR[etype])
        else:
            raise GGUFHeaderError(f"damaged GGUF header (unknown array type {etype})")
        if self.pos > self.size:
            raise GGUFHeaderError("truncated file (the header ends early)")

    def tensor_info(self) -> tuple[int, int, int]:
        """(elements, GGML type id, offset into the data section) of the next tensor."""
        self.string()  # the name
        n_dims = self.scalar("I")
        if n_dims > 8:
            raise GGUFHeaderError("damaged GGUF header (tensor with more than 8 dimensions)")
        n_el = 1
        for _ in range(n_dims):
            n_el *= self.count()
        return n_el, self.scalar("I"), self.scalar("Q")

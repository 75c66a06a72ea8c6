"""Reading GGUF model files: metadata, and tensors as stored (dequantized on demand).

Follows the GGUF spec (ggml docs/gguf.md, versions 2 and 3, either byte order): magic,
version, tensor count, KV count, the KV pairs, the tensor infos, then the aligned tensor
data. The header is parsed straight from the file's memory map: numeric arrays (token
scores, types) become lists through one numpy view each, string arrays (a 262k-token
vocabulary) one slice per string; nothing past the tensor infos is read until a backend
asks for a tensor's bytes. No `gguf` package import on this path (it costs ~0.2 s).

Bad files fail in one line (ModelFileError): a truncated header or tensor data, a tensor
whose rows are not whole blocks, a tensor type panechat does not read (`check_types`).
"""

from __future__ import annotations

import mmap
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from panechat.backends.quant import registry
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.quant.registry import read_types_text

# GGUF value types (gguf.GGUFValueType) -> struct format of one element; 8 STRING, 9 ARRAY.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_MAX_COUNT = 1 << 40  # a count this large is a damaged header, not a model
_SLICE = 65536  # array elements made into Python numbers per GIL-holding pass

# numpy dtype of the stored values, for the types stored element by element (as gguf.GGUFReader)
_ELEMENT_DTYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class ModelFileError(Exception):
    """A model file that cannot be used; the message is one line naming problem and fix."""


class GGUFFormatError(ModelFileError):
    """The bytes do not form a whole GGUF header; the message is a short reason."""


class TensorInfo(NamedTuple):
    """One tensor info of the header: dims innermost first, as the file lists them."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # into the data section

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


@dataclass
class ParsedHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_start: int  # where the (aligned) tensor data section begins
    order: str  # struct byte order of the file: "<" or ">"


def type_name(type_id: int) -> str:
    """The GGML name of a tensor type id ("Q4_K"), or "type N" for an id unknown to gguf."""
    t = registry.by_id(type_id)
    if t is not None:
        return t.name
    from gguf import GGMLQuantizationType  # deferred: only for types panechat does not read

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def type_size(name: str) -> tuple[int, int] | None:
    """(values per block, bytes per block) of a GGML type name; None when unknown."""
    t = registry.get(name)
    if t is not None:
        return t.block_weights, t.block_bytes
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # deferred, as above

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    except KeyError:
        return None


def parse_header(buf: Any, size: int, *, arrays: bool = True) -> ParsedHeader:
    """Parse the GGUF header in `buf` (a mapped file of `size` bytes). `arrays=False` skips
    array values (a listing needs only scalars). Raises GGUFFormatError."""
    if size < 4:
        raise GGUFFormatError("not a GGUF file (too small)")
    if buf[:4] != b"GGUF":
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cur = _Cursor(buf, size, "<")
    version = cur.scalar("I")
    if version & 0xFFFF == 0 and version >> 16:  # a big-endian file read little-endian
        cur = _Cursor(buf, size, ">")
        version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.count(), cur.count()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.scalar("I")
        if vtype == _ARRAY:
            if arrays:
                metadata[key] = cur.array()
            else:
                cur.skip_array()
        else:
            metadata[key] = cur.value(vtype)
    tensors = [cur.tensor_info() for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
        alignment = _DEFAULT_ALIGNMENT
    data_start = -(-cur.pos // alignment) * alignment
    return ParsedHeader(version, metadata, tensors, data_start, cur.order)


@dataclass
class GGUFFile:
    """An opened GGUF file: `metadata` (key -> python value) and lazily read tensors."""

    path: Path
    metadata: dict[str, Any]
    _tensors: dict[str, GGUFTensor]
    _unread: dict[str, str] | None = None  # tensor name -> type panechat does not read

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        """Open and validate `path`; raises ModelFileError with a one-line reason."""
        path = Path(path)
        if not path.exists():
            raise ModelFileError(f"model file not found: {path}")
        if not path.is_file():
            raise ModelFileError(f"model path is not a file: {path}")
        try:
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise ModelFileError(f"{path} is not a GGUF model file (bad magic); pass a .gguf file")
                size = f.seek(0, 2)
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(f"cannot read {path} ({e.strerror or type(e).__name__})") from None
        try:
            header = parse_header(buf, size)
            tensors, unread = _tensors(header, buf, size)
        except GGUFFormatError as e:
            raise ModelFileError(f"{path} is a damaged or truncated GGUF file ({e}); download it again") from None
        return cls(path, header.metadata, tensors, unread)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor as stored, a view of the memory map; nothing is read or converted
        until a backend asks (`GGUFTensor.dequantize`, or its blocks)."""
        return self._tensors[name]

    def check_types(self) -> None:
        """Raise ModelFileError (one line) when a tensor has a type panechat does not read,
        naming the type, the tensor and the types it reads."""
        if self._unread:
            name, qtype = next(iter(self._unread.items()))
            more = len(self._unread) - 1
            others = f" (and {more} more tensor{'s' if more > 1 else ''})" if more else ""
            raise ModelFileError(
                f"{self.path}: tensor {name}{others} has type {qtype}, which panechat does not read; "
                f"it reads {read_types_text()}: use a file quantized as one of those (e.g. Q4_K_M or Q8_0)")


def _tensors(header: ParsedHeader, buf: mmap.mmap, size: int) -> tuple[dict[str, GGUFTensor], dict[str, str]]:
    """Every tensor as a GGUFTensor over the mapped bytes, and the unread ones' types.
    Raises GGUFFormatError for data past the end of the file or rows of partial blocks."""
    data = np.ndarray((size,), np.uint8, buffer=buf)  # read-only, no copy; its base is the map
    order = header.order
    tensors: dict[str, GGUFTensor] = {}
    unread: dict[str, str] = {}
    for info in header.tensors:
        qtype = type_name(info.type_id)
        if info.name in tensors:
            raise GGUFFormatError(f"tensor {info.name} appears twice")
        sizes = type_size(qtype)
        if sizes is None:  # a type even gguf does not know: its byte size is unknown
            unread[info.name] = qtype
            continue
        block, block_bytes = sizes
        shape = tuple(reversed(info.dims)) or (1,)  # row-major, rows first
        row = shape[-1]
        if row % block:
            raise GGUFFormatError(f"tensor {info.name} has rows of {row} values, not whole "
                                  f"{block}-value {qtype} blocks")
        n_bytes = info.n_elements // block * block_bytes
        start = header.data_start + info.offset
        if start + n_bytes > size:
            raise GGUFFormatError(f"truncated file: tensor {info.name} needs bytes up to {start + n_bytes:,} "
                                  f"but the file has {size:,}")
        raw = data[start:start + n_bytes]
        if qtype in _ELEMENT_DTYPES:
            values = raw.view(np.dtype(_ELEMENT_DTYPES[qtype]).newbyteorder(order)).reshape(shape)
        else:  # blocks: uint8 [rows..., bytes per row]
            values = raw.reshape(*shape[:-1], row // block * block_bytes)
        tensors[info.name] = GGUFTensor(info.name, shape, qtype, values)
        if registry.get(qtype) is None:
            unread[info.name] = qtype
    return tensors, unread


class _Cursor:
    """A read position in the mapped header; running past the end means a truncated file."""

    def __init__(self, buf: Any, size: int, order: str):
        self.buf, self.size, self.order, self.pos = buf, size, order, 4
        self._u64 = struct.Struct(order + "Q")

    def _need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GGUFFormatError("truncated file (the header ends early)")

    def scalar(self, fmt: str) -> Any:
        s = struct.Struct(self.order + fmt)
        self._need(s.size)
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value

    def count(self) -> int:
        n = self.scalar("Q")
        if n > _MAX_COUNT:
            raise GGUFFormatError("damaged GGUF header (impossible count)")
        return n

    def string(self) -> str:
        n = self.count()
        self._need(n)
        text = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype not in _SCALAR:
            raise GGUFFormatError(f"damaged GGUF header (unknown value type {vtype})")
        return self.scalar(_SCALAR[vtype])

    def array(self) -> list:
        """An array value as a list: numbers through one numpy view, strings one by one."""
        etype, n = self.scalar("I"), self.count()
        if etype == _STRING:
            buf, pos, size, u64 = self.buf, self.pos, self.size, self._u64.unpack_from
            out = []
            append = out.append
            for _ in range(n):
                if pos + 8 > size:
                    raise GGUFFormatError("truncated file (the header ends early)")
                (length,) = u64(buf, pos)
                end = pos + 8 + length
                append(buf[pos + 8:end].decode("utf-8", errors="replace"))
                pos = end
            if pos > size:
                raise GGUFFormatError("truncated file (the header ends early)")
            self.pos = pos
            return out
        if etype == _ARRAY:
            return [self.array() for _ in range(n)]
        if etype not in _SCALAR:
            raise GGUFFormatError(f"damaged GGUF header (unknown array type {etype})")
        dtype = np.dtype(_SCALAR[etype]).newbyteorder(self.order)
        self._need(n * dtype.itemsize)
        values = np.frombuffer(self.buf, dtype, n, self.pos)
        self.pos += n * dtype.itemsize
        if n <= _SLICE:
            return values.tolist()
        # a vocabulary's scores or types: in slices, the GIL let go between them, so a model
        # loading beside serving ones does not stop their streams
        out: list = []
        for a in range(0, n, _SLICE):
            out += values[a:a + _SLICE].tolist()
            time.sleep(0)
        return out

    def skip_array(self) -> None:
        etype, n = self.scalar("I"), self.count()
        if etype == _STRING:  # each element is a u64 length and its bytes
            pos, size, u64 = self.pos, self.size, self._u64
            for _ in range(n):
                if pos + 8 > size:
                    raise GGUFFormatError("truncated file (the header ends early)")
                pos += 8 + u64.unpack_from(self.buf, pos)[0]
            self.pos = pos
        elif etype == _ARRAY:
            for _ in range(n):
                self.skip_array()
        elif etype in _SCALAR:
            self.pos += n * struct.calcsize(_SCALAR[etype])
        else:
            raise GGUFFormatError(f"damaged GGUF header (unknown array type {etype})")
        if self.pos > self.size:
            raise GGUFFormatError("truncated file (the header ends early)")

    def tensor_info(self) -> TensorInfo:
        name = self.string()
        n_dims = self.scalar("I")
        if n_dims > 8:
            raise GGUFFormatError("damaged GGUF header (tensor with more than 8 dimensions)")
        dims = tuple(self.count() for _ in range(n_dims))
        return TensorInfo(name, dims, self.scalar("I"), self.scalar("Q"))

"""One tensor of a GGUF file as the file stores it: what the model loader hands a backend.

Nothing is converted up front. `blocks` is a view of the file's memory map (ggml block
layout, GGUF spec docs/gguf.md): a backend that keeps a quantized type in block form reads
it from there, so no float32 copy of that tensor ever exists; anything else calls
`dequantize()` (gguf's reference dequantization) when, and only for what, it needs floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from panechat.backends.errors import one_line
from panechat.backends.quant.registry import read_types_text


class TensorError(ValueError):
    """A tensor that cannot be read or dequantized; the message is one line."""


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """A tensor as stored, dequantized on demand. `shape` is row-major with rows first
    (a weight is [N out, K in]); `blocks` holds the stored values (float32 / float16
    arrays of that shape) or bytes (uint8 [rows, bytes per row] of ggml blocks)."""

    name: str
    shape: tuple[int, ...]
    qtype: str  # GGML type name: "F32", "F16", "Q8_0", "Q4_K", ...
    blocks: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes as stored (mapped from the file, not resident memory of its own)."""
        return int(self.blocks.nbytes)

    def dequantize(self) -> np.ndarray:
        """The whole tensor as float32 [shape], exactly the floats ggml dequantizes (an F32
        tensor is its stored array itself, no copy). Raises TensorError."""
        return self._dequantize(self.blocks).reshape(self.shape)

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` of a 2-D tensor as float32 [len(rows), K]: the same floats as
        `dequantize()[rows]`, without dequantizing the others (blocks never span rows)."""
        return self._dequantize(self.blocks[np.asarray(rows)]).reshape(len(rows), self.shape[-1])

    def row_range(self, start: int, stop: int) -> "GGUFTensor":
        """Rows start..stop of a 2-D tensor as stored, a view of the same blocks (a row of
        ggml blocks is contiguous and blocks never span rows): a fused weight split this
        way is, bit for bit, the separate matrices, with no copy and no float32."""
        if len(self.shape) != 2 or not 0 <= start < stop <= self.shape[0]:
            raise TensorError(f"tensor {self.name} of shape {self.shape} has no rows {start}..{stop}")
        return GGUFTensor(f"{self.name}[{start}:{stop}]", (stop - start, self.shape[1]), self.qtype,
                          self.blocks[start:stop])

    def _dequantize(self, blocks: np.ndarray) -> np.ndarray:
        # The types of the start-up path (float norms, a Q8_0 embedding table) without
        # importing gguf, with gguf's arithmetic: q * d in float32 (gguf.quants.Q8_0).
        if self.qtype in ("F32", "F16"):
            return np.ascontiguousarray(blocks, dtype=np.float32)
        if self.qtype == "Q8_0":
            b = np.asarray(blocks, np.uint8).reshape(-1, 34)
            return b[:, 2:].view(np.int8).astype(np.float32) * b[:, :2].view(np.float16).astype(np.float32)
        from gguf import GGMLQuantizationType, quants  # deferred: importing gguf costs ~0.3 s

        try:
            data = quants.dequantize(blocks, GGMLQuantizationType[self.qtype])
        except (NotImplementedError, KeyError):
            raise TensorError(f"tensor {self.name} has type {self.qtype}, which panechat cannot "
                              f"dequantize; use a file quantized as one of {read_types_text()}") from None
        except Exception as e:  # a damaged tensor raises many kinds
            raise TensorError(f"tensor {self.name} is unreadable ({one_line(e)})") from None
        return np.ascontiguousarray(data, dtype=np.float32)

    @classmethod
    def from_array(cls, w: np.ndarray, qtype: str = "F32", name: str = "") -> "GGUFTensor":
        """`w` stored as `qtype` the way gguf's writer stores it (quantized for a block
        type): weights for self-checks and tests without a file."""
        from gguf import GGMLQuantizationType, quants

        w = np.ascontiguousarray(w, dtype=np.float32)
        stored = quants.quantize(w, GGMLQuantizationType[qtype])
        if stored is not w:  # read-only like a file's mapped bytes: one array type, one numba build
            stored.flags.writeable = False  # of each kernel (a writable array would compile another)
        return cls(name, tuple(w.shape), qtype, stored)

"""The paged KV store: K and V per layer in fixed-size blocks of `BLOCK_TOKENS` positions.

A sequence's positions live in the blocks its block table lists (position p in block
table[p // BLOCK_TOKENS] at offset p % BLOCK_TOKENS), so sequences grow block by block and
may share blocks (vLLM's PagedAttention). Values are stored in float16 by default (each
rounded once, to nearest even, when written) or float32; attention converts them exactly
to float32 and reads keys in position order whatever blocks they lie in, so a row's
arithmetic does not depend on the layout.
"""

from __future__ import annotations

from typing import Any

BLOCK_TOKENS = 16  # positions per block; part of the layout, not a tuning knob
KV_DTYPES = {"f16": 2, "f32": 4}  # the --kv-dtype choices and their bytes per value


def kv_dtype_bytes(dtype: str) -> int:
    """Bytes per stored value of `dtype` ('f16' or 'f32'); ValueError otherwise."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}; got {dtype!r}")
    return KV_DTYPES[dtype]


def bytes_per_block(n_layer: int, n_kv: int, head_dim: int, dtype: str) -> int:
    """Bytes of one block: K and V of every layer for BLOCK_TOKENS positions."""
    return 2 * n_layer * n_kv * BLOCK_TOKENS * head_dim * kv_dtype_bytes(dtype)


class PagedKV:
    """K and V per layer, each [n_blocks, n_kv, BLOCK_TOKENS, head_dim] of `dtype` on a
    backend's device. `slot_table` (set by `Backend.new_kv`) is the fixed block table of a
    store made of whole-context slots: slot s owns blocks s*per .. (s+1)*per - 1; it is
    what attention uses when a call passes no tables."""

    def __init__(self, k: list[Any], v: list[Any], n_blocks: int, n_kv: int, head_dim: int,
                 dtype: str):
        self.k, self.v = k, v
        self.n_blocks = n_blocks
        self.n_kv, self.head_dim, self.dtype = n_kv, head_dim, dtype
        self.bytes_per_block = bytes_per_block(len(k), n_kv, head_dim, dtype)
        self.slot_table: Any = None
        self.slot_blocks = 0
        # (K, V) as [n_layer, n_blocks, n_kv, B, hd] arrays whose layers `k` and `v` are
        # views of, where the backend allocated them so (numpy: the one-call decode step)
        self.stacked: tuple[Any, Any] | None = None

    @property
    def nbytes(self) -> int:
        return self.n_blocks * self.bytes_per_block

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one whole-context slot of a slotted store (0 for a plain block pool)."""
        return self.slot_blocks * self.bytes_per_block

"""Weights repacked at load into records of 16 output columns: the layouts, pack and unpack.

A record holds one block (Q4_0, Q4_1, Q8_0: 32 weights) or super-block (Q4_K, Q5_K, Q6_K: 256)
of 16 consecutive output columns, the file's bytes of those 16 blocks in another order, so
that a 64-byte vector holds the same part of every column (lane c = column c) and a kernel
meets 16 columns' codes with one broadcast of the activations and no shuffles
(`packed32`, `packed256` are the products). A tensor keeps its size: a record is 16 blocks'
bytes. Each block is cut into fields, and each field is laid out by its unit u (2 for f16
scales, 1 for 6/8-bit sub-block scales, 4 for codes): byte i of column c's field goes to

  field.dest + 16 u (i // u) + u c + i % u

(u bytes of every column side by side, then the field's next u bytes), xor `flip` (Q8_0's
codes are stored plus 128: unsigned, as `vpdpbusd` wants them). A weight whose columns are
not a multiple of 16 gets a last group padded with zero blocks (every byte `flip`: scale 0).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from panechat.backends.cpu.numpy_kernels import _JIT
from panechat.backends.quant import registry

GROUP = 16  # output columns a record holds: one lane each


@dataclass(frozen=True)
class Field:
    """Bytes src..src+size of a block, laid out from record byte `dest` by `unit`, xor `flip`."""

    src: int
    size: int
    dest: int
    unit: int
    flip: int = 0


@dataclass(frozen=True)
class Layout:
    """A type's record: its block's bytes and their fields (together every byte once)."""

    block_bytes: int
    weights: int  # weights a block (32, or 256 for a super-block)
    fields: tuple[Field, ...]

    def places(self) -> tuple[np.ndarray, np.ndarray]:
        """(at int64 [16, block_bytes], flip uint8 [block_bytes]): the record byte of each
        column's block byte, and what it is xor'ed with."""
        at = np.full((GROUP, self.block_bytes), -1, np.int64)
        flip = np.zeros(self.block_bytes, np.uint8)
        for f in self.fields:
            i = np.arange(f.size)
            for c in range(GROUP):
                at[c, f.src + i] = f.dest + GROUP * f.unit * (i // f.unit) + f.unit * c + i % f.unit
            flip[f.src:f.src + f.size] = f.flip
        if (at < 0).any() or sorted(at.ravel()) != list(range(GROUP * self.block_bytes)):
            raise ValueError("a record layout must place every byte of 16 blocks exactly once")
        return at, flip


# Record offsets: each field's 16 columns end where the next field starts.
LAYOUTS = {
    "Q4_0": Layout(18, 32, (Field(0, 2, 0, 2), Field(2, 16, 32, 4))),  # d[16] | codes
    "Q4_1": Layout(20, 32, (Field(0, 4, 0, 2), Field(4, 16, 64, 4))),  # d[16] m[16] | codes
    "Q8_0": Layout(34, 32, (Field(0, 2, 0, 2), Field(2, 32, 32, 4, 0x80))),  # d[16] | codes + 128
    # d[16] dmin[16] | the 12 scale bytes, each 16 wide | qs (4-byte columns)
    "Q4_K": Layout(144, 256, (Field(0, 4, 0, 2), Field(4, 12, 64, 1), Field(16, 128, 256, 4))),
    # d[16] dmin[16] | the 12 scale bytes, each 16 wide | qh then qs (4-byte columns)
    "Q5_K": Layout(176, 256, (Field(0, 4, 0, 2), Field(4, 12, 64, 1), Field(16, 32, 256, 4), Field(48, 128, 768, 4))),
    # d[16] | the 16 int8 scales, each 16 wide | ql then qh (4-byte columns)
    "Q6_K": Layout(210, 256, (Field(208, 2, 0, 2), Field(192, 16, 32, 1), Field(0, 192, 288, 4))),
}
_PLACES = {t: layout.places() for t, layout in LAYOUTS.items()}


def record_bytes(qtype: str) -> int:
    """Bytes of one record: 16 columns' blocks."""
    return GROUP * LAYOUTS[qtype].block_bytes


def pack(blocks: np.ndarray, qtype: str, arena=None) -> np.ndarray:
    """`qtype` blocks uint8 [N, K/w * bytes] as records, uint8 [N', same] with N' = N rounded
    up to 16: rows 16g..16g+15 hold group g's records, block by block. One parallel pass
    with no copy but the result (a load's peak memory: the model plus one tensor's pages),
    which `arena` (a `weight_memory.WeightArena`) holds, else numpy."""
    N, rb = blocks.shape
    bb = LAYOUTS[qtype].block_bytes
    if rb % bb:
        raise ValueError(f"pack: {qtype} blocks {blocks.shape} are not rows of whole blocks")
    at, flip = _PLACES[qtype]
    shape = (-(-N // GROUP) * GROUP, rb)
    out = np.empty(shape, np.uint8) if arena is None else arena.empty(shape, np.uint8)
    _pack_into(np.ascontiguousarray(blocks, np.uint8), out, at, flip)
    return out


@njit(parallel=True, **_JIT)
def _pack_into(blocks, out, at, flip):
    """`pack`'s loop: record (g, b) starts at flat byte (16g * rb + 16 * bb * b) of out; the
    padding columns of a last group get `flip` (a zero block)."""
    N, rb = blocks.shape
    bb = at.shape[1]
    flat = out.reshape(-1)
    G = out.shape[0] // GROUP
    for g in prange(G):
        for c in range(GROUP):
            n = GROUP * g + c
            for b in range(rb // bb):
                o = g * GROUP * rb + b * GROUP * bb
                if n < N:
                    for i in range(bb):
                        flat[o + at[c, i]] = blocks[n, b * bb + i] ^ flip[i]
                else:
                    for i in range(bb):
                        flat[o + at[c, i]] = flip[i]


def unpack(packed: np.ndarray, qtype: str, rows: int | None = None) -> np.ndarray:
    """`pack`'s inverse: the file's blocks again, the first `rows` (default all) of them."""
    N, rb = packed.shape
    bb = LAYOUTS[qtype].block_bytes
    at, flip = _PLACES[qtype]
    rec = packed.reshape(N // GROUP, rb // bb, GROUP * bb)
    blocks = rec[:, :, at] ^ flip  # [G, B, 16, bb]
    return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(N, rb)[:rows]


def reference(qtype: str, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """x @ W.T by the arithmetic of `qtype`'s repacked product (the `reference` of the module
    its registry entry's `cpu_packed` names) in numpy, W the file's blocks (not packed): bit
    for bit what the kernels give."""
    t = registry.get(qtype)
    if t is None or not t.cpu_packed:
        raise ValueError(f"{qtype} is not a repacked type")
    module, _, _ = t.cpu_packed.partition(":")
    return importlib.import_module(module).reference(qtype, x, blocks)

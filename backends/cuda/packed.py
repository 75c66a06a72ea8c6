"""Q4_0 / Q4_1 / Q8_0 weights for the CuPy backend's q4 and q80 kernels, in GGUF's block
form: the codes of every block exactly as stored (Q4: 16 bytes, byte j holding weight j in
the low nibble and weight j + 16 in the high nibble; Q8_0: 32 int8), and the block's
float16 d (and m) as stored, split off into their own arrays so that every row of codes
starts 16-byte aligned (an 18-, 20- or 34-byte block would not). 0.5625 (Q4_0) / 0.625
(Q4_1) / 1.0625 (Q8_0) bytes a weight, the file's size; the kernels dequantize in
registers with gguf's float32 expressions: w = (q - 8) * d or q * d (exact), q * d + m
(the product exact, the add rounded once). Q6_K likewise: the first 208 bytes of each
210-byte super-block as stored (ql, qh, scales; 208 = 13 * 16) and its float16 d split
off, 0.8203 bytes a weight, the file's size. Q5_0 / Q5_1 as Q4_x with each block's 32
fifth bits (a uint32 as stored) split off too: 0.6875 / 0.75 bytes a weight, the file's.
Host-side numpy, at load.
"""

from __future__ import annotations

import numpy as np

from panechat.backends.quant import registry


def split_blocks(blocks: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks [n, k/32 * bytes] -> (qs uint8 [n, k/2], d float16 [n, k/32], m float16
    [n, k/32] or None), every byte as the file has it."""
    nb = k // 32
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, nb, registry.get(qtype).block_bytes)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).reshape(n, nb)
    if qtype == "Q8_0":  # (q int8 [n, k], d, None)
        return np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(n, k), d, None
    if qtype == "Q4_1":
        m = np.ascontiguousarray(b[..., 2:4]).view(np.float16).reshape(n, nb)
        qs = b[..., 4:20]
    else:
        m, qs = None, b[..., 2:18]
    return np.ascontiguousarray(qs).reshape(n, nb * 16), d, m


def split_q6k(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks [n, k/256 * 210] -> (body uint8 [n, k/256 * 208]: ql[128], qh[64],
    int8 scales[16] as stored; d float16 [n, k/256] as stored)."""
    nb = k // 256
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, nb, 210)
    body = np.ascontiguousarray(b[..., 0:208]).reshape(n, nb * 208)
    return body, np.ascontiguousarray(b[..., 208:210]).view(np.float16).reshape(n, nb)


def split_q5(blocks: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Q5_0 / Q5_1 blocks [n, k/32 * 22 or 24] -> (qs uint8 [n, k/2], d float16 [n, k/32],
    m float16 [n, k/32] or None, qh uint32 [n, k/32]), every byte as the file has it."""
    nb = k // 32
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, nb, registry.get(qtype).block_bytes)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).reshape(n, nb)
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16).reshape(n, nb) if qtype == "Q5_1" else None
    o = 4 if qtype == "Q5_1" else 2
    qh = np.ascontiguousarray(b[..., o:o + 4]).view("<u4").astype(np.uint32).reshape(n, nb)
    return np.ascontiguousarray(b[..., o + 4:o + 20]).reshape(n, nb * 16), d, m, qh

"""GGUF's 32-weight blocks (ggml Q8_0, Q4_0, Q4_1) unpacked for kernels that keep
weights quantized as int8 codes plus float scales (MLX, CuPy); the numpy backend reads
the blocks themselves (`quant_kernels`).

ggml-common.h: Q8_0 = {f16 d; int8 q[32]}, Q4_0 = {f16 d; u8 qs[16]} with w = d*(q-8),
Q4_1 = {f16 d; f16 m; u8 qs[16]} with w = d*q + m; byte j of qs holds element j in its
low nibble and element j+16 in its high nibble.

Other block types are not unpacked: a backend that keeps them reads the blocks as stored
(numpy: `quant_kernels`, for every type of the registry with a CPU loader)."""

from __future__ import annotations

import numpy as np

from panechat.backends.quant import registry
from panechat.backends.quant.gguf_tensor import GGUFTensor

BLOCK = 32
UNPACKED = ("Q8_0", "Q4_0", "Q4_1")  # the types `unpack` turns into int8 codes (its arithmetic)


def unpack(blocks: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks [n, k/32 * bytes] -> (q int8 [n, k], d float32 [n, k/32], m float32
    [n, k/32] or None) with w[i, j] = q[i, j] * d[i, j // 32] (+ m[i, j // 32]), exactly
    the floats ggml dequantizes (f16 -> f32 is exact)."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, k // BLOCK, registry.get(qtype).block_bytes)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q8_0":
        return np.ascontiguousarray(b[..., 2:].copy().view(np.int8).reshape(n, k)), d, None
    if qtype == "Q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = b[..., 4:20]
    else:
        m, qs = None, b[..., 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8)
    if qtype == "Q4_0":
        q -= 8
    return np.ascontiguousarray(q.reshape(n, k)), d, m


def kept_quantized(t: GGUFTensor) -> bool:
    """True when the weight `t` can stay quantized: a 2-D tensor of a kept type."""
    return t.qtype in UNPACKED and len(t.shape) == 2 and t.shape[1] % BLOCK == 0

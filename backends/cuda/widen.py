"""K-quant (Q4_K, Q5_K, Q6_K) and Q5_0/Q5_1 weights for the CuPy backend's q8 kernels:
int8 codes q [N, K] with a float32 scale S and min M per group of G weights (G = 32, or
16 for Q6_K), so that w = q * S (+ M) -- exactly the floats `gguf.quants.dequantize`
gives (and the CPU's quant_kernels read), with gguf's roundings in gguf's order:

  Q4_K / Q5_K  w = (d * sc) * q - (dmin * m): S = d * sc and M = -(dmin * m) are exact
               (an f16 times a 6-bit integer), q * S is exact (a 4/5-bit code), and
               q * S + M rounds once, as gguf's subtraction does
  Q6_K         w = (d * sc) * (q - 32): S = d * sc exact, the product exact (<= 24 bits)
  Q5_0         w = d * (q - 16), exact;  Q5_1  w = d * q + m, rounding once in the add

The codes are widened to a byte per weight (plus 8 bytes of scale and min per group): more
than the 4.5-6.6 bits of the file, less than a float16 copy, and exact where float16 was
not. Host-side numpy. Since every one of these types is resident in its block form
(cupy_packed.py, the q4k / q5k / q6k / q5 kernels), this widened form is what
`prepare_weight(..., widened=True)` gives: the reference the block-form kernels are tested
against bit for bit.
"""

from __future__ import annotations

import numpy as np

from panechat.backends.quant import registry

WIDENED = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")  # the types `widen` reads (geometry: the registry)


def can_widen(qtype: str, shape: tuple) -> bool:
    return qtype in WIDENED and len(shape) == 2 and registry.get(qtype).fits(shape[1])


def _f16(b: np.ndarray, o: int) -> np.ndarray:
    return b[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for j = 0..7 over the 12 packed bytes -> (sc, m) [..., 8]."""
    s = sc.astype(np.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], -1), np.concatenate([lo_m, hi_m], -1)


def widen(blocks: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Blocks [n, k / block * bytes] -> (q int8 [n, k], S float32 [n, k/G], M float32
    [n, k/G] or None, G)."""
    t = registry.get(qtype)
    nb = k // t.block_weights
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, nb, t.block_bytes)
    if qtype in ("Q5_0", "Q5_1"):
        d = _f16(b, 0)
        off = 4 if qtype == "Q5_1" else 2
        qh = b[..., off:off + 4].copy().view(np.uint32)[..., 0][..., None]
        qs = b[..., off + 4:off + 20].astype(np.int32)
        j = np.arange(16, dtype=np.uint32)
        x0 = (qs & 0xF) | (((qh >> j) << 4) & 0x10).astype(np.int32)
        x1 = (qs >> 4) | ((qh >> (j + 12)) & 0x10).astype(np.int32)
        q = np.concatenate([x0, x1], -1)
        if qtype == "Q5_0":
            return _done(q - 16, d, None, n, k, 32)
        return _done(q, d, _f16(b, 2), n, k, 32)
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
        sc, m = _scale_min_k4(b[..., 4:16])
        S = d * sc.astype(np.float32)
        M = -(dmin * m.astype(np.float32))
        qs = b[..., 48:176] if qtype == "Q5_K" else b[..., 16:144]
        qs = qs.reshape(n, nb, 4, 32).astype(np.int32)
        q = np.stack([qs & 0xF, qs >> 4], axis=3)  # [n, nb, pair, lo/hi, 32]
        if qtype == "Q5_K":
            qh = b[..., 16:48].astype(np.int32)[:, :, None, None, :]
            bit = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[None, None, :, :, None]
            q = q + ((qh >> bit) & 1) * 16
        return _done(q, S, M, n, k, 32)
    # Q6_K: ql[128], qh[64], int8 scales[16], f16 d; two halves of 128 weights
    d = _f16(b, 208)[..., None]
    S = d * b[..., 192:208].view(np.int8).astype(np.float32)
    ql = b[..., 0:128].reshape(n, nb, 2, 64).astype(np.int32)
    qh = b[..., 128:192].reshape(n, nb, 2, 32).astype(np.int32)
    lo, hi = ql[..., 0:32], ql[..., 32:64]
    q = np.stack([(lo & 0xF) | ((qh & 3) << 4), (hi & 0xF) | (((qh >> 2) & 3) << 4),
                  (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], axis=3) - 32
    return _done(q, S, None, n, k, 16)


def _done(q, S, M, n: int, k: int, g: int):
    q = np.ascontiguousarray(np.asarray(q).reshape(n, k).astype(np.int8))
    S = np.ascontiguousarray(np.asarray(S, np.float32).reshape(n, k // g))
    M = None if M is None else np.ascontiguousarray(np.asarray(M, np.float32).reshape(n, k // g))
    return q, S, M, g


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """Valid blocks of `qtype` [n, k / block * bytes] with random codes and scales and
    small finite f16 d (and dmin): test data for the kernels."""
    t = registry.get(qtype)
    nb = k // t.block_weights
    raw = rng.integers(0, 256, (n, nb, t.block_bytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (n, nb, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        raw[..., 208:210] = d[..., 0:2]
    else:
        raw[..., 0:4] = d
    return raw.reshape(n, -1)

"""The numpy emulation of the CuPy backend's kernels: the arithmetic of the numerical
contract (package docstring), bit for bit, on the CPU (`emulate_*`), and `EmulatedModule`,
a stand-in for the compiled module that runs those emulations behind the same launches,
checking each launch's arguments against the kernel's C signature."""

from __future__ import annotations

from typing import Any

import numpy as np

from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.backends.cuda.kernels.constants import KSPLIT, NT, OCTET, QBLOCK, WARP, WARPS, cdiv
from panechat.backends.cuda.widen import widen
from panechat.backends.cuda.kernels.sampling import uniform
from panechat.backends.cuda.kernels.source import SOURCE, kernel_signatures

_F32 = np.float32


def fma_f32(a: Any, b: Any, c: Any) -> np.ndarray:
    """Correctly rounded float32 fma(a, b, c) (what __fmaf_rn computes), vectorized.

    a*b is exact in float64; the float64 sum s and its exact error t (TwoSum) give the
    exact a*b + c = s + t; rounding s to float32 is correct except when s is exactly a
    float32 midpoint and t != 0, where t decides the direction (no double rounding).
    """
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    p = a64 * b64
    s = p + c64
    bb = s - p
    t = (p - (s - bb)) + (c64 - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        toward = np.where(s > r64, np.float32(np.inf), np.float32(-np.inf))
        nb = np.nextafter(r, toward)
        mid = (r64 + nb.astype(np.float64)) * 0.5
        tie = (s == mid) & (t != 0) & (s != r64)
    if np.any(tie):
        fix = np.where(t > 0, np.maximum(r, nb), np.minimum(r, nb))
        r = np.where(tie, fix, r)
    return np.asarray(r, np.float32)


_LANE = np.arange(WARP)


def tree32(v: np.ndarray) -> np.ndarray:
    """The warp butterfly over the last axis (32 lanes): v += v[lane ^ h], h = 16..1."""
    v = np.asarray(v, np.float32)
    for h in (16, 8, 4, 2, 1):
        v = v + v[..., _LANE ^ h]
    return v[..., 0]


def block_sum256(v: np.ndarray) -> np.ndarray:
    """block_sum over the last axis (256 threads)."""
    w = tree32(np.asarray(v, np.float32).reshape(*v.shape[:-1], WARPS, WARP))
    w = [w[..., i] for i in range(WARPS)]
    return ((w[0] + w[1]) + (w[2] + w[3])) + ((w[4] + w[5]) + (w[6] + w[7]))


def emulate_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """out = x @ w.T (x [M, K], w float32 [N, K] as dequantized) with the kernel's order."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    M, K = x.shape
    N = w.shape[0]
    lanes = min(WARP, cdiv(K, OCTET)) if K else 0
    acc = np.zeros((M, N, WARP), np.float32)
    if lanes:
        a = acc[:, :, :lanes]
        for step in range(cdiv(K, WARP * OCTET)):
            for j in range(OCTET):
                k = step * WARP * OCTET + np.arange(lanes) * OCTET + j
                valid = k < K
                if not valid.any():
                    continue
                kk = np.where(valid, k, 0)
                new = fma_f32(x[:, None, kk], w[None, :, kk], a)
                a = np.where(valid, new, a)
        acc[:, :, :lanes] = a
    return tree32(acc)


def dequantize(kind: str, w: np.ndarray, scales: np.ndarray | None = None,
               mins: np.ndarray | None = None, group: int = QBLOCK, qh: np.ndarray | None = None) -> np.ndarray:
    """The float32 weights a linear kernel of `kind` multiplies (exactly)."""
    if kind == "f32":
        return np.asarray(w, np.float32)
    if kind == "f16":
        return np.asarray(w).view(np.float16).astype(np.float32)
    if kind == "bf16":
        return (np.asarray(w).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if kind == "q4":
        return dequantize_q4(w, scales, mins)
    if kind == "q4k":  # Q4_K super-blocks as stored: the widened codes, scales and mins
        n, nbytes = np.asarray(w).shape
        q, S, M, g = widen(w, "Q4_K", n, nbytes // 144 * 256)
        return dequantize("q8", q, S, M, g)
    if kind == "q5":
        return dequantize_q5(w, scales, mins, qh)
    if kind == "q5k":
        return dequantize_q5k(w)
    if kind == "q6k":
        return dequantize_q6k(w, scales)
    if kind == "q80":  # Q8_0 blocks: int8 codes, float16 d per 32
        scales = np.asarray(scales).view(np.float16).astype(np.float32)
    N, K = w.shape
    q = np.asarray(w).view(np.int8).reshape(N, K // group, group).astype(np.float32)
    out = q * np.asarray(scales, np.float32)[:, :, None]
    if mins is not None:
        out = out + np.asarray(mins, np.float32)[:, :, None]
    return out.reshape(N, K)


def _octets(nb: int) -> tuple[np.ndarray, np.ndarray]:
    """(super-block [G], first weight j [G]) of the K / 8 octets of a 256-weight super-block row."""
    g = np.arange(nb * 32)
    return g // 32, 8 * (g % 32)


def dequantize_q5k(b: np.ndarray) -> np.ndarray:
    """The float32 weights of Q5_K super-blocks as stored (uint8 [N, K/256 * 176]), decoded
    octet by octet with the q5k kernel's addressing (WQ5K: codes at 48 + 32 (j / 64) + j % 32,
    the fifth bit is = j / 32 of qh[j % 32], get_scale_min_k4) and gguf's expressions --
    written apart from cupy_widen so that the two forms check each other."""
    N = np.asarray(b).shape[0]
    blk = np.asarray(b, np.uint8).reshape(N, -1, 176)
    sb, j = _octets(blk.shape[1])
    i = np.arange(8)
    isg = j // 32
    codes = blk[:, sb[:, None], (48 + 32 * (j // 64) + j % 32)[:, None] + i].astype(np.uint32)
    hbits = blk[:, sb[:, None], (16 + j % 32)[:, None] + i].astype(np.uint32)
    q = ((codes >> np.where(isg % 2, 4, 0)[:, None]) & 0xF) | (((hbits >> isg[:, None]) & 1) << 4)

    def sbyte(k):  # scales[k] of each octet's super-block
        return blk[:, sb, 4 + k].astype(np.uint32)

    lo = isg < 4
    sc = np.where(lo, sbyte(isg) & 63, (sbyte(isg + 4) & 0xF) | ((sbyte(isg - 4) >> 6) << 4))
    mn = np.where(lo, sbyte(isg + 4) & 63, (sbyte(isg + 4) >> 4) | ((sbyte(isg) >> 6) << 4))
    d = blk[:, sb, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blk[:, sb, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    S = d * sc.astype(np.float32)
    Mn = -(dmin * mn.astype(np.float32))
    return (q.astype(np.float32) * S[..., None] + Mn[..., None]).astype(np.float32).reshape(N, -1)


def dequantize_q6k(b: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The float32 weights of Q6_K held as the q6k kernels read them (the first 208 bytes of
    each super-block as stored, uint8 [N, K/256 * 208], and the f16 d [N, K/256]), decoded
    octet by octet with WQ6K's addressing and gguf's (d * sc) * (q - 32) -- written apart
    from cupy_widen so that the two forms check each other."""
    N = np.asarray(b).shape[0]
    blk = np.asarray(b, np.uint8).reshape(N, -1, 208)
    sb, j = _octets(blk.shape[1])
    i = np.arange(8)
    hf, r, l0 = j // 128, (j // 32) % 4, j % 32
    ql = blk[:, sb[:, None], (64 * hf + 32 * (r % 2) + l0)[:, None] + i].astype(np.int32)
    qh = blk[:, sb[:, None], (128 + 32 * hf + l0)[:, None] + i].astype(np.int32)
    q = (((ql >> np.where(r >= 2, 4, 0)[:, None]) & 0xF) | (((qh >> (2 * r)[:, None]) & 3) << 4)) - 32
    sc = blk[:, sb, 192 + 8 * hf + l0 // 16 + 2 * r].view(np.int8).astype(np.float32)
    dd = np.asarray(d).view(np.float16).reshape(N, -1)[:, sb].astype(np.float32)
    S = dd * sc
    return (q.astype(np.float32) * S[..., None]).astype(np.float32).reshape(N, -1)


def dequantize_q5(qs: np.ndarray, d: np.ndarray, m: np.ndarray | None, qh: np.ndarray) -> np.ndarray:
    """The float32 weights of Q5_0 (m None: (q - 16) * d) or Q5_1 (q * d + m) blocks held as
    the q5 kernels read them (qs uint8 [N, K/2] as stored, qh uint32 [N, K/32], d, m float16
    [N, K/32]), decoded octet by octet with WQ5's addressing -- part p = g % 4 of block g / 4,
    low or high nibbles of bytes 8 (p % 2) .., the fifth bit of weight 8p + i bit 8p + i of
    qh -- and gguf's expressions, written apart from cupy_widen so that the two forms check
    each other."""
    d = np.asarray(d).view(np.float16).astype(np.float32)
    N, nb = d.shape
    g = np.arange(nb * 4)
    blk, p, i = g // 4, g % 4, np.arange(8)
    codes = np.asarray(qs, np.uint8).reshape(N, nb, 16)[:, blk[:, None], (8 * (p % 2))[:, None] + i].astype(np.uint32)
    bits = np.asarray(qh).view(np.uint32).reshape(N, nb)[:, blk][..., None]
    q = ((codes >> np.where(p >= 2, 4, 0)[:, None]) & 0xF) | (((bits >> (8 * p[:, None] + i)) & 1) << 4)
    q = q.astype(np.float32)
    dd = d[:, blk][..., None]
    if m is None:
        return ((q - _F32(16)) * dd).reshape(N, nb * 32)
    mm = np.asarray(m).view(np.float16).astype(np.float32)[:, blk][..., None]
    return (q * dd + mm).reshape(N, nb * 32)


def dequantize_q4(qs: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """The float32 weights of Q4_0 (m None: (q - 8) * d) or Q4_1 (q * d + m) blocks held as
    the q4 kernels read them: qs uint8 [N, K/2] (16 bytes per block as stored), d, m
    float16 [N, K/32] -- the nibbles unpacked as gguf does, gguf's float32 expressions."""
    d = np.asarray(d).view(np.float16).astype(np.float32)
    N, nb = d.shape
    b = np.asarray(qs, np.uint8).reshape(N, nb, 16)
    q = np.concatenate([b & 0x0F, b >> 4], axis=-1).astype(np.float32)  # [N, nb, 32]
    if m is None:
        return ((q - _F32(8)) * d[:, :, None]).reshape(N, nb * 32)
    mm = np.asarray(m).view(np.float16).astype(np.float32)
    return (q * d[:, :, None] + mm[:, :, None]).reshape(N, nb * 32)


def emulate_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float32)
    R, D = x.shape
    acc = np.zeros((R, NT), np.float32)
    for s in range(cdiv(D, NT)):
        k = s * NT + np.arange(NT)
        valid = k < D
        v = x[:, np.where(valid, k, 0)]
        acc = np.where(valid, fma_f32(v, v, acc), acc)
    ss = block_sum256(acc)
    inv = _F32(1.0) / np.sqrt(ss / _F32(D) + _F32(eps))
    return (x * inv[:, None]) * np.asarray(weight, np.float32)


_EXP_LO, _LOG2E = _F32(-87.33654), _F32(1.44269504088896341)
_LN2_HI, _LN2_LO = _F32(0.693359375), _F32(-2.12194440e-4)
_P = [_F32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                        4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)]


def expf_pc(x: np.ndarray) -> np.ndarray:
    """The kernels' expf_pc, elementwise in float32."""
    x = np.maximum(np.asarray(x, np.float32), _EXP_LO)
    n = np.floor(x * _LOG2E + _F32(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _P[0] * r + _P[1]
    for c in _P[2:]:
        p = p * r + c
    p = (p * (r * r) + r) + _F32(1.0)
    two_n = ((n.astype(np.int32) + 127) << 23).astype(np.int32).view(np.float32)
    return (p * two_n).astype(np.float32)


def emulate_silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g = np.asarray(g, np.float32)
    e = expf_pc(np.minimum(-g, _F32(88.0)))
    return (g / (_F32(1.0) + e)) * np.asarray(u, np.float32)


_GELU_C0, _GELU_C1 = _F32(0.7978845608028654), _F32(0.044715)


def emulate_gelu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g = np.asarray(g, np.float32)
    with np.errstate(over="ignore"):
        inner = _GELU_C0 * (g + ((_GELU_C1 * g) * g) * g)
        e = expf_pc(np.minimum(_F32(2.0) * inner, _F32(88.0)))
    t = _F32(1.0) - _F32(2.0) / (e + _F32(1.0))
    return ((_F32(0.5) * g) * (_F32(1.0) + t)) * np.asarray(u, np.float32)


def emulate_scores(q: np.ndarray, keys: np.ndarray, scale: float) -> np.ndarray:
    """q [..., D] against keys [..., P, D] -> scores [..., P] (attn_scores' order)."""
    D = q.shape[-1]
    acc = np.zeros(keys.shape[:-1] + (WARP,), np.float32)
    for i in range(cdiv(D, WARP)):
        d = i * WARP + _LANE
        valid = d < D
        dd = np.where(valid, d, 0)
        new = fma_f32(q[..., None, dd], keys[..., dd], acc)
        acc = np.where(valid, new, acc)
    return tree32(acc) * _F32(scale)


def emulate_softmax_v(scores: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scores [P], vals [P, D] -> (out [D], e [P]) with attn_softmax_v's order."""
    P = scores.shape[0]
    D = vals.shape[1]
    e = expf_pc(scores - scores.max())
    part = np.zeros(NT, np.float32)
    for t0 in range(0, P, NT):
        c = e[t0:t0 + NT]
        part[:len(c)] = part[:len(c)] + c
    total = block_sum256(part)
    S = NT // D
    parts = np.zeros((S, D), np.float32)
    for t0 in range(0, P, S):
        n = min(S, P - t0)
        parts[:n] = fma_f32(e[t0:t0 + n, None], vals[t0:t0 + n], parts[:n])
    acc = parts[0]
    for s in range(1, S):
        acc = acc + parts[s]
    return acc * (_F32(1.0) / total), e


def emulate_attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, slots: np.ndarray,
                      pos: np.ndarray, scale: float, window: int = 0) -> np.ndarray:
    R, H, D = q.shape
    G = kc.shape[1]
    out = np.empty_like(q)
    for r in range(R):
        P, s = int(pos[r]) + 1, int(slots[r])
        t0 = _window_start(P, window)
        for h in range(H):
            g = h // (H // G)
            sc = emulate_scores(q[r, h], kc[s, g, t0:P], scale)
            out[r, h] = emulate_softmax_v(sc, vc[s, g, t0:P])[0]
    return out


def _window_start(P: int, window: int) -> int:
    """The first key a row at position P - 1 attends to (attention kernels' t0)."""
    return max(0, P - window) if window > 0 else 0


def _argmax(x: np.ndarray) -> int:
    return int(np.argmax(x))  # NaN first, then the largest, ties to the lowest index


def _chunk_sums(p: np.ndarray, t: np.float32) -> np.ndarray:
    """Each thread's sequential sum of its chunk's p >= t -> [NT]."""
    V = p.size
    ch = -(-V // NT)
    pad = np.zeros(NT * ch, np.float32)
    pad[:V] = np.where(p >= t, p, _F32(0.0))
    return np.add.accumulate(pad.reshape(NT, ch), axis=1, dtype=np.float32)[:, -1]


def emulate_sample_row(x: np.ndarray, temp: float, top_p: float, min_p: float, top_k: int,
                       seed_step: np.ndarray) -> tuple[int, int]:
    """(token, bad) for one row of logits, as sample_rows computes it."""
    x = np.asarray(x, np.float32)
    V = x.size
    bi = _argmax(x)
    bv = x[bi]
    temp, top_p, min_p = _F32(temp), _F32(top_p), _F32(min_p)
    if not np.isfinite(bv):
        return bi, 1
    if temp == 0:
        return bi, 0
    with np.errstate(over="ignore", under="ignore"):
        d = x / temp - bv / temp
        p = np.where(d < _F32(-87.0), _F32(0.0), expf_pc(np.maximum(d, _F32(-87.0)))).astype(np.float32)
    p[p < min_p] = 0.0
    if 0 < top_k < V:
        lo, hi = 0, 0x3F800000
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            if int((p >= np.uint32(mid).view(np.float32)).sum()) >= top_k:
                lo = mid
            else:
                hi = mid - 1
        p[p < np.uint32(lo).view(np.float32)] = 0.0
    if top_p < 1:
        target = top_p * block_sum256(_chunk_sums(p, _F32(0.0)))
        lo, hi = 0, 0x3F800000
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            if block_sum256(_chunk_sums(p, np.uint32(mid).view(np.float32))) >= target:
                lo = mid
            else:
                hi = mid - 1
        p[p < np.uint32(lo).view(np.float32)] = 0.0
    cs = _chunk_sums(p, _F32(0.0))
    total = np.add.accumulate(cs, dtype=np.float32)[-1]
    ss = np.asarray(seed_step, np.uint32)
    target = uniform(int(ss[0]) | (int(ss[1]) << 32), int(ss[2])) * total
    ch = -(-V // NT)
    run = _F32(0.0)
    for c in range(NT):
        nxt = run + cs[c]
        if nxt > target:
            last = -1
            for i in range(min(V, c * ch), min(V, c * ch + ch)):
                if p[i] > 0:
                    last = i
                    run = run + p[i]
                    if run > target:
                        return i, 0
            return (last if last >= 0 else bi), 0
        run = nxt
    return bi, 0


def emulate_sample_rows(logits: np.ndarray, fparams: np.ndarray, top_k: np.ndarray,
                        seed_step: np.ndarray) -> np.ndarray:
    """int32 [R, 2] (token, bad) for logits [R, V]."""
    R = logits.shape[0]
    out = np.zeros((R, 2), np.int32)
    for r in range(R):
        out[r] = emulate_sample_row(logits[r], fparams[r, 0], fparams[r, 1], fparams[r, 2], int(top_k[r]),
                                    seed_step[r])
    return out


_NP_OF_CTYPE = {
    "float": (np.float32,),
    "unsigned short": (np.float16, np.uint16),
    "signed char": (np.int8,),
    "unsigned char": (np.uint8,),
    "int": (np.int32,),
    "long long": (np.int64,),
    "unsigned int": (np.uint32,),
}


class EmulatedModule:
    """A stand-in for cupy.RawModule(code=SOURCE) that runs every kernel on numpy arrays
    through the emulation above, after checking each launch's arguments against the
    kernel's C signature (count, pointer vs scalar, dtypes, contiguity) and its grid."""

    def __init__(self, source: str = SOURCE):
        self.signatures = kernel_signatures(source)
        self.launches: list[tuple[str, tuple]] = []

    def get_function(self, name: str):
        if name not in self.signatures:
            raise KeyError(f"no kernel named {name}")
        sig = self.signatures[name]

        def call(grid, block, args, shared_mem=0):
            _check_args(name, sig, grid, block, args)
            self.launches.append((name, tuple(grid)))
            self._emulate(name, grid, args)

        return call

    def _emulate(self, name: str, grid: tuple, args: tuple) -> None:
        _EMULATORS["linear" if name.startswith("linear_") else name](name, grid, args)


def _check_args(name, sig, grid, block, args) -> None:
    if tuple(block) != (NT,):
        raise ValueError(f"{name}: block {block}, kernels assume ({NT},)")
    if not 1 <= len(grid) <= 3 or any(int(g) < 1 for g in grid) or any(int(g) > 65535 for g in grid[1:]):
        raise ValueError(f"{name}: bad grid {grid}")
    if len(args) != len(sig):
        raise TypeError(f"{name}: {len(args)} arguments for {len(sig)} parameters")
    for i, (a, (ctype, is_ptr)) in enumerate(zip(args, sig)):
        ok_types = _NP_OF_CTYPE[ctype]
        if is_ptr:
            if not (isinstance(a, np.ndarray) and a.dtype.type in ok_types and a.flags.c_contiguous):
                raise TypeError(f"{name}: argument {i} must be a C-contiguous {ctype} array, got "
                                f"{getattr(a, 'dtype', type(a).__name__)}")
        elif not (isinstance(a, np.generic) and type(a) in ok_types):
            raise TypeError(f"{name}: argument {i} must be a numpy {ok_types[0].__name__} scalar, "
                            f"got {type(a).__name__}")


def _emu_linear(name, grid, args):
    parts = name.split("_")
    kind = parts[1]
    tm, nc = (1, 1) if parts[2] == "s" else (int(parts[2]), int(parts[3]))
    if kind == "q8":
        x, q, d, m, out, M, N, K, has_m, gshift, add, add_mode, nw, eps, norm = args
        w = dequantize("q8", q.reshape(int(N), int(K)), d.reshape(int(N), -1),
                       m.reshape(int(N), -1) if has_m else None, 1 << int(gshift))
    elif kind == "q4k":
        x, b, out, M, N, K, add, add_mode, nw, eps, norm = args
        w = dequantize("q4k", b.reshape(int(N), -1))
    elif kind == "q5":
        x, qs, d, m, qh, out, M, N, K, has_m, add, add_mode, nw, eps, norm = args
        w = dequantize_q5(qs.reshape(int(N), -1), d.reshape(int(N), -1), m.reshape(int(N), -1) if has_m else None,
                          qh.reshape(int(N), -1))
    elif kind == "q5k":
        x, b, out, M, N, K, add, add_mode, nw, eps, norm = args
        w = dequantize("q5k", b.reshape(int(N), -1))
    elif kind == "q6k":
        x, b, d, out, M, N, K, add, add_mode, nw, eps, norm = args
        w = dequantize("q6k", b.reshape(int(N), -1), d.reshape(int(N), -1))
    elif kind == "q80":
        x, q, d, out, M, N, K, add, add_mode, nw, eps, norm = args
        w = dequantize("q80", q.reshape(int(N), int(K)), d.reshape(int(N), -1))
    elif kind == "q4":
        x, qs, d, m, out, M, N, K, has_m, add, add_mode, nw, eps, norm = args
        w = dequantize_q4(qs.reshape(int(N), -1), d.reshape(int(N), -1), m.reshape(int(N), -1) if has_m else None)
    else:
        x, w0, out, M, N, K, add, add_mode, nw, eps, norm = args
        w = dequantize(kind, w0)
    M, N, K = int(M), int(N), int(K)
    if tuple(grid) != (cdiv(M, tm), cdiv(N, WARPS * nc)):
        raise ValueError(f"{name}: grid {grid} does not cover M={M}, N={N}")
    xin = x.reshape(M, K)
    if int(norm):  # the fused RMS norm: the rms_norm kernel's output, formed in the launch
        xin = emulate_rms_norm(xin, nw.reshape(K), float(eps))
    y = emulate_linear(xin, w.reshape(N, K))
    if int(add_mode):  # the residual [M, N] or the bias [N], added once after the sum
        y = y + (add.reshape(M, N) if int(add_mode) == 1 else add.reshape(N))
    out.reshape(M, N)[...] = y


def _emu_rms(name, grid, args):
    x, w, y, D, eps = args
    R = int(grid[0])
    y.reshape(-1, int(D))[:R] = emulate_rms_norm(x.reshape(-1, int(D))[:R], w, float(eps))


def _emu_silu(name, grid, args):
    g, u, y, n = args
    y.reshape(-1)[: int(n)] = emulate_silu_mul(g.reshape(-1)[: int(n)], u.reshape(-1)[: int(n)])


def _emu_kv_write(name, grid, args):
    k, v, kc, vc, slot, pos, R, G, C, D = args
    R, G, C, D = int(R), int(G), int(C), int(D)
    kcv = kc.reshape(-1, G, C, D)
    vcv = vc.reshape(-1, G, C, D)
    kk, vv = k.reshape(R, G, D), v.reshape(R, G, D)
    for r in range(R):
        kcv[slot[r], :, pos[r], :] = kk[r]
        vcv[slot[r], :, pos[r], :] = vv[r]


def _emu_gelu(name, grid, args):
    g, u, y, n = args
    y.reshape(-1)[: int(n)] = emulate_gelu_mul(g.reshape(-1)[: int(n)], u.reshape(-1)[: int(n)])


def emulate_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: np.ndarray, neox: bool) -> np.ndarray:
    """x [R, H, D] -> the rope kernel's result (each product rounded, then the sum)."""
    half = cos.shape[1]
    c = cos[pos][:, None, :]
    s = sin[pos][:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * c - b * s
        out[..., half:2 * half] = b * c + a * s
    else:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * c - b * s
        out[..., 1:2 * half:2] = b * c + a * s
    return out


def _emu_rope(name, grid, args):
    x, y, cs, sn, pos, n, HD, D, half, neox = args
    D, HD, half = int(D), int(HD), int(half)
    R = int(n) // HD
    xv = x.reshape(-1)[: int(n)].reshape(R, HD // D, D)
    y.reshape(-1)[: int(n)] = emulate_rope(xv, cs.reshape(-1, half), sn.reshape(-1, half),
                                           pos.reshape(-1)[:R], bool(neox)).reshape(-1)


def emulate_rope_kv_write(q, k, v, kc, vc, cos, sin, tables, seqs, pos, neox: bool) -> np.ndarray:
    """The rope_kv_write kernel: q [R, H, D] turned (returned), k turned and v written into
    the paged store kc, vc [NB, G, BT, D] at (tables[seqs[r], pos[r] // BT], :, pos[r] % BT)
    -- emulate_rope, then the scatter with numpy's rounding to the store's dtype (nearest
    even): by construction rope, rope and ArrayBackend.write_kv."""
    q_out = emulate_rope(q, cos, sin, pos, neox)
    k_rot = emulate_rope(k, cos, sin, pos, neox)
    blocks, offs = tables[seqs, pos // BLOCK_TOKENS], pos % BLOCK_TOKENS
    kc[blocks, :, offs, :] = k_rot
    vc[blocks, :, offs, :] = v
    return q_out


def _emu_rope_kv_write(name, grid, args):
    q, k, v, qo, kc, vc, cs, sn, tab, nb, seq, pos, nq, nk, HD, G, D, half, neox = args
    nq, nk, HD, G, D, half, nb = int(nq), int(nk), int(HD), int(G), int(D), int(half), int(nb)
    R = nq // HD
    if nk != R * G * D or (int(grid[0]) < min(cdiv(nq + nk, NT), 4096)):
        raise ValueError(f"{name}: grid {grid} for {nq} + {nk} elements")
    store = np.float16 if name.endswith("_f16") else np.float32
    kcv = kc.view(store).reshape(-1, G, BLOCK_TOKENS, D)
    vcv = vc.view(store).reshape(-1, G, BLOCK_TOKENS, D)
    pos_r = pos.reshape(-1)[:R].astype(np.int64)
    seq_r = seq.reshape(-1)[:R].astype(np.int64)
    qo.reshape(-1)[:nq] = emulate_rope_kv_write(
        q.reshape(-1)[:nq].reshape(R, HD // D, D), k.reshape(-1)[:nk].reshape(R, G, D),
        v.reshape(-1)[:nk].reshape(R, G, D), kcv, vcv, cs.reshape(-1, half), sn.reshape(-1, half),
        tab.reshape(-1, nb), seq_r, pos_r, bool(neox)).reshape(-1)


def gather_keys(store: np.ndarray, table: np.ndarray, g: int, t0: int, P: int) -> np.ndarray:
    """Keys (or values) t0 .. P-1 of kv head g of one sequence (its block table row) from a
    paged store [NB, G, BT, D], in position order, as float32 (an exact conversion): what
    the attention kernels read through the table."""
    nb = -(-P // BLOCK_TOKENS)
    blocks = store[np.asarray(table[:nb], np.int64), g]  # [nb, BT, D]
    return blocks.reshape(nb * BLOCK_TOKENS, -1)[t0:P].astype(np.float32)


def _emu_scores(name, grid, args):
    q, kc, tab, nb, seq, pos, sc, H, G, D, scale, r0, window = args
    H, G, D, r0, nb = int(H), int(G), int(D), int(r0), int(nb)
    if grid[0] % H or grid[1] != KSPLIT:
        raise ValueError(f"{name}: grid {grid}")
    qv = q.reshape(-1, H, D)
    kcv = kc.reshape(-1, G, BLOCK_TOKENS, D)
    tabv = tab.reshape(-1, nb)
    scv = sc.reshape(-1, H, nb * BLOCK_TOKENS)
    for rr in range(grid[0] // H):
        r = r0 + rr
        P = int(pos[r]) + 1
        t0 = _window_start(P, int(window))
        for h in range(H):
            keys = gather_keys(kcv, tabv[int(seq[r])], h // (H // G), t0, P)
            scv[rr, h, t0:P] = emulate_scores(qv[r, h], keys, float(scale))


def _emu_softmax_v(name, grid, args):
    sc, vc, tab, nb, seq, pos, o, H, G, D, r0, window = args
    H, G, D, r0, nb = int(H), int(G), int(D), int(r0), int(nb)
    if grid[0] % H:
        raise ValueError(f"{name}: grid {grid}")
    scv = sc.reshape(-1, H, nb * BLOCK_TOKENS)
    vcv = vc.reshape(-1, G, BLOCK_TOKENS, D)
    tabv = tab.reshape(-1, nb)
    ov = o.reshape(-1, H, D)
    for rr in range(grid[0] // H):
        r = r0 + rr
        P = int(pos[r]) + 1
        t0 = _window_start(P, int(window))
        for h in range(H):
            vals = gather_keys(vcv, tabv[int(seq[r])], h // (H // G), t0, P)
            ov[r, h], scv[rr, h, t0:P] = emulate_softmax_v(scv[rr, h, t0:P], vals)


def _emu_sample_rows(name, grid, args):
    logits, prob, fparams, top_k, seed_step, out, V = args
    R, V = int(grid[0]), int(V)
    out.reshape(-1, 2)[:R] = emulate_sample_rows(logits.reshape(-1, V)[:R], fparams.reshape(-1, 4),
                                                 top_k, seed_step.reshape(-1, 3))


_EMULATORS = {
    "linear": _emu_linear,
    "rms_norm": _emu_rms,
    "silu_mul": _emu_silu,
    "gelu_mul": _emu_gelu,
    "rope": _emu_rope,
    "kv_write": _emu_kv_write,
    "rope_kv_write_f16": _emu_rope_kv_write,
    "rope_kv_write_f32": _emu_rope_kv_write,
    "attn_scores_f16": _emu_scores,
    "attn_scores_f32": _emu_scores,
    "attn_softmax_v_f16": _emu_softmax_v,
    "attn_softmax_v_f32": _emu_softmax_v,
    "sample_rows": _emu_sample_rows,
}

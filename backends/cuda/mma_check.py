"""Checks of the tensor-core (MMA) mode on a CupyBackend with it on (the device, or the
emulation): the x split bit for bit against its numpy form, every product within the
documented error bound of the float64 product (and of the numpy model), and rows alone
== the same rows in batches of 2..64 at several positions, bit for bit. Used by
scripts/gpu_check.py and the tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from panechat.backends.cuda.cupy_backend import CupyBackend, CupyWeight, prepare_weight
from panechat.backends.cuda.kernels.mma_emulation import block_codes, from_bf16, mma_error_bound, split_x
from panechat.backends.cuda.widen import random_blocks
from panechat.backends.quant import registry
from panechat.backends.quant.gguf_tensor import GGUFTensor

#: (GGUF type, N, K): every MMA weight form -- f16, bf16; int8 codes with one scale per 32
#: (Q8_0, Q4_0), with mins (Q4_1, Q4_K), 16 weights per scale (Q6_K); N not a multiple of
#: the 16-row tile, K of several chunks per warp
MMA_CASES = (("F16", 72, 320), ("BF16", 40, 256), ("Q8_0", 200, 512), ("Q4_0", 40, 96), ("Q4_1", 70, 256),
             ("Q4_K", 48, 512), ("Q6_K", 33, 256),
             ("Q8_0 blocks", 40, 256), ("Q4_0 blocks", 24, 320), ("Q4_1 blocks", 33, 256))
BATCHES = (2, 3, 5, 8, 9, 16, 17, 31, 33, 64)


def mma_tensor(rng: np.random.Generator, qtype: str, n: int, k: int) -> GGUFTensor:
    if qtype.endswith("_K"):
        return GGUFTensor("w", (n, k), qtype, random_blocks(rng, qtype, n, k))
    return GGUFTensor.from_array(rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)), qtype)


def block_form(t: GGUFTensor) -> CupyWeight:
    """Q8_0 / Q4_0 / Q4_1 in GGUF's block form, the layout of the CUDA-core kernels' q80 / q4
    weights (cupy_packed on the block-form branch): the codes as stored (Q4: 16 bytes per
    32 weights, byte j = weight j low nibble, j + 16 high), float16 d (and m) split off."""
    n, k = t.shape
    nb = k // 32
    b = np.ascontiguousarray(t.blocks, dtype=np.uint8).reshape(n, nb, registry.get(t.qtype).block_bytes)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).reshape(n, nb)
    if t.qtype == "Q8_0":
        return CupyWeight("q80", n, k, np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(n, k), d)
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16).reshape(n, nb) if t.qtype == "Q4_1" else None
    qs = b[..., 4:20] if t.qtype == "Q4_1" else b[..., 2:18]
    return CupyWeight("q4", n, k, np.ascontiguousarray(qs).reshape(n, nb * 16), d, m)


def host_weight(t: GGUFTensor, blocks: bool = False) -> CupyWeight:
    return block_form(t) if blocks else prepare_weight(t, widened=True)  # int8 codes + float32 scales


def on_backend(be: CupyBackend, h: CupyWeight) -> CupyWeight:
    return CupyWeight(h.kind, h.n, h.k, be.asarray(h.w), None if h.scales is None else be.asarray(h.scales),
                      None if h.mins is None else be.asarray(h.mins), h.group)


def exact_weights(t: GGUFTensor | CupyWeight) -> tuple[np.ndarray, np.ndarray, int]:
    """(w, w', G): the float64 weights the MMA kernels multiply (q*d + m exactly; f16 as
    stored), the bound's |q d| + |m|, and the weights per scale."""
    h = prepare_weight(t, widened=True) if isinstance(t, GGUFTensor) else t  # the same floats as any block form
    if h.kind in ("q8", "q80", "q4"):
        codes = block_codes(h.w, h.n, h.k, h.mins is not None) if h.kind == "q4" else h.w
        q = codes.astype(np.float64).reshape(h.n, -1, h.group)
        d = h.scales.astype(np.float64)[:, :, None]
        m = 0.0 if h.mins is None else h.mins.astype(np.float64)[:, :, None]
        return (q * d + m).reshape(h.n, h.k), (np.abs(q * d) + np.abs(m)).reshape(h.n, h.k), h.group
    w = (from_bf16(h.w) if h.kind == "bf16" else np.asarray(h.w)).astype(np.float64)
    return w, np.abs(w), 32


def probe_rows(rng: np.random.Generator, M: int, K: int) -> np.ndarray:
    """Activations with rows of very different magnitudes (the row scale's job), a zero row
    and a row with a few outliers."""
    x = rng.standard_normal((M, K), dtype=np.float32)
    x *= np.float32(10.0) ** rng.integers(-6, 5, (M, 1)).astype(np.float32)
    x[min(3, M - 1)] = 0.0
    x[min(5, M - 1), :: max(1, K // 7)] *= np.float32(3000.0)
    return x


def rows_invariant(be: CupyBackend, w: Any, x: np.ndarray, batches=BATCHES, add: np.ndarray | None = None
                   ) -> str | None:
    """None when every row of x alone equals the same row inside batches of each size at
    the start, middle and end of x (bit for bit), else the first difference."""
    def run(lo: int, hi: int) -> np.ndarray:
        xr = be.asarray(x[lo:hi])
        if add is None:
            return be.to_numpy(be.linear(xr, w))
        return be.to_numpy(be.linear_add(xr, w, be.asarray(add[lo:hi])))

    alone = [run(i, i + 1)[0] for i in range(len(x))]
    for size in batches:
        if size > len(x):
            continue
        for start in sorted({0, (len(x) - size) // 2, len(x) - size}):
            got = run(start, start + size)
            for j in range(size):
                if not np.array_equal(got[j].view(np.uint32), alone[start + j].view(np.uint32)):
                    return f"row {start + j} differs alone vs at row {j} of a batch of {size}"
    return None


def check_mma(be: CupyBackend, seed: int = 11, batches=BATCHES, cases=MMA_CASES) -> list[tuple[bool, str]]:
    """[(ok, one line)] for the split, each case's error bound and invariance."""
    if be.mma is None:
        return [(False, "the MMA mode is off on this backend (PANECHAT_CUPY_MMA=1)")]
    rng = np.random.default_rng(seed)
    out = []
    # (1) the split: IEEE operations only, so bit for bit
    x = probe_rows(rng, 13, 256)
    x[7, 3] = np.float32(1e-40)  # a subnormal input
    x[8] = np.float32(1e-42)  # a row of subnormals
    x[9] *= np.float32(1e33)  # near float32's top
    for bf16 in (False, True):
        got = [be.to_numpy(a) for a in be.mma.split(be.asarray(x), 16, 4, True, bf16)]
        want = split_x(x, 16, 4, True, bf16)
        same = all(np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
                   for g, w in zip(got, want))
        out.append((same, f"mma_split_x ({'bf16 hi, mid, lo' if bf16 else 'f16 hi, lo'}, 1/scale, group sums): "
                          f"{'bit-identical to' if same else 'DIFFERS from'} the numpy form"))
    emu = CupyBackend.emulated_on_cpu(mma=True)
    for name, n, k in cases:
        qtype, blocks = name.split()[0], name.endswith(" blocks")
        t = mma_tensor(rng, qtype, n, k)
        host = host_weight(t, blocks)
        w, w_abs, group = exact_weights(host)
        pw = on_backend(be, host)
        if not be.mma.handles(pw):
            out.append((False, f"{name} {n}x{k}: not taken by the MMA kernels"))
            continue
        M = max(batches)
        x = probe_rows(rng, M, k)
        y = be.to_numpy(be.linear(be.asarray(x), pw)).astype(np.float64)
        ref = x.astype(np.float64) @ w.T
        bound = mma_error_bound(x, w_abs, group)
        err = np.abs(y - ref)
        ratio = float((err / np.maximum(bound, 1e-300)).max())
        y_emu = emu.to_numpy(emu.linear(x, on_backend(emu, host))).astype(np.float64)
        vs_emu = float((np.abs(y - y_emu) / np.maximum(2 * bound, 1e-300)).max())
        scale = np.abs(x.astype(np.float64)) @ w_abs.T
        rel = float((err / np.maximum(scale, 1e-300)).max())
        ok = bool(np.isfinite(y).all()) and ratio <= 1.0 and vs_emu <= 1.0
        out.append((ok, f"{name} {n}x{k} M={M}: |err| vs float64 <= {ratio:.3f} of the bound (max "
                        f"{rel:.1e} of sum|x||w|); vs the numpy model {vs_emu:.3f} of 2x the bound"))
        problem = rows_invariant(be, pw, x, batches)
        if problem is None and qtype in ("F16", "Q8_0"):  # the fused residual / bias add too
            problem = rows_invariant(be, pw, x, batches[:4], add=rng.standard_normal((M, n), dtype=np.float32))
        out.append((problem is None, f"{name} {n}x{k}: rows alone vs in batches of {batches[0]}..{batches[-1]}: "
                                     f"{problem or 'bit-identical'}"))
    return out

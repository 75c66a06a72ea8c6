"""Launching the CuPy backend's kernels: the tile and variant choice, grids and argument
lists, for a cupy.RawModule or the numpy emulation alike (`Kernels`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.backends.cuda.kernels.constants import BLOCK_KINDS, COL_TILES, KSPLIT, MAX_HEAD_DIM, NT, ROW_TILES, WARPS, WIDE_N, cdiv
from panechat.backends.cuda.kernels.source import KERNEL_NAMES, linear_kernel_name

SCRATCH_FLOATS = 1 << 24  # attention score scratch per launch group (64 MiB); rows are chunked


def row_tile(m: int) -> int:
    """TM: the smallest row tile >= m, at most 16."""
    for tm in ROW_TILES:
        if m <= tm:
            return tm
    return ROW_TILES[-1]


def col_tile(n: int) -> int:
    """NC: 4 columns per warp for wide matrices, else 1 (more blocks for small N)."""
    return COL_TILES[-1] if n > WIDE_N else COL_TILES[0]


def _ptr(a: Any) -> int:
    data = getattr(a, "data", None)
    if hasattr(data, "ptr"):  # cupy
        return int(data.ptr)
    return int(a.ctypes.data)


def add_arguments(kernel: str, add: Any, out: Any, M: int, N: int) -> tuple:
    """The linear kernels' (add, add_mode) arguments: nothing to add (0; `out` stands in
    for the pointer), a residual [M, N] (1) or a bias [N] (2)."""
    if add is None:
        return out, np.int32(0)
    if tuple(add.shape) == (M, N):
        return add, np.int32(1)
    if tuple(add.shape) == (N,):
        return add, np.int32(2)
    raise ValueError(f"{kernel}: add{tuple(add.shape)} is neither [{M}, {N}] nor [{N}]")


class ModuleKernels:
    """The kernels of `module` (a cupy.RawModule, or an emulated one), each looked up once,
    launched on arrays of `xp` (cupy, or numpy for the emulation); `NAMES` lists them."""

    NAMES: tuple = ()

    def __init__(self, module: Any, xp: Any):
        self.module = module
        self.xp = xp
        self._fns: dict[str, Any] = {}

    def fn(self, name: str) -> Any:
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self.module.get_function(name)
        return f

    def compile_all(self) -> None:
        """Compile and load every kernel now (errors surface at start-up, not mid-answer)."""
        for name in self.NAMES:
            self.fn(name)


class Kernels(ModuleKernels):
    """Launches the kernels of `module` (a cupy.RawModule, or EmulatedModule) on arrays
    of `xp` (cupy, or numpy for the emulation). Arrays must be C-contiguous."""

    NAMES = tuple(KERNEL_NAMES)

    def launch(self, name: str, grid: tuple, args: tuple) -> None:
        self.fn(name)(grid, (NT,), args)

    # -- the operations ----------------------------------------------------------------
    def linear(self, x: Any, w: Any, out: Any, add: Any = None, norm: tuple | None = None) -> Any:
        """out[M, N] = x[M, K] @ W.T (+ add: [M, N] a residual, or [N] a bias) for a prepared
        weight `w` (kind, n, k, arrays); with norm = (weight [K] float32, eps) the product's
        input is rms_norm(x, weight, eps), formed by the same launch (bit for bit the
        rms_norm kernel's output)."""
        M, K = x.shape
        N = w.n
        if K != w.k or out.shape != (M, N):
            raise ValueError(f"linear: x{tuple(x.shape)} w[{w.n}, {w.k}] out{tuple(out.shape)}")
        if M == 0 or N == 0:
            return out
        if K % 8 == 0 and _ptr(x) % 16 == 0 and (norm is None or _ptr(norm[0]) % 16 == 0):
            tm, nc = row_tile(M), col_tile(N)
            grid = (cdiv(M, tm), cdiv(N, WARPS * nc))
        elif w.kind in BLOCK_KINDS:
            raise ValueError(f"linear: {w.kind} weights need K a multiple of their group and a 16-byte aligned x")
        else:  # the any-K kernel: same arithmetic, scalar loads, one row per block
            tm, nc = 0, 0
            grid = (M, cdiv(N, WARPS))
        if grid[1] > 65535:
            raise ValueError(f"linear: N={N} too large for one launch")
        i32 = np.int32
        tail = add_arguments("linear", add, out, M, N)
        if norm is None:
            tail += (x, np.float32(0.0), i32(0))
        else:
            if tuple(norm[0].shape) != (K,):
                raise ValueError(f"linear: norm weight{tuple(norm[0].shape)} is not [{K}]")
            tail += (norm[0], np.float32(norm[1]), i32(1))
        if w.kind == "q8":
            mins = w.mins if w.mins is not None else w.scales
            group = getattr(w, "group", 32)
            args = (x, w.w, w.scales, mins, out, i32(M), i32(N), i32(K), i32(w.mins is not None),
                    i32(group.bit_length() - 1)) + tail
        elif w.kind in ("q4k", "q5k"):
            args = (x, w.w, out, i32(M), i32(N), i32(K)) + tail
        elif w.kind == "q6k":
            args = (x, w.w, w.scales, out, i32(M), i32(N), i32(K)) + tail
        elif w.kind == "q80":
            args = (x, w.w, w.scales, out, i32(M), i32(N), i32(K)) + tail
        elif w.kind == "q4":
            mins = w.mins if w.mins is not None else w.scales
            args = (x, w.w, w.scales, mins, out, i32(M), i32(N), i32(K), i32(w.mins is not None)) + tail
        elif w.kind == "q5":
            mins = w.mins if w.mins is not None else w.scales
            args = (x, w.w, w.scales, mins, w.qh, out, i32(M), i32(N), i32(K), i32(w.mins is not None)) + tail
        else:
            args = (x, w.w, out, i32(M), i32(N), i32(K)) + tail
        self.launch(linear_kernel_name(w.kind, tm, nc), grid, args)
        return out

    def rms_norm(self, x: Any, weight: Any, eps: float, out: Any) -> Any:
        R, D = x.shape
        if R:
            self.launch("rms_norm", (R,), (x, weight, out, np.int32(D), np.float32(eps)))
        return out

    def silu_mul(self, g: Any, u: Any, out: Any) -> Any:
        n = int(g.size)
        if n:
            self.launch("silu_mul", (min(cdiv(n, NT), 4096),), (g, u, out, np.int64(n)))
        return out

    def gelu_mul(self, g: Any, u: Any, out: Any) -> Any:
        n = int(g.size)
        if n:
            self.launch("gelu_mul", (min(cdiv(n, NT), 4096),), (g, u, out, np.int64(n)))
        return out

    def rope(self, x: Any, out: Any, cos: Any, sin: Any, pos: Any, neox: bool) -> Any:
        """Rotary embedding of x [R, H, D] at pos [R] (int32) with tables [max_pos, half]."""
        R, H, D = x.shape
        half = int(cos.shape[1])
        n = R * H * D
        if n:
            self.launch("rope", (min(cdiv(n, NT), 4096),),
                        (x, out, cos, sin, pos, np.int64(n), np.int32(H * D), np.int32(D), np.int32(half),
                         np.int32(bool(neox))))
        return out

    def rope_kv_write(self, q: Any, k: Any, v: Any, q_out: Any, kc: Any, vc: Any, cos: Any, sin: Any,
                      tables: Any, seqs: Any, pos: Any, neox: bool) -> Any:
        """One launch: q [R, H, D] turned by RoPE into q_out, k [R, G, D] turned and v
        [R, G, D] written into one layer's paged store kc, vc [NB, G, BT, D] (float16,
        rounded to nearest even, or float32) at block tables[seqs[r], pos[r] / BT], offset
        pos[r] % BT -- the bits of rope(q), rope(k), then the store's scatter. Returns q_out."""
        R, H, D = q.shape
        NB, G, bt, D2 = kc.shape
        S, nb = tables.shape
        if (tuple(k.shape) != (R, G, D) or tuple(v.shape) != (R, G, D) or D2 != D or bt != BLOCK_TOKENS
                or q_out.shape != q.shape or vc.shape != kc.shape):
            raise ValueError(f"rope_kv_write: q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                             f"store{tuple(kc.shape)}")
        if kc.dtype != vc.dtype or np.dtype(str(kc.dtype)) not in (np.float16, np.float32):
            raise ValueError(f"rope_kv_write: a float16 or float32 store, got {kc.dtype}")
        half = int(cos.shape[1])
        if 2 * half > D:
            raise ValueError(f"rope_kv_write: rope tables of {2 * half} dims for head_dim {D}")
        kind = "f16" if np.dtype(str(kc.dtype)) == np.float16 else "f32"
        nq, nk = R * H * D, R * G * D
        if nq + nk:
            i32 = np.int32
            self.launch(f"rope_kv_write_{kind}", (min(cdiv(nq + nk, NT), 4096),),
                        (q, k, v, q_out, kc, vc, cos, sin, tables, i32(nb), seqs, pos, np.int64(nq), np.int64(nk),
                         i32(H * D), i32(G), i32(D), i32(half), i32(bool(neox))))
        return q_out

    def kv_write(self, k: Any, v: Any, kc: Any, vc: Any, slots: Any, pos: Any) -> None:
        R, G, D = k.shape
        S, G2, C, D2 = kc.shape
        if (G2, D2) != (G, D) or v.shape != k.shape or vc.shape != kc.shape:
            raise ValueError(f"kv_write: k{tuple(k.shape)} cache{tuple(kc.shape)}")
        n = R * G * D
        if n:
            i32 = np.int32
            self.launch("kv_write", (min(cdiv(n, NT), 4096),),
                        (k, v, kc, vc, slots, pos, i32(R), i32(G), i32(C), i32(D)))

    def attention(self, q: Any, kc: Any, vc: Any, tables: Any, seqs: Any, pos: Any, scale: float, out: Any,
                  window: int = 0) -> Any:
        """Causal GQA of q [R, H, D] over keys 0..pos[r] of sequence seqs[r] (with a sliding
        `window` > 0: the last `window` of them) -> out [R, H, D], reading one layer's paged
        store kc, vc [NB, G, BT, D] (float16 or float32) in place through the block tables
        [S, nb] (int32)."""
        R, H, D = q.shape
        NB, G, bt, D2 = kc.shape
        S, nb = tables.shape
        if D2 != D or bt != BLOCK_TOKENS or H % G or D > MAX_HEAD_DIM or out.shape != q.shape or vc.shape != kc.shape:
            raise ValueError(f"attention: q{tuple(q.shape)} store{tuple(kc.shape)} (head_dim <= {MAX_HEAD_DIM})")
        if kc.dtype != vc.dtype or np.dtype(str(kc.dtype)) not in (np.float16, np.float32):
            raise ValueError(f"attention: a float16 or float32 store, got {kc.dtype}")
        if R == 0:
            return out
        kind = "f16" if np.dtype(str(kc.dtype)) == np.float16 else "f32"
        C = nb * BLOCK_TOKENS
        rows = max(1, min(R, SCRATCH_FLOATS // (H * C)))  # rows per launch pair
        sc = self.xp.empty((rows, H, C), self.xp.float32)
        i32 = np.int32
        for r0 in range(0, R, rows):
            n = min(rows, R - r0)
            self.launch(f"attn_scores_{kind}", (n * H, KSPLIT),
                        (q, kc, tables, i32(nb), seqs, pos, sc, i32(H), i32(G), i32(D), np.float32(scale), i32(r0),
                         i32(window)))
            self.launch(f"attn_softmax_v_{kind}", (n * H,),
                        (sc, vc, tables, i32(nb), seqs, pos, out, i32(H), i32(G), i32(D), i32(r0), i32(window)))
        return out

    def sample_rows(self, logits: Any, prob: Any, fparams: Any, top_k: Any, seed_step: Any, out: Any) -> Any:
        """(token, bad) int32 [R, 2] for logits [R, V] (the sample_rows contract in sampling.cuh);
        `prob` [R, V] float32 is scratch, the other inputs come from sampling.sampling_table."""
        R, V = logits.shape
        if R:
            self.launch("sample_rows", (R,), (logits, prob, fparams, top_k, seed_step, out, np.int32(V)))
        return out

"""The MLX backend: Apple silicon GPU (Metal), or the CPU where MLX runs without Metal.

Weights: GGUF Q4_0, Q4_1 and Q8_0 tensors stay quantized. Each is exactly an MLX affine
quantization with group size 32 (w = scale * q + bias, q unsigned):
  Q4_1  w = d*q + m        -> bits 4, scale d, bias m
  Q4_0  w = d*(q - 8)      -> bits 4, scale d, bias -8d
  Q8_0  w = d*q, q int8    -> bits 8, q + 128, scale d, bias -128d
built from the GGUF blocks as stored (`GGUFTensor.blocks`), with float32 scales and
biases (every f16 d and m, and -8d, -128d, is exact in float32), so the weights MLX
multiplies are bit for bit the dequantized GGUF weights. Other tensor types are dequantized: float32 on
the CPU device (exact; MLX's CPU float16 matmul is no faster there), float16 on the GPU
(activations are cast to float16 for those matmuls), F32 tensors stay float32.

Kernel policy. MLX picks kernels by row count: on Metal a quantized matmul of M rows
uses the qmv vector kernel below a device-dependent limit (6..32 rows) and the tiled qmm
kernel above it, a float matmul gemv for M = 1 and gemm otherwise, and the kernels round
differently. Policies (`policy=` or PANECHAT_MLX_POLICY):
- "rowwise" (default): every `linear` is R independent matrix-vector products. x is
  viewed as [R, 1, K] and the weight gets a batch axis [1, N, K], so M = 1 for every row
  whatever R is (float weights: x also as a transposed view, so Metal cannot fold the
  batch back into M). Same kernel, same shapes, for a row alone or among 100.
- "tile": on the GPU (on the CPU it is "rowwise"), rows are padded with zero rows to a multiple of TILE (32 >= every
  qmv limit), so every call takes the tiled qmm/gemm kernels, which read the weights once
  per 32 rows (batching pays off) but whose invariance rests on the tiled kernels
  rounding a row the same at every tile position: the self-check must confirm it.
- "plain": 2-D calls as MLX chooses (expected to fail the self-check on Metal).
On the CPU device, quantized matmuls are plain 2-D calls under every policy: MLX's CPU
kernel computes the rows one after another with the same code (a batch axis there would
copy the weight once per row); float matmuls follow the policy.
Attention: a row attends over a key length that depends only on its own position
(position + 1 rounded up to ATTN_BLOCK, masked past the position); rows of different
lengths run as separate groups, so neither the other rows' positions nor their count
change a row's reductions. `self_check()` verifies all of it on the running device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

import mlx.core as mx

from panechat.backends.base import Array, Backend
from panechat.backends.paged_kv import BLOCK_TOKENS, PagedKV, kv_dtype_bytes
from panechat.backends.quant.gguf_blocks import unpack
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.self_check import AttentionCase, CheckPlan, check_batch_invariance

GROUP = 32  # GGUF block size == MLX affine group size
TILE = 32  # "tile" policy: rows padded to a multiple of this
POLICIES = ("rowwise", "tile", "plain")
ATTN_BLOCK = 128  # attention key lengths are rounded up to a multiple of this

_AFFINE = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # the GGUF types kept quantized: bits per weight in MLX


@dataclass
class MLXWeight:
    """A prepared [N, K] weight: affine-quantized (q, scales, biases, bits) or float (w)."""

    n: int
    k: int
    w: Any  # affine: uint32 [N, K*bits/32]; float: [N, K]
    scales: Any = None  # [N, K/32] float32
    biases: Any = None
    bits: int = 0  # 0 = float

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.w, self.scales, self.biases) if a is not None)


def affine_from_gguf(blocks: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, ...]:
    """GGUF Q4_0/Q4_1/Q8_0 blocks [n, k/32 * block bytes] -> MLX affine (w_q uint32
    [n, k*bits/32], scales float32 [n, k/32], biases float32 [n, k/32], bits)."""
    q, d, m = unpack(blocks, qtype, n, k)
    bits = _AFFINE[qtype]
    offset = {"Q8_0": 128, "Q4_0": 8, "Q4_1": 0}[qtype]  # MLX stores unsigned values
    vals = (q.astype(np.int16) + offset).astype(np.uint8)  # [n, k] in order
    bias = m if m is not None else np.float32(-offset) * d
    if bits == 8:
        return vals.view(np.uint32), d, bias, bits
    # MLX: element i sits at bits 4*(i%8) of uint32 word i//8 (little endian).
    packed = (vals[:, 0::2] | (vals[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed).view(np.uint32), d, bias, bits


class MLXBackend(Backend):
    """MLX arrays on the default MLX device; quantized GGUF weights stay quantized."""

    name = "mlx"
    # batch sizes across Metal's qmv/qmm and gemv/gemm limits; probes in three attention
    # buckets, the last at the final position
    check_plan = CheckPlan(
        batches=(2, 3, 5, 8, 13, 17, 33, 40),
        linear=(("Q4_1", 96, 576), ("Q4_0", 64, 128), ("Q8_0", 72, 512), ("F32", 48, 64), ("F16", 40, 256)),
        norm_widths=(576,),
        attention=(AttentionCase(4, 2, 3 * ATTN_BLOCK + 40, 64, 6, (5, ATTN_BLOCK + 3, 3 * ATTN_BLOCK + 39)),
                   AttentionCase(4, 2, 3 * ATTN_BLOCK + 40, 64, 6, (5, 3 * ATTN_BLOCK + 39), window=ATTN_BLOCK + 7)))

    def __init__(self, device: str | None = None, policy: str | None = None,
                 float_dtype: str | None = None):
        if device is not None:
            mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
        policy = policy or os.environ.get("PANECHAT_MLX_POLICY") or "rowwise"
        if policy not in POLICIES:
            raise ValueError(f"unknown MLX kernel policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.on_gpu = mx.default_device() == mx.gpu
        if float_dtype is None:
            float_dtype = "float16" if self.on_gpu else "float32"
        self.float_dtype = getattr(mx, float_dtype)
        self._plan: Any = None
        self._dirty: list[PagedKV] = []

    def describe(self) -> str:
        dev = "cpu"
        if self.on_gpu:
            dev = "gpu (Metal)" if _available("metal") else "gpu (CUDA)" if _available("cuda") else "gpu"
        policy = {"rowwise": "row-wise kernels (one matrix-vector product per row)",
                  "tile": f"tiled kernels (rows padded to {TILE})",
                  "plain": "plain batched kernels (not batch-invariant on Metal)"}[self.policy]
        return (f"mlx {mx.__version__} on {dev}, Q4_0/Q4_1/Q8_0 kept quantized, {policy}, "
                f"attention in {ATTN_BLOCK}-position buckets")

    # -- moving data -----------------------------------------------------------------
    def asarray(self, a: np.ndarray) -> Array:
        return mx.array(np.ascontiguousarray(a))

    def to_numpy(self, a: Array) -> np.ndarray:
        pending = [x for kv in self._dirty for x in (*kv.k, *kv.v)]
        self._dirty = []
        mx.eval(a, *pending)
        return np.array(a, copy=True)

    def linear_weight(self, t: GGUFTensor) -> MLXWeight:
        n, k = t.shape
        if t.qtype in _AFFINE and k % GROUP == 0:
            wq, scales, biases, bits = affine_from_gguf(t.blocks, t.qtype, n, k)
            out = MLXWeight(n, k, mx.array(wq), mx.array(scales), mx.array(biases), bits)
            mx.eval(out.w, out.scales, out.biases)
            return out
        dtype = mx.float32 if t.qtype == "F32" else self.float_dtype
        if t.qtype == "F16" and dtype == mx.float16:
            out = MLXWeight(n, k, mx.array(np.ascontiguousarray(t.blocks)))  # as stored
        else:
            out = MLXWeight(n, k, mx.array(t.dequantize()).astype(dtype))
        mx.eval(out.w)
        return out

    def nbytes(self, w: Any) -> int:
        return int(w.nbytes)

    # -- the forward pass's operations -------------------------------------------------
    def linear(self, x: Array, w: MLXWeight) -> Array:
        R = x.shape[0]
        if self.policy == "plain" or (w.bits and not self.on_gpu):
            return self._linear2d(x, w)
        if self.policy == "tile" and self.on_gpu:
            pad = -R % TILE
            if pad:
                x = mx.concatenate([x, mx.zeros((pad, x.shape[1]), dtype=x.dtype)], axis=0)
            y = self._linear2d(x, w)
            return y[:R] if pad else y
        if w.bits:
            # w with a batch axis: Metal keeps M = 1 (qmv for every row) instead of
            # folding the R rows into one qmm.
            y = mx.quantized_matmul(x[:, None, :], w.w[None], w.scales[None], w.biases[None],
                                    transpose=True, group_size=GROUP, bits=w.bits)
            return y.reshape(R, w.n)
        # x as a transposed [R, 1, K] view: a batch MLX cannot collapse into M rows.
        xv = x.astype(w.w.dtype)[:, :, None].swapaxes(1, 2)
        return _float_out(mx.matmul(xv, w.w[None].swapaxes(1, 2))).reshape(R, w.n)

    @staticmethod
    def _linear2d(x: Array, w: MLXWeight) -> Array:
        if w.bits:
            return mx.quantized_matmul(x, w.w, w.scales, w.biases, transpose=True,
                                       group_size=GROUP, bits=w.bits)
        return _float_out(x.astype(w.w.dtype) @ w.w.T)

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        return mx.fast.rms_norm(x, weight, eps)

    def rope(self, x: Array, positions: Array, style: str, tables: tuple[Array, Array]) -> Array:
        cos = tables[0][positions][:, None, :]  # (R, 1, rope_dim/2)
        sin = tables[1][positions][:, None, :]
        half = cos.shape[-1]
        rest = x[..., 2 * half:]
        if style == "neox":
            a, b = x[..., :half], x[..., half:2 * half]
            parts = [a * cos - b * sin, b * cos + a * sin]
        else:
            a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
            rot = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
            parts = [rot.reshape(*x.shape[:-1], 2 * half)]
        if rest.shape[-1]:
            parts.append(rest)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def silu_mul(self, gate: Array, up: Array) -> Array:
        return gate * mx.sigmoid(gate) * up

    def gelu_mul(self, gate: Array, up: Array) -> Array:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
        return 0.5 * gate * (1.0 + mx.tanh(inner)) * up

    def new_paged_kv(self, n_blocks, n_layer, n_kv, head_dim, dtype="f16") -> PagedKV:
        """Blocks as MLX arrays (updated by scatter; MLX reuses the buffer, so a write
        costs only the written rows)."""
        dt = mx.float16 if kv_dtype_bytes(dtype) == 2 else mx.float32
        shape = (n_blocks, n_kv, BLOCK_TOKENS, head_dim)
        kv = PagedKV([mx.zeros(shape, dtype=dt) for _ in range(n_layer)],
                     [mx.zeros(shape, dtype=dt) for _ in range(n_layer)], n_blocks, n_kv, head_dim, dtype)
        mx.eval(kv.k, kv.v)
        return kv

    def write_kv(self, kv: PagedKV, layer, k, v, seqs, positions, tables=None) -> None:
        t = kv.slot_table if tables is None else tables
        blocks = t[seqs, positions // BLOCK_TOKENS][:, None]
        offs = (positions % BLOCK_TOKENS)[:, None]
        heads = mx.arange(k.shape[1])[None, :]
        dt = kv.k[layer].dtype
        kv.k[layer][blocks, heads, offs] = k.astype(dt)  # rounded once to the KV dtype
        kv.v[layer][blocks, heads, offs] = v.astype(dt)
        if not self._dirty or self._dirty[-1] is not kv:
            self._dirty.append(kv)

    def attend(self, kv: PagedKV, layer, q, k, v, seqs, positions, scale, window=0, tables=None):
        R, n_head, hd = q.shape
        n_kv = k.shape[1]
        rep = n_head // n_kv
        self.write_kv(kv, layer, k, v, seqs, positions, tables)
        t = kv.slot_table if tables is None else tables
        kc, vc = kv.k[layer], kv.v[layer]
        groups = self._groups(seqs, positions, t.shape[1] * BLOCK_TOKENS)
        outs = []
        for length, rows, rows_np, seqs_g, pos_g in groups:
            qg = q if rows is None else q[rows]
            tab = t[seqs_g][:, : length // BLOCK_TOKENS]  # (Rg, nb): the rows' blocks in order
            keys = _in_order(kc[tab])  # (Rg, n_kv, L, hd) float32
            vals = _in_order(vc[tab])
            qg = qg.reshape(-1, n_kv, rep, 1, hd)
            s = mx.matmul(qg, keys[:, :, None].swapaxes(-1, -2)) * scale  # (Rg, n_kv, rep, 1, L)
            mask = mx.arange(length)[None, :] <= pos_g[:, None]  # (Rg, L)
            if window:  # sliding window: keys max(0, pos - window + 1)..pos
                mask = mask & (mx.arange(length)[None, :] > pos_g[:, None] - window)
            s = mx.where(mask[:, None, None, None, :], s, -mx.inf)
            p = mx.softmax(s, axis=-1)
            o = mx.matmul(p, vals[:, :, None])  # (Rg, n_kv, rep, 1, hd)
            outs.append(o.reshape(-1, n_head, hd))
        if len(groups) == 1:
            return outs[0]
        order = np.concatenate([g[2] for g in groups])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return mx.concatenate(outs, axis=0)[mx.array(inverse.astype(np.int32))]

    def _groups(self, slots: Array, positions: Array, ctx: int):
        """Rows grouped by attention length (position + 1 rounded up to ATTN_BLOCK, at
        most ctx); cached per forward pass (same positions array for every layer)."""
        plan = self._plan
        if plan is not None and plan[0] is positions and plan[1] is slots and plan[2] == ctx:
            return plan[3]
        pos = np.array(positions, dtype=np.int64)
        lengths = np.minimum((pos // ATTN_BLOCK + 1) * ATTN_BLOCK, ctx)
        uniq = np.unique(lengths)
        groups = []
        if len(uniq) == 1:
            groups.append((int(uniq[0]), None, np.arange(len(pos)), slots, positions))
        else:
            for length in uniq:
                rows_np = np.nonzero(lengths == length)[0]
                rows = mx.array(rows_np.astype(np.int32))
                groups.append((int(length), rows, rows_np, slots[rows], positions[rows]))
        self._plan = (positions, slots, ctx, groups)  # holds the arrays: `is` stays valid
        return groups

    def self_check(self, weights: Sequence[GGUFTensor] = ()) -> str | None:
        return check_batch_invariance(self, self.check_plan, weights=weights)

    def copy_blocks(self, kv: PagedKV, src: list[int], dst: list[int]) -> None:
        """The source blocks are read out first, so each store's scatter has no read of the
        store pending and MLX can write into its buffer in place. A scatter whose rows were
        gathered from the store itself could make MLX copy the whole store, in every layer,
        at a copy-on-write of a shared prefix block: 0.26 s for a 655 MB pool in a
        microbenchmark (0.3 ms this way), 4-8 s a copy in a tiny model's engine at the
        default KV budget."""
        if not src:
            return
        s, d = self.asarray(np.asarray(src, np.int32)), self.asarray(np.asarray(dst, np.int32))
        rows = [(k[s], v[s]) for k, v in zip(kv.k, kv.v)]
        mx.eval(rows)
        for layer, (k, v) in enumerate(rows):
            kv.k[layer][d] = k
            kv.v[layer][d] = v
        mx.eval(kv.k, kv.v)

    def kv_export(self, kv: PagedKV, blocks: list[int], n_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        mx.eval(kv.k, kv.v)  # pending writes first
        return super().kv_export(kv, blocks, n_tokens)

    def kv_import(self, kv: PagedKV, blocks: list[int], arrays: list[tuple[np.ndarray, np.ndarray]]) -> None:
        super().kv_import(kv, blocks, arrays)
        mx.eval(kv.k, kv.v)


def _available(module: str) -> bool:
    try:
        return bool(getattr(mx, module).is_available())
    except Exception:
        return False


def _in_order(g: Array) -> Array:
    """Gathered blocks (Rg, nb, n_kv, B, hd) -> keys in position order (Rg, n_kv, nb*B, hd),
    converted exactly to float32."""
    Rg, nb, n_kv, B, hd = g.shape
    return g.transpose(0, 2, 1, 3, 4).reshape(Rg, n_kv, nb * B, hd).astype(mx.float32)


def _float_out(y: Array) -> Array:
    return y if y.dtype == mx.float32 else y.astype(mx.float32)

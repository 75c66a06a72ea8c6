"""The CuPy backend: NVIDIA GPUs through CUDA, with panechat's own row-invariant kernels.

Importing this module needs neither cupy nor a GPU; `CupyBackend()` raises
`BackendUnavailable` with a one-line reason when either is missing. See docs/cupy.md.

Weights live on the GPU:
  Q4_0, Q4_1        GGUF's blocks: the codes nibble-packed as stored + float16 d (and m)
                    (cupy_packed.py), dequantized in registers: w = (q-8)*d, Q4_1 w = q*d + m
                    -- exactly the floats gguf dequantizes (q*d is exact, + m rounds once).
  Q8_0              GGUF's blocks: int8 q as stored + float16 d, w = q*d, exact.
  F32               float32, exact.
  F16               float16, exact.
  BF16              as stored (uint16), widened exactly in registers.
  Q4_K, Q5_K        the 144- / 176-byte super-blocks exactly as stored (16-byte aligned).
  Q6_K              the super-blocks as stored, their f16 d split off (cupy_packed.py).
  Q5_0, Q5_1        GGUF's blocks as Q4_x, each block's fifth bits (uint32) split off too
                    (cupy_packed.py): w = (q-16)*d, Q5_1 w = q*d + m, gguf's floats.
  anything else     dequantized on the host, then float16
                    (float32 if a value exceeds float16's range, or when
                    PANECHAT_CUPY_WEIGHTS=f32 asks for exact float32 weights).
The embedding table stays on the host as stored; a step's rows are dequantized there and
copied over (`Backend.embed`). The KV cache is paged (`PagedKV`: float16 by default, each
value rounded once when written); the attention kernels read its blocks in place through
the block tables (float16 converted exactly); activations and all arithmetic are float32.

Kernel policy: no cuBLAS (its algorithm, and so a row's rounding, depends on the number
of rows). `linear`, `attend`, `rms_norm` and `silu_mul` run the kernels of `cupy_kernels`,
whose per-element arithmetic is fixed by the source, and so do rope and the KV write
(`rope_attend`: one `rope_kv_write` launch); what is left elementwise on CuPy arrays is
one IEEE operation per element, so nothing to reorder. Logits come back to the host for sampling.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from panechat.backends.errors import BackendUnavailable, one_line
from panechat.backends.array_backend import ArrayBackend
from panechat.backends.paged_kv import PagedKV
from panechat.backends.cuda.kernels import MAX_HEAD_DIM, WIDE_N, EmulatedModule, Kernels, build_module
from panechat.backends.cuda.kernels.sampling import sampling_table
from panechat.backends.cuda.mma import build_mma, emulated_mma, mma_requested, with_mma_checks
from panechat.backends.cuda.step_graphs import GraphCapture, ReplayByRerun, StepGraphs
from panechat.backends.cuda.packed import split_blocks, split_q5, split_q6k
from panechat.backends.cuda.widen import WIDENED, can_widen, random_blocks, widen
from panechat.backends.quant.gguf_blocks import UNPACKED, kept_quantized, unpack
from panechat.backends.quant import registry
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.self_check import AttentionCase, CheckPlan

F16_MAX = 65504.0
FUSED_NORM_MAX_ROWS = 16  # norm_linear_many fuses the norm into the products up to this many rows


@dataclass
class CupyWeight:
    """A prepared [n, k] weight. kind 'f32' / 'f16' / 'bf16' (uint16 bits): w is the matrix;
    'q8': w is int8 q, scales float32 [n, k/group], mins float32 [n, k/group] or None;
    'q4' (Q4_0/Q4_1 blocks, cupy_packed): w is uint8 qs [n, k/2] as stored, scales float16
    [n, k/32], mins float16 [n, k/32] (Q4_1) or None; 'q80' (Q8_0 blocks): w is int8 q
    [n, k] as stored, scales float16 [n, k/32]; 'q4k' (Q4_K): w is the uint8 super-blocks
    [n, k/256 * 144] exactly as stored; 'q5k' (Q5_K): the super-blocks [n, k/256 * 176] as
    stored; 'q6k' (Q6_K): w the first 208 bytes of each super-block [n, k/256 * 208] as
    stored, scales its float16 d [n, k/256]; 'q5' (Q5_0/Q5_1 blocks): as 'q4' plus qh, the
    blocks' fifth bits uint32 [n, k/32] as stored."""

    kind: str
    n: int
    k: int
    w: Any
    scales: Any = None
    mins: Any = None
    group: int = 32  # weights per scale (q8): 32, or 16 for Q6_K
    qh: Any = None  # 'q5': the blocks' fifth bits, uint32 [n, k/32]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.w, self.scales, self.mins, self.qh) if a is not None)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)


def prepare_weight(t: GGUFTensor, float_weights: str = "f16", widened: bool = False) -> CupyWeight:
    """The host-side form of the weight `t` for the kernels (numpy arrays; see module doc).
    `widened`: Q8_0/Q4_x/Q5_x/Q4_K/Q5_K/Q6_K as int8 codes + float32 scales (the q8 kernels; the same
    floats) instead of their block form."""
    n, k = t.shape
    kind = registry.get(t.qtype)
    if kind is not None and kind.cuda_form and kind.fits(k) and not widened:  # block form, as stored
        return _STORED_FORMS[kind.cuda_form](t, n, k)
    if kept_quantized(t):
        q, d, m = unpack(t.blocks, t.qtype, n, k)
        return CupyWeight("q8", n, k, q, d, m)
    if can_widen(t.qtype, t.shape):  # K-quants, Q5_x: int8 codes + float32 scale/min, exact
        q, d, m, g = widen(t.blocks, t.qtype, n, k)
        return CupyWeight("q8", n, k, q, d, m, g)
    if t.qtype == "F16" and float_weights != "f32":
        return CupyWeight("f16", n, k, np.ascontiguousarray(t.blocks, dtype=np.float16))  # as stored
    if t.qtype == "BF16" and len(t.shape) == 2:  # as stored, widened exactly in registers
        return CupyWeight("bf16", n, k, np.ascontiguousarray(t.blocks).view(np.uint16).reshape(n, k))
    w = t.dequantize()
    if t.qtype == "F32" or float_weights == "f32":
        return CupyWeight("f32", n, k, w)
    if not w.size or float(np.abs(w).max()) <= F16_MAX:
        return CupyWeight("f16", n, k, w.astype(np.float16))
    return CupyWeight("f32", n, k, w)


def _q4_blocks(t: GGUFTensor, n: int, k: int) -> CupyWeight:
    qs, d, m = split_blocks(t.blocks, t.qtype, n, k)
    return CupyWeight("q80" if t.qtype == "Q8_0" else "q4", n, k, qs, d, m)


def _q5_blocks(t: GGUFTensor, n: int, k: int) -> CupyWeight:  # the fifth bits split off too
    qs, d, m, qh = split_q5(t.blocks, t.qtype, n, k)
    return CupyWeight("q5", n, k, qs, d, m, qh=qh)


def _super_blocks(t: GGUFTensor, n: int, k: int) -> CupyWeight:  # the super-blocks as stored
    return CupyWeight(registry.get(t.qtype).cuda_form, n, k,
                      np.ascontiguousarray(t.blocks, dtype=np.uint8).reshape(n, registry.get(t.qtype).row_bytes(k)))


def _q6k_blocks(t: GGUFTensor, n: int, k: int) -> CupyWeight:  # as stored, the f16 d split off
    body, d = split_q6k(t.blocks, n, k)
    return CupyWeight("q6k", n, k, body, d)


# The block-form kernel families a registry entry's `cuda_form` names, and how each is laid out.
_STORED_FORMS = {"q80": _q4_blocks, "q4": _q4_blocks, "q5": _q5_blocks, "q4k": _super_blocks, "q5k": _super_blocks,
                 "q6k": _q6k_blocks}


def _import_cupy():
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken install raising on import
        raise BackendUnavailable(
            f"the CuPy backend needs cupy ({one_line(e, with_type=True)}); install it with: pip install 'panechat[cuda]'"
        ) from None
    return cupy


def _driver_version() -> str:
    """The NVIDIA kernel driver's version (e.g. 580.159.03) where Linux exposes it."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and word.count(".") >= 1:
                    return word
    except OSError:
        pass
    return "?"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


class CupyBackend(ArrayBackend):
    """CuPy arrays on the current CUDA device (CUDA_VISIBLE_DEVICES picks it)."""

    name = "cupy"
    samples_on_device = True
    mma = None  # MmaKernels when the tensor-core products are on (cupy_mma.py)
    # every linear kind and variant (row tiles 1..16, 1 and 4 columns per warp past WIDE_N,
    # the any-K kernel), a norm tail past the 256 threads, GQA with a head_dim below and
    # one at 128
    check_plan = CheckPlan(
        batches=(2, 3, 4, 5, 8, 9, 16, 17, 33, 64),
        linear=(("F32", 70, 96), ("F16", 70, 96), ("F16", 64, 200), ("F32", 37, 44), ("Q8_0", 70, 96),
                ("BF16", 70, 96), ("BF16", 33, 44),
                ("Q4_1", 70, 128), ("Q4_0", 33, 96), ("F16", WIDE_N + 8, 64), ("Q8_0", WIDE_N + 8, 32)),
        norm_widths=(300,),
        attention=(AttentionCase(4, 2, 80, 40, 6, (37,)), AttentionCase(3, 1, 300, 128, 2, (257,)),
                   AttentionCase(4, 2, 80, 40, 6, (5, 37), window=21)))

    def __init__(self, float_weights: str | None = None, mma: bool | None = None):
        cp = _import_cupy()
        try:
            n_dev = cp.cuda.runtime.getDeviceCount()
        except Exception as e:
            raise BackendUnavailable(
                f"the CuPy backend found no usable CUDA GPU ({one_line(e, with_type=True)}); check nvidia-smi and that "
                "the cupy wheel matches the driver (cupy-cuda12x for CUDA 12 drivers, cupy-cuda13x for 13)"
            ) from None
        if n_dev < 1:
            raise BackendUnavailable("the CuPy backend found no CUDA GPU (cupy sees 0 devices)")
        self.xp = cp
        self.float_weights = float_weights or os.environ.get("PANECHAT_CUPY_WEIGHTS", "f16")
        if self.float_weights not in ("f16", "f32"):
            raise ValueError("float_weights must be 'f16' or 'f32'")
        try:
            self.kernels = Kernels(build_module(cp), cp)
            self.kernels.compile_all()
        except Exception as e:
            raise BackendUnavailable(
                f"the CuPy backend cannot build its CUDA kernels ({one_line(e, with_type=True)}); cupy needs NVRTC from "
                "a CUDA toolkit or: pip install nvidia-cuda-nvrtc-cu12 (CUDA 12) / nvidia-cuda-nvrtc (13)"
            ) from None
        self._info = self._device_info(cp)
        self.mma = build_mma(cp) if mma_requested(mma) else None  # tensor-core products (cupy_mma.py)
        if self.mma is not None:
            self.check_plan = with_mma_checks(self.check_plan)
        graphs = os.environ.get("PANECHAT_CUDA_GRAPHS", "1") != "0"
        self.graphs = StepGraphs(cp, GraphCapture(cp)) if graphs else None

    @classmethod
    def emulated_on_cpu(cls, float_weights: str = "f16", mma: bool = False) -> "CupyBackend":
        """This backend's host code on numpy arrays with every kernel run by the numpy
        emulation of `cupy_kernels` (bit for bit what the GPU must compute). For tests and
        for checking the GPU; slow."""
        self = cls.__new__(cls)
        # the emulation is slow: fewer batch sizes (the wide weights fewer still)
        self.check_plan = replace(cls.check_plan, batches=(2, 3, 5, 8, 9, 17, 33), wide_batches=(2, 3, 5, 17))
        self.xp = np
        self.float_weights = float_weights
        self.kernels = Kernels(EmulatedModule(), np)
        self._info = "numpy emulation of the CUDA kernels on the CPU"
        self.mma = emulated_mma() if mma else None
        if mma:
            self.check_plan = with_mma_checks(self.check_plan)
        self.graphs = StepGraphs(np, ReplayByRerun())  # the padding and bucket logic, no CUDA graph
        return self

    @staticmethod
    def _device_info(cp: Any) -> str:
        dev = cp.cuda.Device()
        try:
            props = cp.cuda.runtime.getDeviceProperties(dev.id)
            name = props.get("name", b"?")
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = props.get("totalGlobalMem", 0) / 2**30
            sms = props.get("multiProcessorCount", "?")
        except Exception:
            name, mem, sms = "?", 0.0, "?"
        try:
            drv = _cuda_version(cp.cuda.runtime.driverGetVersion())
            rt = _cuda_version(cp.cuda.runtime.runtimeGetVersion())
        except Exception:
            drv = rt = "?"
        cc = dev.compute_capability
        return (f"{name} (sm_{cc}, {sms} SMs, {mem:.0f} GiB; driver {_driver_version()}, CUDA {drv}; "
                f"runtime {rt}; cupy {cp.__version__})")

    def describe(self) -> str:
        floats = "float32" if self.float_weights == "f32" else "float16"
        return (f"cupy on {self._info}; weights: Q8_0/Q4_x/Q5_x/Q4_K/Q5_K/Q6_K in their blocks (codes as stored), "
                f"F32 float32, "
                f"BF16 as stored, others {floats}; own fixed-order CUDA kernels for matmul, attention and norms "
                "(no cuBLAS), row-invariant" + ("; tensor-core matmuls for F16, BF16 and int8-code weights "
                                                "(PANECHAT_CUPY_MMA=1, same mode at every batch size)" if self.mma else ""))

    # -- weights ---------------------------------------------------------------------
    def linear_weight(self, t: GGUFTensor) -> CupyWeight:
        h = prepare_weight(t, self.float_weights)
        xp = self.xp
        return CupyWeight(h.kind, h.n, h.k, xp.asarray(h.w),
                          None if h.scales is None else xp.asarray(h.scales),
                          None if h.mins is None else xp.asarray(h.mins), h.group,
                          None if h.qh is None else xp.asarray(h.qh))

    def free_memory(self) -> int | None:
        if self.xp is np:  # the emulation on the CPU
            return super().free_memory()
        return int(self.xp.cuda.Device().mem_info[0])

    def nbytes(self, w: Any) -> int:
        return int(w.nbytes)

    # -- the forward pass's operations -------------------------------------------------
    def _f32(self, a: Any) -> Any:
        return self.xp.ascontiguousarray(a, dtype=self.xp.float32)

    def linear(self, x: Any, w: CupyWeight) -> Any:
        x = self._f32(x)
        out = self.xp.empty((x.shape[0], w.n), self.xp.float32)
        if self.mma is not None and self.mma.handles(w):  # by the weight, never by the batch
            return self.mma.linear(x, w, out)
        return self.kernels.linear(x, w, out)

    def norm_linear_many(self, x: Any, weight: Any, eps: float, ws: tuple, biases: tuple | None = None) -> tuple:
        """Each product with the RMS norm formed inside its own launch (the linear kernels'
        fused norm: the rms_norm kernel's arithmetic, bit for bit): no rms_norm launch, no
        normed copy of x. Past FUSED_NORM_MAX_ROWS rows (prefill, large batches) the norm
        runs once as its own launch instead -- every block of a fused product computes its
        rows' norms one after another, which only pays while a launch matters -- with the
        same bits either way."""
        x, weight = self._f32(x), self._f32(weight)
        xp = self.xp
        if x.shape[0] > FUSED_NORM_MAX_ROWS:
            return super().norm_linear_many(x, weight, eps, ws, biases)
        biases = biases or (None,) * len(ws)
        if self.mma is not None and any(self.mma.handles(w) for w in ws):  # tensor cores take the normed x
            xn = self.rms_norm(x, weight, eps)  # the fused norm's bits, so the others may still fuse it
            return tuple((self.linear(xn, w) if b is None else self.linear_add(xn, w, b)) if self.mma.handles(w)
                         else self.kernels.linear(x, w, xp.empty((x.shape[0], w.n), xp.float32),
                                                  None if b is None else self._f32(b), norm=(weight, eps))
                         for w, b in zip(ws, biases))
        return tuple(self.kernels.linear(x, w, xp.empty((x.shape[0], w.n), xp.float32),
                                         None if b is None else self._f32(b), norm=(weight, eps))
                     for w, b in zip(ws, biases))

    def linear_add(self, x: Any, w: CupyWeight, add: Any) -> Any:
        """The matmul with the residual or bias added by the same kernel (one launch)."""
        x = self._f32(x)
        out = self.xp.empty((x.shape[0], w.n), self.xp.float32)
        if self.mma is not None and self.mma.handles(w):
            return self.mma.linear(x, w, out, self._f32(add))
        return self.kernels.linear(x, w, out, self._f32(add))

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        x = self._f32(x)
        D = x.shape[-1]
        out = self.xp.empty_like(x)
        self.kernels.rms_norm(x.reshape(-1, D), self._f32(weight), eps, out.reshape(-1, D))
        return out

    def silu_mul(self, gate: Any, up: Any) -> Any:
        gate, up = self._f32(gate), self._f32(up)
        out = self.xp.empty_like(gate)
        return self.kernels.silu_mul(gate, up, out)

    def new_paged_kv(self, n_blocks, n_layer, n_kv, head_dim, dtype="f16") -> PagedKV:
        """The paged store with one spare block past `n_blocks` (`kv.spare_block`; the block
        pool never hands it out): the rows that pad a decode step up to its graph's bucket
        write and read there only (cupy_step_graphs). Allocated once, so a captured graph's
        pointers into it stay valid."""
        kv = super().new_paged_kv(n_blocks + 1, n_layer, n_kv, head_dim, dtype)
        kv.n_blocks = n_blocks
        kv.spare_block = n_blocks
        return kv

    def new_kv(self, n_slots, n_layer, n_kv, ctx, head_dim, dtype="f16") -> PagedKV:
        """Whole-context slots plus a spare slot past `n_slots` (`kv.spare_slot`), whose
        table row lists only the spare block: padded rows of a graph step use it."""
        kv = super().new_kv(n_slots, n_layer, n_kv, ctx, head_dim, dtype)
        spare = np.full((1, kv.slot_blocks), kv.spare_block, np.int32)
        kv.slot_table = self.asarray(np.concatenate([self.to_numpy(kv.slot_table), spare]))
        kv.spare_slot = n_slots
        return kv

    def run_decode_step(self, kv: Any, owner: Any, body: Any, x: Any, slots: np.ndarray,
                        positions: np.ndarray, tables: np.ndarray | None = None) -> Any:
        """The decode step through its bucket's CUDA graph (cupy_step_graphs); eagerly when
        graphs are off, failed to capture, or the batch is past the largest bucket."""
        if self.graphs is not None and getattr(kv, "spare_block", None) is not None:
            out = self.graphs.run(kv, owner, body, self._f32(x), slots, positions, tables)
            if out is not None:
                return out
        return body(kv, x, self.asarray(slots), self.asarray(positions),
                    None if tables is None else self.asarray(tables))

    def sample_rows(self, logits: Any, temperature: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                    top_k: np.ndarray, seeds: np.ndarray, steps: np.ndarray, before_pick: Any = None) -> np.ndarray:
        """Tokens picked by the sample_rows kernel (greedy, temperature, top-k, top-p, min-p,
        Philox keyed by seed and step), after `before_pick(logits, xp)` changed rows on the
        device; only [R, 2] int32 comes back to the host."""
        xp = self.xp
        logits = self._f32(logits)
        if before_pick is not None:  # on the device, in the same stream, before the kernel reads them
            before_pick(logits, xp)
        f, k, ss = sampling_table(temperature, top_p, min_p, top_k, seeds, steps)
        out = xp.empty((logits.shape[0], 2), xp.int32)
        self.kernels.sample_rows(logits, xp.empty_like(logits), xp.asarray(f), xp.asarray(k), xp.asarray(ss), out)
        return self.to_numpy(out)

    def rope(self, x: Any, positions: Any, style: str, tables: tuple[Any, Any]) -> Any:
        """One `rope` kernel launch (the same per-element arithmetic as ArrayBackend.rope)."""
        xp = self.xp
        x = self._f32(x)
        out = xp.empty_like(x)
        return self.kernels.rope(x, out, tables[0], tables[1], xp.ascontiguousarray(positions, dtype=xp.int32),
                                 style == "neox")

    def rope_attend(self, kv: PagedKV, layer: int, q: Any, k: Any, v: Any, seqs: Any, positions: Any,
                    scale: float, window: int, tables: Any, style: str, rope_tables: tuple[Any, Any]) -> Any:
        """RoPE + KV write in one `rope_kv_write` launch (q turned into a new array; k turned
        and v stored straight into their blocks, no CuPy scatter), then the two attention
        launches: the bits of `rope`, `rope`, `attend` (Backend.rope_attend), KV included."""
        xp = self.xp
        q, k, v = self._f32(q), self._f32(k), self._f32(v)
        if q.shape[-1] > MAX_HEAD_DIM:
            raise ValueError(f"the CuPy backend supports head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
        seqs = xp.ascontiguousarray(seqs, dtype=xp.int32)
        positions = xp.ascontiguousarray(positions, dtype=xp.int32)
        t = xp.ascontiguousarray(kv.slot_table if tables is None else tables, dtype=xp.int32)
        qr = self.kernels.rope_kv_write(q, k, v, xp.empty_like(q), kv.k[layer], kv.v[layer], rope_tables[0],
                                        rope_tables[1], t, seqs, positions, style == "neox")
        out = xp.empty_like(q)
        return self.kernels.attention(qr, kv.k[layer], kv.v[layer], t, seqs, positions, scale, out, window)

    def gelu_mul(self, gate: Any, up: Any) -> Any:
        gate, up = self._f32(gate), self._f32(up)
        out = self.xp.empty_like(gate)
        return self.kernels.gelu_mul(gate, up, out)

    def unsupported(self, args: Any) -> str | None:
        if args.ffn_act not in ("silu", "gelu_tanh"):
            return f"the {args.ffn_act} feed-forward not yet supported on {self.name}"
        return None

    def attend(self, kv: PagedKV, layer: int, q: Any, k: Any, v: Any,
               seqs: Any, positions: Any, scale: float, window: int = 0, tables: Any = None) -> Any:
        xp = self.xp
        q = self._f32(q)
        seqs = xp.ascontiguousarray(seqs, dtype=xp.int32)
        positions = xp.ascontiguousarray(positions, dtype=xp.int32)
        if q.shape[-1] > MAX_HEAD_DIM:
            raise ValueError(f"the CuPy backend supports head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
        self.write_kv(kv, layer, self._f32(k), self._f32(v), seqs, positions, tables)
        t = xp.ascontiguousarray(kv.slot_table if tables is None else tables, dtype=xp.int32)
        out = xp.empty_like(q)  # the kernels read the blocks in place through the tables
        return self.kernels.attention(q, kv.k[layer], kv.v[layer], t, seqs, positions, scale, out, window)


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in float32 units in the last place between a and b."""
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # monotone integer order
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.abs(ia - ib).max()) if ia.size else 0


def compare_kernels_with_emulation(backend: CupyBackend, seed: int = 7) -> list[str]:
    """Run every kernel (each linear variant: row tiles 1..16, 1 and 4 columns per warp,
    the any-K kernel, the q4 block-form kernels, the fused RMS norm; RMS norm; SiLU; GELU; rope; the KV write; attention, also with a sliding
    window; RoPE + KV write in one launch (rope_attend) with its attention; device sampling) on `backend` and on the
    numpy emulation with the same inputs; return one line per result that is not bit for
    bit identical (empty: the device computes exactly the documented contract)."""
    emu = CupyBackend.emulated_on_cpu(backend.float_weights)
    rng = np.random.default_rng(seed)
    problems: list[str] = []

    def same(name: str, got: Any, want: np.ndarray) -> None:
        got = backend.to_numpy(got)
        if got.shape != want.shape:
            problems.append(f"{name}: shape {got.shape} != {want.shape}")
        elif not np.array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32)):
            n = int((got.view(np.uint32) != want.view(np.uint32)).sum())
            problems.append(f"{name}: {n} of {got.size} values differ, up to {_ulps(got, want)} ulp")

    linear_cases = [(1, 40, 64), (2, 70, 96), (3, 33, 288), (4, 9000, 64), (8, 70, 4096),
                    (16, 40, 320), (17, 8200, 32), (33, 65, 192), (64, 24, 1536), (3, 50, 77)]
    # the types sharing the q8 / 16-bit kernels above: fewer cases (the emulation is slow),
    # still both column tiles, the any-K kernel (BF16) and the 16-weight groups (Q6_K)
    few = [(1, 40, 512), (5, 8200, 256), (17, 33, 256), (3, 50, 77)]
    for qtype in ("F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"):
        for M, N, K in (linear_cases if qtype in ("F32", "F16", "Q8_0", "Q4_1", "Q4_0") else few):
            if (qtype in UNPACKED or qtype in WIDENED) and K % 32 or qtype.endswith("_K") and K % 256:
                continue
            if qtype.endswith("_K"):
                t = GGUFTensor("w", (N, K), qtype, random_blocks(rng, qtype, N, K))
            else:
                t = GGUFTensor.from_array(rng.standard_normal((N, K), dtype=np.float32), qtype)
            x = rng.standard_normal((M, K), dtype=np.float32)
            pw, ew = backend.linear_weight(t), emu.linear_weight(t)
            same(f"linear {qtype} M={M} N={N} K={K}", backend.linear(backend.asarray(x), pw),
                 emu.linear(x, ew))
    for qtype, M, N, K in (("F16", 5, 70, 96), ("Q8_0", 17, 8200, 64), ("F32", 3, 50, 77), ("Q6_K", 2, 40, 256)):
        if qtype == "Q6_K":
            t = GGUFTensor("w", (N, K), qtype, random_blocks(rng, qtype, N, K))
        else:
            t = GGUFTensor.from_array(rng.standard_normal((N, K), dtype=np.float32), qtype)
        x = rng.standard_normal((M, K), dtype=np.float32)
        pw, ew = backend.linear_weight(t), emu.linear_weight(t)
        for what, add in (("residual", rng.standard_normal((M, N), dtype=np.float32)),
                          ("bias", rng.standard_normal(N, dtype=np.float32))):
            same(f"linear_add {what} {qtype} M={M} N={N} K={K}",
                 backend.linear_add(backend.asarray(x), pw, backend.asarray(add)), emu.linear_add(x, ew, add))
    for qtype, M, N, K in (("F16", 5, 70, 96), ("Q4_0", 1, 40, 1536), ("Q4_1", 16, 33, 256), ("Q8_0", 16, 8200, 64),
                           ("F32", 3, 50, 77)):  # the RMS norm inside the product == the separate ops
        t = GGUFTensor.from_array(rng.standard_normal((N, K), dtype=np.float32), qtype)
        x = rng.standard_normal((M, K), dtype=np.float32) * 3
        nw = rng.standard_normal(K, dtype=np.float32)
        pw, ew = backend.linear_weight(t), emu.linear_weight(t)
        same(f"norm + linear {qtype} M={M} N={N} K={K}",
             backend.norm_linear_many(backend.asarray(x), backend.asarray(nw), 1e-6, (pw,))[0],
             emu.linear(emu.rms_norm(x, nw, 1e-6), ew))
    for R, D in ((5, 300), (3, 4096), (1, 64)):
        x = rng.standard_normal((R, D), dtype=np.float32) * 3
        wt = rng.standard_normal(D, dtype=np.float32)
        same(f"rms_norm R={R} D={D}", backend.rms_norm(backend.asarray(x), backend.asarray(wt), 1e-6),
             emu.rms_norm(x, wt, 1e-6))
    g = np.concatenate([np.linspace(-120, 120, 4001, dtype=np.float32),
                        rng.standard_normal(6000, dtype=np.float32) * 4])
    u = rng.standard_normal(g.size, dtype=np.float32)
    same("silu_mul", backend.silu_mul(backend.asarray(g), backend.asarray(u)), emu.silu_mul(g, u))
    same("gelu_mul", backend.gelu_mul(backend.asarray(g), backend.asarray(u)), emu.gelu_mul(g, u))
    for style, (R, H, D, rd) in (("neox", (5, 3, 64, 64)), ("normal", (4, 2, 128, 128)), ("neox", (3, 2, 80, 32))):
        x = rng.standard_normal((R, H, D), dtype=np.float32) * 3
        pos = rng.integers(0, 100, R).astype(np.int32)
        tabs, etabs = backend.rope_tables(rd, 10000.0, 100), emu.rope_tables(rd, 10000.0, 100)
        same(f"rope {style} R={R} H={H} D={D} rope_dim={rd}",
             backend.rope(backend.asarray(x), backend.asarray(pos), style, tabs), emu.rope(x, pos, style, etabs))
    for S, G, C, D, H, R, W, dt in ((4, 2, 80, 40, 6, 7, 0, "f16"), (3, 1, 300, 128, 2, 5, 0, "f16"),
                                    (2, 2, 700, 64, 8, 9, 0, "f16"), (3, 2, 300, 64, 4, 6, 100, "f16"),
                                    (3, 2, 96, 40, 4, 5, 0, "f32")):
        kvs = [be.new_kv(S, 1, G, C, D, dt) for be in (backend, emu)]
        init_k = rng.standard_normal(kvs[1].k[0].shape, dtype=np.float32).astype(kvs[1].k[0].dtype)
        init_v = rng.standard_normal(kvs[1].v[0].shape, dtype=np.float32).astype(kvs[1].v[0].dtype)
        kvs[0].k[0][...] = backend.asarray(init_k)
        kvs[0].v[0][...] = backend.asarray(init_v)
        kvs[1].k[0][...] = init_k
        kvs[1].v[0][...] = init_v
        order = rng.permutation(kvs[1].n_blocks).astype(np.int32).reshape(S, -1)  # shuffled tables
        kvs[0].slot_table, kvs[1].slot_table = backend.asarray(order), order
        pairs = rng.choice(S * C, R, replace=False)  # distinct (slot, position) per row
        slots, poss = (pairs // C).astype(np.int32), (pairs % C).astype(np.int32)
        poss[0] = C - 1  # the longest key range
        q = rng.standard_normal((R, H, D), dtype=np.float32) * 2
        k = rng.standard_normal((R, G, D), dtype=np.float32)
        v = rng.standard_normal((R, G, D), dtype=np.float32)
        name = f"attention S={S} G={G} C={C} D={D} H={H} R={R} window={W} kv={dt}"
        got = backend.attend(kvs[0], 0, backend.asarray(q), backend.asarray(k), backend.asarray(v),
                             backend.asarray(slots), backend.asarray(poss), D ** -0.5, W)
        want = emu.attend(kvs[1], 0, q, k, v, slots, poss, D ** -0.5, W)
        same(name, got, want)
        same(name + " K cache", kvs[0].k[0].astype(np.float32), kvs[1].k[0].astype(np.float32))
        same(name + " V cache", kvs[0].v[0].astype(np.float32), kvs[1].v[0].astype(np.float32))
    # RoPE + KV write in one launch (rope_attend), then attention: the output and both stores
    for S, G, C, D, H, R, W, dt, style, rd in ((3, 2, 96, 64, 4, 5, 0, "f16", "neox", 64),
                                               (2, 1, 64, 128, 2, 3, 0, "f32", "normal", 64),
                                               (3, 2, 96, 40, 6, 7, 21, "f16", "neox", 32),
                                               (2, 2, 48, 64, 4, 4, 0, "f32", "neox", 48)):
        kvs = [be.new_kv(S, 1, G, C, D, dt) for be in (backend, emu)]
        for name in ("k", "v"):
            init = rng.standard_normal(getattr(kvs[1], name)[0].shape, dtype=np.float32)
            init = init.astype(getattr(kvs[1], name)[0].dtype)
            getattr(kvs[0], name)[0][...] = backend.asarray(init)
            getattr(kvs[1], name)[0][...] = init
        order = rng.permutation(kvs[1].n_blocks).astype(np.int32).reshape(S, -1)  # shuffled tables
        kvs[0].slot_table, kvs[1].slot_table = backend.asarray(order), order
        pairs = rng.choice(S * C, R, replace=False)
        slots, poss = (pairs // C).astype(np.int32), (pairs % C).astype(np.int32)
        poss[0] = C - 1
        q = rng.standard_normal((R, H, D), dtype=np.float32) * 2
        k = rng.standard_normal((R, G, D), dtype=np.float32) * 3
        v = rng.standard_normal((R, G, D), dtype=np.float32)
        tabs, etabs = backend.rope_tables(rd, 10000.0, C), emu.rope_tables(rd, 10000.0, C)
        name = f"rope_attend {style} rope_dim={rd} S={S} G={G} C={C} D={D} H={H} R={R} window={W} kv={dt}"
        got = backend.rope_attend(kvs[0], 0, backend.asarray(q), backend.asarray(k), backend.asarray(v),
                                  backend.asarray(slots), backend.asarray(poss), D ** -0.5, W, None, style, tabs)
        want = emu.rope_attend(kvs[1], 0, q, k, v, slots, poss, D ** -0.5, W, None, style, etabs)
        same(name, got, want)
        same(name + " K cache", kvs[0].k[0].astype(np.float32), kvs[1].k[0].astype(np.float32))
        same(name + " V cache", kvs[0].v[0].astype(np.float32), kvs[1].v[0].astype(np.float32))
    R, V = 6, 3000
    logits = rng.standard_normal((R, V), dtype=np.float32) * 3
    logits[1, [5, 900]] = 20.0  # a tie
    logits[2, 7] = np.nan
    f, k, ss = sampling_table([0.0, 0.0, 0.9, 0.7, 1.3, 0.5], [1.0, 1.0, 1.0, 0.9, 0.95, 1.0],
                              [0.0, 0.0, 0.0, 0.0, 0.05, 0.0], [0, 0, 0, 50, 0, 1], [1, 2, 3, 4, 2**40 + 5, 6],
                              [0, 1, 2, 3, 4, 5])
    got = backend.to_numpy(backend.kernels.sample_rows(
        backend.asarray(logits), backend.xp.empty((R, V), backend.xp.float32), backend.asarray(f),
        backend.asarray(k), backend.asarray(ss), backend.xp.empty((R, 2), backend.xp.int32)))
    want = emu.kernels.sample_rows(logits, np.empty((R, V), np.float32), f, k, ss, np.empty((R, 2), np.int32))
    if not np.array_equal(got, want):
        problems.append(f"sample_rows: {got.tolist()} != {want.tolist()}")
    return problems

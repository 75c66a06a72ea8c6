"""The numpy (CPU) backend.

Kernel policy: OpenBLAS sgemm is fast but its rows are not batch-invariant (an output
row changes in the last bits with the number of rows and the row's position), so
`linear` and `attend` run numba kernels from `numpy_kernels` whose per-element
arithmetic is fixed by the source. Quantized weights (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) stay in their ggml blocks and F16/BF16
weights in 16 bits (`quant_kernels`, `block_linear`): a Q4_1 weight costs 5 bits a step,
as in the file, and no quantized matrix ever gets a float32 copy. Most are read from the
file's memory map; Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K are regrouped at load into
records of 16 columns (the same bytes in memory of their own, `repack`). Each product is bit-identical
to the float32 kernel on gguf's dequantized weights, except the K-quants Q4_K, Q5_K and
Q6_K, whose products round the activations to 8 bits as llama.cpp does (`q8k_dot`'s
contract, by `packed256` over their records), and Q4_0, Q4_1 and Q8_0, which round them to int16
(`packed32`). Elementwise ops and per-row reductions use numpy (`ArrayBackend`).

The kernels run on as many threads as other processes leave cores idle
(`cpu_threads.ThreadGovernor`); setting NUMBA_NUM_THREADS fixes the count instead.

`StackedGemvBackend` is the slower reference policy (OpenBLAS gemv per row), for
comparison in benchmarks; `PANECHAT_NUMPY_KERNELS=gemv` selects it (`cpu_backend`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import numpy as np

from panechat.backends.array_backend import ArrayBackend
from panechat.backends.cpu.threads import ThreadGovernor
from panechat.backends.quant import registry
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.paged_kv import BLOCK_TOKENS, PagedKV, kv_dtype_bytes


@dataclass
class KQuantWeight:
    """A weight [N, K] of a type whose scales the kernels take at load (registry
    `scales_at_load`: Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_XS) as stored: `blocks` uint8 [N, K/256 * bytes]
    (a view of the memory map), with each super-block's f16 d and dmin as float32 [N, K/256]
    (Q3_K, Q6_K and IQ4_XS: no dmin, `dmin` is `d`)."""

    qtype: str
    blocks: np.ndarray
    d: np.ndarray
    dmin: np.ndarray
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.d.nbytes + (self.dmin.nbytes if self.dmin is not self.d else 0)


@dataclass
class _HeldWeight:
    """A weight [N, K] of type `qtype` whose kernels read the bytes `data`."""

    qtype: str
    data: np.ndarray
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class StoredWeight(_HeldWeight):
    """An F16/BF16 weight or one of blocks whose kernels read the scales in the blocks (Q5_0,
    Q5_1, IQ4_NL; Q4_0, Q4_1, Q8_0 where not repacked) as stored, a view of the memory map:
    `data` uint16 [N, K] (16-bit floats as integers) or uint8 [N, K/32 * bytes] (blocks,
    f16 scales included)."""


@dataclass
class PackedWeight(_HeldWeight):
    """A weight of a type whose products run over repacked blocks (registry `cpu_packed`:
    Q4_0, Q4_1, Q8_0, Q4_K): `data` uint8 [N', row bytes] (N' = N rounded up to 16), the
    file's blocks regrouped into records of 16 columns at load (`repack.pack`: the same bytes
    in another order, in memory of its own; the file's pages are let go)."""


_HALF = ("F16", "BF16")  # quant_kernels.linear_half; the block types are the registry's
_LANES = 16  # numpy_kernels.LANES: a 16-bit weight row must be whole vectors


class NumpyBackend(ArrayBackend):
    """CPU arrays with numpy; batch-invariant matmul and attention kernels (numba)."""

    name = "numpy"

    def __init__(self):
        from panechat.backends.cpu import (activation_kernels, decode_attention, norm_kernels,  # numba; else `cpu_backend()`
                                           numpy_kernels, quant_kernels, repack, step_threads)
        from panechat.backends.cpu import decoder as cpu_decoder
        from panechat.backends.cpu.freed_memory import keep_freed_memory

        keep_freed_memory()  # a step's arrays reuse the last step's pages (no page faults in the kernels)

        self.kernels = numpy_kernels
        self.decode_attention = decode_attention
        self.norm_kernels = norm_kernels
        self.quant_kernels = quant_kernels
        self.repack = repack
        self.activation_kernels = activation_kernels
        self.cpu_decoder = cpu_decoder
        self.crew = step_threads.StepCrew()
        self._sync = step_threads.new_sync()
        import numba

        self._threads = numba.get_num_threads
        self._background = False  # inside `background()`: one thread, whatever the governor says
        self._arena = None  # inside `loading_weights()`: where repacked weights go
        self.governor: ThreadGovernor | None = None
        if not os.environ.get("NUMBA_NUM_THREADS"):
            self.governor = ThreadGovernor(numba.get_num_threads(), numba.set_num_threads)
            self.governor.prime()  # the first step knows the load (start-up: the model loads meanwhile)

    @contextlib.contextmanager
    def loading_weights(self):
        """Repacked weights go to one `WeightArena` while inside: 2 MiB pages, freed with
        the model that holds them."""
        from panechat.backends.cpu.weight_memory import WeightArena

        was, self._arena = self._arena, WeightArena()
        try:
            yield
        finally:
            self._arena = was

    def describe(self) -> str:
        if self.governor is not None:
            threads = f"up to {self.governor.max_threads} threads, fewer while other processes hold cores"
        else:
            threads = f"{os.environ['NUMBA_NUM_THREADS']} threads (NUMBA_NUM_THREADS)"
        from panechat.backends.cpu.generated import uses_amx

        stored = "/".join(t.name for t in registry.block_types())
        amx = "/".join(t.name for t in registry.block_types() if uses_amx(t))
        return (f"numpy on CPU ({threads}), numba row-invariant kernels, "
                f"{stored} read as stored, F16/BF16 in 16 bits" + (f", {amx} on AMX tiles for many rows" if amx else ""))

    def begin_step(self) -> None:
        if self.governor is not None and not self._background:
            self.governor.tick()

    @contextlib.contextmanager
    def background(self):
        """One numba thread: no crew and no OpenMP team beside the serving engines' spinning
        ones (2 x 2 spinning threads on 2 cores stalled a serving stream for 0.2 s). Not a
        lower priority too: on a machine busy with other processes a nice-19 thread got so
        little CPU that a 6 s load took 55 s."""
        import numba

        was, self._background = self._background, True
        numba.set_num_threads(1)
        try:
            yield
        finally:
            self._background = was
            numba.set_num_threads(self.governor.threads if self.governor is not None else numba.config.NUMBA_NUM_THREADS)

    def linear_weight(self, t: GGUFTensor) -> np.ndarray | KQuantWeight | StoredWeight | PackedWeight:
        kind = registry.get(t.qtype)
        if kind is not None and kind.cpu_loader and len(t.shape) == 2 and kind.fits(t.shape[1]):
            blocks = np.ascontiguousarray(t.blocks, dtype=np.uint8)  # the mapped bytes, no copy
            if kind.cpu_packed:
                packed = self.repack.pack(blocks, t.qtype, self._arena)
                _let_go_of_mapped(blocks)
                return PackedWeight(t.qtype, packed, t.shape)
            if kind.scales_at_load:
                return KQuantWeight(t.qtype, blocks, *self.quant_kernels.superblock_scales(blocks, t.qtype),
                                    t.shape)
            return StoredWeight(t.qtype, blocks, t.shape)
        if t.qtype in _HALF and len(t.shape) == 2 and t.shape[1] % _LANES == 0:
            bits = np.ascontiguousarray(t.blocks).view(np.uint16).reshape(t.shape)  # no copy
            return StoredWeight(t.qtype, bits, t.shape)
        return t.dequantize()

    def linear(self, x: np.ndarray, w: np.ndarray | KQuantWeight | StoredWeight | PackedWeight) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
        if isinstance(w, PackedWeight):
            self.quant_kernels.linear_packed(x, w.data, w.qtype, out)
        elif isinstance(w, KQuantWeight):
            self.quant_kernels.linear_kquant(x, w.blocks, w.qtype, w.d, w.dmin, out)
        elif isinstance(w, StoredWeight) and w.qtype not in _HALF:
            self.quant_kernels.linear_block32(x, w.data, w.qtype, out)
        elif isinstance(w, StoredWeight):
            self.quant_kernels.linear_half(x, w.data, w.qtype, out)
        else:
            self.kernels.linear(x, w, out)
        return out

    def linear_many(self, x: np.ndarray, ws: tuple) -> tuple:
        """Weights of one block type and K (q, k, v; gate, up) in one parallel region:
        fewer fork-joins a step, each product the same bits as `linear`'s."""
        first = ws[0]
        same = 1 < len(ws) <= 3 and isinstance(first, (KQuantWeight, StoredWeight, PackedWeight)) and all(
            type(w) is type(first) and w.qtype == first.qtype and w.shape[1] == first.shape[1] for w in ws)
        x = np.ascontiguousarray(x)
        if same and isinstance(first, PackedWeight):
            return tuple(self.quant_kernels.linear_packed_many(x, [w.data for w in ws], first.qtype,
                                                                [w.shape[0] for w in ws]))
        if same and isinstance(first, KQuantWeight):
            return tuple(self.quant_kernels.linear_kquant_many(x, [(w.blocks, w.d, w.dmin) for w in ws],
                                                                first.qtype))
        if same and isinstance(first, StoredWeight) and first.qtype not in _HALF:
            return tuple(self.quant_kernels.linear_block32_many(x, [w.data for w in ws], first.qtype))
        return super().linear_many(x, ws)

    def silu_mul(self, gate, up):
        """silu(gate) * up in numba (`activation_kernels`: the one-call step's bits)."""
        return self.activation_kernels.gated(gate, up, False)

    def gelu_mul(self, gate, up):
        return self.activation_kernels.gated(gate, up, True)

    def new_paged_kv(self, n_blocks, n_layer, n_kv, head_dim, dtype="f16") -> PagedKV:
        """Each layer's K and V a view of one array per store (`PagedKV.stacked`), which the
        one-call decode step takes whole."""
        dt = np.float16 if kv_dtype_bytes(dtype) == 2 else np.float32
        shape = (n_layer, n_blocks, n_kv, BLOCK_TOKENS, head_dim)
        k_all, v_all = _lazy_zeros(shape, dt), _lazy_zeros(shape, dt)
        kv = PagedKV(list(k_all), list(v_all), n_blocks, n_kv, head_dim, dtype)
        kv.stacked = (k_all, v_all)
        return kv

    @staticmethod
    def _stored(w):
        """(qtype, blocks, d, dmin) of a weight kept in GGUF blocks, else None. A type with
        `cpu_packed` is the step's only in its repacked form (its N rows: the padding of the
        last group lies past them in the same buffer, where the kernels read it)."""
        if isinstance(w, PackedWeight):
            return w.qtype, w.data[:w.shape[0]], None, None
        if isinstance(w, KQuantWeight):
            return w.qtype, w.blocks, w.d, w.dmin
        if isinstance(w, StoredWeight) and w.qtype not in _HALF and not registry.get(w.qtype).cpu_packed:
            return w.qtype, w.data, None, None
        return None

    def prepare_decoder(self, spec, layers, output_norm, output, rope):
        """The one-call decode step's plan (`cpu_decoder.build_plan`: None where `spec` has a
        feature the step does not implement), unless PANECHAT_CPU_STEP=ops."""
        if os.environ.get("PANECHAT_CPU_STEP", "one-call") == "ops":
            return None
        return self.cpu_decoder.build_plan(spec, layers, output_norm, output, rope, self._stored)

    def run_decoder(self, plan, kv, x, slots, positions, tables):
        """The decode step on the crew (`cpu_decoder.decode_step`); None, having written
        nothing, when a sequence's rows are not at its consecutive positions or are more
        than `cpu_decoder.MAX_RUN`, the store is not stacked or does not
        match the plan's shape, or the KV is float16 and the CPU lacks F16C."""
        spec = plan.spec
        if (kv.stacked is None or (kv.stacked[0].dtype == np.float16 and not self.decode_attention.HAS_F16C)
                or kv.n_kv != spec.n_kv or kv.head_dim != spec.head_dim or len(kv.k) != spec.n_layer
                or x.shape[-1] != spec.n_embd):
            return None
        c = np.ascontiguousarray
        t = c(kv.slot_table if tables is None else tables, np.int32)
        seqs, pos = c(slots, np.int32), c(positions, np.int32)
        status = self.cpu_decoder.check_rows(t, seqs, pos, kv.n_blocks, BLOCK_TOKENS, plan.max_pos,
                                             self.cpu_decoder.MAX_RUN)
        if status == 1:
            return None
        if status:
            raise ValueError("decode step: a row's sequence or position, or a block table entry, is out of range")
        k_all, v_all = kv.stacked
        if k_all.dtype == np.float16:
            k_all, v_all = k_all.view(np.uint16), v_all.view(np.uint16)
        x = np.array(x, np.float32, order="C", copy=True)
        R, D = x.shape
        n = self._threads()  # the governor's count for this step
        H, G, hd, F = spec.n_head, spec.n_kv, spec.head_dim, plan.n_ff

        def e(*shape):
            return np.empty(shape, np.float32)

        logits = e(R, plan.vocab)
        bufs = (e(n, R, D), e(R, H * hd), e(R, G * hd), e(R, G * hd), e(R, H, hd), e(R, H * hd), e(R, D),
                e(R, F), e(R, F), e(R, F), e(n, hd), logits)
        self._sync[:] = 0
        self.crew.run(self.cpu_decoder.decode_step,
                      (x, plan.weights, (k_all, v_all, t, seqs, pos), plan.form, bufs, self._sync), n)
        return logits

    def rms_norm(self, x, weight, eps):
        """One numba call with the numpy expression's bits (`norm_kernels`)."""
        if (x.dtype == np.float32 and x.flags.c_contiguous and weight.dtype == np.float32
                and weight.shape == x.shape[-1:]):
            return self.norm_kernels.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    @staticmethod
    def _rope_kernel_fits(x, style, tables) -> bool:
        cos, sin = tables
        return (x.dtype == np.float32 and x.ndim == 3 and x.flags.c_contiguous and cos.dtype == np.float32
                and sin.dtype == np.float32 and cos.flags.c_contiguous and sin.flags.c_contiguous
                and 2 * cos.shape[1] <= x.shape[2] and style in ("neox", "normal"))

    def rope(self, x, positions, style, tables):
        if self._rope_kernel_fits(x, style, tables):
            cos, sin = tables
            return self.kernels.rope(x, np.asarray(positions, dtype=np.int64), style == "neox", cos, sin)
        return super().rope(x, positions, style, tables)

    def rope_attend(self, kv: PagedKV, layer, q, k, v, seqs, positions, scale, window, tables, style, rope_tables):
        """At decode, RoPE inside the one-call attention (`decode_attention`, the same bits
        as `rope` then `attend`); otherwise the two `rope` calls, then `attend`."""
        if self._rope_kernel_fits(q, style, rope_tables) and self._rope_kernel_fits(k, style, rope_tables) \
                and v.dtype == np.float32 and v.flags.c_contiguous:
            out = self._decode(kv, layer, q, k, v, seqs, positions, scale, window, tables,
                               (*rope_tables, style == "neox"))
            if out is not None:
                return out
        return super().rope_attend(kv, layer, q, k, v, seqs, positions, scale, window, tables, style, rope_tables)

    def _decode(self, kv: PagedKV, layer, q, k, v, seqs, positions, scale, window, tables, rope=None):
        """`decode_attention.paged_decode`'s output (the K/V written, RoPE applied first when
        `rope` is given), or None, having written nothing, when a sequence has several rows."""
        c = np.ascontiguousarray
        out = np.empty_like(q)
        t = c(kv.slot_table if tables is None else tables, np.int32)
        done = self.decode_attention.paged_decode(q, k, v, kv.k[layer], kv.v[layer], t, c(seqs, np.int32),
                                                  c(positions, np.int32), scale, out, window, rope)
        return out if done else None

    def attend(self, kv: PagedKV, layer, q, k, v, seqs, positions, scale, window=0, tables=None):
        """At decode (every row its own sequence) one numba call writes K and V and attends
        (`decode_attention`); a call with a prefill chunk writes with numpy and gathers each
        such sequence once (`paged_attention`). The same bits either way."""
        c = np.ascontiguousarray
        q, k, v = c(q, np.float32), c(k, np.float32), c(v, np.float32)
        out = self._decode(kv, layer, q, k, v, seqs, positions, scale, window, tables)
        if out is not None:
            return out
        out = np.empty_like(q)
        t = c(kv.slot_table if tables is None else tables, np.int32)
        seqs, positions = c(seqs, np.int32), c(positions, np.int32)
        self.write_kv(kv, layer, k, v, seqs, positions, tables)
        self.kernels.paged_attention(q, kv.k[layer], kv.v[layer], t, seqs, positions, np.float32(scale), out, window)
        return out


def _let_go_of_mapped(view: np.ndarray) -> None:
    """Drop from this process the pages of a file's memory map that `view` lies in (whole
    pages only), once its bytes live elsewhere: they stay in the page cache and come back
    on the next read (a tied embedding's rows). A view of anything but a file map is left
    alone (MADV_DONTNEED would zero anonymous memory)."""
    base, owner = view, None
    while isinstance(base, np.ndarray):
        owner, base = base, base.base
    if not isinstance(base, mmap.mmap) or owner is None or view.nbytes == 0:
        return
    start = view.ctypes.data - owner.ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        with contextlib.suppress(OSError, ValueError):
            base.madvise(mmap.MADV_DONTNEED, first, last - first)


def _lazy_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros whose pages become resident only when written: an anonymous memory map.
    (np.zeros would do the same but asks for transparent huge pages on large arrays, and
    the KV store is written a 2 KB block at a time: 2 MB resident per block touched.)"""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype, count=int(np.prod(shape))).reshape(shape)


class StackedGemvBackend(ArrayBackend):
    """The slow reference policy, for comparison in benchmarks and tests: one OpenBLAS
    gemv per row and attention one row at a time (invariant, since no call sees two rows);
    every weight float32."""

    name = "numpy"

    def describe(self) -> str:
        return "numpy on CPU, stacked GEMV (OpenBLAS gemv per row)"

    def linear_weight(self, t: GGUFTensor) -> np.ndarray:
        return t.dequantize()

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        # A stacked GEMV: one BLAS gemv per row, identical to the row computed alone.
        return np.matmul(w, np.ascontiguousarray(x)[:, :, None])[:, :, 0]

    def attend(self, kv: PagedKV, layer, q, k, v, seqs, positions, scale, window=0, tables=None):
        self.write_kv(kv, layer, k, v, seqs, positions, tables)
        kc, vc = self.contiguous_kv(kv, layer, tables)
        out = np.empty_like(q)
        n_rep = q.shape[1] // kc.shape[1]
        for r in range(q.shape[0]):
            first = max(0, positions[r] - window + 1) if window else 0
            keys = np.repeat(kc[seqs[r], :, first: positions[r] + 1], n_rep, axis=0)  # (H, L, hd)
            vals = np.repeat(vc[seqs[r], :, first: positions[r] + 1], n_rep, axis=0)
            s = np.matmul(keys, q[r][:, :, None])[:, :, 0] * np.float32(scale)  # (H, L)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[r] = np.matmul(vals.transpose(0, 2, 1), p[:, :, None])[:, :, 0]
        return out


def cpu_backend(kernels: str | None = None) -> NumpyBackend | StackedGemvBackend:
    """The CPU backend `kernels` (else PANECHAT_NUMPY_KERNELS) names: "numba" (default) or
    "gemv"; the stacked GEMV also when numba cannot be imported."""
    if (kernels or os.environ.get("PANECHAT_NUMPY_KERNELS", "numba")) != "gemv":
        try:
            return NumpyBackend()
        except ImportError:
            pass
    return StackedGemvBackend()

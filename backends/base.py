"""The small interface every array backend implements (numpy, MLX, CuPy).

The model code in `panechat.engine.model.forward` is written once against these operations.
Every operation must be *row-invariant*: the result for one row (a token of one
sequence) may depend only on that row's inputs, never on how many other rows share
the call or where the row sits. `self_check()` verifies that on the running device.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from panechat.backends.layer_spec import DecoderSpec
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.paged_kv import BLOCK_TOKENS, PagedKV

Array = Any  # the backend's array type


class Backend(ABC):
    """Array operations for one device. Arrays stay on the device between calls."""

    name: str = "abstract"

    @abstractmethod
    def describe(self) -> str:
        """One line naming backend, device and kernel policy (for the start-up line)."""

    # -- moving data -----------------------------------------------------------------
    @abstractmethod
    def asarray(self, a: np.ndarray) -> Array:
        """Copy a host array to the device (dtype kept)."""

    @abstractmethod
    def to_numpy(self, a: Array) -> np.ndarray:
        """Copy a device array to the host."""

    @abstractmethod
    def linear_weight(self, t: GGUFTensor) -> Any:
        """Prepare the [N, K] weight `t`, as the file stores it, for `linear` (layout, dtype,
        device): a type the backend keeps quantized from `t.blocks` (no float32 copy), any
        other from `t.dequantize()`."""

    def loading_weights(self) -> contextlib.AbstractContextManager:
        """Inside, `linear_weight` prepares one model's weights (the CPU backend: copies
        it makes go to memory of that model's own, on 2 MiB pages). Nothing elsewhere."""
        return contextlib.nullcontext()

    def free_memory(self) -> int | None:
        """Bytes the KV store could still take on this device (the default KV budget is a
        share of it): the host's available RAM (None where unknown)."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None

    def nbytes(self, w: Any) -> int:
        """Resident bytes of a prepared weight."""
        return int(getattr(w, "nbytes", 0))

    def begin_step(self) -> None:
        """Called once at the start of every forward pass, on the thread that runs it
        (the CPU backend adapts its thread count here)."""

    def background(self) -> contextlib.AbstractContextManager:
        """Inside, the calling thread's work on this backend gives way to other work in the
        process (the CPU backend: one thread):
        what a model loading beside serving ones runs its start-up check in. Nothing
        elsewhere."""
        return contextlib.nullcontext()

    samples_on_device = False  # True: `sample_rows` picks tokens where the logits are

    def sample_rows(self, logits: Array, temperature: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                    top_k: np.ndarray, seeds: np.ndarray, steps: np.ndarray, before_pick: Any = None) -> np.ndarray:
        """Pick one token per row of logits [R, V] on the device (temperature 0: greedy),
        each row from its own logits, seed and step alone -> host int32 [R, 2] (token, bad:
        the logits were not finite). `before_pick(logits, xp)`, when given, is called first
        with the float32 logits on the device and their array module, to change rows in
        place (the engine's logits processors). Only backends with `samples_on_device`."""
        raise NotImplementedError(f"{self.name} samples on the host")

    # -- the forward pass's operations -------------------------------------------------
    def run_decode_step(self, kv: Any, owner: Any, body: Any, x: Array, slots: np.ndarray,
                        positions: np.ndarray, tables: np.ndarray | None = None) -> Array:
        """Run `body(kv, x, slots, positions, tables)` (the layers and head of a decode step,
        every row's logits wanted; slots and positions host int32 [R], `tables` the
        sequences' host int32 block tables [S, max_blocks] or None for a slotted store) ->
        logits on the device. A backend may replay a captured graph of `body` instead
        (CuPy; `owner` keys it, with `kv`); the result must be the same bit for bit."""
        return body(kv, x, self.asarray(slots), self.asarray(positions),
                    None if tables is None else self.asarray(tables))

    def prepare_decoder(self, spec: DecoderSpec, layers: list[dict], output_norm: Array, output: Any,
                        rope: list) -> Any:
        """A plan for `run_decoder`: the whole decode step of the model `spec` describes in
        one call (the layers' prepared weights and vectors as dicts keyed by GGUF names, as
        `Model` holds them; `rope` each layer's (cos, sin)), or None (the default, and
        wherever `spec` has a feature the step does not implement): the model runs op by op."""
        return None

    def run_decoder(self, plan: Any, kv: Any, x: Array, slots: np.ndarray, positions: np.ndarray,
                    tables: np.ndarray | None) -> Array | None:
        """`run_decode_step`'s logits for a plan from `prepare_decoder`, bit for bit the
        op-by-op layers and head; None, having changed nothing, where the plan cannot
        run these rows (the caller then runs op by op)."""
        return None

    def embed(self, table: GGUFTensor, ids: np.ndarray) -> Array:
        """Rows of the embedding `table` [V, D] (as stored) for host token ids [R] -> float32
        [R, D] on the device; only those rows are dequantized."""
        return self.asarray(table.dequantize_rows(ids))

    @abstractmethod
    def linear(self, x: Array, w: Any) -> Array:
        """x [R, K] @ w.T -> [R, N], each output row independent of the others."""

    def linear_many(self, x: Array, ws: tuple) -> tuple:
        """``tuple(self.linear(x, w) for w in ws)``: products sharing their input (q, k, v;
        gate, up). A backend may compute them in one call (fewer kernel launches a step);
        each result must equal `linear`'s bit for bit."""
        return tuple(self.linear(x, w) for w in ws)

    def norm_linear_many(self, x: Array, weight: Array, eps: float, ws: tuple, biases: tuple | None = None) -> tuple:
        """``linear_many(rms_norm(x, weight, eps), ws)`` -- with `biases` (one per weight, or
        None) ``linear_add(h, w, b)`` where b is not None: the products whose input is a
        norm (q, k, v; gate, up; the head). A backend may form the norm inside the products'
        launches; each result must equal the separate ops' bit for bit."""
        h = self.rms_norm(x, weight, eps)
        if biases is None or all(b is None for b in biases):
            return self.linear_many(h, ws)
        return tuple(self.linear(h, w) if b is None else self.linear_add(h, w, b) for w, b in zip(ws, biases))

    def linear_add(self, x: Array, w: Any, add: Array) -> Array:
        """linear(x, w) + add, with add [R, N] (a residual) or [N] (a bias): bit for bit
        `linear(x, w) + add` (the add rounds once); a backend may fuse it into the matmul."""
        return self.linear(x, w) + add

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """x / sqrt(mean(x^2) + eps) * weight, per row."""

    @abstractmethod
    def rope(self, x: Array, positions: Array, style: str, tables: tuple[Array, Array]) -> Array:
        """Rotary embedding of x [R, H, hd] at `positions` [R]; style 'normal' or 'neox';
        `tables` = (cos, sin) [max_pos, rope_dim/2] from `rope_tables`."""

    @abstractmethod
    def silu_mul(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up, elementwise."""

    def gelu_mul(self, gate: Array, up: Array) -> Array:
        """gelu(gate) * up, elementwise, GELU in its tanh approximation (gemma's FFN)."""
        raise NotImplementedError(f"the GELU feed-forward (gemma) is not yet supported on {self.name}")

    def new_kv(self, n_slots: int, n_layer: int, n_kv: int, ctx: int, head_dim: int,
               dtype: str = "f16") -> PagedKV:
        """A paged store cut into `n_slots` whole-context slots (slot s owns a fixed run of
        blocks, `kv.slot_table`): what a caller without its own block tables uses."""
        per = -(-ctx // BLOCK_TOKENS)
        kv = self.new_paged_kv(n_slots * per, n_layer, n_kv, head_dim, dtype)
        kv.slot_blocks = per
        kv.slot_table = self.asarray(np.arange(n_slots * per, dtype=np.int32).reshape(n_slots, per))
        return kv

    @abstractmethod
    def new_paged_kv(self, n_blocks: int, n_layer: int, n_kv: int, head_dim: int,
                     dtype: str = "f16") -> PagedKV:
        """Allocate the KV store: per layer, K and V [n_blocks, n_kv, BLOCK_TOKENS, head_dim]
        in float16 ('f16') or float32 ('f32'), zeroed."""

    @abstractmethod
    def write_kv(self, kv: PagedKV, layer: int, k: Array, v: Array, seqs: Array, positions: Array,
                 tables: Array | None = None) -> None:
        """Store k, v [R, n_kv, hd] (float32, rounded once to the KV dtype) of layer `layer`
        at each row's position in its sequence's blocks: block tables[seq, pos // B],
        offset pos % B (tables None: `kv.slot_table`, seqs are slots)."""

    @abstractmethod
    def attend(self, kv: PagedKV, layer: int, q: Array, k: Array, v: Array,
               seqs: Array, positions: Array, scale: float, window: int = 0,
               tables: Array | None = None) -> Array:
        """`write_kv` k and v, then causal attention of q [R, n_head, hd] over keys
        0..position of the row's sequence, read through its block table in position order
        and converted to float32 -> [R, n_head, hd]; with a sliding `window` > 0 over keys
        max(0, position - window + 1)..position only."""

    def rope_attend(self, kv: PagedKV, layer: int, q: Array, k: Array, v: Array, seqs: Array, positions: Array,
                    scale: float, window: int, tables: Array | None, style: str,
                    rope_tables: tuple[Array, Array]) -> Array:
        """``attend(kv, layer, rope(q), rope(k), v, ...)``, q and k turned at `positions` by
        `rope` (style, tables): what the model calls each layer. A backend may fuse the turns
        into its attention call; the result must be the same bits."""
        return self.attend(kv, layer, self.rope(q, positions, style, rope_tables),
                           self.rope(k, positions, style, rope_tables), v, seqs, positions, scale, window, tables)

    def unsupported(self, args: Any) -> str | None:
        """Why this backend cannot run a model with these `ModelArgs`, or None."""
        return None

    def copy_blocks(self, kv: PagedKV, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared block)."""
        if not src:
            return
        s, d = self.asarray(np.asarray(src, np.int32)), self.asarray(np.asarray(dst, np.int32))
        for layer in range(len(kv.k)):
            kv.k[layer][d] = kv.k[layer][s]
            kv.v[layer][d] = kv.v[layer][s]

    def kv_export(self, kv: PagedKV, blocks: list[int], n_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The KV of positions 0..n_tokens-1 held in `blocks` (in order), per layer (K, V)
        as host arrays [n_kv, n_tokens, head_dim] in the KV dtype (for snapshots)."""
        nb = -(-n_tokens // BLOCK_TOKENS)
        if nb > len(blocks):
            raise ValueError(f"kv_export: {n_tokens} tokens need {nb} blocks, got {len(blocks)}")
        idx = self.asarray(np.asarray(blocks[:nb], np.int32))
        out = []
        for layer in range(len(kv.k)):
            pair = []
            for store in (kv.k[layer], kv.v[layer]):
                a = self.to_numpy(store[idx])  # (nb, n_kv, B, hd)
                a = a.transpose(1, 0, 2, 3).reshape(a.shape[1], nb * BLOCK_TOKENS, a.shape[3])
                pair.append(np.ascontiguousarray(a[:, :n_tokens]))
            out.append((pair[0], pair[1]))
        return out

    def kv_import(self, kv: PagedKV, blocks: list[int], arrays: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Write `kv_export`'s arrays back into `blocks` (the positions past n_tokens in the
        last block keep what they held)."""
        if len(arrays) != len(kv.k):
            raise ValueError(f"kv_import: {len(arrays)} layers, the store has {len(kv.k)}")
        for layer, pair in enumerate(arrays):
            for store, a in zip((kv.k[layer], kv.v[layer]), pair):
                n_kv, n, hd = a.shape
                if (n_kv, hd) != (kv.n_kv, kv.head_dim):
                    raise ValueError(f"kv_import: shape {a.shape} does not fit [{kv.n_kv}, n, {kv.head_dim}]")
                nb = -(-n // BLOCK_TOKENS)
                if nb > len(blocks):
                    raise ValueError(f"kv_import: {n} tokens need {nb} blocks, got {len(blocks)}")
                full, tail = divmod(n, BLOCK_TOKENS)
                host = np.ascontiguousarray(a).astype(self.to_numpy(store[:1]).dtype, copy=False)
                if full:
                    part = host[:, : full * BLOCK_TOKENS].reshape(n_kv, full, BLOCK_TOKENS, hd)
                    store[self.asarray(np.asarray(blocks[:full], np.int32))] = self.asarray(
                        np.ascontiguousarray(part.transpose(1, 0, 2, 3)))
                if tail:
                    store[blocks[full], :, :tail] = self.asarray(np.ascontiguousarray(host[:, full * BLOCK_TOKENS:]))

    def rope_tables(self, rope_dim: int, base: float, max_pos: int,
                    freq_factors: np.ndarray | None = None, mscale: float = 1.0) -> tuple[Array, Array]:
        """Rotary (cos, sin) tables [max_pos, rope_dim/2], computed once at load (float64
        angles, stored float32 on the device); the model owns them. Pair i turns by
        base^(-2i/rope_dim) / freq_factors[i] per position; cos and sin are times `mscale`
        (RoPE scaling, engine/model/rope_scaling.py)."""
        inv = 1.0 / (base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
        if freq_factors is not None:
            inv = inv / freq_factors.astype(np.float64)
        angles = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]  # (P, rope_dim/2)
        return (self.asarray((np.cos(angles) * mscale).astype(np.float32)),
                self.asarray((np.sin(angles) * mscale).astype(np.float32)))

    @abstractmethod
    def self_check(self, weights: Sequence[GGUFTensor] = ()) -> str | None:
        """None when rows are batch-invariant on this device, else what differed: every
        backend runs the one check, `self_check.check_batch_invariance`, with its own
        `CheckPlan` of the shapes that cross its kernel choices. `weights`: a loaded model's
        (`Model.weight_samples`): its own matrices are multiplied, and the plan's only for
        the types it uses, so the check runs (and compiles) the kernels the model runs."""

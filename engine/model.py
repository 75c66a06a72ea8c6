"""The decoder-only transformer forward pass (llama, qwen2, qwen3 and gemma3 families).

Written once against the `Backend` interface; follows llama.cpp's `llm_build_llama`,
`llm_build_qwen2`, `llm_build_qwen3` and `llm_build_gemma3` graphs. What differs is data:
`ModelArgs` (activation, embedding scale, per-layer window and RoPE) and optional tensors
(QKV biases, per-head q/k norms, norms after attention and FFN), skipped when absent.
The forward pass holds no cache state of its own: the KV store comes in as an argument,
and each row of a batch carries its own slot and position, so rows of different
sequences (prefill chunks and decode tokens alike) share one pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.base import Backend
from ..backends.gguf_tensor import GGUFTensor, TensorError
from .gguf_file import GGUFFile, ModelFileError
from .model_args import ModelArgs


@dataclass
class Layer:
    """One transformer block's weights; names follow the GGUF tensor names."""

    attn_norm: Any
    attn_q: Any
    attn_k: Any
    attn_v: Any
    attn_output: Any
    ffn_norm: Any
    ffn_gate: Any
    ffn_up: Any
    ffn_down: Any
    attn_q_bias: Any = None
    attn_k_bias: Any = None
    attn_v_bias: Any = None
    attn_q_norm: Any = None  # per-head RMS norms of q and k (qwen3, gemma3)
    attn_k_norm: Any = None
    post_attention_norm: Any = None  # gemma3: RMS norm of the attention / FFN output
    post_ffw_norm: Any = None  # before it joins the residual stream


@dataclass
class Batch:
    """Rows to compute in one step: token, sequence and position per row, plus the rows
    whose logits are wanted (the last row of each sequence in the step).

    `block_tables` [S, max_blocks] int32 lists each sequence's KV blocks (row r's position
    p lies in block block_tables[slots[r], p // BLOCK_TOKENS]); None: `slots` are the
    fixed whole-context slots of a store made by `Backend.new_kv`."""

    tokens: np.ndarray  # (R,) int32
    slots: np.ndarray  # (R,) int32: the row's sequence (an index into block_tables)
    positions: np.ndarray  # (R,) int32
    logit_rows: np.ndarray  # (L,) int64
    block_tables: np.ndarray | None = None  # (S, max_blocks) int32


@dataclass
class Model:
    """Weights on a backend plus the forward pass."""

    args: ModelArgs
    backend: Backend
    token_embd: GGUFTensor  # as stored; `Backend.embed` dequantizes the rows a step needs
    output_norm: Any
    output: Any
    layers: list[Layer]
    rope: list = ()  # per layer, (cos, sin) tables on the backend (shared between layers)
    load_seconds: float = 0.0
    weight_bytes: int = 0

    @classmethod
    def load(cls, gf: GGUFFile, backend: Backend, max_positions: int | None = None) -> "Model":
        """Hand every tensor of `gf` to `backend` as stored (`GGUFTensor`); the backend
        keeps or dequantizes it. Timed in `load_seconds`; raises ModelFileError."""
        try:
            return cls._load(gf, backend, max_positions)
        except TensorError as e:  # a tensor the backend could not dequantize
            raise ModelFileError(f"{gf.path}: {e}") from None

    @classmethod
    def _load(cls, gf: GGUFFile, backend: Backend, max_positions: int | None) -> "Model":
        t0 = time.perf_counter()
        args = ModelArgs.from_metadata(gf.metadata)
        why = backend.unsupported(args)
        if why:
            raise ModelFileError(f"{gf.path}: {why}")
        nbytes = 0

        def tensor(name: str, required: bool = True) -> GGUFTensor | None:
            if not gf.has(name):
                if required:
                    raise ModelFileError(f"{gf.path}: tensor {name} is missing; the file is incomplete")
                return None
            return gf.tensor(name)

        def vec(name: str, required: bool = True):
            t = tensor(name, required)
            return None if t is None else backend.asarray(t.dequantize().reshape(-1))

        def lin(name: str):
            nonlocal nbytes
            w = backend.linear_weight(tensor(name))
            nbytes += backend.nbytes(w)
            return w

        embd = tensor("token_embd.weight")  # rows are dequantized per step (Backend.embed)
        _check_shape("token_embd.weight", embd, (args.vocab_size, args.n_embd), gf)
        layers = []
        for i in range(args.n_layer):
            p = f"blk.{i}."
            layers.append(Layer(
                attn_norm=vec(p + "attn_norm.weight"),
                attn_q=lin(p + "attn_q.weight"),
                attn_k=lin(p + "attn_k.weight"),
                attn_v=lin(p + "attn_v.weight"),
                attn_output=lin(p + "attn_output.weight"),
                ffn_norm=vec(p + "ffn_norm.weight"),
                ffn_gate=lin(p + "ffn_gate.weight"),
                ffn_up=lin(p + "ffn_up.weight"),
                ffn_down=lin(p + "ffn_down.weight"),
                attn_q_bias=vec(p + "attn_q.bias", required=False),
                attn_k_bias=vec(p + "attn_k.bias", required=False),
                attn_v_bias=vec(p + "attn_v.bias", required=False),
                attn_q_norm=vec(p + "attn_q_norm.weight", required=False),
                attn_k_norm=vec(p + "attn_k_norm.weight", required=False),
                post_attention_norm=vec(p + "post_attention_norm.weight", required=False),
                post_ffw_norm=vec(p + "post_ffw_norm.weight", required=False),
            ))
        output = lin("output.weight" if gf.has("output.weight") else "token_embd.weight")  # tied
        nbytes += embd.nbytes
        freqs = tensor("rope_freqs.weight", required=False)
        rope = _rope_per_layer(args, backend, max_positions or args.context_length,
                               None if freqs is None else freqs.dequantize())
        return cls(args, backend, embd, vec("output_norm.weight"), output, layers,
                   rope=rope, load_seconds=time.perf_counter() - t0, weight_bytes=nbytes)

    def forward(self, kv: Any, batch: Batch) -> np.ndarray:
        """Run every row of `batch`; return float32 logits [L, vocab] for `logit_rows`."""
        a, be = self.args, self.backend
        be.begin_step()
        slots = be.asarray(batch.slots)
        positions = be.asarray(batch.positions)
        tables = None if batch.block_tables is None else be.asarray(batch.block_tables)
        R = len(batch.tokens)
        ffn_act = be.silu_mul if a.ffn_act == "silu" else be.gelu_mul
        x = be.embed(self.token_embd, batch.tokens)  # (R, D)
        if a.embed_scale != 1.0:
            x = x * np.float32(a.embed_scale)
        for i, L in enumerate(self.layers):
            h = be.rms_norm(x, L.attn_norm, a.rms_eps)
            q = _biased(be.linear(h, L.attn_q), L.attn_q_bias).reshape(R, a.n_head, a.head_dim)
            k = _biased(be.linear(h, L.attn_k), L.attn_k_bias).reshape(R, a.n_kv_head, a.head_dim)
            v = _biased(be.linear(h, L.attn_v), L.attn_v_bias).reshape(R, a.n_kv_head, a.head_dim)
            q = be.rope(_normed(be, q, L.attn_q_norm, a.rms_eps), positions, a.rope_style, self.rope[i])
            k = be.rope(_normed(be, k, L.attn_k_norm, a.rms_eps), positions, a.rope_style, self.rope[i])
            o = be.attend(kv, i, q, k, v, slots, positions, a.scale, a.window(i), tables)  # (R, n_head, hd)
            o = be.linear(o.reshape(R, a.n_head * a.head_dim), L.attn_output)
            x = x + _normed(be, o, L.post_attention_norm, a.rms_eps)
            h = be.rms_norm(x, L.ffn_norm, a.rms_eps)
            h = be.linear(ffn_act(be.linear(h, L.ffn_gate), be.linear(h, L.ffn_up)), L.ffn_down)
            x = x + _normed(be, h, L.post_ffw_norm, a.rms_eps)
        rows = be.asarray(np.asarray(batch.logit_rows, dtype=np.int64))
        h = be.rms_norm(x[rows], self.output_norm, a.rms_eps)
        logits = be.to_numpy(be.linear(h, self.output))
        if a.final_logit_softcap > 0:  # gemma2-style; elementwise on the host
            cap = np.float32(a.final_logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits


def _rope_per_layer(a: ModelArgs, be: Backend, max_pos: int, freqs: np.ndarray | None) -> list:
    """(cos, sin) for each layer: global layers use `rope_base`, the file's `rope_freqs` and
    linear scaling by `rope_freq_scale`; sliding-window layers `swa_rope_base`, unscaled
    (llama.cpp `rope_freq_base_train_swa`). Each distinct table is computed once."""
    factors = freqs
    if a.rope_freq_scale != 1.0:  # linear scaling: angle = pos * freq_scale * inv_freq
        factors = (np.ones(a.rope_dim // 2) if freqs is None else freqs.astype(np.float64)) / a.rope_freq_scale
    global_ = local = None
    per_layer = []
    for i in range(a.n_layer):
        if a.window(i):
            local = local or be.rope_tables(a.rope_dim, a.swa_rope_base, max_pos)
            per_layer.append(local)
        else:
            global_ = global_ or be.rope_tables(a.rope_dim, a.rope_base, max_pos, factors)
            per_layer.append(global_)
    return per_layer


def _normed(be: Backend, x, weight, eps: float):
    return x if weight is None else be.rms_norm(x, weight, eps)


def _biased(y, bias):
    return y if bias is None else y + bias


def _check_shape(name: str, a: GGUFTensor, want: tuple[int, ...], gf: GGUFFile) -> None:
    if tuple(a.shape) != want:
        raise ModelFileError(f"{gf.path}: tensor {name} has shape {a.shape}, metadata says {want}")

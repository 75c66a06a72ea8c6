"""The decoder-only transformer forward pass (llama incl. Mistral and Llama 3.x, qwen2,
qwen3, gemma3 and phi3 families).

Written once against the `Backend` interface; follows llama.cpp's `llm_build_llama`,
`llm_build_qwen2`, `llm_build_qwen3`, `llm_build_gemma3` and `llm_build_phi3` graphs. What
differs is data: `ModelArgs` (activation, embedding scale, per-layer window, RoPE and its
scaling) and optional tensors (QKV biases, per-head q/k norms, norms after attention and
FFN), skipped when absent. phi3's fused tensors (`attn_qkv`: Q, K, V rows; `ffn_up`: gate
rows, then up rows) are split at load into row ranges of their stored blocks, so the
forward pass sees the same separate matrices as for the others.
What the layers compute is described once at load (`backends.layer_spec.DecoderSpec`,
built by `decoder_spec`): this pass reads its features from it, and a backend's one-call
decode step (`Backend.prepare_decoder`) takes it or declines.
The forward pass holds no cache state of its own: the KV store comes in as an argument,
and each row of a batch carries its own slot and position, so rows of different
sequences (prefill chunks and decode tokens alike) share one pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from panechat.backends.base import Backend
from panechat.backends.layer_spec import DecoderSpec
from panechat.backends.quant.gguf_tensor import GGUFTensor, TensorError
from panechat.engine.gguf.file import GGUFFile, ModelFileError
from panechat.engine.model.args import ModelArgs
from panechat.engine.model.decoder_spec import decoder_spec
from panechat.engine.model.rope_scaling import global_rope


# the features this pass computes (`DecoderSpec.unsupported_by`): any value of the others
OP_BY_OP = {"rope_style": ("normal", "neox"), "activation": ("silu", "gelu_tanh"), "attn_q_bias": None,
            "attn_k_bias": None, "attn_v_bias": None, "attn_q_norm": None, "attn_k_norm": None,
            "post_attention_norm": None, "post_ffw_norm": None, "uneven_layers": None, "embed_scale": None,
            "logit_softcap": None}


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


#: Rows of each `Model.weight_samples` matrix: past the widest column tile (6), with a leftover.
SAMPLE_ROWS = 70


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
    spec: DecoderSpec | None = None  # what the layers and head compute: both paths read it
    decoder: Any = None  # the backend's whole-decode-step plan (`Backend.prepare_decoder`), if any
    #: the first SAMPLE_ROWS rows of one weight matrix per stored type (views of the file):
    #: what the backend's self-check multiplies, so it runs the kernels this model does
    weight_samples: tuple[GGUFTensor, ...] = ()
    decoder_off: str | None = None  # why the one-call step was turned off after load (`turn_off_decoder`)

    @classmethod
    def load(cls, gf: GGUFFile, backend: Backend, max_positions: int | None = None) -> "Model":
        """Hand every tensor of `gf` to `backend` as stored (`GGUFTensor`); the backend
        keeps or dequantizes it. Timed in `load_seconds`; raises ModelFileError."""
        try:
            with backend.loading_weights():
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
        samples: dict[str, GGUFTensor] = {}

        def tensor(name: str, required: bool = True) -> GGUFTensor | None:
            if not gf.has(name):
                if required:
                    raise ModelFileError(f"{gf.path}: tensor {name} is missing; the file is incomplete")
                return None
            return gf.tensor(name)

        def vec(name: str, required: bool = True):
            t = tensor(name, required)
            return None if t is None else backend.asarray(t.dequantize().reshape(-1))

        def prepared(t: GGUFTensor):
            nonlocal nbytes
            if t.qtype not in samples and len(t.shape) == 2:
                samples[t.qtype] = t.row_range(0, min(SAMPLE_ROWS, t.shape[0]))
            w = backend.linear_weight(t)
            nbytes += backend.nbytes(w)
            return w

        def lin(name: str):
            return prepared(tensor(name))

        def lin_split(name: str, rows: tuple[int, ...]) -> list:
            """A fused weight as the separate matrices of `rows` rows each: row ranges of
            its stored blocks (views), bit-identical to separate tensors in the file."""
            t = tensor(name)
            if t.shape[0] != sum(rows):
                raise ModelFileError(f"{gf.path}: tensor {name} has {t.shape[0]} rows, metadata says {sum(rows)}")
            ends = np.cumsum(rows)
            return [prepared(t.row_range(int(e - n), int(e))) for n, e in zip(rows, ends)]

        q_rows, kv_rows = args.n_head * args.head_dim, args.n_kv_head * args.head_dim

        embd = tensor("token_embd.weight")  # rows are dequantized per step (Backend.embed)
        _check_shape("token_embd.weight", embd, (args.vocab_size, args.n_embd), gf)
        layers = []
        for i in range(args.n_layer):
            p = f"blk.{i}."
            if gf.has(p + "attn_qkv.weight"):  # phi3: Q, K, V rows in one tensor
                q, k, v = lin_split(p + "attn_qkv.weight", (q_rows, kv_rows, kv_rows))
            else:
                q, k, v = lin(p + "attn_q.weight"), lin(p + "attn_k.weight"), lin(p + "attn_v.weight")
            if gf.has(p + "ffn_gate.weight"):
                gate, up = lin(p + "ffn_gate.weight"), lin(p + "ffn_up.weight")
            else:  # phi3: ffn_up holds the gate's rows, then the up rows (llama.cpp LLM_FFN_SWIGLU)
                gate, up = lin_split(p + "ffn_up.weight", (args.n_ff, args.n_ff))
            layers.append(Layer(
                attn_norm=vec(p + "attn_norm.weight"),
                attn_q=q,
                attn_k=k,
                attn_v=v,
                attn_output=lin(p + "attn_output.weight"),
                ffn_norm=vec(p + "ffn_norm.weight"),
                ffn_gate=gate,
                ffn_up=up,
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
        max_pos = max_positions or args.context_length
        rope = _rope_per_layer(args, backend, max_pos, _rope_freq_factors(gf, args, max_pos))
        output_norm = vec("output_norm.weight")
        spec = decoder_spec(args, layers)
        why = spec.unsupported_by(OP_BY_OP)
        if why:
            raise ModelFileError(f"{gf.path}: the forward pass cannot run this model: {why}")
        decoder = backend.prepare_decoder(spec, _layer_dicts(layers), output_norm, output, rope)
        return cls(args, backend, embd, output_norm, output, layers, rope=rope,
                   load_seconds=time.perf_counter() - t0, weight_bytes=nbytes, spec=spec, decoder=decoder,
                   weight_samples=tuple(samples.values()))

    def with_args(self, args: ModelArgs) -> "Model":
        """These weights and RoPE tables under other `args` (a test's shorter window): the
        description and the one-call plan are built again from them, so both paths follow."""
        spec = decoder_spec(args, self.layers)
        decoder = self.backend.prepare_decoder(spec, _layer_dicts(self.layers), self.output_norm, self.output,
                                               self.rope)
        return replace(self, args=args, spec=spec, decoder=decoder)

    def turn_off_decoder(self, why: str) -> None:
        """Stop using the one-call decode step (`Backend.run_decoder`): every later step
        runs op by op. `why` is kept in `decoder_off`."""
        self.decoder, self.decoder_off = None, why

    def forward(self, kv: Any, batch: Batch) -> np.ndarray:
        """Run every row of `batch`; return float32 logits [L, vocab] for `logit_rows`.

        A decode-shaped batch (every row's logits wanted, in row order) goes through
        `Backend.run_decode_step`, which may replay a captured CUDA graph of the layers and
        head (CuPy); the result is the same bit for bit."""
        logits = self.backend.to_numpy(self._device_logits(kv, batch))
        if self.spec.logit_softcap > 0:  # gemma2-style; elementwise on the host
            cap = np.float32(self.spec.logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    @property
    def samples_on_device(self) -> bool:
        """Whether `forward_tokens` can pick the tokens where the logits are."""
        return self.backend.samples_on_device and not self.spec.logit_softcap > 0

    def forward_tokens(self, kv: Any, batch: Batch, temperature: np.ndarray, top_p: np.ndarray,
                       min_p: np.ndarray, top_k: np.ndarray, seeds: np.ndarray, steps: np.ndarray,
                       before_pick: Any = None) -> np.ndarray:
        """Like `forward`, but each logit row is sampled on the device (`Backend.sample_rows`,
        per-row parameters; `before_pick(logits, xp)` may first change rows there) and only
        int32 [L, 2] (token, bad) comes back."""
        return self.backend.sample_rows(self._device_logits(kv, batch), temperature, top_p, min_p, top_k,
                                        seeds, steps, before_pick)

    def _device_logits(self, kv: Any, batch: Batch) -> Any:
        s, be = self.spec, self.backend
        be.begin_step()
        R = len(batch.tokens)
        x = be.embed(self.token_embd, batch.tokens)  # (R, D)
        if s.embed_scale != 1.0:
            x = x * np.float32(s.embed_scale)
        rows = np.asarray(batch.logit_rows, dtype=np.int64)
        if len(rows) == R and np.array_equal(rows, np.arange(R)):
            if self.decoder is not None:  # the whole step in one backend call, where it can
                out = be.run_decoder(self.decoder, kv, x, batch.slots, batch.positions, batch.block_tables)
                if out is not None:
                    return out
            return be.run_decode_step(kv, self, self._all_rows, x, batch.slots, batch.positions, batch.block_tables)
        tables = None if batch.block_tables is None else be.asarray(batch.block_tables)
        return self.layers_and_head(kv, x, be.asarray(batch.slots), be.asarray(batch.positions),
                                    be.asarray(rows), tables)

    def _all_rows(self, kv: Any, x: Any, slots: Any, positions: Any, tables: Any = None) -> Any:
        return self.layers_and_head(kv, x, slots, positions, None, tables)

    def layers_and_head(self, kv: Any, x: Any, slots: Any, positions: Any, rows: Any,
                        tables: Any = None) -> Any:
        """The device part of a step: every layer over x [R, D] (rows of sequences `slots`
        at `positions`, on the backend; `tables`: the sequences' KV block tables, None for
        a slotted store), then the output norm and head for `rows` (None: all rows) ->
        logits on the backend. Launches the same kernels for the same shapes
        whatever the values, so a backend may capture it as a graph."""
        s, be = self.spec, self.backend
        R, eps = x.shape[0], s.eps
        ffn_act = be.silu_mul if s.activation == "silu" else be.gelu_mul
        for i, L in enumerate(self.layers):
            # the norm and the products (and biases) in one call where the backend can
            q, k, v = be.norm_linear_many(x, L.attn_norm, eps, (L.attn_q, L.attn_k, L.attn_v),
                                          (L.attn_q_bias, L.attn_k_bias, L.attn_v_bias))
            q, k, v = (q.reshape(R, s.n_head, s.head_dim), k.reshape(R, s.n_kv, s.head_dim),
                       v.reshape(R, s.n_kv, s.head_dim))
            q, k = _normed(be, q, L.attn_q_norm, eps), _normed(be, k, L.attn_k_norm, eps)
            o = be.rope_attend(kv, i, q, k, v, slots, positions, s.scale, s.windows[i], tables, s.rope_style,
                               self.rope[i])  # RoPE on q and k, then attention: (R, n_head, hd)
            x = _residual(be, x, o.reshape(R, s.n_head * s.head_dim), L.attn_output, L.post_attention_norm, eps)
            gate, up = be.norm_linear_many(x, L.ffn_norm, eps, (L.ffn_gate, L.ffn_up))
            x = _residual(be, x, ffn_act(gate, up), L.ffn_down, L.post_ffw_norm, eps)
        return be.norm_linear_many(x if rows is None else x[rows], self.output_norm, eps, (self.output,))[0]


def _layer_dicts(layers: list[Layer]) -> list[dict]:
    """Each layer's weights keyed by GGUF name, as `Backend.prepare_decoder` takes them."""
    return [{f.name: getattr(L, f.name) for f in fields(L)} for L in layers]


def _rope_freq_factors(gf: GGUFFile, a: ModelArgs, max_pos: int) -> np.ndarray | None:
    """The file's RoPE frequency factors, as llama.cpp's `get_rope_factors` picks them:
    `rope_freqs` (Llama 3.x), else phi3's long factors when a sequence may run past the
    original context, else its short ones; None when the file has none."""
    names = ["rope_freqs.weight",
             "rope_factors_long.weight" if max_pos > a.rope_orig_ctx else "rope_factors_short.weight"]
    name = next((n for n in names if gf.has(n)), None)
    return None if name is None else gf.tensor(name).dequantize().reshape(-1)


def _rope_per_layer(a: ModelArgs, be: Backend, max_pos: int, freqs: np.ndarray | None) -> list:
    """(cos, sin) for each layer: global layers use `rope_base`, the file's frequency
    factors and the RoPE scaling (engine/model/rope_scaling.py); sliding-window layers
    `swa_rope_base`, unscaled (llama.cpp `rope_freq_base_train_swa`). Each distinct table
    is computed once."""
    try:
        factors, mscale = global_rope(a, freqs)
    except ValueError as e:
        raise ModelFileError(str(e)) from None
    global_ = local = None
    per_layer = []
    for i in range(a.n_layer):
        if a.window(i):
            local = local or be.rope_tables(a.rope_dim, a.swa_rope_base, max_pos)
            per_layer.append(local)
        else:
            global_ = global_ or be.rope_tables(a.rope_dim, a.rope_base, max_pos, factors, mscale)
            per_layer.append(global_)
    return per_layer


def _normed(be: Backend, x, weight, eps: float):
    return x if weight is None else be.rms_norm(x, weight, eps)


def _residual(be: Backend, x, h, w, post_norm, eps: float):
    """x + (h @ w.T, RMS-normed by `post_norm` when there is one); without a post norm the
    residual add goes into the matmul (`linear_add`), the same bits."""
    if post_norm is None:
        return be.linear_add(h, w, x)
    return x + be.rms_norm(be.linear(h, w), post_norm, eps)


def _check_shape(name: str, a: GGUFTensor, want: tuple[int, ...], gf: GGUFFile) -> None:
    if tuple(a.shape) != want:
        raise ModelFileError(f"{gf.path}: tensor {name} has shape {a.shape}, metadata says {want}")

"""Hyper-parameters of a model, read from GGUF metadata (mlx-lm `ModelArgs` style).

What differs between the supported architectures is data here, not code in the forward
pass: RoPE style and scaling, the feed-forward activation, the embedding scale, and
(gemma3) the interleaved sliding-window layers with their own RoPE base. Optional tensors
(biases, q/k norms, post-norms, phi3's fused QKV and gate-up) are found by name at load;
see `engine/model/forward.py`. RoPE scaling follows llama.cpp's `llama_model::load_hparams`;
the tables themselves are built in `engine/model/rope_scaling.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from panechat.engine.gguf.file import ModelFileError

# llama.cpp src/llama-arch.cpp / llama-model.cpp: LLAMA (Llama 1-3.x, Mistral) uses "normal"
# RoPE (adjacent pairs, the converter permutes Q/K for it); QWEN2, QWEN3, GEMMA3 and PHI3
# use NEOX RoPE (halves).
ROPE_STYLE = {"llama": "normal", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox", "phi3": "neox"}
SUPPORTED_ARCHITECTURES = tuple(ROPE_STYLE)

# llama.cpp's `rope.scaling.type` names (LLAMA_ROPE_SCALING_TYPES). "longrope" (phi3's
# long/short factor tensors) scales like "linear"; the factors come from the file.
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")

# gemma3 (llama.cpp `llama_model::load_hparams`): every 6th layer is global, the others
# attend over a sliding window and use RoPE base 10000 with no scaling.
GEMMA3_SWA_PATTERN = 6
GEMMA3_SWA_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class ModelArgs:
    """What the forward pass needs to know about a model, derived once at load."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_style: str
    rope_freq_scale: float = 1.0  # RoPE scaling of the global layers: positions times 1 / factor
    rope_scaling: str = "linear"  # one of ROPE_SCALING_TYPES (llama.cpp's default: "linear")
    rope_orig_ctx: int = 0  # context the model was trained at before scaling (yarn, phi3's long factors)
    rope_attn_factor: float = 1.0  # cos and sin times this (rope.scaling.attn_factor; phi3 128k)
    yarn_ext_factor: float = 0.0  # weight of yarn's extrapolation ramp: 1 for "yarn", else 0
    yarn_beta_fast: float = 32.0  # yarn's ramp between extrapolated and interpolated pairs
    yarn_beta_slow: float = 1.0
    ffn_act: str = "silu"  # gated FFN activation: "silu" or "gelu_tanh" (gemma)
    embed_scale: float = 1.0  # gemma: token embeddings times sqrt(n_embd), as float32
    attn_scale: float = 0.0  # softmax scale of q . k; 0 means 1 / sqrt(head_dim)
    sliding_window: int = 0  # keys a sliding-window layer sees (0: no such layers)
    swa_pattern: int = 0  # with a window: layer i is global iff i % swa_pattern == swa_pattern - 1
    swa_rope_base: float = 10000.0  # RoPE base of the sliding-window layers
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) when > 0

    def window(self, layer: int) -> int:
        """Keys before and including the row's own that `layer` attends to; 0 = all."""
        if not self.sliding_window or layer % self.swa_pattern == self.swa_pattern - 1:
            return 0
        return self.sliding_window

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "ModelArgs":
        arch = str(meta.get("general.architecture", "unknown"))
        if arch not in ROPE_STYLE:
            raise ModelFileError(
                f"unsupported model architecture '{arch}'; panechat supports: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelFileError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete")
            return value

        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length", n_embd // n_head))
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
        common = dict(
            architecture=arch,
            n_layer=int(get("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_kv_head=int(get("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_ff=int(get("feed_forward_length")),
            vocab_size=vocab,
            context_length=int(get("context_length", 4096)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_style=ROPE_STYLE[arch],
        )
        common.update(_rope_scaling(meta, arch, common["context_length"]))
        if arch == "gemma3":
            common.update(
                ffn_act="gelu_tanh",
                embed_scale=float(np.sqrt(np.float32(n_embd))),  # llama.cpp: sqrtf(n_embd)
                # llama.cpp: 1/sqrt(head_dim); the 27B (62 layers) uses 1/sqrt(n_embd/n_head)
                attn_scale=1.0 / math.sqrt(n_embd // n_head if common["n_layer"] == 62 else head_dim),
                sliding_window=int(meta.get(f"{arch}.attention.sliding_window", 0) or 0),
                swa_pattern=GEMMA3_SWA_PATTERN,
                swa_rope_base=GEMMA3_SWA_ROPE_BASE,
                final_logit_softcap=float(meta.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
            )
        return cls(**common)


def _rope_scaling(meta: dict[str, Any], arch: str, n_ctx_train: int) -> dict[str, Any]:
    """The RoPE scaling fields as llama.cpp reads them: the type defaults to "linear",
    freq_scale = 1 / rope.scaling.factor (the older key rope.scale_linear too) unless the
    type is "none"; the original context defaults to the trained one. An unknown type is
    refused rather than silently run unscaled, as is yarn's log multiplier (DeepSeek's
    attention scaling, which llama.cpp applies and panechat does not)."""
    kind = str(meta.get(f"{arch}.rope.scaling.type", "linear"))
    if kind not in ROPE_SCALING_TYPES:
        raise ModelFileError(f"unsupported RoPE scaling type '{kind}' ({arch}.rope.scaling.type); "
                             f"panechat supports: {', '.join(ROPE_SCALING_TYPES)}")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear", 0.0))
    factor = float(factor or 0.0)
    scaled = kind != "none" and factor > 0
    if float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0):
        raise ModelFileError(f"yarn RoPE scaling with a log multiplier ({arch}.rope.scaling.yarn_log_multiplier) "
                             "is not supported by panechat")
    ext = meta.get(f"{arch}.rope.scaling.yarn_ext_factor")  # llama.cpp: else 1 for yarn, 0 otherwise
    ext = float(ext) if ext is not None and float(ext) >= 0 else float(kind == "yarn")
    return dict(
        rope_scaling=kind,
        rope_freq_scale=1.0 / factor if scaled else 1.0,
        rope_orig_ctx=int(meta.get(f"{arch}.rope.scaling.original_context_length", 0) or n_ctx_train),
        rope_attn_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0) or 1.0),
        yarn_ext_factor=ext,
        yarn_beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0) or 32.0),
        yarn_beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0) or 1.0),
    )

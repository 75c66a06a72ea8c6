"""One description of a decoder-only model's layers and head, read by both CPU paths.

The engine builds a `DecoderSpec` once at load from `ModelArgs` and the tensors present
(engine/model/forward.py `decoder_spec`) and hands it to the backend. The op-by-op
forward pass reads its features from it, and the one-call decode step
(backends/cpu/decoder.py) checks it against the features it implements: a feature the
step does not know, set to anything but its default, makes the step decline.

Fields marked `shape` are sizes every path takes as they come; every other field is a
feature, whose default is the plain llama layer. phi3's fused QKV and gate-up tensors are
split at load into separate matrices, so they are no feature here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# the optional per-layer vectors, by their GGUF tensor names
OPTIONAL_VECTORS = ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_q_norm", "attn_k_norm",
                    "post_attention_norm", "post_ffw_norm")


def _shape() -> Any:
    return field(metadata={"shape": True})


@dataclass(frozen=True)
class DecoderSpec:
    """What the layers and head of a model compute: sizes, then named features."""

    n_layer: int = _shape()
    n_embd: int = _shape()
    n_head: int = _shape()
    n_kv: int = _shape()
    head_dim: int = _shape()
    n_ff: int = _shape()
    vocab: int = _shape()
    eps: float = _shape()  # of every RMS norm
    scale: float = _shape()  # softmax scale of q . k
    windows: tuple[int, ...] = _shape()  # per layer: keys a row attends to, 0 = all
    rope_style: str = "normal"  # "normal" (adjacent pairs) or "neox" (halves)
    activation: str = "silu"  # gated FFN: "silu" or "gelu_tanh"
    attn_q_bias: bool = False  # every layer adds a bias to q (qwen2)
    attn_k_bias: bool = False
    attn_v_bias: bool = False
    attn_q_norm: bool = False  # every layer RMS-norms each head of q (qwen3, gemma3)
    attn_k_norm: bool = False
    post_attention_norm: bool = False  # every layer RMS-norms the attention output (gemma3)
    post_ffw_norm: bool = False  # ... and the FFN output, before the residual add
    uneven_layers: bool = False  # some layers have an optional vector that others lack
    embed_scale: float = 1.0  # token embeddings times this (gemma3): by the model, before the layers
    logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) when > 0: by the model, after the head

    def features(self) -> dict[str, Any]:
        """Every feature field and its value (the shape fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("shape")}

    def features_set(self) -> dict[str, Any]:
        """The features whose value is not their default (what sets this model apart from
        the plain llama layer)."""
        defaults = {f.name: f.default for f in fields(self)}
        return {name: v for name, v in self.features().items() if v != defaults[name]}

    def unsupported_by(self, implements: dict[str, Any]) -> str | None:
        """Why a path that `implements` {feature: allowed values, or None for any value}
        cannot compute this model, or None. A feature it does not list declines unless it
        has its default value."""
        unknown = self.features_set()
        for name, value in self.features().items():
            if name not in implements:
                if name in unknown:
                    return f"{name}={value!r} is a feature it does not implement"
            elif implements[name] is not None and value not in implements[name]:
                return f"{name}={value!r} is not one it implements"
        return None

"""Hyper-parameters of a model, read from GGUF metadata (mlx-lm `ModelArgs` style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gguf_file import ModelFileError

# llama.cpp src/llama-arch.cpp: LLAMA uses "normal" RoPE (adjacent pairs, the
# converter permutes Q/K for it); QWEN2 uses NEOX RoPE (first half / second half).
ROPE_STYLE = {"llama": "normal", "qwen2": "neox"}
SUPPORTED_ARCHITECTURES = tuple(ROPE_STYLE)


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
        return cls(
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

"""The backend's description of a model's layers (`backends.layer_spec.DecoderSpec`), built
once at load from `ModelArgs` and the optional tensors the layers hold."""

from __future__ import annotations

from typing import Any

from panechat.backends.layer_spec import OPTIONAL_VECTORS, DecoderSpec
from panechat.engine.model.args import ModelArgs


def decoder_spec(args: ModelArgs, layers: list[Any]) -> DecoderSpec:
    """The description both CPU paths read: `layers` are the loaded `Layer`s (an optional
    vector is None where a layer lacks it)."""
    every = {n: all(getattr(L, n) is not None for L in layers) for n in OPTIONAL_VECTORS}
    some = {n: any(getattr(L, n) is not None for L in layers) for n in OPTIONAL_VECTORS}
    return DecoderSpec(
        n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, n_kv=args.n_kv_head,
        head_dim=args.head_dim, n_ff=args.n_ff, vocab=args.vocab_size, eps=args.rms_eps, scale=args.scale,
        windows=tuple(args.window(i) for i in range(args.n_layer)),
        rope_style=args.rope_style, activation=args.ffn_act, **every,
        uneven_layers=every != some, embed_scale=args.embed_scale, logit_softcap=args.final_logit_softcap)

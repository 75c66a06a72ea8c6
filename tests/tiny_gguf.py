"""Tiny synthetic GGUF models written with gguf.GGUFWriter, and a float64 reference.

The reference is a direct transcription of the llama / qwen2 equations in float64,
independent of panechat's model code, so the two can be compared."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _byte_vocab() -> list[str]:
    """GPT-2 byte-to-unicode alphabet: 256 single-character tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_gguf(path: Path, arch: str = "llama", *, n_layer: int = 2, n_embd: int = 64,
                    n_head: int = 4, n_kv: int = 2, n_ff: int = 96, qtype: str = "F32",
                    tied: bool = True, seed: int = 0,
                    zero_raw: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Write a random model; return its float32 weights as the file stores them
    (after quantization round-trip), keyed by GGUF tensor name. `zero_raw` maps tensor
    names to a GGML type whose zero blocks are stored instead (for unsupported types)."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(seed)
    vocab = _byte_vocab() + ["he", "<|im_start|>", "<|im_end|>"]
    n_vocab = len(vocab)
    hd = n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([1] * 257 + [3, 3])
    w.add_token_merges(["h e"])
    w.add_bos_token_id(n_vocab - 2)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    stored: dict[str, np.ndarray] = {}
    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def add(name: str, a: np.ndarray, quantize: bool = True) -> None:
        a = a.astype(np.float32)
        if zero_raw and name in zero_raw:
            raw_type = getattr(gguf.GGMLQuantizationType, zero_raw[name])
            block, size = gguf.GGML_QUANT_SIZES[raw_type]
            raw = np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_type)
            return
        if quantize and qtype != "F32" and a.ndim == 2:
            q = quants.quantize(a, qt)
            w.add_tensor(name, q, raw_dtype=qt)
            stored[name] = quants.dequantize(q, qt).astype(np.float32)
        else:
            w.add_tensor(name, a)
            stored[name] = a

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)

    add("token_embd.weight", rng.standard_normal((n_vocab, n_embd)))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
        add(p + "attn_q.weight", mat(n_head * hd, n_embd))
        add(p + "attn_k.weight", mat(n_kv * hd, n_embd))
        add(p + "attn_v.weight", mat(n_kv * hd, n_embd))
        if arch == "qwen2":
            add(p + "attn_q.bias", 0.1 * rng.standard_normal(n_head * hd))
            add(p + "attn_k.bias", 0.1 * rng.standard_normal(n_kv * hd))
            add(p + "attn_v.bias", 0.1 * rng.standard_normal(n_kv * hd))
        add(p + "attn_output.weight", mat(n_embd, n_head * hd))
        add(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
        add(p + "ffn_gate.weight", mat(n_ff, n_embd))
        add(p + "ffn_up.weight", mat(n_ff, n_embd))
        add(p + "ffn_down.weight", mat(n_embd, n_ff))
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
    if not tied:
        add("output.weight", mat(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    stored["_meta"] = np.array([n_layer, n_embd, n_head, n_kv, n_ff])
    return stored


def reference_logits(weights: dict[str, np.ndarray], arch: str, tokens: list[int]) -> np.ndarray:
    """float64 logits [T, vocab] for a whole sequence, straight from the equations."""
    n_layer, n_embd, n_head, n_kv, _ = weights["_meta"].tolist()
    W = {k: v.astype(np.float64) for k, v in weights.items() if k != "_meta"}
    hd, T = n_embd // n_head, len(tokens)
    pos = np.arange(T)
    inv = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # x (T, H, hd)
        y = x.copy()
        if arch == "qwen2":  # NEOX: halves
            a, b = x[..., : hd // 2], x[..., hd // 2:]
            y[..., : hd // 2], y[..., hd // 2:] = a * cos - b * sin, b * cos + a * sin
        else:  # normal: adjacent pairs
            a, b = x[..., 0::2], x[..., 1::2]
            y[..., 0::2], y[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return y

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    x = W["token_embd.weight"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q = h @ W[p + "attn_q.weight"].T + W.get(p + "attn_q.bias", 0)
        k = h @ W[p + "attn_k.weight"].T + W.get(p + "attn_k.bias", 0)
        v = h @ W[p + "attn_v.weight"].T + W.get(p + "attn_v.bias", 0)
        q, k, v = rope(q.reshape(T, n_head, hd)), rope(k.reshape(T, n_kv, hd)), v.reshape(T, n_kv, hd)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, n_embd)
        x = x + o @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g = h @ W[p + "ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    out = W.get("output.weight", W["token_embd.weight"])
    return norm(x, W["output_norm.weight"]) @ out.T

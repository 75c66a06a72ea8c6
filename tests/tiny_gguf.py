"""Tiny synthetic GGUF models written with gguf.GGUFWriter, and a float64 reference.

The reference is a direct transcription of the llama / qwen2 / qwen3 / gemma3 / phi3
equations in float64, independent of panechat's model code, so the two can be compared;
its RoPE scaling follows Hugging Face transformers' `modeling_rope_utils` (linear, yarn,
Llama 3 and phi3 "longrope" factors), not llama.cpp's ggml code that panechat follows."""

from __future__ import annotations

from pathlib import Path

import numpy as np


# Shapes that make each architecture's differences matter: qwen3 and gemma3 with a
# head_dim unlike n_embd / n_head; gemma3 with 7 layers (0-4 and 6 slide over 5 keys,
# 5 is global), so a sequence of 6+ tokens crosses the window in both kinds of layer;
# phi3 with grouped KV heads (Phi-3-medium's), so the fused QKV rows are of two sizes.
ARCH_SHAPES = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=32),
    "gemma3": dict(n_layer=7, head_dim=32, window=5),
    "phi3": {},
}

# llama-family files with RoPE scaling, as llama.cpp's converter writes them: Llama 3.x
# (rope_freqs.weight, no scaling type), linear and yarn (rope.scaling.*); phi3 128k
# (rope_factors_long/short.weight and rope.scaling.attn_factor). Writer keyword arguments.
ROPE_VARIANTS = {
    "llama3-rope-freqs": dict(arch="llama", rope_freqs=True),
    "llama-linear": dict(arch="llama", rope_type="linear", rope_scale=4.0),
    "qwen3-yarn": dict(arch="qwen3", head_dim=32, rope_type="yarn", rope_scale=4.0, orig_ctx=4096),
    "phi3-long-factors": dict(arch="phi3", long_factors=True, orig_ctx=32),  # a 64-position run: long
    "phi3-short-factors": dict(arch="phi3", long_factors=True, orig_ctx=128),  # and short
}


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
                    tied: bool = True, seed: int = 0, head_dim: int | None = None,
                    window: int = 5, rope_scale: float = 0.0, rope_type: str = "linear",
                    orig_ctx: int = 0, rope_freqs: bool = False, long_factors: bool = False,
                    fused: bool = True, chat_template: bool = True, zero_raw: dict[str, str] | None = None,
                    random_raw: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Write a random model; return its float32 weights as the file stores them
    (after quantization round-trip), keyed by GGUF tensor name. `zero_raw` maps tensor
    names to a GGML type whose zero blocks are stored instead (for unsupported types);
    `random_raw` maps tensor names to IQ4_NL, IQ4_XS, Q2_K or Q3_K, whose blocks (gguf
    cannot quantize them) are written as random bytes with small scales (`random_raw_blocks`).
    `head_dim` (attention.key_length) defaults to n_embd / n_head; gemma3 files get a
    sliding `window` (every 6th layer global, so give them n_layer >= 7 to have both kinds
    on either side). With `rope_scale` > 0, RoPE scaling of kind `rope_type` (of the global
    layers), from `orig_ctx` positions (rope.scaling.original_context_length) when given;
    `rope_freqs` writes Llama 3 frequency factors, `long_factors` phi3's long and short
    ones. phi3 files store Q, K, V in one attn_qkv tensor and gate and up in ffn_up
    (llama.cpp's layout) unless `fused` is False. Without `chat_template` the file is a
    base model's: no tokenizer.chat_template."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(seed)
    vocab = _byte_vocab() + ["he", "<|im_start|>", "<|im_end|>"]
    n_vocab = len(vocab)
    hd = head_dim or n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "gemma3":
        w.add_sliding_window(window)
    if rope_scale:
        w.add_string(gguf.Keys.Rope.SCALING_TYPE.format(arch=arch), rope_type)  # any name, refused ones too
        w.add_rope_scaling_factor(rope_scale)
    if orig_ctx:
        w.add_rope_scaling_orig_ctx_len(orig_ctx)
    attn_factor = 1.0
    if long_factors:  # the converter's longrope attention factor for 256 / orig_ctx
        attn_factor = float(np.sqrt(1 + np.log(256 / orig_ctx) / np.log(orig_ctx))) if orig_ctx < 256 else 1.0
        w.add_rope_scaling_attn_factors(attn_factor)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([1] * 257 + [3, 3])
    w.add_token_merges(["h e"])
    w.add_bos_token_id(n_vocab - 2)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    if chat_template:
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
        if random_raw and name in random_raw:
            raw_type = getattr(gguf.GGMLQuantizationType, random_raw[name])
            raw = random_raw_blocks(rng, random_raw[name], a.shape[0], a.shape[1])
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_type)
            stored[name] = quants.dequantize(raw, raw_type).astype(np.float32).reshape(a.shape)
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

    def fused_or_not(names: list[str], parts: list[np.ndarray], fused_name: str) -> None:
        if arch == "phi3" and fused:
            add(fused_name, np.concatenate(parts))
        else:
            for name, part in zip(names, parts):
                add(name, part)

    add("token_embd.weight", rng.standard_normal((n_vocab, n_embd)))
    if rope_freqs:  # Llama 3.1's rule (factor 8, low 1, high 4) for a 64-token original context
        wavelen = 2 * np.pi * 10000.0 ** (np.arange(0, hd, 2) / hd)
        smooth = np.clip((64 / wavelen - 1) / (4 - 1), 0.0, 1.0)  # 1: high frequencies, kept
        add("rope_freqs.weight", 1 / ((1 - smooth) / 8 + smooth))
    if long_factors:
        add("rope_factors_long.weight", 1 + 3 * rng.random(hd // 2))
        add("rope_factors_short.weight", 1 + 0.2 * rng.random(hd // 2))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
        fused_or_not([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                     [mat(n_head * hd, n_embd), mat(n_kv * hd, n_embd), mat(n_kv * hd, n_embd)],
                     p + "attn_qkv.weight")
        if arch == "qwen2":
            add(p + "attn_q.bias", 0.1 * rng.standard_normal(n_head * hd))
            add(p + "attn_k.bias", 0.1 * rng.standard_normal(n_kv * hd))
            add(p + "attn_v.bias", 0.1 * rng.standard_normal(n_kv * hd))
        if arch in ("qwen3", "gemma3"):
            add(p + "attn_q_norm.weight", 1 + 0.1 * rng.standard_normal(hd))
            add(p + "attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(hd))
        add(p + "attn_output.weight", mat(n_embd, n_head * hd))
        if arch == "gemma3":  # the GGUF stores gemma's (1 + w): used as is
            add(p + "post_attention_norm.weight", 0.5 + 0.1 * rng.standard_normal(n_embd))
            add(p + "post_ffw_norm.weight", 0.5 + 0.1 * rng.standard_normal(n_embd))
        add(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
        fused_or_not([p + "ffn_gate.weight", p + "ffn_up.weight"], [mat(n_ff, n_embd), mat(n_ff, n_embd)],
                      p + "ffn_up.weight")  # phi3: gate rows, then up rows
        add(p + "ffn_down.weight", mat(n_embd, n_ff))
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
    if not tied:
        add("output.weight", mat(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    stored["_meta"] = np.array([n_layer, n_embd, n_head, n_kv, n_ff, hd, window, rope_scale,
                                ["linear", "yarn", "longrope", "none", "dynamic"].index(rope_type), orig_ctx or 256,
                                attn_factor])
    return stored


# The weights' RMS over d for random codes and sub-block scales (kvalues reach 127, IQ4_XS's
# ls - 32 reaches 32, Q3_K's (sc - 32) * q reaches 128, Q2_K's sc * q 45); other types: measured
_RAW_RMS = {"IQ4_NL": 80, "IQ4_XS": 1280, "Q2_K": 13, "Q3_K": 43}


def _measured_rms(qtype: str) -> float:
    """The RMS of gguf's weights of random `qtype` blocks with every f16 scale 1."""
    from gguf import GGMLQuantizationType, quants

    from panechat.backends.quant import registry

    t = registry.get(qtype)
    b = np.random.default_rng(0).integers(0, 256, (64, t.block_bytes), dtype=np.uint8)
    for o in t.f16_at:
        b[:, o:o + 2] = np.array([1.0], np.float16).view(np.uint8)
    return float(np.sqrt(np.mean(quants.dequantize(b, GGMLQuantizationType[qtype]).astype(np.float64) ** 2)))


def random_raw_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, k/block * bytes] blocks of a registered block type (IQ4_NL, IQ4_XS, Q2_K, Q3_K:
    gguf cannot quantize them) as a GGUF file stores them: random codes and sub-block scales,
    each block's f16 d (Q2_K: and dmin, positive as llama.cpp's) drawn so that the weights
    are about 1/sqrt(k)."""
    from panechat.backends.quant import registry

    t = registry.get(qtype)
    (per, size), f16_at = (t.block_weights, t.block_bytes), t.f16_at
    rms = _RAW_RMS.get(qtype) or _measured_rms(qtype)
    b = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    scale = 1 / (np.sqrt(k) * rms)
    for o in f16_at:
        d = rng.uniform(0.5 * scale, 1.5 * scale, b.shape[:2])
        d *= 1 if qtype == "Q2_K" else rng.choice([-1, 1], b.shape[:2])
        b[..., o:o + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(n, -1)


def set_row_length(path: Path, tensor: str, value: int) -> None:
    """Rewrite the innermost dimension (the row length) of 2-D `tensor` in the header of the
    little-endian GGUF at `path`: a damaged file whose tensor data no longer fits its type."""
    import struct

    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", data, at)[0] == 2  # n_dims
    struct.pack_into("<Q", data, at + 4, value)
    path.write_bytes(bytes(data))


def reference_logits(weights: dict[str, np.ndarray], arch: str, tokens: list[int],
                     max_pos: int = 64) -> np.ndarray:
    """float64 logits [T, vocab] for a whole sequence, straight from the equations, for a
    run whose sequences may reach `max_pos` positions (phi3's long or short factors)."""
    n_layer, n_embd, n_head, n_kv, n_ff, hd, window, rope_scale, kind, orig_ctx, attn_factor = \
        weights["_meta"].tolist()
    n_layer, n_embd, n_head, n_kv, n_ff, hd, window = map(int, (n_layer, n_embd, n_head, n_kv, n_ff, hd, window))
    kind = ["linear", "yarn", "longrope", "none", "dynamic"][int(kind)]
    W = {k: v.astype(np.float64) for k, v in weights.items() if k != "_meta"}
    for i in range(n_layer):  # phi3's fused tensors: Q, K, V rows; gate rows, then up rows
        p = f"blk.{i}."
        if p + "attn_qkv.weight" in W:
            W[p + "attn_q.weight"], W[p + "attn_k.weight"], W[p + "attn_v.weight"] = np.split(
                W.pop(p + "attn_qkv.weight"), [n_head * hd, (n_head + n_kv) * hd])
        if p + "ffn_gate.weight" not in W:
            W[p + "ffn_gate.weight"], W[p + "ffn_up.weight"] = np.split(W[p + "ffn_up.weight"], [n_ff])
    gemma = arch == "gemma3"
    T = len(tokens)
    pos = np.arange(T)

    def scaled_inv_freq(inv, base):
        """The global layers' frequencies and cos/sin factor, as transformers scales them."""
        attention = 1.0
        if "rope_freqs.weight" in W:  # llama3
            inv = inv / W["rope_freqs.weight"]
        if "rope_factors_long.weight" in W:  # longrope: the long factors past the original context
            inv = inv / W["rope_factors_long.weight" if max_pos > orig_ctx else "rope_factors_short.weight"]
            attention = attn_factor
        if rope_scale and kind in ("linear", "longrope"):
            inv = inv / rope_scale
        elif rope_scale and kind == "yarn":
            def corr_dim(rotations):
                return hd * np.log(orig_ctx / (rotations * 2 * np.pi)) / (2 * np.log(base))
            low, high = max(np.floor(corr_dim(32)), 0), min(np.ceil(corr_dim(1)), hd - 1)
            extrapolated = 1 - np.clip((np.arange(hd // 2) - low) / (high - low), 0, 1)
            inv = inv / rope_scale * (1 - extrapolated) + inv * extrapolated
            attention = 0.1 * np.log(rope_scale) + 1
        return inv, attention

    def rope_angles(base, scaled=False):
        inv, attention = 1.0 / base ** (np.arange(0, hd, 2) / hd), 1.0
        if scaled:
            inv, attention = scaled_inv_freq(inv, base)
        ang = pos[:, None] * inv[None, :]
        return attention * np.cos(ang)[:, None, :], attention * np.sin(ang)[:, None, :]

    def rope(x, cos, sin):  # x (T, H, hd)
        y = x.copy()
        if arch != "llama":  # NEOX: halves
            a, b = x[..., : hd // 2], x[..., hd // 2:]
            y[..., : hd // 2], y[..., hd // 2:] = a * cos - b * sin, b * cos + a * sin
        else:  # normal: adjacent pairs
            a, b = x[..., 0::2], x[..., 1::2]
            y[..., 0::2], y[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return y

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def gelu(x):  # tanh approximation
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    x = W["token_embd.weight"][tokens] * (np.sqrt(n_embd) if gemma else 1.0)
    ahead = np.arange(T)[None, :] > np.arange(T)[:, None]  # key after query
    behind = np.arange(T)[:, None] - np.arange(T)[None, :] >= window  # key out of the window
    for i in range(n_layer):
        p = f"blk.{i}."
        local = gemma and i % 6 != 5
        if gemma:
            cos, sin = rope_angles(10000.0) if local else rope_angles(1e6, scaled=True)
        else:
            cos, sin = rope_angles(10000.0, scaled=True)
        h = norm(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T + W.get(p + "attn_q.bias", 0)).reshape(T, n_head, hd)
        k = (h @ W[p + "attn_k.weight"].T + W.get(p + "attn_k.bias", 0)).reshape(T, n_kv, hd)
        v = (h @ W[p + "attn_v.weight"].T + W.get(p + "attn_v.bias", 0)).reshape(T, n_kv, hd)
        if p + "attn_q_norm.weight" in W:  # per-head RMS norm (qwen3, gemma3)
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        mask = np.where(ahead | (behind if local else False), -np.inf, 0.0)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, n_head * hd) @ W[p + "attn_output.weight"].T
        x = x + (norm(o, W[p + "post_attention_norm.weight"]) if gemma else o)
        h = norm(x, W[p + "ffn_norm.weight"])
        g = h @ W[p + "ffn_gate.weight"].T
        act = gelu(g) if gemma else g / (1 + np.exp(-g))
        f = (act * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        x = x + (norm(f, W[p + "post_ffw_norm.weight"]) if gemma else f)
    out = W.get("output.weight", W["token_embd.weight"])
    return norm(x, W["output_norm.weight"]) @ out.T

"""A test-only K-quant writer: the default model re-quantized into Q4_K / Q6_K blocks.

Not llama.cpp's quantizer (no search for the best scales): plain min/max scales, rounded
to 6 bits (Q4_K) or int8 (Q6_K), codes rounded to nearest; the blocks are valid ggml
blocks (ggml-common.h layouts, packed as `gguf.quants` unpacks them), which is all the
kernel tests need. Every weight whose rows are whole 256-weight super-blocks is
re-quantized (in SmolLM2-135M only ffn_down, K = 1536: its other weights have K = 576, which
llama.cpp's K-quant files keep in 32-weight types too), alternating Q4_K and Q6_K by layer
as a Q4_K_M mix does; the other tensors are copied as stored.

    .venv/bin/python -m tests.kquant_model OUT.gguf [SRC.gguf]   writes a file for benchmarks
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

QK_K = 256


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> Q4_K blocks uint8 [N, K/256 * 144]."""
    x = w.astype(np.float32).reshape(-1, 8, 32)  # (blocks, sub-block, 32)
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15  # (blocks, 8)
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (-lo.min(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    step, off = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.clip(np.rint(np.divide(x + off, step, out=np.zeros_like(x), where=step > 0)), 0, 15).astype(np.uint8)
    packed = np.empty((len(x), 12), np.uint8)  # inverse of ggml get_scale_min_k4
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    q = q.reshape(-1, 4, 2, 32)  # (blocks, 64-weight chunk, low/high nibble, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], -1)
    return out.reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> Q6_K blocks uint8 [N, K/256 * 210]."""
    x = w.astype(np.float32).reshape(-1, 16, 16)  # (blocks, sub-block, 16)
    scale = np.abs(x).max(-1) / 31  # (blocks, 16)
    d = (scale.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = (np.clip(np.rint(np.divide(x, step, out=np.zeros_like(x), where=step > 0)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # (blocks, half of 128, group of 32, 32)
    low = q & 0x0F
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)  # byte l: group l//32, +64 high nibble
    hi = q >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], -1)
    return out.reshape(w.shape[0], -1)


def kquant_type(name: str, n_in: int) -> str | None:
    """The type this writer gives tensor `name` with rows of n_in weights (None: copied)."""
    if not name.endswith(".weight") or n_in % QK_K or not name.startswith("blk."):
        return None
    return "Q6_K" if int(name.split(".")[1]) % 2 else "Q4_K"


def write_kquant_copy(src: Path, dst: Path) -> dict[str, str]:
    """Write `src` (a GGUF) to `dst` with eligible weights re-quantized; metadata and
    tokenizer copied. Returns {tensor name: new type}."""
    import gguf

    from panechat.engine.gguf.file import GGUFFile

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    gf = GGUFFile.open(src)
    changed = {}
    for t in reader.tensors:
        n_in = int(t.shape[0])
        qtype = kquant_type(t.name, n_in)
        if qtype is None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        w = gf.tensor(t.name).dequantize()
        blocks = (quantize_q4_k if qtype == "Q4_K" else quantize_q6_k)(w)
        writer.add_tensor(t.name, blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])
        changed[t.name] = qtype
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


if __name__ == "__main__":
    from panechat.engine.default_model import resolve_model_path

    out = Path(sys.argv[1])
    source = Path(sys.argv[2]) if len(sys.argv) > 2 else resolve_model_path(None)
    types = write_kquant_copy(source, out)
    print(f"{out}: {len(types)} tensors re-quantized ({', '.join(sorted(set(types.values())))})")

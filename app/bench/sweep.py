"""`panechat bench sweep`: llama-batched-bench's table for our forward pass.

For each B: prefill B sequences of `npp` random tokens (in chunks of 512 rows, as the
engine does), then `ntg` batched decode steps of B rows each (greedy). Columns and
formulas follow llama.cpp's tools/batched-bench: S_PP = B*PP/T_PP, S_TG = B*TG/T_TG.

Sequence 0 has the same prompt in every cell, so its greedy tokens must be the same at
every B: the `same` column says whether they equal the first cell's (batch invariance)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from panechat.engine.default_model import resolve_model_path
from panechat.engine.model.loader import load_model
from panechat.engine.model.forward import Batch

CHUNK = 512


def sweep_cell(model, npp: int, ntg: int, b: int, seed: int = 0) -> dict:
    """Time prefill and decode of one B; returns the row of the table."""
    a = model.args
    kv = model.backend.new_kv(b, a.n_layer, a.n_kv_head, npp + ntg, a.head_dim)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, a.vocab_size, (b, npp)).astype(np.int32)
    rows_tok = tokens.reshape(-1)
    rows_slot = np.repeat(np.arange(b, dtype=np.int32), npp)
    rows_pos = np.tile(np.arange(npp, dtype=np.int32), b)
    t0 = time.perf_counter()
    last = None
    for s in range(0, rows_tok.size, CHUNK):
        e = min(s + CHUNK, rows_tok.size)
        ends = [r - s for r in range(npp - 1, rows_tok.size, npp) if s <= r < e]
        out = model.forward(kv, Batch(rows_tok[s:e], rows_slot[s:e], rows_pos[s:e], np.asarray(ends, np.int64)))
        last = out if last is None else np.concatenate([last, out])
    t_pp = time.perf_counter() - t0
    nxt = last.argmax(-1).astype(np.int32)
    slots = np.arange(b, dtype=np.int32)
    every = np.arange(b, dtype=np.int64)
    seq0 = [int(nxt[0])]
    greedy = _greedy_rows(b) if model.samples_on_device else None
    t0 = time.perf_counter()
    for i in range(ntg):
        batch = Batch(nxt, slots, np.full(b, npp + i, np.int32), every)
        if greedy is None:
            nxt = model.forward(kv, batch).argmax(-1).astype(np.int32)
        else:  # argmax on the device (CuPy): only the ids come back, as in the engine
            nxt = np.ascontiguousarray(model.forward_tokens(kv, batch, *greedy)[:, 0])
        seq0.append(int(nxt[0]))
    t_tg = time.perf_counter() - t0
    return {"PP": npp, "TG": ntg, "B": b, "N_KV": b * (npp + ntg),
            "T_PP": t_pp, "S_PP": b * npp / t_pp, "T_TG": t_tg, "S_TG": b * ntg / t_tg,
            "T": t_pp + t_tg, "S": b * (npp + ntg) / (t_pp + t_tg), "seq0": seq0}


def _greedy_rows(b: int) -> tuple[np.ndarray, ...]:
    """`Model.forward_tokens`'s per-row arrays for b greedy rows."""
    z = np.zeros(b)
    return (z.astype(np.float32), np.ones(b, np.float32), z.astype(np.float32), z.astype(np.int32),
            z.astype(np.uint64), z.astype(np.int64))


def run_sweep(args: argparse.Namespace) -> int:
    try:
        npl = [int(x) for x in str(args.npl).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--npl must be a comma-separated list of integers, got '{args.npl}'") from None
    if not npl or min(npl) < 1 or args.npp < 1 or args.ntg < 1:
        raise ValueError("--npl values, --npp and --ntg must be >= 1")
    lm = load_model(resolve_model_path(args.model), args.backend, max_positions=args.npp + args.ntg)
    model = lm.model
    sweep_cell(model, 16, 4, 2)  # warm-up: kernel compilation and page faults
    rows, first = [], None
    if not args.json:
        print(f"model: {lm.name}  backend: {model.backend.describe()}")
        print(f"{'PP':>5} {'TG':>5} {'B':>4} {'N_KV':>7} {'T_PP s':>8} {'S_PP t/s':>9} "
              f"{'T_TG s':>8} {'S_TG t/s':>9} {'T s':>8} {'S t/s':>8} {'same':>5}")
    for b in npl:
        r = sweep_cell(model, args.npp, args.ntg, b)
        seq0 = r.pop("seq0")
        first = first if rows else seq0
        r["same"] = seq0 == first
        rows.append(r)
        if not args.json:
            print(f"{r['PP']:>5} {r['TG']:>5} {r['B']:>4} {r['N_KV']:>7} {r['T_PP']:>8.3f} {r['S_PP']:>9.2f} "
                  f"{r['T_TG']:>8.3f} {r['S_TG']:>9.2f} {r['T']:>8.3f} {r['S']:>8.2f} {'yes' if r['same'] else 'NO':>5}",
                  flush=True)
    if args.json:
        print(json.dumps({"model": lm.name, "backend": model.backend.describe(), "rows": rows}))
    return 0

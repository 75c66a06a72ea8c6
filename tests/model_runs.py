"""Runs that every backend's tests share (mlx-lm `test_models.py` style): the same
forward-pass drivers and golden comparison, whatever the backend under test."""

from __future__ import annotations

import numpy as np

from panechat.engine.model.forward import Batch, Model


def forward_chunks(model: Model, tokens: list[int], chunk: int, ctx: int = 64, kv_dtype: str = "f32") -> np.ndarray:
    """Logits for every token of one sequence, prefilled `chunk` tokens per pass (float32 KV
    by default: these runs are compared with float64 references)."""
    a = model.args
    kv = model.backend.new_kv(1, a.n_layer, a.n_kv_head, ctx, a.head_dim, kv_dtype)
    out = []
    for s in range(0, len(tokens), chunk):
        t = np.asarray(tokens[s:s + chunk], np.int32)
        n = len(t)
        out.append(model.forward(kv, Batch(t, np.zeros(n, np.int32), np.arange(s, s + n, dtype=np.int32),
                                           np.arange(n))))
    return np.concatenate(out)


def teacher_forced_logits(model: Model, prompt_ids: list[int], tokens: list[int],
                          kv_dtype: str = "f16") -> np.ndarray:
    """Logits predicting each of `tokens`, from one pass over prompt + tokens (float16 KV,
    the engine's default and llama.cpp's)."""
    ids = list(prompt_ids) + list(tokens)
    n, p = len(ids), len(prompt_ids)
    kv = model.backend.new_kv(1, model.args.n_layer, model.args.n_kv_head, n, model.args.head_dim, kv_dtype)
    return model.forward(kv, Batch(np.asarray(ids, np.int32), np.zeros(n, np.int32),
                                   np.arange(n, dtype=np.int32), np.arange(p - 1, n - 1)))


def golden_agreement(model: Model, cases: list[dict]) -> tuple[int, int, list, list]:
    """Teacher-forced comparison with llama.cpp's greedy cases (tests/data/GOLDEN_README.md):
    (steps agreeing on top-1, steps, disagreements where llama.cpp's top1-top2 margin is
    >= 0.5, per-step largest |logprob difference| over llama.cpp's top 5)."""
    agree = total = 0
    misses, gaps = [], []
    for case in cases:
        logp = teacher_forced_logits(model, case["prompt_ids"], case["tokens"]).astype(np.float64)
        logp -= logp.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for i, step in enumerate(case["steps"]):
            top = step["top"]
            ours = int(np.argmax(logp[i]))
            total += 1
            agree += ours == top[0][0]
            if top[0][1] - top[1][1] >= 0.5 and ours != top[0][0]:
                prompt = case["prompt"] if "prompt" in case else case["messages"][-1]["content"]
                misses.append((prompt, i, ours, top[0][0]))
            gaps.append(max(abs(logp[i][t] - lp) for t, lp in top))
    return agree, total, misses, gaps


def run_batched(model: Model, kv, seqs: list[list[int]], steps: int, order_seed: int) -> list[list[np.ndarray]]:
    """Prefill every sequence (slot i) in one batch, then `steps` greedy decode steps with
    all sequences in one batch per step, rows in a shuffled order each step.
    Returns logits[seq][step]."""
    rng = np.random.default_rng(order_seed)
    toks = [list(s) for s in seqs]
    out: list[list[np.ndarray]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    for _ in range(steps + 1):
        order = rng.permutation(len(seqs))
        tokens, slots, positions, last = [], [], [], []
        for i in order:
            new = toks[i][done[i]:]
            tokens += new
            slots += [i] * len(new)
            positions += list(range(done[i], done[i] + len(new)))
            last.append(len(tokens) - 1)
            done[i] = len(toks[i])
        logits = model.forward(kv, Batch(np.array(tokens, np.int32), np.array(slots, np.int32),
                                         np.array(positions, np.int32), np.array(last)))
        for row, i in enumerate(order):
            out[i].append(logits[row].copy())
            toks[i].append(int(np.argmax(logits[row])))
    return out


def new_kv(model: Model, n_slots: int, ctx: int = 128):
    a = model.args
    return model.backend.new_kv(n_slots, a.n_layer, a.n_kv_head, ctx, a.head_dim)

"""Start-up proof that batching does not change the answer on the running backend.

Runs a sequence alone, then the same sequence inside a mixed batch (other sequences'
prefill and decode rows around it, at another row position), and compares the logits
bit for bit; a decode row also beside another sequence's prefill chunk, which takes the
op-by-op path where a decode-only step may run in one call. The engine turns batching off when this fails.

`check_speculation` proves what exact speculative decoding relies on: k+1 rows of one
sequence (a decode row and its drafts, positions L..L+k) give the logits of k+1 single
decode steps bit for bit, alone (in the one-call step where the model has one, and op by
op) and beside another sequence's decode row.

`check_one_call_step` compares the one-call decode step with op by op directly: a
difference condemns that step, not batching, and the engine turns the step off.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from panechat.engine.model.forward import Batch, Model


def check_model_invariance(model: Model, kv: Any) -> str | None:
    """None when rows are batch-invariant; else a one-line description. Uses KV blocks
    0..2 of the paged store `kv` (in a shuffled block table), whose contents it leaves
    undefined (callers run it before serving)."""
    problem = model.backend.self_check(model.weight_samples)
    if problem:
        return problem
    if kv.n_blocks < 3:
        return None  # a single-sequence engine cannot batch anyway
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    seq = rng.integers(0, vocab, 6).astype(np.int32)
    others = [rng.integers(0, vocab, n).astype(np.int32) for n in (4, 9)]

    alone = model.forward(kv, _rows([(0, seq, 0)]))[0]
    mixed = model.forward(kv, _rows([(1, others[0], 0), (0, seq, 0), (2, others[1], 0)]))[1]
    if not np.array_equal(alone, mixed):
        return f"prefill logits differ alone vs batched (max |diff| {np.abs(alone - mixed).max():.3g})"
    nxt = np.array([int(np.argmax(alone))], np.int32)
    alone = model.forward(kv, _rows([(0, nxt, len(seq))]))[0]
    mixed = model.forward(kv, _rows([(2, others[1][:1], len(others[1])), (1, others[0][:1], 4),
                                     (0, nxt, len(seq))]))[2]
    if not np.array_equal(alone, mixed):
        return f"decode logits differ alone vs batched (max |diff| {np.abs(alone - mixed).max():.3g})"
    # beside another sequence's two-row chunk the step runs op by op (a decode-only step
    # may run in one backend call: Backend.run_decoder): the same bits either way
    beside = model.forward(kv, _rows([(1, others[0][:2], 4), (0, nxt, len(seq))]))[1]
    if not np.array_equal(alone, beside):
        return ("decode logits differ beside a prefill chunk from a decode-only step "
                f"(max |diff| {np.abs(alone - beside).max():.3g})")
    return None


def check_one_call_step(model: Model, kv: Any) -> str | None:
    """None when the model's one-call decode step (`Backend.run_decoder`) gives op by op's
    logits bit for bit, or it has none; else a one-line description. Uses KV blocks 0..2
    of `kv` as `check_model_invariance` does. (Its steps with several rows of a sequence
    are speculation's verify steps: `check_speculation` proves those.)"""
    if model.decoder is None or kv.n_blocks < 3:
        return None
    rng = np.random.default_rng(1)
    vocab = model.args.vocab_size
    prompts = [rng.integers(0, vocab, n).astype(np.int32) for n in (6, 11)]
    model.forward(kv, _rows([(0, prompts[0], 0), (1, prompts[1], 0)]))  # a prefill: op by op
    step = _rows([(s, rng.integers(0, vocab, 1).astype(np.int32), len(p)) for s, p in enumerate(prompts)])
    one_call = model.forward(kv, step)
    ops = _op_by_op(model, kv, step)  # rewrites the step's K and V: the same bits when the step is right
    if np.array_equal(one_call.view(np.uint32), ops.view(np.uint32)):
        return None
    return f"the one-call decode step's logits differ from op by op's (max |diff| {np.abs(one_call - ops).max():.3g})"


def _op_by_op(model: Model, kv: Any, batch: Batch) -> np.ndarray:
    """`model.forward` with its one-call decode step off."""
    plan, model.decoder = model.decoder, None
    try:
        return model.forward(kv, batch)
    finally:
        model.decoder = plan


def check_speculation(model: Model, kv: Any, k: int = 4) -> str | None:
    """None when k+1 rows of one sequence in one pass give each row the logits its single
    decode step gives; else a one-line description. Uses KV blocks 0..2 of `kv` as
    `check_model_invariance` does."""
    if kv.n_blocks < 3:
        return None
    rng = np.random.default_rng(2)
    vocab = model.args.vocab_size
    prompt, other = rng.integers(0, vocab, 5).astype(np.int32), rng.integers(0, vocab, 7).astype(np.int32)
    run = rng.integers(0, vocab, k + 1).astype(np.int32)  # the decode token, then k drafts
    model.forward(kv, _rows([(0, prompt, 0), (1, other, 0)]))
    single = np.stack([model.forward(kv, _rows([(0, run[j:j + 1], len(prompt) + j)]))[0] for j in range(k + 1)])
    verify = _every_row(_rows([(0, run, len(prompt))]))
    alone = model.forward(kv, verify)  # the one-call step, where the model has one
    if not np.array_equal(single.view(np.uint32), alone.view(np.uint32)):
        return (f"{k + 1} rows of one sequence differ from {k + 1} single decode steps "
                f"(max |diff| {np.abs(single - alone).max():.3g})")
    if model.decoder is not None:  # a verify step beside another's prefill chunk runs op by op
        ops = _op_by_op(model, kv, verify)
        if not np.array_equal(single.view(np.uint32), ops.view(np.uint32)):
            return (f"{k + 1} rows of one sequence op by op differ from {k + 1} single decode steps "
                    f"(max |diff| {np.abs(single - ops).max():.3g})")
    beside = model.forward(kv, _every_row(_rows([(1, other[:1], len(other)), (0, run, len(prompt))])))[1:]
    if not np.array_equal(single.view(np.uint32), beside.view(np.uint32)):
        return (f"{k + 1} rows of one sequence beside another's decode row differ from single steps "
                f"(max |diff| {np.abs(single - beside).max():.3g})")
    return None


_TABLES = np.array([[2], [0], [1]], np.int32)  # sequence i's one block: not block i


def _every_row(batch: Batch) -> Batch:
    """`batch` with every row's logits wanted, in row order (a decode-shaped step)."""
    return replace(batch, logit_rows=np.arange(len(batch.tokens), dtype=np.int64))


def _rows(parts: list[tuple[int, np.ndarray, int]]) -> Batch:
    """(sequence, tokens, first position) per sequence -> one Batch with each one's last row."""
    tokens, seqs, positions, last = [], [], [], []
    for seq, toks, start in parts:
        tokens.extend(toks.tolist())
        seqs.extend([seq] * len(toks))
        positions.extend(range(start, start + len(toks)))
        last.append(len(tokens) - 1)
    return Batch(np.asarray(tokens, np.int32), np.asarray(seqs, np.int32),
                 np.asarray(positions, np.int32), np.asarray(last, np.int64), _TABLES)

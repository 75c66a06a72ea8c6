"""The cost side of speculative decoding: a verify step (one sequence's decode row and its
k drafts, k+1 rows of one forward pass) against a plain one-row step, timed on the model
itself without an engine, so a random-weight shape model measures it too.

Each repeat times a one-row step and the verify step in turn, so the machine's load drifts
over both alike; then (where the backend has a one-call step) the verify step op by op is
timed on its own: interleaved, the op-by-op kernels' OpenMP threads, still spinning after
them, took the cores from the next one-row step and made it look 1.5x as dear (a 5-row
verify step read 1.27x a one-row step on the default model instead of 2.1x). The medians
are reported.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from panechat.engine.model.forward import Batch, Model

CONTEXT = 64  # positions already in the sequence: a short reply's attention


def verify_cost(model: Model, rows: int = 5, repeats: int = 15) -> dict:
    """Median milliseconds of a one-row step and of a `rows`-row verify step of one
    sequence (and op by op, None without a one-call step), their ratio, and whether the
    backend's one-call step took the verify rows."""
    a, be = model.args, model.backend
    kv = be.new_kv(1, a.n_layer, a.n_kv_head, CONTEXT + rows + 1, a.head_dim, "f16")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, a.vocab_size, CONTEXT).astype(np.int32)
    model.forward(kv, _rows(prompt, 0, [CONTEXT - 1]))

    def step(n: int) -> float:
        batch = _rows(rng.integers(0, a.vocab_size, n).astype(np.int32), CONTEXT, list(range(n)))
        t0 = time.perf_counter()
        model.forward(kv, batch)  # rewrites positions CONTEXT.. each time
        return (time.perf_counter() - t0) * 1000

    verify = _rows(np.zeros(rows, np.int32), CONTEXT, list(range(rows)))
    x = be.embed(model.token_embd, verify.tokens)
    one_call = model.decoder is not None and be.run_decoder(model.decoder, kv, x, verify.slots, verify.positions,
                                                            verify.block_tables) is not None
    one, many, ops = [], [], []
    for _ in range(repeats):
        one.append(step(1))
        many.append(step(rows))
    if model.decoder is not None:  # apart: the op-by-op kernels' OpenMP team spins on after
        plan, model.decoder = model.decoder, None  # them and slowed the next one-call step
        try:
            ops = [step(rows) for _ in range(repeats)]
        finally:
            model.decoder = plan
    one_ms, many_ms = statistics.median(one), statistics.median(many)
    return {"rows": rows, "one_row_ms": one_ms, "verify_ms": many_ms, "ratio": many_ms / one_ms,
            "verify_op_by_op_ms": statistics.median(ops) if ops else None, "one_call": one_call}


def describe(cost: dict) -> str:
    """One line for the terminal."""
    line = (f"verify step: {cost['rows']} rows of one sequence {cost['verify_ms']:.1f} ms = {cost['ratio']:.2f}x "
            f"a one-row step ({cost['one_row_ms']:.1f} ms), "
            f"{'in one call' if cost['one_call'] else 'op by op'}")
    if cost["verify_op_by_op_ms"] is not None:
        line += f"; op by op {cost['verify_op_by_op_ms']:.1f} ms"
    return line


def _rows(tokens: np.ndarray, start: int, logit_rows: list[int]) -> Batch:
    n = len(tokens)
    return Batch(tokens, np.zeros(n, np.int32), np.arange(start, start + n, dtype=np.int32),
                 np.asarray(logit_rows, np.int64))

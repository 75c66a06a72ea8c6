"""The backend half of the start-up proof that batching never changes an answer, written
once against the `Backend` interface for every backend (vLLM's batch-invariance suite:
a row alone vs the same row inside batches of other sizes and at other positions, compared
bit for bit).

It covers the operations whose reductions a kernel could reorder with the batch: `linear`
for each weight type, `rms_norm`, and `write_kv` + `attend` (rows of other slots and
positions around, prefill rows vs one at a time). What differs per backend is only which
shapes cross its kernel choices: its `CheckPlan`. engine/model/invariance.py then checks a whole
model on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from panechat.backends.errors import one_line
from panechat.backends.quant.gguf_tensor import GGUFTensor

if TYPE_CHECKING:
    from panechat.backends.base import Backend


@dataclass(frozen=True)
class AttentionCase:
    """A KV store of `n_slots` slots [n_kv, ctx, head_dim] filled with random keys and
    values; probe row i sits in slot i at position `probes[i]`, other rows in the
    remaining slots (so they never write where a probe reads). `window` > 0: sliding-window
    attention over that many keys (gemma3's local layers)."""

    n_slots: int
    n_kv: int
    ctx: int
    head_dim: int
    n_head: int
    probes: tuple[int, ...]
    window: int = 0


@dataclass(frozen=True)
class CheckPlan:
    """The shapes a backend's self-check runs: batch sizes that cross its kernels' row
    limits, weights (GGUF type, N, K) that reach each kernel variant, norm widths, and
    attention cases."""

    batches: tuple[int, ...] = (2, 3, 5, 8, 17, 32, 64)  # 64: Q4_K's AMX form (packed256.Q4K_AMX_MIN_ROWS)
    linear: tuple[tuple[str, int, int], ...] = (
        ("F32", 70, 96), ("F32", 64, 200),  # leftover columns; a K tail
        ("Q8_0", 70, 128), ("Q4_0", 64, 192), ("Q4_1", 64, 192))  # K/32 even: the AMX forms (amx_blocks32) at 17, 32, 64
    norm_widths: tuple[int, ...] = (300,)
    attention: tuple[AttentionCase, ...] = (AttentionCase(4, 2, 80, 40, 6, (37,)),
                                            AttentionCase(4, 2, 80, 40, 6, (37,), window=21))
    prefill: int = 24  # consecutive rows of one slot in one call vs each alone
    wide_batches: tuple[int, ...] | None = None  # for weights of N > 1000 rows; None: `batches`


def check_batch_invariance(be: Backend, plan: CheckPlan, seed: int = 1234,
                           weights: Sequence[GGUFTensor] = ()) -> str | None:
    """None when every row of every probe is bit-identical alone and batched on `be`,
    else the first difference in one line (an exception counts as a failed check).
    `weights` (a model's `weight_samples`): multiplied too, and then the plan's made-up
    weights only of the types among them."""
    rng = np.random.default_rng(seed)
    try:
        return (_check_linear(be, plan, rng, weights) or _check_norm(be, plan, rng)
                or _check_attention(be, plan, rng))
    except Exception as e:  # a kernel that cannot run is a failed check, not a crash
        return f"{be.name} self-check raised {one_line(e, with_type=True)}"


def _rows_agree(name: str, run: Callable[[np.ndarray], np.ndarray], x: np.ndarray,
                batches: tuple[int, ...]) -> str | None:
    """run(rows) -> host results; every row of x alone vs inside slices of each batch
    size taken at the start, middle and end of x."""
    alone = [run(x[i:i + 1])[0] for i in range(len(x))]
    for size in batches:
        for start in sorted({0, (len(x) - size) // 2, len(x) - size}):
            got = run(x[start:start + size])
            for j in range(size):
                if not np.array_equal(got[j], alone[start + j]):
                    return f"{name}: row {start + j} differs alone vs at row {j} of a batch of {size}"
    return None


def _check_linear(be: Backend, plan: CheckPlan, rng: np.random.Generator,
                  weights: Sequence[GGUFTensor] = ()) -> str | None:
    used = {t.qtype for t in weights}
    probes = [(f"linear {qtype} {n}x{k}", GGUFTensor.from_array(
        rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)), qtype))
        for qtype, n, k in plan.linear if not weights or qtype in used]
    probes += [(f"linear {t.qtype} {t.shape[0]}x{t.shape[1]} ({t.name})", t) for t in weights]
    for name, t in probes:
        n, k = t.shape
        w = be.linear_weight(t)
        batches = plan.wide_batches if n > 1000 and plan.wide_batches else plan.batches
        x = rng.standard_normal((max(batches), k), dtype=np.float32)
        err = _rows_agree(name, lambda r, w=w: be.to_numpy(be.linear(be.asarray(r), w)), x, batches)
        if err:
            return err
    return None


def _check_norm(be: Backend, plan: CheckPlan, rng: np.random.Generator) -> str | None:
    for d in plan.norm_widths:
        g = be.asarray(rng.standard_normal(d, dtype=np.float32))
        x = rng.standard_normal((max(plan.batches), d), dtype=np.float32)
        err = _rows_agree(f"rms_norm D={d}", lambda r, g=g: be.to_numpy(be.rms_norm(be.asarray(r), g, 1e-5)),
                          x, plan.batches)
        if err:
            return err
    return None


def _check_attention(be: Backend, plan: CheckPlan, rng: np.random.Generator) -> str | None:
    for c in plan.attention:
        S, G, C, D, H = c.n_slots, c.n_kv, c.ctx, c.head_dim, c.n_head
        name = f"attention H={H} G={G} D={D}" + (f" window={c.window}" if c.window else "")
        kv = be.new_kv(S, 1, G, C, D)
        for slot in range(S):  # random keys and values at every position of every slot
            be.write_kv(kv, 0, be.asarray(rng.standard_normal((C, G, D), dtype=np.float32)),
                        be.asarray(rng.standard_normal((C, G, D), dtype=np.float32)),
                        be.asarray(np.full(C, slot, np.int32)), be.asarray(np.arange(C, dtype=np.int32)))

        def row(slot: int, pos: int) -> tuple:
            return (slot, pos, rng.standard_normal((H, D), dtype=np.float32),
                    rng.standard_normal((G, D), dtype=np.float32), rng.standard_normal((G, D), dtype=np.float32))

        def run(rows: list[tuple], kv=kv, D=D, window=c.window) -> np.ndarray:
            q, k, v = (be.asarray(np.stack([r[i] for r in rows])) for i in (2, 3, 4))
            return be.to_numpy(be.attend(kv, 0, q, k, v, be.asarray(np.array([r[0] for r in rows], np.int32)),
                                         be.asarray(np.array([r[1] for r in rows], np.int32)), D ** -0.5,
                                         window))

        probes = [row(slot, pos) for slot, pos in enumerate(c.probes)]
        alone = [run([p])[0] for p in probes]
        for size in plan.batches:
            rows = [row(int(rng.integers(len(probes), S)), int(rng.integers(C))) for _ in range(size)]
            at = rng.choice(size, min(size, len(probes)), replace=False)
            for i, j in enumerate(at):
                rows[j] = probes[i]
            got = run(rows)
            for i, j in enumerate(at):
                if not np.array_equal(got[j], alone[i]):
                    return f"{name}: position {c.probes[i]} differs alone vs at row {j} of a batch of {size}"
        n, p0 = plan.prefill, 7  # then a prefill chunk of slot 0 vs its rows one at a time
        chunk = [row(0, p0 + i) for i in range(n)]
        full = run(chunk)  # leaves every chunk row's K, V in the cache
        for i in (0, n // 2, n - 1):
            if not np.array_equal(full[i], run([chunk[i]])[0]):
                return f"{name}: prefill row {i} of {n} differs from the same row alone"
    return None

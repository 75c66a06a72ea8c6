"""The promise: a sequence's logits are bit-identical alone or inside any batch.

vLLM's batch-invariance suite style: each sequence alone, then all of them together at
rotating row positions beside extra sequences, logits compared with exact equality;
and the inverse test: with a non-invariant kernel (OpenBLAS GEMM) a difference shows."""

import numpy as np
import pytest

from panechat.backends.cpu.numpy_backend import NumpyBackend, StackedGemvBackend
from panechat.engine.model.invariance import check_model_invariance
from panechat.engine.model.forward import Model

from ..model_runs import new_kv, run_batched
from ..tiny_gguf import ROPE_VARIANTS, write_tiny_gguf

PROMPTS = [[1, 9690, 198, 2683, 359, 253], [1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198],
           [504, 2365, 6354], [28120, 198, 6693, 1116, 216, 2899, 5600, 4861, 4966]]
EXTRA = [[57, 5248, 2090], [19556, 905, 30, 338, 314, 260, 12619]]


class GemmBackend(StackedGemvBackend):
    """Deliberately not invariant: one OpenBLAS sgemm over all rows."""

    def linear(self, x, w):
        return np.ascontiguousarray(x) @ w.T


@pytest.fixture(scope="module")
def model(model_path):
    from panechat.engine.gguf.file import GGUFFile

    return Model.load(GGUFFile.open(model_path), NumpyBackend(), max_positions=128)


def test_logits_bit_identical_alone_vs_batched(model):
    """4 sequences x 12 decode steps: alone vs together (+ 0..2 extra sequences), rows in
    random order every step: every logit of every step is bit-identical."""
    steps = 12
    alone = [run_batched(model, new_kv(model, 1), [p], steps, 0)[0] for p in PROMPTS]
    for extra, seed in ((0, 1), (2, 2)):
        together = run_batched(model, new_kv(model, 6), PROMPTS + EXTRA[:extra], steps, seed)
        for i in range(len(PROMPTS)):
            for s in range(steps + 1):
                assert np.array_equal(alone[i][s], together[i][s]), f"seq {i} step {s} with {extra} extra"


def test_logits_bit_identical_at_any_thread_count(model, monkeypatch):
    """The CPU backend changes its kernel thread count while it runs (cpu_threads.py):
    the same batch at 1 thread and at every thread gives the same bits."""
    import numba

    most = numba.config.NUMBA_NUM_THREADS
    if most < 2:
        pytest.skip("one CPU thread only")
    monkeypatch.setattr(model.backend, "governor", None)  # hold the count where the test sets it
    runs = []
    try:
        for n in (1, most):
            numba.set_num_threads(n)
            runs.append(run_batched(model, new_kv(model, 6), PROMPTS + EXTRA, 6, 1))
    finally:
        numba.set_num_threads(most)
    for i, (a, b) in enumerate(zip(*runs)):
        for s, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x, y), f"seq {i} step {s}: 1 thread vs {most}"


def test_inverse_gemm_kernel_breaks_invariance(model_path):
    """With OpenBLAS GEMM for the matmuls, the same comparison finds differences, and the
    start-up self-check notices: proof that the tests above can fail."""
    from panechat.engine.gguf.file import GGUFFile

    gemm = Model.load(GGUFFile.open(model_path), GemmBackend(), max_positions=128)
    alone = [run_batched(gemm, new_kv(gemm, 1), [p], 4, 0)[0] for p in PROMPTS]
    together = run_batched(gemm, new_kv(gemm, 6), PROMPTS + EXTRA, 4, 3)
    differs = any(not np.array_equal(alone[i][s], together[i][s]) for i in range(4) for s in range(5))
    assert differs
    assert check_model_invariance(gemm, new_kv(gemm, 3)) is not None


def test_startup_self_check_passes(model):
    assert model.decoder is not None  # the one-call decode step is what the decode checks run
    assert check_model_invariance(model, new_kv(model, 3)) is None


def test_startup_self_check_notices_a_one_call_step_unlike_op_by_op(model, monkeypatch):
    """A one-call decode step one ulp off the op-by-op path passes the alone-vs-batched
    checks (both run in one call) and is caught by the check beside a prefill chunk."""
    real = model.backend.run_decoder

    def one_ulp_off(*args):
        out = real(*args)
        return None if out is None else np.nextafter(out, np.float32(np.inf))

    monkeypatch.setattr(model.backend, "run_decoder", one_ulp_off)
    problem = check_model_invariance(model, new_kv(model, 3))
    assert problem is not None and "beside a prefill chunk" in problem


@pytest.mark.parametrize("arch", ["gemma3", "qwen3", "phi3", *ROPE_VARIANTS])
def test_tiny_architectures_bit_identical_alone_vs_batched(tiny, tmp_path, arch):
    """The same promise for the other architectures' differences (per-head q/k norms,
    post-norms, GELU, gemma3's 5-key sliding window that every sequence here crosses,
    phi3's fused weights split at load) and for scaled RoPE tables."""
    from panechat.engine.gguf.file import GGUFFile

    if arch in ROPE_VARIANTS:
        path = tmp_path / f"{arch}.gguf"
        write_tiny_gguf(path, qtype="Q8_0", seed=3, **ROPE_VARIANTS[arch])
    else:
        path, _ = tiny(arch, "Q8_0")
    model = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=128)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.args.vocab_size, n).tolist() for n in (3, 9, 17, 30)]
    alone = [run_batched(model, new_kv(model, 1), [p], 8, 0)[0] for p in prompts]
    together = run_batched(model, new_kv(model, 5), prompts + [[5, 6, 7]], 8, 4)
    for i in range(len(prompts)):
        for s in range(9):
            assert np.array_equal(alone[i][s], together[i][s]), f"seq {i} step {s}"

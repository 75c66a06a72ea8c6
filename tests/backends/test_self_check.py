"""The one batch-invariance self-check (backends/self_check.py) that every backend runs:
it passes on each backend, and it notices an operation whose rows change with the batch."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.cpu.numpy_backend import NumpyBackend, StackedGemvBackend
from panechat.backends.self_check import AttentionCase, CheckPlan, check_batch_invariance


def _mlx():
    pytest.importorskip("mlx.core")
    from panechat.backends.mlx.mlx_backend import MLXBackend

    return MLXBackend()


BACKENDS = {"numpy": NumpyBackend, "stacked-gemv": StackedGemvBackend,
            "cupy-emulated": CupyBackend.emulated_on_cpu, "mlx": _mlx}
SMALL = CheckPlan(batches=(2, 5), linear=(("F32", 8, 64), ("Q8_0", 8, 64)), norm_widths=(64,),
                  attention=(AttentionCase(3, 1, 40, 32, 2, (20,)),), prefill=8)


@pytest.mark.parametrize("backend", ["stacked-gemv", "mlx"])  # numpy, cupy: in their own tests
def test_passes_with_the_backends_own_plan(backend):
    assert BACKENDS[backend]().self_check() is None


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("op,found", [("linear", "linear Q8_0 8x64"), ("rms_norm", "rms_norm D=64"),
                                      ("attend", "attention H=2 G=1 D=32")])
def test_a_row_that_changes_with_the_batch_is_found(backend, op, found, monkeypatch):
    be = BACKENDS[backend]()
    assert check_batch_invariance(be, SMALL) is None
    weights: list = []
    real_weight, real = be.linear_weight, getattr(be, op)
    monkeypatch.setattr(be, "linear_weight", lambda t: weights.append(real_weight(t)) or weights[-1])

    def drifting(*args):  # rows 1e-6 larger in batches of more than 4 (linear: the 2nd weight only)
        y = real(*args)
        rows = args[2] if op == "attend" else args[0]
        if rows.shape[0] > 4 and (op != "linear" or args[1] is weights[-1] and len(weights) == 2):
            return y * (1 + 1e-6)
        return y

    monkeypatch.setattr(be, op, drifting)
    problem = check_batch_invariance(be, SMALL)
    assert problem and problem.startswith(found) and "differs" in problem, problem


def test_an_exception_is_a_failed_check():
    class Broken(StackedGemvBackend):
        def rms_norm(self, x, weight, eps):
            raise RuntimeError("no kernel\nfor this")

    problem = Broken().self_check()
    assert problem == "numpy self-check raised RuntimeError: no kernel"


def test_the_model_check_reports_the_backend_check_first(tiny):
    from panechat.engine.gguf.file import GGUFFile
    from panechat.engine.model.invariance import check_model_invariance
    from panechat.engine.model.forward import Model

    class Drifting(StackedGemvBackend):
        def rms_norm(self, x, weight, eps):
            y = super().rms_norm(x, weight, eps)
            return y * np.float32(1 + 1e-6) if x.shape[0] > 4 else y

    path, _ = tiny("llama", "Q8_0")
    model = Model.load(GGUFFile.open(path), Drifting(), max_positions=64)
    a = model.args
    problem = check_model_invariance(model, model.backend.new_kv(3, a.n_layer, a.n_kv_head, 64, a.head_dim))
    assert problem and problem.startswith("rms_norm")


def test_a_models_own_weights_are_checked_and_only_its_types_of_the_plan(gemma_path):
    """The start-up check multiplies a few rows of the model's own matrices, one per stored
    type (gemma3: Q5_0, Q4_K, Q6_K, Q8_0; the plan has none of the K-quants), and the plan's
    made-up weights only of those types: a Q6_K kernel whose batched rows drift is found, and a
    broken kernel of a type the model does not use (Q4_0) is never run."""
    from panechat.engine.gguf.file import GGUFFile
    from panechat.engine.model.forward import Model

    class Drifting(NumpyBackend):
        def linear(self, x, w):
            if getattr(w, "qtype", None) == "Q4_0":
                raise RuntimeError("the Q4_0 kernel is broken")
            y = super().linear(x, w)
            drifts = self.drift is not None and self.drift == getattr(w, "qtype", None) and x.shape[0] > 4
            return y * np.float32(1 + 1e-6) if drifts else y

    model = Model.load(GGUFFile.open(gemma_path), NumpyBackend(), max_positions=64)
    samples = model.weight_samples
    assert sorted(t.qtype for t in samples) == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    assert all(t.shape[0] == 70 for t in samples)  # each a view of its tensor's first rows
    be = Drifting()
    be.drift = None
    assert be.self_check(samples) is None  # Q4_0 is in the plan but not in the model: never run
    assert be.self_check().startswith("numpy self-check raised RuntimeError: the Q4_0 kernel")
    be.drift = "Q6_K"
    problem = be.self_check(samples)
    assert problem and problem.startswith("linear Q6_K 70x") and "differs" in problem, problem

"""The checks every block type of the quant-type registry gets, parametrized from the
registry itself (backends/quant/registry.py), so a newly registered type gets them all:
its entry agrees with gguf (id, block geometry); its CPU loader gives gguf's float32
weights bit for bit under adversarial scales; its kernels give the float32 kernel's
product at rows 1..33 on one thread and two; and a tiny model with a layer of each type
runs its one-call decode step bit for bit as its op-by-op step.

The kernel checks compile each type's two big kernels (about a minute a type on a cold
cache). `make test` runs them for the types of the shipped models (SHIPPED_TYPES: what a
user's default and gemma3 runs use); the other types' kernels and the every-type model
are `slow` (`make test-slow`), so the CI suite keeps to its budget. Their loaders are
checked in every run."""

import numba
import numpy as np
import pytest

from panechat.backends.cpu.generated import loader_of
from panechat.backends.cpu import repack
from panechat.backends.quant import registry

from .raw_types import (assert_kernels_are_linear_at_every_row_count, assert_loader_is_gguf_any_scale,
                        assert_one_call_equals_ops, tiny_model)


def _gguf_type(name):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType.__members__.get(name)


BLOCK_TYPES = [t.name for t in registry.block_types()]
GGUF_BLOCK_TYPES = [n for n in BLOCK_TYPES if _gguf_type(n) is not None]  # gguf dequantizes these
#: the block types of SmolLM2-135M-Instruct.Q4_1 (Q4_1, Q8_0) and gemma-3-270m Q4_K_M (Q5_0,
#: Q4_K, Q6_K, Q8_0): their kernels are checked in every run, the others' in `make test-slow`
SHIPPED_TYPES = ("Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")


def _slow_unless_shipped(names):
    return [n if n in SHIPPED_TYPES else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", [t.name for t in registry.types()])
def test_entry_agrees_with_gguf(name):
    from gguf import GGML_QUANT_SIZES

    t, g = registry.get(name), _gguf_type(name)
    assert g is not None and t.type_id == g.value and (t.block_weights, t.block_bytes) == GGML_QUANT_SIZES[g]
    assert registry.by_id(t.type_id) is t
    assert all(0 <= o <= t.block_bytes - 2 for o in t.f16_at)


@pytest.mark.parametrize("name", GGUF_BLOCK_TYPES)
def test_loader_weights_are_gguf_dequantize_any_scale(name):
    t = registry.get(name)
    assert_loader_is_gguf_any_scale(loader_of(t), name, 60, t.f16_at[0], t.block_bytes)


@pytest.mark.parametrize("name", _slow_unless_shipped(GGUF_BLOCK_TYPES))
def test_kernels_equal_linear_at_every_row_count(name):
    assert_kernels_are_linear_at_every_row_count(name, 61)


TYPE_SETS = {"shipped": [n for n in GGUF_BLOCK_TYPES if n in SHIPPED_TYPES], "every": GGUF_BLOCK_TYPES}


@pytest.fixture(scope="module", params=["shipped", pytest.param("every", marks=pytest.mark.slow)])
def every_type_model(request, tmp_path_factory):
    """A tiny llama whose layer i matrices are all of the set's i-th type (random blocks):
    (model, file, types)."""
    types = TYPE_SETS[request.param]
    model, gf = tiny_model(tmp_path_factory.mktemp("types") / "types.gguf", types, 11)
    return model, gf, types


def test_every_type_model_runs_the_one_call_step(every_type_model):
    model, gf, types = every_type_model
    assert [model.layers[i].ffn_down.qtype for i in range(len(types))] == types
    for i, qtype in enumerate(types):  # kept in the file's blocks, no float32 copy
        for m in ("attn_q", "ffn_down"):
            w, t = getattr(model.layers[i], m), gf.tensor(f"blk.{i}.{m}.weight")
            kept = w.blocks if hasattr(w, "blocks") else w.data
            same = (np.array_equal(repack.unpack(kept, qtype, t.shape[0]), t.blocks) if registry.get(qtype).cpu_packed
                    else np.shares_memory(kept, t.blocks))  # a repacked type: the file's bytes regrouped
            assert t.qtype == w.qtype == qtype and same, (qtype, m)
    assert model.decoder is not None  # the one-call step takes every type


@pytest.mark.parametrize("threads", [1, 2])
def test_every_type_model_one_call_equals_ops(every_type_model, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("one core")
    assert_one_call_equals_ops(every_type_model[0], threads)

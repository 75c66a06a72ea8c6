"""EngineConfig holds every engine limit (the CLI, the TUI launcher and serve all read it)."""

from __future__ import annotations

import argparse

import pytest

from panechat.app.engine_factory import engine_config
from panechat.engine.serving.config import EngineConfig


@pytest.mark.parametrize("fields,message", [
    ({"max_concurrent": 0}, "--max-concurrent must be between 1 and 64"),
    ({"max_concurrent": 65}, "--max-concurrent must be between 1 and 64"),
    ({"max_concurrent": 4, "kv_sessions": 3}, "--kv-sessions must be at least --max-concurrent"),
    ({"kv_memory": 0}, "--kv-memory must be a positive size, like 2GiB"),
    ({"kv_dtype": "bf16"}, "--kv-dtype must be one of f16, f32"),
    ({"max_queue": -1}, "--max-queue must be between 0 and 4096"),
    ({"max_queue": 4097}, "--max-queue must be between 0 and 4096"),
    ({"ctx_size": 63}, "--ctx-size must be at least 64"),
    ({"prefill_chunk": 0}, "--prefill-chunk must be >= 1"),
    ({"straggler_ms": -0.1}, "--straggler-ms must be between 0 and 1000"),
    ({"straggler_ms": 1000.5}, "--straggler-ms must be between 0 and 1000"),
])
def test_out_of_range_is_refused_in_one_place(fields, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**fields)
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:  # the flags go through the same check
        engine_config(argparse.Namespace(**fields))
    assert str(e.value) == message


@pytest.mark.parametrize("fields", [
    {"max_concurrent": 1, "kv_sessions": 1, "max_queue": 0, "ctx_size": 64, "prefill_chunk": 1, "straggler_ms": 0},
    {"max_concurrent": 64, "ctx_size": 1 << 20, "straggler_ms": 1000, "max_queue": 4096},
])
def test_the_limits_themselves_are_allowed(fields):
    assert engine_config(argparse.Namespace(**fields)) == EngineConfig(**fields)


def test_flags_not_given_keep_the_defaults():
    assert engine_config(argparse.Namespace(model="x.gguf", max_queue=3)) == EngineConfig(max_queue=3)

"""The AMX tile products of repacked Q4_K, Q5_K and Q6_K weights (backends/cpu/amx_tiles.py):
the contract's bits (`repack.reference`) at every row count a pass, a block and an
overlapping last pass make, through the column functions and the parallel product; and
where AMX may not run, nothing chooses them. On a CPU without AMX-INT8 the bit checks skip."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from panechat.backends.cpu import amx_tiles, packed256, quant_kernels, repack
from panechat.backends.cpu.generated import uses_amx
from panechat.backends.quant import registry

from .test_repacked import _blocks, assert_q8k_columns_give_the_reference

needs_amx = pytest.mark.skipif(not amx_tiles.enabled(), reason="this CPU or kernel runs no AMX-INT8 tiles")
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
WITH_AMX = ("Q4_0", "Q8_0") + KQUANTS  # the types with an AMX form (registry `cpu_amx`)


def test_amx_is_read_from_the_compile_targets_features():
    assert amx_tiles.target_has_amx("+avx512f,+amx-tile,+amx-int8,+avx2")
    assert not amx_tiles.target_has_amx("+avx512f,+amx-tile,-amx-int8")
    assert not amx_tiles.target_has_amx("+avx512f,+avx512vnni,+avx2")


@needs_amx
@pytest.mark.parametrize("qtype", KQUANTS)
def test_amx_columns_give_the_reference_bits(qtype):
    """Rows 1..33 (one pass of fewer than 16, passes of 16, a last one overlapping the one
    before), 130 and 300 (blocks of 128 rows, a last block of 2 and of 44 rows), 24 and 40
    columns (a last group of 8), a row with a zero chunk of activations."""
    cols = getattr(amx_tiles, f"{qtype.lower().replace('_', '')}_columns")
    assert_q8k_columns_give_the_reference(cols, qtype, [(m, 24) for m in range(1, 34)] + [(130, 40), (300, 16)], 7)


@needs_amx
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_the_parallel_product_in_blocks_of_rows_gives_each_row_its_bits(qtype):
    """`linear_packed` at 300 rows of K = 2048 (blocks of `task_rows` = 128 rows, the AMX
    form) and at 17 and 5 (Q6_K: AMX, then the record tiles; Q4_K: the record tiles): every
    row the reference's bits, so the same as alone."""
    assert uses_amx(registry.get(qtype))
    rng = np.random.default_rng(8)
    K, N = 2048, 48
    blocks = _blocks(rng, qtype, N, K)
    packed = repack.pack(blocks, qtype)
    assert packed256.task_rows(300, K) == 128
    x = rng.standard_normal((300, K), dtype=np.float32)
    want = repack.reference(qtype, x, blocks)
    for M in (300, 17, 5):
        out = np.empty((M, N), np.float32)
        quant_kernels.linear_packed(x[:M].copy(), packed, qtype, out)
        assert np.array_equal(out, want[:M]), (qtype, M)


def test_panechat_amx_0_turns_the_amx_forms_off():
    """PANECHAT_AMX=0 (or a CPU without AMX): `enabled()` is False and every type's product
    is the record tiles' and panels' form, not compiled for AMX."""
    code = ("from panechat.backends.cpu import amx_tiles; from panechat.backends.cpu.generated import "
            "packed_columns_of, uses_amx; from panechat.backends.quant import registry; "
            "assert not amx_tiles.enabled(); "
            f"assert not any(uses_amx(registry.get(t)) for t in {WITH_AMX}); "
            "assert packed_columns_of(registry.get('Q6_K')).__name__ == 'q6_k_columns'; "
            "assert packed_columns_of(registry.get('Q8_0')).__name__ == 'q8_0_columns'; print('ok')")
    env = dict(os.environ, PANECHAT_AMX="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_amx
def test_where_amx_runs_the_kernels_a_model_calls_are_the_amx_forms_and_the_start_up_line_says_so():
    """The op-by-op product kernel and the one-call step's range function of each type with
    an AMX form (what `Model.forward` calls) are the generated `_amx` copies, and the CPU
    backend's description, printed at start-up, names them."""
    from panechat.backends.cpu import block_tasks
    from panechat.backends.cpu.numpy_backend import NumpyBackend

    assert [t.name for t in registry.block_types() if t.cpu_amx] == list(WITH_AMX)
    for qtype in WITH_AMX:
        t = registry.get(qtype)
        assert uses_amx(t)
        assert quant_kernels.packed_kernel(qtype).py_func.__name__ == f"_packed_{qtype.lower()}_amx"
        assert block_tasks.range_function(t).__name__ == f"_range_{qtype.lower()}_amx"
    assert NumpyBackend().describe().endswith(", Q4_0/Q8_0/Q4_K/Q5_K/Q6_K on AMX tiles for many rows")

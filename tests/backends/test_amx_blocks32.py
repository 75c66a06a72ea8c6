"""The AMX tile products of repacked Q4_0 and Q8_0 weights (backends/cpu/amx_blocks32.py):
the contract's bits (`repack.reference`) at every row count a pass, a block of rows and an
overlapping last pass make, through the column functions and the parallel product in
blocks of rows; a K of an odd number of blocks goes to the record tiles. On a CPU without
AMX-INT8 the checks skip (test_amx_tiles checks that nothing chooses these forms there)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from panechat.backends.cpu import amx_blocks32, amx_tiles, packed32, quant_kernels, repack
from panechat.backends.cpu.generated import uses_amx
from panechat.backends.quant import registry

from .test_repacked import _blocks, assert_runs_give_the_reference

needs_amx = pytest.mark.skipif(not amx_tiles.enabled(), reason="this CPU or kernel runs no AMX-INT8 tiles")
TYPES = ("Q4_0", "Q8_0")


def _run(cols):
    @njit(cache=False)
    def run(x, w, out):
        xq, xd, xs, sx = packed32.quantized_rows(x)
        cols(w, xq, xd, xs, sx, out, 0, out.shape[1])

    return run


@needs_amx
@pytest.mark.parametrize("qtype", TYPES)
def test_amx_columns_give_the_reference_bits(qtype):
    """Rows 1..33 at K = 256 (one pass of fewer than 16, passes of 16, a last one overlapping
    the one before), 24 columns (a last group of 8), row 0 with a zero chunk of activations;
    at K = 2048 300 rows (blocks of `task_rows` = 128 rows, the last of 44) and 270 (a last
    14 joining the block before)."""
    run = _run(getattr(amx_blocks32, f"{qtype.lower()}_columns"))
    cases = [(m, 24, 256) for m in range(1, 34)] + [(300, 40, 2048), (270, 16, 2048)]
    assert_runs_give_the_reference(run, qtype, cases, 11)
    assert packed32.task_rows(300, 2048) == 128 and packed32.task_rows(64, 8192) == 32


@needs_amx
@pytest.mark.parametrize("qtype", TYPES)
def test_the_parallel_product_gives_each_row_its_bits(qtype):
    """`linear_packed` (the AMX form, `uses_amx`) at 300 rows of K = 2048 (tasks in blocks of
    128 rows), at 40, 17 and 5 (AMX from Q4_0_MIN_ROWS / Q8_0_MIN_ROWS, then the record
    tiles), and at K = 96, three blocks (no pair for the last: the record tiles at any rows):
    every row the reference's bits, so the same as alone."""
    assert uses_amx(registry.get(qtype))
    rng = np.random.default_rng(12)
    for K, N, rows in ((2048, 48, (300, 40, 17, 5)), (96, 32, (40,))):
        blocks = _blocks(rng, qtype, N, K)
        packed = repack.pack(blocks, qtype)
        x = rng.standard_normal((max(rows), K), dtype=np.float32)
        want = repack.reference(qtype, x, blocks)
        for M in rows:
            out = np.empty((M, N), np.float32)
            quant_kernels.linear_packed(x[:M].copy(), packed, qtype, out)
            assert np.array_equal(out, want[:M]), (qtype, K, M)

"""Weights repacked into records of 16 columns (`repack`; Q4_0, Q4_1, Q8_0 by `packed32`
over int16 activations, Q4_K, Q5_K, Q6_K by `packed256` and `q8k_panel` over Q8_K rows):
the records are the file's bytes, the kernels give the numpy reference's bits in every
form and at every row count, alone or batched, and stay at float32's distance from exact
products."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from panechat.backends.cpu import packed32 as pk
from panechat.backends.cpu import packed256, q8k_dot, q8k_panel, repack
from panechat.backends.cpu.numpy_backend import NumpyBackend, PackedWeight, _let_go_of_mapped
from panechat.backends.quant import registry
from panechat.backends.quant.gguf_tensor import GGUFTensor

from .raw_types import assert_products_at_every_row_count
from .test_numpy_kernels import _raw_blocks, _read_only

TYPES = [t for t in pk.PACKED + packed256.PACKED if registry.get(t).cpu_packed]
#: the types whose kernels every run compiles; Q5_K's (no shipped model's type, the costliest
#: to compile) are checked in `make test-slow`, as test_registry_types does
EVERY_RUN = [t for t in TYPES if t != "Q5_K"]
_KQ = {"Q4_K", "Q5_K", "Q6_K"}


def _k(qtype, k32):
    """A row length for `qtype`: k32 for the 32-weight types, a multiple of 256 for K-quants."""
    return max(512, k32 // 256 * 256) if qtype in _KQ else k32


def _module(qtype):
    return packed256 if qtype in _KQ else pk


def _blocks(rng, qtype, N, K):
    """`qtype` blocks of random weights as gguf quantizes them (K-quants, which gguf cannot
    quantize: random codes and scales), uint8 [N, K/w * bytes]."""
    from gguf import GGMLQuantizationType, quants

    if qtype in _KQ:
        return np.ascontiguousarray(_raw_blocks(rng, qtype, N, K).reshape(N, -1))
    w = rng.standard_normal((N, K)).astype(np.float32)
    return np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[qtype]).view(np.uint8).reshape(N, -1))


def _dense(blocks, qtype, N, K):
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.dequantize(blocks, GGMLQuantizationType[qtype]), np.float32).reshape(N, K)


def test_the_registry_names_a_packed_product_for_each_type():
    assert [t.name for t in registry.types() if t.cpu_packed] == TYPES == ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", sorted(repack.LAYOUTS))
def test_a_layout_places_every_byte_where_its_field_says(qtype):
    """Each field's byte i of column c at dest + 16u (i // u) + uc + i % u, and pack / unpack
    are inverse on random bytes (every byte of 16 blocks placed once: `Layout.places`)."""
    lay = repack.LAYOUTS[qtype]
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (32, 3 * lay.block_bytes), dtype=np.uint8)
    packed = repack.pack(blocks, qtype)
    assert np.array_equal(repack.unpack(packed, qtype), blocks)
    rec = packed.reshape(2, 3, 16 * lay.block_bytes)
    for f in lay.fields:
        for c in (0, 9, 15):
            for i in range(f.size):
                at = f.dest + 16 * f.unit * (i // f.unit) + f.unit * c + i % f.unit
                assert rec[1, 2, at] == blocks[16 + c, 2 * lay.block_bytes + f.src + i] ^ f.flip


@pytest.mark.parametrize("qtype", TYPES)
def test_a_record_holds_the_files_bytes_of_16_columns(qtype):
    """pack keeps every byte (unpack restores the file's blocks) and puts column c's code of
    weight k where the module docstring says: the records are the layout the kernels read."""
    rng = np.random.default_rng(1)
    N, K = 32, _k(qtype, 96)
    blocks = _blocks(rng, qtype, N, K)
    packed = repack.pack(blocks, qtype)
    assert packed.shape == blocks.shape and packed.dtype == np.uint8
    assert np.array_equal(repack.unpack(packed, qtype), blocks)
    w = repack.LAYOUTS[qtype].weights
    bb = blocks.shape[1] // (K // w)
    rec = packed.reshape(N // 16, K // w, 16 * bb)
    g, b, c, k = 1, K // w - 1, 5, 7  # column 21, weight 7 of the last block
    n = 16 * g + c
    block = blocks[n, b * bb:(b + 1) * bb]
    if qtype == "Q4_K":  # d dmin | 12 scale bytes | qs; code byte q of column c at 256 + 64 (q // 4) + 4c + q % 4
        assert rec[g, b, 2 * c:2 * c + 2].tobytes() == block[:2].tobytes()
        assert rec[g, b, 32 + 2 * c:32 + 2 * c + 2].tobytes() == block[2:4].tobytes()
        assert [rec[g, b, 64 + 16 * t + c] for t in range(12)] == list(block[4:16])
        assert all(rec[g, b, 256 + 64 * (q // 4) + 4 * c + q % 4] == block[16 + q] for q in range(128))
        return
    if qtype == "Q5_K":  # d dmin | 12 scale bytes | qh | qs, 4-byte columns from 256 and 768
        assert rec[g, b, 2 * c:2 * c + 2].tobytes() == block[:2].tobytes()
        assert rec[g, b, 32 + 2 * c:32 + 2 * c + 2].tobytes() == block[2:4].tobytes()
        assert [rec[g, b, 64 + 16 * t + c] for t in range(12)] == list(block[4:16])
        assert all(rec[g, b, 256 + 64 * (q // 4) + 4 * c + q % 4] == block[16 + q] for q in range(32))
        assert all(rec[g, b, 768 + 64 * (q // 4) + 4 * c + q % 4] == block[48 + q] for q in range(128))
        return
    if qtype == "Q6_K":  # d | 16 int8 scales | ql, qh; byte q of ql/qh at 288 + 64 (q // 4) + 4c + q % 4
        assert rec[g, b, 2 * c:2 * c + 2].tobytes() == block[208:210].tobytes()
        assert [rec[g, b, 32 + 16 * t + c] for t in range(16)] == list(block[192:208])
        assert all(rec[g, b, 288 + 64 * (q // 4) + 4 * c + q % 4] == block[q] for q in range(192))
        return
    assert rec[g, b, 2 * c:2 * c + 2].tobytes() == block[:2].tobytes()  # d
    if qtype == "Q8_0":
        code = rec[g, b, 32 + 64 * (k // 4) + 4 * c + k % 4]
        assert code == block[2 + k] ^ 0x80
    else:
        at = 64 if qtype == "Q4_1" else 32
        if qtype == "Q4_1":
            assert rec[g, b, 32 + 2 * c:32 + 2 * c + 2].tobytes() == block[2:4].tobytes()  # m
        qs = block[at // 16:]
        assert rec[g, b, at + 64 * (k // 4) + 4 * c + k % 4] == qs[k]  # low nibble k, high nibble k + 16


def test_every_weight_is_packed_a_last_group_padded():
    """A weight whose columns are not a multiple of 16 is packed too (its last group padded
    with zero blocks), and its products are the reference's on the file's blocks."""
    rng = np.random.default_rng(2)
    be = NumpyBackend()
    for qtype in EVERY_RUN:
        K = _k(qtype, 64)
        for n in (48, 37):
            blocks = _blocks(rng, qtype, n, K)
            w = be.linear_weight(GGUFTensor("w", (n, K), qtype, _read_only(blocks)))
            assert isinstance(w, PackedWeight) and w.shape == (n, K) and w.data.shape[0] == -(-n // 16) * 16
            assert np.array_equal(repack.unpack(w.data, qtype, n), blocks)
            x = rng.standard_normal((5, K), dtype=np.float32)
            assert np.array_equal(be.linear(x, w), repack.reference(qtype, x, blocks))


def test_activations_round_to_int16_in_two_int8_planes():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 128), dtype=np.float32) * np.float32(4.0)
    x[0, :32] = 0  # an all-zero block: scale 0, codes 0
    x[1, 32:64] = np.float32(-2.5)  # every value the block's largest magnitude, negative
    x[2, 64] = np.float32(1e-30)  # a tiny block beside ordinary ones
    x[2, 65:96] = 0
    xq, xd, xs, sx = pk.quantized_rows(x)
    rq, rd, rs, rsx = pk.reference_rows(x)
    assert np.array_equal(xq, pk.planes(rq)) and np.array_equal(xd, rd)
    assert np.array_equal(xs, rs) and np.array_equal(sx, rsx)
    assert np.abs(rq).max() == pk.QMAX and xd[0, 0] == 0 and not rq[0, :32].any()
    assert (rq[1, 32:64] == -pk.QMAX).all()
    a, b = xq[:, :128].astype(np.int32), xq[:, 128:].astype(np.int32)
    assert np.array_equal(256 * a + b, rq)  # the planes are the int16 codes
    # the rounding: within half a step of x / dx, and 256x finer than int8's
    step = np.repeat(rd, 32, 1)
    ok = step > 0
    assert (np.abs(rq[ok] * step[ok] - x[ok]) <= step[ok] * 0.5001 + 1e-37).all()


def _columns_source(qtype):
    cols = getattr(_module(qtype), f"{qtype.lower()}_columns")
    if qtype in _KQ:  # Q8_K rows
        def run(x, w, out):
            xq, xd, xs = q8k_dot.quantized_rows(x)
            cols(w, xq, xd, xs, out, 0, out.shape[1])

        return run

    def run(x, w, out):
        xq, xd, xs, sx = pk.quantized_rows(x)
        cols(w, xq, xd, xs, sx, out, 0, out.shape[1])

    return run


def _check_reference_bits(shapes=((1, 16), (1, 48), (3, 32), (4, 16), (5, 40), (6, 48), (9, 16), (25, 40)),
                          types=EVERY_RUN):
    rng = np.random.default_rng(4)
    for qtype in types:
        run = njit(cache=False)(_columns_source(qtype))
        for M, N in shapes:
            K = _k(qtype, 160)
            x = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3.0)
            x[0, 32:64] = 0
            blocks = _blocks(rng, qtype, N, K)
            out = np.empty((M, N), np.float32)
            run(x, repack.pack(blocks, qtype), out)
            assert np.array_equal(out, repack.reference(qtype, x, blocks)), (qtype, q8k_dot.FORM, M, N)


@pytest.mark.parametrize("form", q8k_dot.FORMS)
def test_every_form_gives_the_reference_bits(form, monkeypatch):
    """vnni, avx512 (no VNNI), avx2 and generic: the same exact integers, so the same bits
    (4-row tiles, tails of 1-3 rows, the 5-row tile at 5, 9 and 25 rows, one row against
    pairs of groups and a last one at 48 columns, Q6_K's record panels at 25 rows and a
    last group of 8 columns). This CPU runs each form whose instructions it has."""
    need = {"vnni": "vnni", "avx512": "avx512", "avx2": "avx2"}.get(form)
    if need is not None and q8k_dot.FORMS.index(q8k_dot.target_form()) > q8k_dot.FORMS.index(need):
        pytest.skip(f"this CPU cannot run the {form} form")
    monkeypatch.setattr(q8k_dot, "FORM", form)
    monkeypatch.setattr(pk, "FORM", form)
    _check_reference_bits()


@pytest.mark.slow
@pytest.mark.parametrize("form", q8k_dot.FORMS)
def test_every_form_gives_q5_k_reference_bits(form, monkeypatch):
    """`test_every_form_gives_the_reference_bits` for Q5_K."""
    need = {"vnni": "vnni", "avx512": "avx512", "avx2": "avx2"}.get(form)
    if need is not None and q8k_dot.FORMS.index(q8k_dot.target_form()) > q8k_dot.FORMS.index(need):
        pytest.skip(f"this CPU cannot run the {form} form")
    monkeypatch.setattr(q8k_dot, "FORM", form)
    _check_reference_bits(types=("Q5_K",))


_AVX2_TARGET = """
from panechat.backends.cpu import packed32 as pk
from panechat.backends.cpu import q8k_dot
from tests.backends import test_repacked as t
assert q8k_dot.FORM == pk.FORM == "avx2", pk.FORM
t._check_reference_bits(((5, 32),), ("Q4_0", "Q4_K"))
print("ok")
"""


def test_an_avx2_target_compiles_the_avx2_form():
    """numba compiling for a Haswell (no AVX-512; F16C) and for a generic x86-64 (no F16C:
    the scales widened by bit moves) gives the reference bits: one type of each module (the
    others' forms are checked in this process, above)."""
    root = Path(__file__).resolve().parents[2]
    feats = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,"
             "+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=feats)
    out = subprocess.run([sys.executable, "-c", _AVX2_TARGET], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    generic = _AVX2_TARGET.replace('== "avx2"', '== "generic"')
    env = dict(os.environ, NUMBA_CPU_NAME="x86-64", NUMBA_CPU_FEATURES="+64bit,+cmov,+cx8,+fxsr,+mmx,+sse,+sse2")
    out = subprocess.run([sys.executable, "-c", generic], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("qtype", [t if t in EVERY_RUN else pytest.param(t, marks=pytest.mark.slow)
                                   for t in ("Q5_K", "Q6_K")])
def test_record_panels_at_every_pass_shape(qtype):
    """`q8k_panel`'s record panels (`packed256` takes them from 24 rows, Q5_K, and 20, Q6_K)
    give the reference's bits at any row count: one row, two, three (a group of four
    repeating its last), passes of eight, then four, then a last two (6, 11, 70 rows), and a
    last group of 8 columns; in this CPU's form."""
    cols = getattr(q8k_panel, f"{qtype.lower().replace('_', '')}_record_panel_columns")
    assert_q8k_columns_give_the_reference(cols, qtype, ((1, 24), (2, 16), (3, 16), (6, 40), (11, 16), (70, 24)), 8)


def assert_q8k_columns_give_the_reference(cols, qtype, cases, seed):
    """A K-quant column product `cols` (w, xq, xd, xs, out, c0, c1) over Q8_K rows gives
    `repack.reference`'s bits for each (rows M, columns N) of `cases`, K = 512."""
    @njit(cache=False)
    def run(x, w, out):
        xq, xd, xs = q8k_dot.quantized_rows(x)
        cols(w, xq, xd, xs, out, 0, out.shape[1])

    assert_runs_give_the_reference(run, qtype, [(M, N, 512) for M, N in cases], seed)


def assert_runs_give_the_reference(run, qtype, cases, seed):
    """run(x, packed weights, out) gives `repack.reference`'s bits for each (rows M, columns
    N, K) of `cases`, row 0 with a zero chunk of activations (64 of them)."""
    rng = np.random.default_rng(seed)
    for M, N, K in cases:
        x = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3.0)
        x[0, 32:96] = 0
        blocks = _blocks(rng, qtype, N, K)
        out = np.full((M, N), np.nan, np.float32)
        run(x, repack.pack(blocks, qtype), out)
        assert np.array_equal(out, repack.reference(qtype, x, blocks)), (qtype, M, N, K)


@pytest.mark.parametrize("qtype", [t if t in EVERY_RUN else pytest.param(t, marks=pytest.mark.slow) for t in TYPES])
def test_products_at_every_row_count_are_the_reference(qtype):
    """Rows 1..33 in shuffled order, on one thread and two, through `linear` and the fused
    `linear_many` (two weights of 48 and 21 columns): every product is the reference's, so a
    row's bits are its own whatever the batch."""
    rng = np.random.default_rng(6)
    be = NumpyBackend()
    K = _k(qtype, 256)
    blocks = [_read_only(_blocks(rng, qtype, n, K)) for n in (48, 21)]
    kept = [be.linear_weight(GGUFTensor("w", (b.shape[0], K), qtype, b)) for b in blocks]
    assert all(isinstance(w, PackedWeight) for w in kept)
    pool = rng.standard_normal((33, K), dtype=np.float32)
    want = [repack.reference(qtype, pool, b) for b in blocks]
    alone = [np.concatenate([repack.reference(qtype, pool[i:i + 1], b) for i in range(33)]) for b in blocks]
    assert all(np.array_equal(a, w) for a, w in zip(alone, want))  # the reference is row-invariant itself
    assert_products_at_every_row_count(be, kept, pool, want, rng, qtype)


@pytest.mark.parametrize("qtype", pk.PACKED)  # Q4_K's products are Q8_K's, as before its repacking (test_q8k_dot)
def test_products_stay_at_float32s_distance_from_exact(qtype):
    """Against the float64 product on gguf's weights, the int16 activations err about as much
    as float32 arithmetic over the dequantized weights does, and far less than int8's rounding
    would (whose error here is ~100x larger)."""
    rng = np.random.default_rng(7)
    N, K, M = 64, 1024, 8
    blocks = _blocks(rng, qtype, N, K)
    w = _dense(blocks, qtype, N, K)
    x = rng.standard_normal((M, K), dtype=np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    ours = NumpyBackend().linear(x, PackedWeight(qtype, repack.pack(blocks, qtype), (N, K)))
    scale = np.abs(exact).max()
    assert np.abs(ours - exact).max() < 2e-4 * scale


def test_letting_go_of_mapped_pages_keeps_the_bytes(tmp_path):
    """The file pages of a packed tensor are dropped from this process but read back the same;
    anonymous memory is never touched (MADV_DONTNEED would zero it)."""
    data = np.random.default_rng(8).integers(0, 256, 5 * mmap.PAGESIZE, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.ndarray((data.size,), np.uint8, buffer=buf)[100:4 * mmap.PAGESIZE + 7]
    view.sum()  # read: the pages are resident now
    _let_go_of_mapped(view)
    assert np.array_equal(view, data[100:4 * mmap.PAGESIZE + 7])
    anon = data.copy()
    _let_go_of_mapped(anon)
    assert np.array_equal(anon, data)
    del view
    buf.close()

"""The int8-activation K-quant products (backends/cpu/q8k_dot.py): activations rounded as
llama.cpp's quantize_row_q8_K_ref, every instruction-set form (VNNI, AVX-512 without VNNI,
AVX2, generic) and every tile giving the numpy reference's bits, and that reference being
gguf's product when the activations are exact int8 values.

The products through the backend (rows 1..33, threads, the one-call step) are checked
with every other type's, from the registry (test_registry_types.py, test_block_linear.py)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from panechat.backends.cpu import q8k_dot as q
from panechat.backends.cpu import q8k_panel as p
from panechat.backends.cpu import quant_kernels as qk
from panechat.backends.cpu.generated import packed_activations
from panechat.backends.quant import registry

from .test_numpy_kernels import raw_blocks



def test_the_shipped_kquants_round_activations():
    """Q4_K, Q5_K and Q6_K by `packed256` over their repacked records, on the same Q8_K rows
    and this module's contract (test_repacked); the kernels here, on the file's blocks, are
    the contract's second implementation, tested below."""
    packed = [t.name for t in registry.block_types() if t.cpu_packed and packed_activations(t) == "q8k"]
    assert packed == ["Q4_K", "Q5_K", "Q6_K"]


def _columns_source(module, prefix):
    """A test kernel computing x @ W.T for each q8k type by code (0: Q4_K, 1: Q5_K, 2: Q6_K)
    through `module`'s `{prefix}_columns` products, compiled fresh (cache off)."""
    q4, q5, q6 = (getattr(module, f"{t}{prefix}_columns") for t in ("q4k", "q5k", "q6k"))

    def run(x, w, d, dm, out, code):
        xq, xd, xs = q.quantized_rows(x)
        if code == 0:
            q4(w, d, dm, xq, xd, xs, out, 0, out.shape[1])
        elif code == 1:
            q5(w, d, dm, xq, xd, xs, out, 0, out.shape[1])
        else:
            q6(w, d, dm, xq, xd, xs, out, 0, out.shape[1])
        return xq, xd, xs

    return run


def _products_source():
    """The column products the registry names (the row tiles below PANEL_MIN_ROWS rows,
    panels from it on)."""
    return _columns_source(p, "")


def _row_tiles_source():
    """Every product by the row tiles, whatever the row count (their loop over pairs of
    rows and a chunk past 64 rows run only here once panels take 4 rows and more)."""
    return _columns_source(q, "_row")


def _blocks_source():
    """A small test kernel: each output element by the block products alone (no tiles), so a
    form compiles in seconds; the module's FORM at compile time picks the form."""

    def run(x, w, d, dm, out, code):
        xq, xd, xs = q.quantized_rows(x)
        for m in range(out.shape[0]):
            for n in range(out.shape[1]):
                a = np.float32(0.0)
                for s in range(d.shape[1]):
                    if code == 0:
                        a = q._q4k_sb(a, w, d, dm, xq, xd, xs, m, n, s)
                    elif code == 1:
                        a = q._q5k_sb(a, w, d, dm, xq, xd, xs, m, n, s)
                    else:
                        a = q._q6k_sb(a, w, d, dm, xq, xd, xs, m, n, s)
                out[m, n] = a
        return xq, xd, xs

    return run


def _panels_source():
    """A test kernel: every product by panels, whatever the row count (the module's FORM at
    compile time picks the integer instructions)."""

    def run(x, w, d, dm, out, code):
        xq, xd, xs = q.quantized_rows(x)
        n = out.shape[1]
        if code == 0:
            p._panel_columns(w, d, dm, xq, xd, xs, out, 0, n, p.decode_q4k, p.panel_rows8_8, p.panel_rows8,
                             p.panel_rows8_2, p.panel_rows8_1, 8)
        elif code == 1:
            p._panel_columns(w, d, dm, xq, xd, xs, out, 0, n, p.decode_q5k, p.panel_rows8_8, p.panel_rows8,
                             p.panel_rows8_2, p.panel_rows8_1, 8)
        else:
            p._panel_columns(w, d, dm, xq, xd, xs, out, 0, n, p.decode_q6k, p.panel_rows16_8, p.panel_rows16,
                             p.panel_rows16_2, p.panel_rows16_1, 16)
        return xq, xd, xs

    return run


CODES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}


def _check_reference_bits(run, shapes=((1, 9), (3, 6), (9, 8))):
    rng = np.random.default_rng(5)
    for qtype in CODES:
        for M, N in shapes:
            K = 512
            x = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3.0)
            x[0, 256:] = 0  # an all-zero block: scale 0, codes 0
            w = raw_blocks(rng, qtype, N, K)
            d, dm = qk.superblock_scales(w, qtype)
            out = np.empty((M, N), np.float32)
            xq, xd, xs = run(x, w, d, dm, out, CODES[qtype])
            rq, rd, rs = q.reference_q8k(x)
            assert np.array_equal(xq, rq) and np.array_equal(xd, rd) and np.array_equal(xs, rs)
            assert xd[0, 1] == 0 and not xq[0, 256:].any()
            assert np.array_equal(out, q.reference(qtype, x, w, d, dm)), (qtype, q.FORM, M)


@pytest.mark.parametrize("form", q.FORMS)
def test_every_form_gives_the_reference_bits(form, monkeypatch):
    """vnni, avx512 (no VNNI), avx2 and generic: the same exact integers, so the same bits.
    This CPU runs each form whose instructions it has (an AVX-512 VNNI machine: all four)."""
    need = {"vnni": "vnni", "avx512": "avx512", "avx2": "avx2"}.get(form)
    if need is not None and q.FORMS.index(q.target_form()) > q.FORMS.index(need):
        pytest.skip(f"this CPU cannot run the {form} form")
    monkeypatch.setattr(q, "FORM", form)
    _check_reference_bits(njit(cache=False)(_blocks_source()))
    # tails of 1, 3 and 2 rows; a pass of eight then a group of three
    _check_reference_bits(njit(cache=False)(_panels_source()), ((1, 9), (3, 6), (6, 21), (11, 5)))


def test_the_tiles_give_the_reference_bits():
    """The column products at 1 and 3 rows (the 4x2 and one-row tiles), Q6_K's at 7 rows too
    (4x4, 4x2 and one-row tiles), by panels at 7 (Q4_K, Q5_K), 9 and 70 rows (passes of
    eight, then four; a last group of three, one and two rows; a panel of fewer than 16
    columns, two panels) in this CPU's form."""
    assert 2 < p.PANEL_MIN_ROWS <= 7 < p.Q6K_PANEL_MIN_ROWS <= 9
    _check_reference_bits(njit(cache=False)(_products_source()), ((1, 9), (3, 6), (7, 5), (9, 8), (70, 37)))
    _check_reference_bits(njit(cache=False)(_row_tiles_source()), ((7, 9), (70, 5)))


def test_the_form_follows_the_target_features():
    assert q.target_form("+avx2,+avx512f,+avx512bw,+avx512vnni") == "vnni"
    assert q.target_form("+avx2,+avx512f,+avx512bw,-avx512vnni") == "avx512"
    assert q.target_form("+avx2,-avx512f,-avx512bw") == "avx2"
    assert q.target_form("+neon,+dotprod") == "generic"


_AVX2_TARGET = """
import numpy as np
from numba import njit
from panechat.backends.cpu import q8k_dot as q
from panechat.backends.cpu import q8k_panel as p
from tests.backends import test_q8k_dot as t
assert q.FORM == "avx2", q.FORM
t._check_reference_bits(njit(cache=False)(t._blocks_source()), ((3, 6),))
t._check_reference_bits(njit(cache=False)(t._panels_source()), ((5, 17),))
print("ok")
"""


def test_an_avx2_target_compiles_the_avx2_form():
    """numba compiling for a Haswell (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, as on a CPU without
    AVX-512) picks the avx2 form, and LLVM lowers it for that CPU: the reference bits."""
    feats = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,"
             "+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=feats)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _AVX2_TARGET], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("qtype", list(CODES))
def test_reference_is_gguf_on_exact_activations(qtype):
    """Activations that are int8 values with 127 in every block round to themselves (scale
    -1), so the product is gguf's dequantized one up to float32 rounding."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(6)
    N, K = 7, 512
    x = rng.integers(-126, 127, (3, K)).astype(np.float32)
    x[:, 0], x[:, 256] = 127, -127
    w = raw_blocks(rng, qtype, N, K)
    d, dm = qk.superblock_scales(w, qtype)
    want = x.astype(np.float64) @ quants.dequantize(w, GGMLQuantizationType[qtype]).reshape(N, K).T.astype(np.float64)
    got = q.reference(qtype, x, w, d, dm)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_rounding_follows_llama_cpp():
    """quantize_row_q8_K_ref: the first value of largest magnitude sets iscale = -127 / it,
    codes round half to even and are capped at 127, d = 1 / iscale."""
    x = np.zeros((1, 256), np.float32)
    x[0, :4] = [2.0, -2.0, 1.0, 0.0]  # 2 comes first: iscale -63.5
    xq, xd, xs = q.reference_q8k(x)
    assert xq[0, :4].tolist() == [-127, 127, -64, 0]  # -63.5 rounds to -64 (half to even)
    assert xd[0, 0] == np.float32(1) / np.float32(-127.0 / 2.0)
    assert xs[0, 0] == -64 and xs.dtype == np.int16

"""The CuPy backend (docs/cupy.md).

Without a GPU (what runs everywhere): import hygiene and the one-line BackendUnavailable
message; the CUDA source compiled by NVRTC when libnvrtc is installed (no GPU needed);
the numerical contract of the kernels, emulated in numpy, checked against exact
arithmetic, a literal transcription and float64; and the backend's host code end to end
with every kernel emulated (tiny llama/qwen2 models vs the float64 reference, batch
invariance, self-check, weight preparation).

With a CUDA GPU (skipped otherwise): every real kernel bit for bit against the emulation,
the self-check, whole tiny models bit for bit against the emulated backend, and batch
invariance of the model on the device. scripts/gpu_check.py runs these and more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from panechat.backends import BackendUnavailable
from panechat.backends.errors import one_line
from panechat.backends.cuda import kernels as ck
from panechat.backends.cuda.cupy_backend import (
    CupyBackend,
    CupyWeight,
    compare_kernels_with_emulation,
    prepare_weight,
)
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.cpu.numpy_backend import NumpyBackend
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.invariance import check_model_invariance
from panechat.engine.model.forward import Model

from ..model_runs import forward_chunks, run_batched
from ..tiny_gguf import reference_logits

QTYPES = [("F32", True), ("F16", False), ("BF16", False), ("Q8_0", True), ("Q4_1", False), ("Q4_0", True)]
PROMPTS = [[1, 90, 198, 26, 35, 253], [1, 40, 198, 26, 2, 198, 1, 52, 95, 198], [50, 23, 63],
           [28, 198, 66, 11, 216, 28, 56, 48, 49]]
EXTRA = [[57, 52, 20], [19, 9, 30, 33, 31, 26, 12]]


def _cuda_reason() -> str | None:
    """None when a CUDA device is usable through cupy, else why not."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        return None if n > 0 else "cupy sees 0 devices"
    except Exception as e:  # ImportError, CUDARuntimeError, ...
        return one_line(e, with_type=True)


NO_CUDA = _cuda_reason()


# ---------------------------------------------------------------------------------------
# import hygiene and the message
# ---------------------------------------------------------------------------------------

def test_imports_without_cupy_and_says_how_to_install():
    code = (
        "import sys; sys.modules['cupy'] = None\n"  # makes 'import cupy' raise ImportError
        "import panechat.backends.cuda.cupy_backend, panechat.backends.cuda.kernels\n"
        "assert 'cupy' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "from panechat.backends import get_backend, BackendUnavailable\n"
        "try:\n"
        "    get_backend('cupy')\n"
        "except BackendUnavailable as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    msg = out.stdout.strip()
    assert "\n" not in msg and "pip install 'panechat[cuda]'" in msg and "cupy" in msg


def test_import_does_not_touch_cuda():
    """Importing the backend modules imports no cupy (so no CUDA initialisation)."""
    code = ("import sys; import panechat.backends.cuda.cupy_backend, panechat.backends.cuda.kernels\n"
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(NO_CUDA is None, reason="a CUDA device is present")
def test_get_backend_cupy_without_gpu_is_one_line_unavailable():
    from panechat.backends import get_backend

    with pytest.raises(BackendUnavailable) as e:
        get_backend("cupy")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the CuPy backend")
    assert ("CUDA" in msg) or ("pip install" in msg)


# ---------------------------------------------------------------------------------------
# the CUDA source, compiled without a GPU
# ---------------------------------------------------------------------------------------

def _nvrtc_reason() -> str | None:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return None
    except Exception as e:
        return f"NVRTC unavailable ({type(e).__name__}); pip install nvidia-cuda-nvrtc-cu12 to run this"


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_nvrtc_compiles_every_kernel_with_ieee_arithmetic_only(arch):
    reason = _nvrtc_reason()
    if reason:
        pytest.skip(reason)
    _check_ptx(ck.compile_ptx(arch).decode())


def test_nvcc_compiles_every_kernel_for_sm90_with_ieee_arithmetic_only():
    """The same source and options through the toolkit's nvcc (no GPU, no cupy needed)."""
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH (a CUDA toolkit runs this check)")
    _check_ptx(ck.build.compile_ptx_nvcc("sm_90").decode())


def _check_ptx(ptx: str) -> None:
    import re

    entries = re.findall(r"\.entry (\w+)", ptx)
    assert sorted(entries) == sorted(ck.KERNEL_NAMES)
    assert set(ck.kernel_signatures()) == set(ck.KERNEL_NAMES)
    # no approximate or flush-to-zero float arithmetic, every f32 op explicitly rounded
    assert ".approx" not in ptx and ".ftz" not in ptx
    f32_ops = set(re.findall(r"\b((?:fma|add|sub|mul|div|sqrt|rcp)\.[\w.]*f32)\b", ptx))
    assert f32_ops <= {"fma.rn.f32", "add.rn.f32", "sub.rn.f32", "mul.rn.f32", "div.rn.f32", "sqrt.rn.f32"}, f32_ops
    assert "fma.rn.f32" in f32_ops


def test_the_geometry_is_defined_once_and_passed_to_the_source():
    from panechat.backends.cuda.kernels import constants

    for name, value in constants.CUDA_DEFINES.items():
        assert value == getattr(constants, name) and f"-D{name}={value}" in ck.OPTIONS
        assert f"#define {name}" not in ck.SOURCE and name in ck.SOURCE


def test_build_module_compiles_with_our_flags_and_caches(tmp_path):
    """build_module calls NVRTC itself (CuPy's compile path would append -ftz=true):
    a cubin for the device's architecture, PTX for one newer than NVRTC knows; cached."""
    reason = _nvrtc_reason()
    if reason:
        pytest.skip(reason)

    class FakeCupy:
        class cuda:
            class Device:
                compute_capability = "90"

        @staticmethod
        def RawModule(path):
            return path

    path = ck.build_module(FakeCupy, tmp_path)
    assert path.endswith(".cubin") and open(path, "rb").read(4) == b"\x7fELF"
    mtime = os.path.getmtime(path)
    assert ck.build_module(FakeCupy, tmp_path) == path and os.path.getmtime(path) == mtime
    FakeCupy.cuda.Device.compute_capability = "999"
    ptx = ck.build_module(FakeCupy, tmp_path)
    assert ptx.endswith(".ptx") and b".entry linear_q8_16_4" in open(ptx, "rb").read()
    assert b".ftz" not in open(ptx, "rb").read()


# ---------------------------------------------------------------------------------------
# the numerical contract, emulated
# ---------------------------------------------------------------------------------------

def _round_f32(x: Fraction) -> np.float32:
    """Exact round-to-nearest-even of a rational to float32 (normal and subnormal range)."""
    if x == 0:
        return np.float32(0.0)
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, -126)
    n = round(a / Fraction(2) ** (e - 23))  # ties to even
    return np.float32(sign * n * 2.0 ** (e - 23))


def _fma_exact(a, b, c) -> np.float32:
    return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def test_fma_f32_is_correctly_rounded():
    rng = np.random.default_rng(0)
    n = 3000
    a = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    c = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, n).astype(np.float32)
    c[::3] = -(a[::3] * b[::3])  # near-cancellation
    got = ck.fma_f32(a, b, c)
    want = np.array([_fma_exact(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fma_f32_avoids_double_rounding():
    # a*b + c = 1 + 2^-24 + 2^-60: float64 rounds it to the float32 midpoint 1 + 2^-24,
    # whose float32 rounding (to even) would be 1.0; the correct result is 1 + 2^-23.
    a = np.float32(2.0 ** -24 * (1 + 2.0 ** -12))
    b = np.float32(1 - 4095 * 2.0 ** -24)
    exact = Fraction(float(a)) * Fraction(float(b)) + 1
    assert exact == 1 + Fraction(1, 2 ** 24) + Fraction(1, 2 ** 60)
    assert float(exact) == 1 + 2.0 ** -24  # the tail is lost in float64: a float32 midpoint
    naive = np.float32(np.float64(a) * np.float64(b) + 1.0)
    assert naive == np.float32(1.0)
    assert ck.fma_f32(a, b, np.float32(1.0)) == np.float32(1 + 2.0 ** -23)
    assert ck.fma_f32(-a, b, np.float32(-1.0)) == np.float32(-(1 + 2.0 ** -23))
    assert _fma_exact(a, b, 1.0) == np.float32(1 + 2.0 ** -23)


def _linear_literal(x, w):
    """The linear contract transcribed literally: lane (k // 8) % 32, ascending k, exact
    fma, then the xor butterfly."""
    M, K = x.shape
    out = np.zeros((M, w.shape[0]), np.float32)
    for m in range(M):
        for n in range(w.shape[0]):
            lanes = [np.float32(0.0)] * 32
            for k in range(K):
                lane = (k // 8) % 32
                lanes[lane] = _fma_exact(x[m, k], w[n, k], lanes[lane])
            for h in (16, 8, 4, 2, 1):
                lanes = [np.float32(lanes[i] + lanes[i ^ h]) for i in range(32)]
            out[m, n] = lanes[0]
    return out


@pytest.mark.parametrize("K", [77, 300, 520])
def test_emulated_linear_is_the_literal_contract(K):
    rng = np.random.default_rng(K)
    x = rng.standard_normal((2, K), dtype=np.float32)
    w = rng.standard_normal((3, K), dtype=np.float32)
    assert np.array_equal(ck.emulate_linear(x, w), _linear_literal(x, w))


def test_emulated_kernels_against_float64():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 1000), dtype=np.float32)
    w = rng.standard_normal((40, 1000), dtype=np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 1000 * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    assert (np.abs(ck.emulate_linear(x, w) - ref) <= bound).all()

    xr = rng.standard_normal((3, 700), dtype=np.float32)
    g = rng.standard_normal(700, dtype=np.float32)
    x64 = xr.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * g
    assert np.abs(ck.emulate_rms_norm(xr, g, 1e-5) - ref).max() < 1e-5

    t = np.linspace(-87, 88, 20001, dtype=np.float32)
    e = ck.expf_pc(t)
    rel = np.abs(e.astype(np.float64) / np.exp(t.astype(np.float64)) - 1)
    assert rel.max() < 3 * 2.0 ** -24

    gate = np.linspace(-200, 200, 4001, dtype=np.float32)
    s = ck.emulate_silu_mul(gate, np.ones_like(gate))
    g64 = gate.astype(np.float64)
    assert np.abs(s - g64 / (1 + np.exp(-g64))).max() < 1e-5 * np.abs(g64).max()

    for S, G, C, D, H in ((3, 2, 70, 40, 6), (2, 1, 600, 128, 2)):
        kc = rng.standard_normal((S, G, C, D), dtype=np.float32)
        vc = rng.standard_normal((S, G, C, D), dtype=np.float32)
        q = rng.standard_normal((4, H, D), dtype=np.float32)
        slots, pos = np.array([0, 1, 2 % S, 1], np.int32), np.array([0, 9, C - 1, 37], np.int32)
        got = ck.emulate_attention(q, kc, vc, slots, pos, D ** -0.5)
        for r in range(4):
            for h in range(H):
                keys = kc[slots[r], h // (H // G), : pos[r] + 1].astype(np.float64)
                vals = vc[slots[r], h // (H // G), : pos[r] + 1].astype(np.float64)
                sc = keys @ q[r, h].astype(np.float64) * D ** -0.5
                p = np.exp(sc - sc.max())
                ref = p @ vals / p.sum()
                assert np.abs(got[r, h] - ref).max() < 2e-6


def test_launch_arguments_are_checked_against_the_c_signature():
    mod = ck.EmulatedModule()
    f = mod.get_function("rms_norm")
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError):
        f((2,), (256,), (x, np.zeros(8, np.float32), x, 8, np.float32(1e-5)))  # python int
    with pytest.raises(TypeError):
        f((2,), (256,), (x, np.zeros(8, np.float64), x, np.int32(8), np.float32(1e-5)))
    with pytest.raises(TypeError):
        f((2,), (256,), (x, x, np.int32(8), np.float32(1e-5)))
    with pytest.raises(ValueError):
        f((2,), (128,), (x, np.zeros(8, np.float32), x, np.int32(8), np.float32(1e-5)))
    with pytest.raises(ValueError):  # a grid that does not cover the matrix
        out = np.zeros((2, 70), np.float32)
        mod.get_function("linear_f32_1_1")((1, 1), (256,), (x, np.zeros((70, 8), np.float32), out,
                                                         np.int32(2), np.int32(70), np.int32(8),
                                                         out, np.int32(0), x, np.float32(0), np.int32(0)))


def test_kernel_variant_choice():
    assert [ck.row_tile(m) for m in (1, 2, 3, 5, 8, 9, 16, 17, 512)] == [1, 2, 4, 8, 8, 16, 16, 16, 16]
    assert ck.col_tile(8192) == 1 and ck.col_tile(8193) == 4
    be = CupyBackend.emulated_on_cpu()
    mod = be.kernels.module
    rng = np.random.default_rng(0)
    for (M, N, K), want in (((3, 70, 64), "linear_f32_4_1"), ((17, 9000, 16), "linear_f32_16_4"),
                            ((2, 5, 77), "linear_f32_s")):
        w = be.linear_weight(GGUFTensor.from_array(rng.standard_normal((N, K), dtype=np.float32)))
        be.linear(rng.standard_normal((M, K), dtype=np.float32), w)
        assert mod.launches[-1][0] == want


def test_attention_row_chunks_do_not_change_bits(monkeypatch):
    be = CupyBackend.emulated_on_cpu()
    rng = np.random.default_rng(2)
    S, G, C, D, H, R = 3, 2, 48, 16, 4, 9  # C: whole KV blocks (the gathered length)
    kv = be.new_kv(S, 1, G, C, D)
    q = rng.standard_normal((R, H, D), dtype=np.float32)
    k = rng.standard_normal((R, G, D), dtype=np.float32)
    v = rng.standard_normal((R, G, D), dtype=np.float32)
    slots = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2], np.int32)
    pos = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2], np.int32) + 5
    whole = be.attend(kv, 0, q, k, v, slots, pos, 0.25)
    monkeypatch.setattr(ck.launch, "SCRATCH_FLOATS", 2 * H * C)  # two rows per launch pair
    n0 = len(be.kernels.module.launches)
    chunked = be.attend(kv, 0, q, k, v, slots, pos, 0.25)
    assert sum(1 for name, _ in be.kernels.module.launches[n0:] if name.startswith("attn_scores_")) == 5
    assert np.array_equal(whole, chunked)


# ---------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_weights_stay_quantized_and_exact(tiny, qtype):
    path, _ = tiny("llama", qtype)
    gf = GGUFFile.open(path)
    for name in ("blk.0.ffn_gate.weight", "token_embd.weight"):
        t = gf.tensor(name)
        w = t.dequantize()
        pw = prepare_weight(t)
        # in their blocks: the file's bytes (backends/cuda/packed.py)
        assert pw.kind == ("q80" if qtype == "Q8_0" else "q4") and pw.nbytes == np.asarray(t.blocks).nbytes
        assert pw.w.dtype == (np.int8 if qtype == "Q8_0" else np.uint8)
        assert (pw.mins is not None) == (qtype == "Q4_1")
        deq = ck.dequantize(pw.kind, pw.w, pw.scales, pw.mins)
        assert np.array_equal(deq.view(np.uint32), w.view(np.uint32)), name


@pytest.mark.parametrize("qtype,K", [("F16", 96), ("F32", 44), ("Q8_0", 64), ("Q6_K", 256)])
def test_linear_add_is_one_launch_and_the_separate_add(qtype, K):
    """The residual [M, N] and bias [N] adds fused into the matmul kernel (vector and
    any-K kernels, every weight kind) == linear(x, w) + add, bit for bit, in one launch."""
    from panechat.backends.cuda.widen import random_blocks

    be = CupyBackend.emulated_on_cpu()
    rng = np.random.default_rng(6)
    N = 40
    if qtype == "Q6_K":
        t = GGUFTensor("w", (N, K), qtype, random_blocks(rng, qtype, N, K))
    else:
        t = GGUFTensor.from_array(rng.standard_normal((N, K), dtype=np.float32), qtype)
    w = be.linear_weight(t)
    x = rng.standard_normal((5, K), dtype=np.float32)
    for add in (rng.standard_normal((5, N), dtype=np.float32), rng.standard_normal(N, dtype=np.float32)):
        be.kernels.module.launches.clear()
        got = be.linear_add(x, w, add)
        assert len(be.kernels.module.launches) == 1
        assert np.array_equal(got.view(np.uint32), (be.linear(x, w) + add).view(np.uint32))


@pytest.mark.parametrize("style,rope_dim", [("neox", 64), ("normal", 64), ("neox", 32), ("normal", 16)])
def test_rope_kernel_is_the_elementwise_rope(style, rope_dim):
    """The one-launch rope kernel (emulated) == ArrayBackend.rope's numpy arithmetic, bit
    for bit, partial rotary dims included; and it is one launch."""
    from panechat.backends.array_backend import ArrayBackend

    be = CupyBackend.emulated_on_cpu()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 3, 64), dtype=np.float32) * 4
    pos = rng.integers(0, 200, 7).astype(np.int32)
    tabs = be.rope_tables(rope_dim, 10000.0, 200)
    be.kernels.module.launches.clear()
    got = be.rope(x, pos, style, tabs)
    assert [n for n, _ in be.kernels.module.launches] == ["rope"]
    want = ArrayBackend.rope(be, x, pos, style, tabs)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
def test_kquant_and_q5_weights_are_widened_exactly(qtype):
    """K-quants and Q5_x: int8 codes + float32 scale (and min) per group, exactly the
    floats gguf dequantizes, and the emulated kernel computes with exactly those."""
    from panechat.backends.cuda.widen import random_blocks

    rng = np.random.default_rng(3)
    if qtype.endswith("_K"):
        t = GGUFTensor("w", (40, 512), qtype, random_blocks(rng, qtype, 40, 512))
    else:
        t = GGUFTensor.from_array(rng.standard_normal((40, 512), dtype=np.float32), qtype)
    pw = prepare_weight(t, widened=True)  # Q4_K: the widened form (its block form: test_cupy_packed.py)
    assert pw.kind == "q8" and pw.w.dtype == np.int8 and pw.group == (16 if qtype == "Q6_K" else 32)
    assert pw.nbytes < t.dequantize().astype(np.float16).nbytes * 0.8  # less than a float16 copy
    want = t.dequantize()
    got = ck.dequantize("q8", pw.w, pw.scales, pw.mins, pw.group)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    be = CupyBackend.emulated_on_cpu()
    x = rng.standard_normal((3, 512), dtype=np.float32)
    assert np.array_equal(be.linear(x, be.linear_weight(t)), ck.emulate_linear(x, want))


def test_float_weight_kinds(tiny):
    path, _ = tiny("llama", "F16", tied=False)
    gf = GGUFFile.open(path)
    name = "blk.0.attn_q.weight"
    t = gf.tensor(name)
    w = t.dequantize()
    pw = prepare_weight(t)
    assert pw.kind == "f16" and np.array_equal(ck.dequantize("f16", pw.w), w)
    w32 = np.random.default_rng(0).standard_normal((8, 16), dtype=np.float32)
    assert prepare_weight(GGUFTensor.from_array(w32, "F32")).kind == "f32"
    assert np.array_equal(prepare_weight(GGUFTensor.from_array(w32, "F32")).w, w32)
    bf = GGUFTensor.from_array(w32, "BF16")  # BF16: as stored, widened exactly
    pb = prepare_weight(bf)
    assert pb.kind == "bf16" and pb.w.dtype == np.uint16 and np.array_equal(ck.dequantize("bf16", pb.w),
                                                                            bf.dequantize())
    q2_k = GGUFTensor("w", (8, 256), "Q2_K", np.zeros((8, 84), np.uint8))  # 84-byte blocks of 256
    assert prepare_weight(q2_k).kind == "f16"  # other types: float16 ...
    assert prepare_weight(q2_k, float_weights="f32").kind == "f32"  # ... unless asked
    big = np.full((8, 84), 0xFF, np.uint8)  # Q2_K codes and scales all ones, d = 60000: w = 2.7e6
    big[:, 80:84] = np.array([60000.0, 0.0], np.float16).view(np.uint8)
    assert prepare_weight(GGUFTensor("w", (8, 256), "Q2_K", big)).kind == "f32"  # ... or out of float16's range
    assert isinstance(prepare_weight(GGUFTensor.from_array(w32, "F32")), CupyWeight)


# ---------------------------------------------------------------------------------------
# the backend's host code with emulated kernels
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("qtype,tied", QTYPES)
def test_emulated_backend_matches_float64_reference(tiny, arch, qtype, tied):
    path, weights = tiny(arch, qtype, tied)
    gf = GGUFFile.open(path)
    model = Model.load(gf, CupyBackend.emulated_on_cpu(), max_positions=64)
    tokens = np.random.default_rng(1).integers(0, model.args.vocab_size, 23).tolist()
    ref = reference_logits(weights, arch, tokens)
    base = None
    for chunk in (23, 5, 1):
        got = forward_chunks(model, tokens, chunk)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 2e-6, f"chunk {chunk}: relative error {err:.2e}"
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        if base is None:
            base = got
        else:  # prefill chunking does not change a bit either
            assert np.array_equal(got, base), f"chunk {chunk}"


def test_gemma3_sliding_window_and_gelu_run_on_the_emulated_backend(tiny):
    """gemma3 (GELU feed-forward; layers 0-4 and 6 slide over 5 keys): the emulated kernels
    against the float64 reference, chunked prefill bit-identical, and batch invariance."""
    path, weights = tiny("gemma3", "F32")
    model = Model.load(GGUFFile.open(path), CupyBackend.emulated_on_cpu(), max_positions=64)
    tokens = np.random.default_rng(2).integers(0, model.args.vocab_size, 14).tolist()
    ref = reference_logits(weights, "gemma3", tokens)
    whole = forward_chunks(model, tokens, 14)
    assert np.abs(whole - ref).max() / np.abs(ref).max() < 2e-6
    assert np.array_equal(forward_chunks(model, tokens, 3), whole)
    _invariance(model, steps=2)


def _invariance(model: Model, steps: int = 3) -> None:
    a = model.args

    def kv(n):
        return model.backend.new_kv(n, a.n_layer, a.n_kv_head, 64, a.head_dim)

    alone = [run_batched(model, kv(1), [p], steps, 0)[0] for p in PROMPTS]
    together = run_batched(model, kv(6), PROMPTS + EXTRA, steps, 5)
    for i in range(len(PROMPTS)):
        for s in range(steps + 1):
            assert np.array_equal(alone[i][s], together[i][s]), f"seq {i} step {s}"
    assert check_model_invariance(model, kv(3)) is None


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("qwen2", "F16")])
def test_emulated_backend_is_batch_invariant(tiny, arch, qtype):
    path, _ = tiny(arch, qtype, qtype != "F16")
    _invariance(Model.load(GGUFFile.open(path), CupyBackend.emulated_on_cpu(), max_positions=64))


def test_emulated_backend_agrees_with_numpy_backend(tiny):
    path, _ = tiny("qwen2", "Q4_1", False)
    gf = GGUFFile.open(path)
    em = Model.load(gf, CupyBackend.emulated_on_cpu(), max_positions=64)
    nm = Model.load(gf, _FloatProducts(), max_positions=64)  # numpy with float32 products, as CuPy's
    tokens = np.random.default_rng(4).integers(0, em.args.vocab_size, 17).tolist()
    a, b = forward_chunks(em, tokens, 17), forward_chunks(nm, tokens, 17)
    assert np.abs(a - b).max() / np.abs(b).max() < 2e-6
    assert (a.argmax(-1) == b.argmax(-1)).all()
    # the numpy backend itself (Q4_1 over int16 activations): the same tokens, float32's distance
    c = forward_chunks(Model.load(gf, NumpyBackend(), max_positions=64), tokens, 17)
    assert np.abs(c - b).max() / np.abs(b).max() < 1e-3 and (c.argmax(-1) == b.argmax(-1)).all()


class _FloatProducts(NumpyBackend):
    """The numpy backend with every weight dequantized to float32 (the float32 kernels)."""

    def linear_weight(self, t):
        return t.dequantize()


def test_emulated_self_check_and_kernel_comparison_run():
    be = CupyBackend.emulated_on_cpu()
    assert be.self_check() is None
    assert compare_kernels_with_emulation(be) == []
    assert "emulation" in be.describe()


# ---------------------------------------------------------------------------------------
# on a CUDA device
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu():
    if NO_CUDA is not None:
        pytest.skip(f"no CUDA device: {NO_CUDA}")
    try:
        return CupyBackend()
    except BackendUnavailable as e:
        pytest.skip(f"no CUDA device: {e}")


def test_gpu_kernels_match_the_emulation_bit_for_bit(gpu):
    assert compare_kernels_with_emulation(gpu) == []


def test_gpu_self_check(gpu):
    assert gpu.self_check() is None
    assert "sm_" in gpu.describe() and "cupy" in gpu.describe()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype,tied", QTYPES)
def test_gpu_model_matches_emulation_and_reference(gpu, tiny, arch, qtype, tied):
    path, weights = tiny(arch, qtype, tied)
    gf = GGUFFile.open(path)
    model = Model.load(gf, gpu, max_positions=64)
    emu = Model.load(gf, CupyBackend.emulated_on_cpu(), max_positions=64)
    tokens = np.random.default_rng(1).integers(0, model.args.vocab_size, 23).tolist()
    ref = reference_logits(weights, arch, tokens)
    for chunk in (23, 5, 1):
        got = forward_chunks(model, tokens, chunk)
        assert np.array_equal(got, forward_chunks(emu, tokens, chunk)), f"chunk {chunk}"
        assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("qwen2", "F16"), ("llama", "F32")])
def test_gpu_model_is_batch_invariant(gpu, tiny, arch, qtype):
    path, _ = tiny(arch, qtype, qtype != "F16")
    _invariance(Model.load(GGUFFile.open(path), gpu, max_positions=64), steps=8)

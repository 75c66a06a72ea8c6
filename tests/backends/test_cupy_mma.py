"""The CuPy backend's tensor-core (MMA) mode (docs/cupy.md, "Tensor-core mode").

Here, without a GPU: the x split (bit-specified) against exact arithmetic, the numpy
model of the products within the documented error bound of float64 for every weight form,
rows alone == rows in batches bit for bit through the backend's host code, the start-up
self-check and whole tiny models with the mode on, the opt-in switch, and the CUDA source
compiled by nvcc (skipped without nvcc) and NVRTC (skipped without it). On a GPU
(skipped otherwise): the same checks on the device (scripts/gpu_check.py runs them too).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from panechat.backends import BackendUnavailable
from panechat.backends.cuda import mma as cupy_mma
from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.cuda.kernels import mma_emulation
from panechat.backends.cuda.kernels.mma_emulation import emulate_mma_product, mma_error_bound, split_x
from panechat.backends.cuda.kernels.mma_launch import mma_tile
from panechat.backends.cuda.kernels.mma_source import MMA_KERNEL_NAMES, MMA_OPTIONS, MMA_SOURCE
from panechat.backends.cuda.mma_check import (
    block_form,
    check_mma,
    exact_weights,
    mma_tensor,
    on_backend,
    probe_rows,
    rows_invariant,
)
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.forward import Model

from ..model_runs import forward_chunks, run_batched
from ..tiny_gguf import reference_logits


@pytest.fixture(scope="module")
def mma_be():
    return CupyBackend.emulated_on_cpu(mma=True)


# -- the split ---------------------------------------------------------------------------

def test_split_x_reconstructs_each_row_to_22_bits():
    rng = np.random.default_rng(0)
    x = probe_rows(rng, 40, 256)
    x[11, :5] = [np.float32(1e-40), -np.float32(3e38), 65504.0, 1e-8, -0.0]
    (hi, lo), xinv, xsum = split_x(x, 48, 5, True)
    assert hi.dtype == lo.dtype == np.float16 and hi.shape == (48, 256)
    assert np.isfinite(hi).all() and np.isfinite(lo).all() and (np.abs(hi.astype(np.float32)) <= 2 ** 15).all()
    assert (xinv[:40] == 2.0 ** np.round(np.log2(xinv[:40]))).all()  # powers of two
    recon = (hi[:40].astype(np.float64) + lo[:40].astype(np.float64)) * xinv[:40, None].astype(np.float64)
    x64 = x.astype(np.float64)
    tol = 2.0 ** -22 * np.abs(x64) + 2.0 ** -39 * np.abs(x64).max(axis=1, keepdims=True)
    assert (np.abs(recon - x64) <= tol).all()
    assert not hi[40:].any() and not lo[40:].any() and (xinv[40:] == 1).all() and not xsum[40:].any()
    v = x * (np.float32(1) / xinv[:40, None])  # the scaled rows (exact: powers of two)
    want = np.zeros((40, 8), np.float32)
    for b in range(8):
        for j in range(32):
            want[:, b] = want[:, b] + v[:, 32 * b + j]  # sequential float32 sums
    assert np.array_equal(xsum[:40], want)


def test_split_scale_keeps_rows_below_f16_overflow():
    for mx in (np.float32(65504.0), np.float32(0.99999994), np.float32(1.0), np.float32(3.4e38),
               np.float32(1e-30), np.float32(0.0)):
        x = np.full((1, 32), mx, np.float32)
        (hi, lo), xinv, _ = split_x(x, 8)
        assert np.isfinite(hi.astype(np.float32)).all()
        if mx > 1e-30:
            assert 2 ** 14 <= abs(float(hi[0, 0])) <= 2 ** 15


# -- the products: model within the bound, the bound able to fail --------------------------

def test_bf16_split_reconstructs_each_row_to_24_bits():
    from panechat.backends.cuda.kernels.mma_emulation import from_bf16, part_values

    rng = np.random.default_rng(7)
    x = probe_rows(rng, 20, 128)
    xp, xinv, _ = split_x(x, 24, bf16=True)
    assert xp.shape == (3, 24, 128) and xp.dtype == np.uint16 and not xp[:, 20:].any()
    hi, mid, lo = part_values(xp[:, :20], True)
    recon = (hi + mid + lo) * xinv[:20, None]
    x64 = x.astype(np.float64)
    assert (np.abs(recon - x64) <= 2.0 ** -26 * np.abs(x64) + 2.0 ** -60 * np.abs(x64).max()).all()
    assert np.array_equal(from_bf16(xp[0, :20]), hi.astype(np.float32))  # bf16 bits as stored


@pytest.mark.parametrize("qtype,n,k", [("F16", 40, 128), ("BF16", 24, 96), ("Q8_0", 72, 256), ("Q4_1", 24, 320),
                                       ("Q4_K", 16, 512), ("Q6_K", 20, 256), ("Q5_0", 17, 64)])
def test_model_is_within_the_bound_of_float64(qtype, n, k):
    rng = np.random.default_rng(1)
    t = mma_tensor(rng, qtype, n, k)
    w, w_abs, group = exact_weights(t)
    x = probe_rows(rng, 19, k)
    be = CupyBackend.emulated_on_cpu(mma=True)
    y = be.linear(x, be.linear_weight(t)).astype(np.float64)
    err = np.abs(y - x.astype(np.float64) @ w.T)
    bound = mma_error_bound(x, w_abs, group)
    assert (err <= bound).all(), float((err / bound).max())
    # and typically far inside it: float32-level accuracy relative to sum |x| |w|
    assert (err <= 1e-6 * (np.abs(x.astype(np.float64)) @ w_abs.T) + 1e-30).all()


def _literal_product(parts, xinv, xsum, w, d, m, gshift):
    """The contract of mma_source.py for one element at a time, written out as stated
    (each mma: the exact sum of its 16 products and the accumulator, rounded once)."""
    R, K = parts[0].shape
    N = w.shape[0]
    G = 1 << gshift if d is not None else 32
    out = np.zeros((R, N), np.float32)
    for r in range(R):
        for n in range(N):
            warps = [np.float32(0)] * 8
            for c in range(K // 32):
                for g0 in range(32 * c, 32 * c + 32, G):
                    p = np.float32(0)
                    for k0 in range(g0, g0 + G, 16):
                        for part in parts:
                            exact = sum(float(part[r, k]) * float(w[n, k]) for k in range(k0, k0 + 16))
                            p = np.float32(float(p) + exact)
                    a = warps[c % 8]
                    if d is None:
                        a = np.float32(a + p)
                    else:
                        b = g0 // G
                        a = ck_fma(d[n, b], p, a)
                        if m is not None:
                            a = ck_fma(m[n, b], xsum[r, b], a)
                    warps[c % 8] = a
            s = ((warps[0] + warps[1]) + (warps[2] + warps[3])) + ((warps[4] + warps[5]) + (warps[6] + warps[7]))
            out[r, n] = np.float32(s * xinv[r])
    return out


def ck_fma(a, b, c):
    from panechat.backends.cuda.kernels import fma_f32

    return fma_f32(np.float32(a), np.float32(b), np.float32(c))[()]


@pytest.mark.parametrize("kind,gshift,mins", [("f16", 5, False), ("bf16", 5, False), ("q8", 5, True),
                                              ("q8", 4, False)])
def test_model_is_the_literal_contract(kind, gshift, mins):
    """emulate_mma_product (vectorized) == the contract written out per element, bit for bit."""
    rng = np.random.default_rng(6)
    R, N, K = 3, 5, 288  # 9 chunks: warp 0 gets two
    x = probe_rows(rng, R, K)
    from panechat.backends.cuda.kernels.mma_emulation import from_bf16, part_values, to_bf16

    xp, xinv, xsum = split_x(x, 8, gshift, mins, kind == "bf16")
    parts = part_values(xp[:, :R], kind == "bf16")
    if kind == "f16":
        w = rng.standard_normal((N, K)).astype(np.float16)
        d = m = None
    elif kind == "bf16":
        w = from_bf16(to_bf16(rng.standard_normal((N, K)).astype(np.float32)))
        d = m = None
    else:
        w = rng.integers(-128, 128, (N, K)).astype(np.int8)
        d = (rng.standard_normal((N, K >> gshift)) * 0.01).astype(np.float32)
        m = (rng.standard_normal((N, K >> gshift)) * 0.01).astype(np.float32) if mins else None
    got = emulate_mma_product(parts, xinv[:R], None if xsum is None else xsum[:R], w, d, m, gshift)
    want = _literal_product(parts, xinv[:R], xsum, w.astype(np.float64), d, m, gshift)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_form_weights_are_gguf_s_weights(qtype):
    """The q80 / q4 block forms (codes as stored, float16 d, m) decode to exactly the
    weights gguf dequantizes (Q4_1: q*d + m before gguf's one rounding), and their MMA
    products are within the bound."""
    rng = np.random.default_rng(8)
    t = mma_tensor(rng, qtype, 24, 256)
    h = block_form(t)
    assert h.kind == ("q80" if qtype == "Q8_0" else "q4") and h.scales.dtype == np.float16
    w, w_abs, group = exact_weights(h)
    want = t.dequantize().astype(np.float64)
    if qtype == "Q4_1":
        assert np.array_equal(w.astype(np.float32), want.astype(np.float32))  # rounded once, as gguf
    else:
        assert np.array_equal(w, want)
    be = CupyBackend.emulated_on_cpu(mma=True)
    x = probe_rows(rng, 11, 256)
    y = be.linear(x, on_backend(be, h)).astype(np.float64)
    assert (np.abs(y - x.astype(np.float64) @ want.T) <= mma_error_bound(x, w_abs, group) + 2.0 ** -24 * (
        np.abs(x.astype(np.float64)) @ np.abs(want).T)).all()


def test_bound_catches_a_split_without_its_low_half(monkeypatch):
    """A product that drops x's low f16 half (x rounded to 11 bits) breaks the bound: the
    check can fail."""
    rng = np.random.default_rng(2)
    t = mma_tensor(rng, "F16", 32, 256)
    w, w_abs, group = exact_weights(t)
    x = probe_rows(rng, 9, 256)
    (hi, lo), xinv, _ = split_x(x, 16)
    w16 = t.dequantize().astype(np.float64)
    y = emulate_mma_product((hi.astype(np.float64), np.zeros(lo.shape)), xinv, None, w16)[:9]
    err = np.abs(y.astype(np.float64) - x.astype(np.float64) @ w.T)
    assert (err > mma_error_bound(x, w_abs, group)).any()


def test_mma_tiles_and_which_weights():
    assert [mma_tile(m) for m in (1, 8, 9, 16, 17, 64, 513)] == [(1, 1), (1, 1), (1, 2), (1, 2), (2, 4), (2, 4),
                                                                (2, 4)]
    be = CupyBackend.emulated_on_cpu(mma=True)
    rng = np.random.default_rng(3)
    kinds = {q: be.mma.handles(be.linear_weight(mma_tensor(rng, q, 16, 64))) for q in ("F16", "Q8_0", "Q4_1")}
    kinds["F32"] = be.mma.handles(be.linear_weight(mma_tensor(rng, "F32", 16, 64)))
    kinds["BF16"] = be.mma.handles(be.linear_weight(mma_tensor(rng, "BF16", 16, 64)))
    kinds["BF16 K=48"] = be.mma.handles(be.linear_weight(mma_tensor(rng, "BF16", 16, 48)))
    kinds["F16 K=40"] = be.mma.handles(be.linear_weight(mma_tensor(rng, "F16", 16, 40)))
    for q in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"):  # block forms it does not know: the CUDA-core kernels
        kinds[q] = be.mma.handles(be.linear_weight(mma_tensor(rng, q, 16, 256)))
    assert kinds == {"F16": True, "Q8_0": True, "Q4_1": True, "F32": False, "BF16": True, "BF16 K=48": False,
                     "F16 K=40": False, "Q4_K": False, "Q5_K": False, "Q6_K": False, "Q5_0": False,
                     "Q5_1": False}


# -- invariance through the backend's host code ----------------------------------------------

@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_1"])
def test_rows_alone_equal_rows_in_batches(mma_be, qtype):
    rng = np.random.default_rng(4)
    t = mma_tensor(rng, qtype, 40, 256)
    w = mma_be.linear_weight(t)
    x = probe_rows(rng, 70, 256)
    assert rows_invariant(mma_be, w, x, (2, 3, 8, 9, 16, 17, 33, 64, 70)) is None
    add = rng.standard_normal((70, 40), dtype=np.float32)
    assert rows_invariant(mma_be, w, x, (5, 17), add=add) is None
    names = {n for n, _ in mma_be.mma.module.launches}
    assert {"mma_split_x", f"mma_linear_{w.kind}_1_1", f"mma_linear_{w.kind}_1_2", f"mma_linear_{w.kind}_2_4"} <= names


def test_check_mma_passes_on_the_model(mma_be):
    results = check_mma(mma_be, batches=(2, 5, 9, 17, 33))
    assert results and all(ok for ok, _ in results), [line for ok, line in results if not ok]


def test_self_check_runs_the_mma_kernels(mma_be):
    assert set(cupy_mma.MMA_CHECK_LINEAR) <= set(mma_be.check_plan.linear)
    mma_be.mma.module.launches.clear()
    assert mma_be.self_check() is None
    names = {n for n, _ in mma_be.mma.module.launches}
    assert {"mma_linear_f16_1_1", "mma_linear_f16_1_2", "mma_linear_f16_2_4"} <= names
    assert {n[-3:] for n in names if n.startswith("mma_linear_q")} == {"1_1", "1_2", "2_4"}  # codes: every tile


# -- whole models with the mode on -----------------------------------------------------------

@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("qwen2", "F16"), ("llama", "Q4_1"), ("llama", "BF16")])
def test_tiny_model_with_mma_matches_float64_and_is_invariant(tiny, arch, qtype):
    path, weights = tiny(arch, qtype, qtype != "F16")
    model = Model.load(GGUFFile.open(path), CupyBackend.emulated_on_cpu(mma=True), max_positions=64)
    tokens = np.random.default_rng(5).integers(0, model.args.vocab_size, 17).tolist()
    ref = reference_logits(weights, arch, tokens)
    whole = forward_chunks(model, tokens, 17)
    assert np.abs(whole - ref).max() / np.abs(ref).max() < 1e-5
    assert (whole.argmax(-1) == ref.argmax(-1)).all()
    assert np.array_equal(forward_chunks(model, tokens, 4), whole)  # chunked prefill: same bits
    assert np.array_equal(forward_chunks(model, tokens, 1), whole)
    a = model.args

    def kv(n):
        return model.backend.new_kv(n, a.n_layer, a.n_kv_head, 64, a.head_dim)

    prompts = [[1, 90, 198, 26, 35, 253], [50, 23, 63], [28, 198, 66, 11, 216, 28, 56, 48, 49]]
    extra = [[57, 52, 20], [19, 9, 30, 33, 31, 26, 12]]
    alone = [run_batched(model, kv(1), [p], 2, 0)[0] for p in prompts]
    together = run_batched(model, kv(5), prompts + extra, 2, 5)
    for i in range(len(prompts)):
        for s in range(3):
            assert np.array_equal(alone[i][s], together[i][s]), f"seq {i} step {s}"


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("qwen2", "Q4_1"), ("llama", "F16")])
def test_every_product_of_a_model_runs_on_tensor_cores(tiny, arch, qtype):
    """With the mode on, every matmul of the forward pass (q/k/v, output, gate/up, down, the
    head) goes through the MMA kernels, at B = 1 as in prefill: none through the CUDA-core
    linear kernels. (Guards the mode's coverage when products get other routes, e.g. a
    fused norm + linear, or weights in another resident form.)"""
    path, _ = tiny(arch, qtype, True)
    be = CupyBackend.emulated_on_cpu(mma=True)
    model = Model.load(GGUFFile.open(path), be, max_positions=64)
    for chunk in (9, 1):
        be.kernels.module.launches.clear()
        be.mma.module.launches.clear()
        forward_chunks(model, list(range(3, 12)), chunk)
        core = [n for n, _ in be.kernels.module.launches if n.startswith("linear_")]
        mma = [n for n, _ in be.mma.module.launches if n.startswith("mma_linear_")]
        assert not core and mma, (chunk, sorted(set(core)))


def test_graph_steps_with_mma_equal_eager_steps(tiny):
    """Decode steps through the per-bucket graphs (rows padded to the bucket, replayed by
    re-running on the emulation) == the eager steps, with the MMA mode on."""
    from panechat.engine.model.forward import Batch

    path, _ = tiny("qwen2", "Q8_0", False)
    gf = GGUFFile.open(path)
    graphed = Model.load(gf, CupyBackend.emulated_on_cpu(mma=True), max_positions=32)
    eager_be = CupyBackend.emulated_on_cpu(mma=True)
    eager_be.graphs = None
    eager = Model.load(gf, eager_be, max_positions=32)
    prompts = [[1, 90, 198, 26, 35], [1, 40, 198, 26], [50, 23, 63]]
    kvs = []
    for model in (graphed, eager):
        a = model.args
        kv = model.backend.new_kv(3, a.n_layer, a.n_kv_head, 32, a.head_dim)
        toks = sum(prompts, [])
        slots = sum(([i] * len(p) for i, p in enumerate(prompts)), [])
        pos = sum((list(range(len(p))) for p in prompts), [])
        model.forward(kv, Batch(np.array(toks, np.int32), np.array(slots, np.int32), np.array(pos, np.int32),
                                np.cumsum([len(p) for p in prompts]) - 1))
        kvs.append(kv)
    for rows in ([2, 0, 1], [1], [0, 2]):
        got, want = (m.forward(kv, Batch(np.array([7 + r for r in rows], np.int32), np.array(rows, np.int32),
                                         np.array([len(prompts[r]) for r in rows], np.int32), np.arange(len(rows))))
                     for m, kv in ((graphed, kvs[0]), (eager, kvs[1])))
        assert np.array_equal(got, want), rows
    assert graphed.backend.graphs.capturer.captures == 3


# -- the switch ------------------------------------------------------------------------------

def test_mma_is_opt_in(monkeypatch):
    monkeypatch.delenv("PANECHAT_CUPY_MMA", raising=False)
    assert cupy_mma.mma_requested() is False
    monkeypatch.setenv("PANECHAT_CUPY_MMA", "1")
    assert cupy_mma.mma_requested() is True
    assert cupy_mma.mma_requested(False) is False
    assert CupyBackend.emulated_on_cpu().mma is None


def test_old_gpu_gets_one_line_unavailable():
    class Dev:
        compute_capability = "75"

    class Cuda:
        @staticmethod
        def Device():
            return Dev()

    class FakeCp:
        cuda = Cuda

    with pytest.raises(BackendUnavailable) as e:
        cupy_mma.build_mma(FakeCp)
    assert "\n" not in str(e.value) and "sm_75" in str(e.value)


def test_emulated_module_checks_launch_arguments(mma_be):
    fn = mma_be.mma.module.get_function("mma_split_x")
    x = np.zeros((2, 32), np.float32)
    with pytest.raises(TypeError):
        fn((8,), (256,), (x, x, x, x, np.int32(2), np.int32(32), np.int32(5), np.int32(0), np.int32(0)))
    assert set(mma_emulation.EmulatedMmaModule().signatures) == set(MMA_KERNEL_NAMES)


# -- compiling the CUDA source without a GPU ---------------------------------------------------

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)


def _check_ptx(ptx: str) -> None:
    entries = re.findall(r"\.entry (\w+)", ptx)
    assert sorted(entries) == sorted(MMA_KERNEL_NAMES)
    assert ".approx" not in ptx and ".ftz" not in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    f32_ops = set(re.findall(r"\b((?:fma|add|sub|mul|div|sqrt|rcp)\.[\w.]*f32)\b", ptx))
    assert f32_ops <= {"fma.rn.f32", "add.rn.f32", "sub.rn.f32", "mul.rn.f32"}, f32_ops


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_nvcc_compiles_the_mma_source_for_sm90_without_spills(tmp_path):
    src = tmp_path / "mma.cu"
    src.write_text(MMA_SOURCE)
    ptx = tmp_path / "mma.ptx"
    subprocess.run([NVCC, "-ptx", "-arch=sm_90", *MMA_OPTIONS, str(src), "-o", str(ptx)], check=True,
                   capture_output=True, text=True, timeout=300)
    _check_ptx(ptx.read_text())
    r = subprocess.run([NVCC, "-cubin", "-arch=sm_80", "-Xptxas", "-v", *MMA_OPTIONS, str(src), "-o",
                        str(tmp_path / "mma.cubin")], check=True, capture_output=True, text=True, timeout=300)
    spills = re.findall(r"(\d+) bytes spill stores", r.stdout + r.stderr)
    assert spills and all(s == "0" for s in spills), r.stderr


def test_nvrtc_compiles_the_mma_source():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable ({type(e).__name__})")
    from panechat.backends.cuda.kernels.build import compile_ptx

    _check_ptx(compile_ptx("compute_90", MMA_SOURCE, MMA_OPTIONS).decode())


# -- on a CUDA device -------------------------------------------------------------------------

def _gpu_mma():
    try:
        return CupyBackend(mma=True)
    except (BackendUnavailable, Exception) as e:  # no cupy, no device, an old device
        pytest.skip(f"no MMA-capable CUDA device ({type(e).__name__})")


def test_gpu_mma_checks():
    be = _gpu_mma()
    results = check_mma(be)
    assert all(ok for ok, _ in results), [line for ok, line in results if not ok]
    assert be.self_check() is None

"""Tests for the batch-invariant numba kernels (panechat.backends.cpu.numpy_kernels).

Invariance is always checked with exact equality (np.array_equal) of a row
computed alone against the same row inside batches of several sizes and at
several positions; accuracy is checked against float64 references.
"""

import numpy as np
import pytest

from panechat.backends.cpu import numpy_kernels as nk
from panechat.backends.cpu.numpy_backend import NumpyBackend
from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.backends.quant import registry
from scripts import reference_kernels as ref

BATCHES = (2, 3, 4, 5, 8, 17, 32)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _rel_err(got, ref, scale):
    return float(np.max(np.abs(got.astype(np.float64) - ref) / scale))


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("M,N,K", [(1, 64, 576), (5, 70, 96), (9, 128, 200), (33, 96, 1536)])
def test_linear_matches_float64(rng, M, N, K):
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    out = nk.linear(x, w, np.empty((M, N), np.float32))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)  # error bound scale
    assert _rel_err(out, ref, scale) < 2e-6


@pytest.mark.parametrize("N,K", [(64, 576), (70, 96), (36, 200), (12, 8)])
def test_linear_row_invariant_across_batches(rng, N, K):
    w = rng.standard_normal((N, K), dtype=np.float32)
    row = rng.standard_normal((1, K), dtype=np.float32)
    alone = nk.linear(row, w, np.empty((1, N), np.float32))[0]
    for B in BATCHES:
        for pos in {0, B // 2, B - 1}:
            x = rng.standard_normal((B, K), dtype=np.float32)
            x[pos] = row[0]
            got = nk.linear(x, w, np.empty((B, N), np.float32))[pos]
            assert np.array_equal(got, alone), (B, pos)


def test_linear_rejects_bad_input(rng):
    x = rng.standard_normal((4, 64), dtype=np.float32)
    w = rng.standard_normal((8, 64), dtype=np.float32)
    with pytest.raises(ValueError):
        nk.linear(x, w[:, :32].copy(), np.empty((4, 8), np.float32))
    with pytest.raises(ValueError):  # not C-contiguous
        nk.linear(np.asfortranarray(x), w, np.empty((4, 8), np.float32))


# --------------------------------------------------------------------------- linear_q8


@pytest.mark.parametrize("with_mins", [False, True])
def test_linear_q8_equals_linear_on_dequantized(rng, with_mins):
    N, K = 68, 192
    wq, d = ref.quantize_q8(rng.standard_normal((N, K), dtype=np.float32))
    mins = rng.standard_normal(d.shape, dtype=np.float32) if with_mins else None
    x = rng.standard_normal((11, K), dtype=np.float32)
    got = ref.linear_q8(x, wq, d, np.empty((11, N), np.float32), mins)
    want = nk.linear(x, ref.dequantize_q8(wq, d, mins), np.empty((11, N), np.float32))
    assert np.array_equal(got, want)


def test_quantize_q8_roundtrip(rng):
    w = rng.standard_normal((16, 64), dtype=np.float32)
    wq, d = ref.quantize_q8(w)
    assert wq.dtype == np.int8 and d.shape == (16, 2)
    assert np.max(np.abs(ref.dequantize_q8(wq, d) - w)) <= np.max(d) * 0.51


def test_linear_q8_row_invariant(rng):
    N, K = 40, 128
    wq, d = ref.quantize_q8(rng.standard_normal((N, K), dtype=np.float32))
    row = rng.standard_normal((1, K), dtype=np.float32)
    alone = ref.linear_q8(row, wq, d, np.empty((1, N), np.float32))[0]
    for B in BATCHES:
        x = rng.standard_normal((B, K), dtype=np.float32)
        x[B - 1] = row[0]
        assert np.array_equal(ref.linear_q8(x, wq, d, np.empty((B, N), np.float32))[B - 1], alone)


# --------------------------------------------------------------------------- GGUF block types
# A weight type kept in its GGUF blocks must give, bit for bit, the float32 kernel's
# product with gguf's dequantized weights, and each row must not depend on the batch.

KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
BLOCK_TYPES = KQUANTS + ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "F16", "BF16")
_F16_AT = {t.name: t.f16_at for t in registry.block_types()}  # f16 d (m)


def raw_blocks(rng, qtype, N, K):
    """The bytes of an [N, K] `qtype` tensor as a GGUF file stores it, uint8 [N, bytes per
    row]: K-quants with random codes and packed scales, small random positive f16 d (and
    dmin) or d and m of either sign; F16/BF16 with random values over 12 decades and
    both signs. Read-only, as the loader hands them over (a view of the file's read-only
    memory map): the kernels get the array type they get in a model, so the tests run,
    and numba compiles once, the build the model path uses (a writable array is another
    numba type, another build of every kernel)."""
    return _read_only(_raw_blocks(rng, qtype, N, K))


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _raw_blocks(rng, qtype, N, K):
    if qtype in ("F16", "BF16"):
        w = (rng.standard_normal((N, K)) * 10.0 ** rng.integers(-8, 4, (N, K))).astype(np.float32)
        if qtype == "F16":
            return w.astype(np.float16).view(np.uint8)
        return np.ascontiguousarray((w.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
    t = registry.get(qtype)
    b = rng.integers(0, 256, (N, K // t.block_weights, t.block_bytes), dtype=np.uint8)
    sign = 1 if t.block_weights == 256 else -1  # K-quant d, dmin are positive by construction
    for o in _F16_AT[qtype]:
        v = rng.uniform(sign * 0.01, 0.01, b.shape[:2] + (1,))
        b[..., o:o + 2] = v.astype(np.float16).view(np.uint8)
    return b.reshape(N, -1)


def _block_weight(rng, qtype, N, K):
    """(run(x) -> x @ W.T through the backend's kernel for `qtype`, W = gguf's float32
    dequantization of the same bytes)."""
    from gguf import GGMLQuantizationType, quants

    from panechat.backends.quant.gguf_tensor import GGUFTensor
    from panechat.backends.cpu.numpy_backend import NumpyBackend

    blocks = raw_blocks(rng, qtype, N, K)
    be = NumpyBackend()
    kept = be.linear_weight(GGUFTensor("w", (N, K), qtype, blocks))
    assert not isinstance(kept, np.ndarray)  # kept as stored, not dequantized
    w = np.ascontiguousarray(quants.dequantize(blocks, GGMLQuantizationType[qtype]), dtype=np.float32)
    return (lambda x: be.linear(x, kept)), w.reshape(N, K), kept


def _expected(x, w, kept):
    """The product's bits: the float32 kernel on gguf's floats `w`, or for a weight repacked
    (registry `cpu_packed`), whose products round activations (Q4_0, Q4_1, Q8_0 to int16;
    Q4_K, Q5_K, Q6_K to 8 bits, `q8k_dot`'s contract), its numpy reference."""
    from panechat.backends.cpu import repack
    from panechat.backends.cpu.numpy_backend import PackedWeight

    if isinstance(kept, PackedWeight):  # in records of 16 columns
        return repack.reference(kept.qtype, x, repack.unpack(kept.data, kept.qtype, kept.shape[0]))
    return nk.linear(x, w, np.empty((x.shape[0], w.shape[0]), np.float32))


#: the types no shipped model uses: their kernels cost about a minute of cold compiling each,
#: so they are checked in `make test-slow` (test_registry_types.SHIPPED_TYPES has the others)
NOT_SHIPPED = ("Q4_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K")


@pytest.mark.parametrize("qtype", [pytest.param(t, marks=pytest.mark.slow) if t in NOT_SHIPPED else t
                                   for t in BLOCK_TYPES])
@pytest.mark.parametrize("M,N,K", [(1, 64, 256), (7, 70, 512), (33, 13, 768)])
def test_block_kernel_equals_linear_on_gguf_dequantized(rng, qtype, M, N, K):
    run, w, kept = _block_weight(rng, qtype, N, K)
    x = rng.standard_normal((M, K), dtype=np.float32)
    assert np.array_equal(run(x), _expected(x, w, kept))


@pytest.mark.parametrize("qtype", [pytest.param(t, marks=pytest.mark.slow) if t in NOT_SHIPPED else t
                                   for t in BLOCK_TYPES])
def test_block_kernel_rows_invariant_1_to_33(rng, qtype):
    """Every row count 1..33, rows drawn from a pool in a shuffled order."""
    run, _, _ = _block_weight(rng, qtype, 70, 512)
    pool = rng.standard_normal((33, 512), dtype=np.float32)
    alone = np.stack([run(pool[i:i + 1])[0] for i in range(33)])
    for B in range(1, 34):
        pick = rng.permutation(33)[:B]
        assert np.array_equal(run(pool[pick]), alone[pick]), B


def test_f16_loads_every_half_exactly():
    """All 65536 half bit patterns: finite ones to the exact float32, inf to inf, NaN to NaN."""
    from numba import njit

    from panechat.backends.cpu import quant_kernels as qk

    @njit
    def widen(h):
        out = np.empty(h.size, np.float32)
        for i in range(0, h.size, 16):
            nk.vstore(out, i, qk.vload_f16(h, i))
        return out

    h = np.arange(1 << 16, dtype=np.uint16)
    got, want = widen(h), h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)) and np.isnan(got[nan]).all()


def test_block_kernel_rejects_bad_input(rng):
    from panechat.backends.cpu import quant_kernels as qk

    blocks = raw_blocks(rng, "Q4_K", 8, 512)
    d, dmin = qk.superblock_scales(blocks, "Q4_K")
    x = rng.standard_normal((2, 512), dtype=np.float32)
    with pytest.raises(ValueError):  # blocks of another type's size
        qk.linear_kquant(x, blocks, "Q6_K", d, dmin, np.empty((2, 8), np.float32))
    with pytest.raises(ValueError):  # K not the blocks' K
        qk.linear_kquant(x[:, :256].copy(), blocks, "Q4_K", d, dmin, np.empty((2, 8), np.float32))


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_backend_keeps_block_weights_in_the_mapped_bytes(rng, qtype):
    from panechat.backends.quant.gguf_tensor import GGUFTensor
    from panechat.backends.cpu.numpy_backend import NumpyBackend

    from panechat.backends.cpu import repack
    from panechat.backends.cpu.numpy_backend import PackedWeight

    t = GGUFTensor("w", (70, 512), qtype, raw_blocks(rng, qtype, 70, 512))
    w = NumpyBackend().linear_weight(t)
    if isinstance(w, PackedWeight):  # Q4_0, Q4_1, Q8_0: the file's bytes regrouped, 80 rows (70 padded to 16s)
        assert np.array_equal(repack.unpack(w.data, qtype, 70), t.blocks)
        assert w.nbytes == t.nbytes // 70 * 80
        return
    stored = w.blocks if qtype in KQUANTS else w.data
    assert np.shares_memory(stored, t.blocks)
    assert w.nbytes <= t.nbytes * 1.06  # no float32 copy: the bytes and <= 2 floats per 256 weights


# --------------------------------------------------------------------------- attention


def _attention_ref(q, kc, vc, slots, poss, scale, window=0):
    R, H, D = q.shape
    grp = H // kc.shape[1]
    out = np.empty((R, H, D))
    for r in range(R):
        first = max(0, poss[r] - window + 1) if window else 0
        for h in range(H):
            k = kc[slots[r], h // grp, first: poss[r] + 1].astype(np.float64)
            v = vc[slots[r], h // grp, first: poss[r] + 1].astype(np.float64)
            s = k @ q[r, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[r, h] = p @ v / p.sum()
    return out


def _cache(rng, S=3, G=2, C=300, D=64):
    shape = (S, G, C, D)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def _attn(q, kc, vc, slots, poss, scale=0.125, window=0):
    slots, poss = np.asarray(slots, np.int32), np.asarray(poss, np.int32)
    return ref.attention(q, kc, vc, slots, poss, scale, np.empty_like(q), window)


@pytest.mark.parametrize("D", [64, 40])
def test_attention_matches_float64(rng, D):
    kc, vc = _cache(rng, D=D)
    q = rng.standard_normal((5, 6, D), dtype=np.float32)  # 6 heads over 2 kv heads
    slots, poss = [0, 2, 1, 2, 0], [0, 17, 299, 64, 150]
    got = _attn(q, kc, vc, slots, poss)
    ref = _attention_ref(q, kc, vc, slots, poss, 0.125)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)


def test_attention_row_invariant_across_batches(rng):
    kc, vc = _cache(rng)
    q1 = rng.standard_normal((1, 6, 64), dtype=np.float32)
    alone = _attn(q1, kc, vc, [1], [123])[0]
    for B in BATCHES:
        pos = B // 2
        q = rng.standard_normal((B, 6, 64), dtype=np.float32)
        q[pos] = q1[0]
        slots = rng.integers(0, 3, B)
        poss = rng.integers(0, 300, B)
        slots[pos], poss[pos] = 1, 123
        assert np.array_equal(_attn(q, kc, vc, slots, poss)[pos], alone), B


def test_attention_prefill_rows_equal_single_rows(rng):
    kc, vc = _cache(rng)
    R, p0 = 48, 100
    q = rng.standard_normal((R, 6, 64), dtype=np.float32)
    poss = np.arange(p0, p0 + R)
    full = _attn(q, kc, vc, np.full(R, 2), poss)
    for i in range(R):
        assert np.array_equal(full[i], _attn(q[i : i + 1].copy(), kc, vc, [2], [poss[i]])[0]), i


@pytest.mark.parametrize("D", [64, 40])
def test_attention_sliding_window_matches_float64(rng, D):
    kc, vc = _cache(rng, D=D)
    q = rng.standard_normal((6, 6, D), dtype=np.float32)
    slots, poss = [0, 2, 1, 2, 0, 1], [0, 17, 299, 64, 150, 36]  # before, at and past the window
    got = _attn(q, kc, vc, slots, poss, window=37)
    np.testing.assert_allclose(got, _attention_ref(q, kc, vc, slots, poss, 0.125, 37), rtol=2e-5, atol=2e-6)
    assert np.abs(got[2] - _attention_ref(q[2:3], kc, vc, slots[2:3], poss[2:3], 0.125)[0]).max() > 1e-3


def test_attention_sliding_window_is_attention_over_the_window(rng):
    """A row at position p with window w gives the bits of the same row attending, without
    a window, to a cache that holds just keys p-w+1..p: the window only moves the start."""
    kc, vc = _cache(rng)
    q = rng.standard_normal((1, 6, 64), dtype=np.float32)
    for pos, w in ((200, 37), (299, 64), (40, 1), (20, 100)):
        first = max(0, pos - w + 1)
        n = pos + 1 - first
        kc2, vc2 = np.zeros_like(kc), np.zeros_like(vc)
        kc2[1, :, :n], vc2[1, :, :n] = kc[0, :, first: pos + 1], vc[0, :, first: pos + 1]
        assert np.array_equal(_attn(q, kc, vc, [0], [pos], window=w), _attn(q, kc2, vc2, [1], [n - 1])), (pos, w)


def test_attention_sliding_window_row_invariant(rng):
    kc, vc = _cache(rng)
    q1 = rng.standard_normal((1, 6, 64), dtype=np.float32)
    alone = _attn(q1, kc, vc, [1], [250], window=50)[0]
    for B in BATCHES:
        pos = B // 2
        q = rng.standard_normal((B, 6, 64), dtype=np.float32)
        q[pos] = q1[0]
        slots, poss = rng.integers(0, 3, B), rng.integers(0, 300, B)
        slots[pos], poss[pos] = 1, 250
        assert np.array_equal(_attn(q, kc, vc, slots, poss, window=50)[pos], alone), B


def test_attention_rejects_out_of_range(rng):
    kc, vc = _cache(rng)
    q = rng.standard_normal((1, 6, 64), dtype=np.float32)
    with pytest.raises(ValueError):
        _attn(q, kc, vc, [3], [0])
    with pytest.raises(ValueError):
        _attn(q, kc, vc, [0], [300])


# --------------------------------------------------------------------------- self check


def test_self_check_passes():
    from panechat.backends.cpu.numpy_backend import NumpyBackend

    assert NumpyBackend().self_check() is None


def test_vsum16_equals_sixteen_vsums(rng):
    from numba import njit

    @njit
    def both(a):  # a: float32 [16 * 16]
        v = [nk.vload(a, 16 * i) for i in range(16)]
        packed = np.empty(16, np.float32)
        nk.vstore(packed, 0, nk.vsum16(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7],
                                       v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]))
        single = np.empty(16, np.float32)
        for i in range(16):
            single[i] = nk.vsum(nk.vload(a, 16 * i))
        return packed, single

    a = (rng.standard_normal(256) * 10.0 ** rng.integers(-6, 6, 256)).astype(np.float32)
    packed, single = both(a)
    assert np.array_equal(packed, single)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("D", [64, 80, 40, 128])
def test_value_sums_add_each_key_in_order_for_any_head_count(rng, dtype, D):
    """`value_sums` (1-4 heads sharing each value vector, then column tails): every element
    is its running value plus e * v key after key, each product and sum rounded to float32,
    whatever the number of heads taken together."""
    P, n, t0 = 50, 13, 7
    v = rng.standard_normal((n, D)).astype(dtype)
    store = np.concatenate([rng.standard_normal(5 * D).astype(dtype), v.reshape(-1)])  # v from offset 5 * D
    bits = store.view(np.uint16) if dtype == np.float16 else store
    for nh in range(1, 7):
        e = rng.random((nh, P), dtype=np.float32)
        acc = rng.standard_normal((nh + 1, D), dtype=np.float32)
        want = acc.copy()
        for j in range(nh):
            for i in range(n):
                want[1 + j] = want[1 + j] + e[j, t0 + i] * v[i].astype(np.float32)
        got = acc.copy()
        nk.value_sums(e.reshape(-1), t0, P, nh, bits, 5 * D, n, got.reshape(-1), D, D)
        assert np.array_equal(got, want), nh


def test_vexp_gives_expf_bits_on_every_lane(rng):
    """Softmax's exp runs 16 lanes at a time (`vexp`): each lane the bits of the scalar
    `_expf`, over values at every scale, the clamp's edge, subnormals, infinities, NaN, and
    a stride through all 2^32 bit patterns."""
    from numba import njit

    @njit
    def lanes(a, out):
        for t in range(0, a.shape[0], 16):
            nk.vstore(out, t, nk.vexp(nk.vload(a, t)))

    @njit
    def scalar(a, out):
        for t in range(a.shape[0]):
            out[t] = nk._expf(a[t])

    special = np.array([0.0, -0.0, nk._EXP_LO, np.nextafter(nk._EXP_LO, np.float32(-1)), -88.0, -103.97, -1e30,
                        -np.inf, np.inf, np.nan, -np.nan, 1e-40, -1e-40, -1e-45, 88.0, 3e38, -0.5, 0.5], np.float32)
    parts = [special, np.arange(0, 2**32, 4093, dtype=np.uint64).astype(np.uint32).view(np.float32)]
    parts += [(rng.standard_normal(1 << 16) * s).astype(np.float32) for s in (1e-3, 1.0, 10.0, 100.0)]
    a = np.concatenate(parts)
    a = np.concatenate([a, np.zeros(-len(a) % 16, np.float32)])
    got, want = np.empty_like(a), np.empty_like(a)
    lanes(a, got)
    scalar(a, want)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_cpu_backend_picks_the_kernel_policy(monkeypatch):
    from panechat.backends.cpu.numpy_backend import NumpyBackend, StackedGemvBackend, cpu_backend

    monkeypatch.delenv("PANECHAT_NUMPY_KERNELS", raising=False)
    assert type(cpu_backend()) is NumpyBackend
    assert type(cpu_backend("gemv")) is StackedGemvBackend
    monkeypatch.setenv("PANECHAT_NUMPY_KERNELS", "gemv")
    assert type(cpu_backend()) is StackedGemvBackend
    assert "stacked GEMV" in cpu_backend().describe()


# --------------------------------------------------------------------------- paged attention


def _paged(rng, kc, vc, dtype):
    """The contiguous cache kc, vc [S, G, C, D] laid out in shuffled blocks of 16 (plus
    spare blocks of noise): (k_blocks, v_blocks, tables)."""
    S, G, C, D = kc.shape
    nb = -(-C // BLOCK_TOKENS)
    n_blocks = S * nb + 7
    tables = rng.permutation(n_blocks)[: S * nb].reshape(S, nb).astype(np.int32)
    kb = rng.standard_normal((n_blocks, G, BLOCK_TOKENS, D), dtype=np.float32).astype(dtype)
    vb = rng.standard_normal((n_blocks, G, BLOCK_TOKENS, D), dtype=np.float32).astype(dtype)
    for s in range(S):
        for p in range(C):
            kb[tables[s, p // BLOCK_TOKENS], :, p % BLOCK_TOKENS] = kc[s, :, p]
            vb[tables[s, p // BLOCK_TOKENS], :, p % BLOCK_TOKENS] = vc[s, :, p]
    return kb, vb, tables


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("D,window", [(64, 0), (40, 0), (64, 37)])
def test_paged_attention_equals_contiguous_rows_1_to_33(rng, dtype, D, window):
    """Same bits as the contiguous kernel over the same (float32-converted) keys, for any
    row count and shuffled block tables: where blocks lie never enters the arithmetic."""
    kc, vc = _cache(rng, S=3, C=150, D=D)
    kc, vc = kc.astype(dtype).astype(np.float32), vc.astype(dtype).astype(np.float32)
    kb, vb, tables = _paged(rng, kc, vc, dtype)
    for R in range(1, 34):
        q = rng.standard_normal((R, 6, D), dtype=np.float32)
        seqs = rng.integers(0, 3, R).astype(np.int32)
        poss = rng.integers(0, 150, R).astype(np.int32)
        poss[0] = 149
        want = ref.attention(q, kc, vc, seqs, poss, 0.125, np.empty_like(q), window)
        got = nk.paged_attention(q, kb, vb, tables, seqs, poss, 0.125, np.empty_like(q), window)
        assert np.array_equal(got, want), R


def test_paged_attention_rejects_bad_tables(rng):
    kc, vc = _cache(rng, S=2, C=40)
    kb, vb, tables = _paged(rng, kc, vc, np.float16)
    q = rng.standard_normal((1, 6, 64), dtype=np.float32)
    bad = tables.copy()
    bad[1, 1] = kb.shape[0]
    with pytest.raises(ValueError, match="block table"):
        nk.paged_attention(q, kb, vb, bad, np.array([1], np.int32), np.array([20], np.int32), 0.1,
                           np.empty_like(q))
    # an entry past the row's position is never read, so it may be anything
    bad[1, 2] = -1
    nk.paged_attention(q, kb, vb, bad[:1], np.array([0], np.int32), np.array([20], np.int32), 0.1,
                       np.empty_like(q))
    with pytest.raises(ValueError, match="out of range"):
        nk.paged_attention(q, kb, vb, tables, np.array([0], np.int32), np.array([48], np.int32), 0.1,
                           np.empty_like(q))


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_kv_export_import_round_trip(rng, dtype):
    """kv_export gives per layer K, V [n_kv, n, hd] in the KV dtype from any blocks;
    kv_import puts them into other blocks bit for bit (the snapshot interface)."""
    be = NumpyBackend()
    kv = be.new_paged_kv(12, 2, 3, 32, dtype)
    for layer in range(2):
        kv.k[layer][...] = rng.standard_normal(kv.k[layer].shape, dtype=np.float32)
        kv.v[layer][...] = rng.standard_normal(kv.v[layer].shape, dtype=np.float32)
    src, n = [7, 2, 9], 37
    out = be.kv_export(kv, src, n)
    assert len(out) == 2 and out[0][0].shape == (3, n, 32)
    assert out[0][0].dtype == (np.float16 if dtype == "f16" else np.float32)
    assert np.array_equal(out[1][1][:, 17], kv.v[1][2, :, 1])  # position 17: block 2, offset 1
    dst = [0, 11, 4]
    be.kv_import(kv, dst, out)
    back = be.kv_export(kv, dst, n)
    for (k0, v0), (k1, v1) in zip(out, back):
        assert np.array_equal(k0, k1) and np.array_equal(v0, v1)
    with pytest.raises(ValueError):
        be.kv_export(kv, [1, 2], n)


@pytest.mark.parametrize("style", ["neox", "normal"])
@pytest.mark.parametrize("R,H,hd,rope_dim", [(1, 9, 64, 64), (5, 3, 64, 32), (3, 2, 128, 128), (33, 4, 80, 80)])
def test_rope_kernel_equals_the_numpy_expressions(style, R, H, hd, rope_dim):
    """NumpyBackend.rope (one numba call) gives ArrayBackend.rope's numpy bits, partial
    rotary dimensions (the tail copied) and scaled tables included."""
    from panechat.backends.array_backend import ArrayBackend
    from panechat.backends.cpu.numpy_backend import NumpyBackend

    be, rng = NumpyBackend(), np.random.default_rng(3)
    x = (rng.standard_normal((R, H, hd)) * 40).astype(np.float32)
    tables = be.rope_tables(rope_dim, 10000.0, 8192, mscale=1.25)
    pos = rng.integers(0, 8192, R).astype(np.int32)
    got = be.rope(x, pos, style, tables)
    assert np.array_equal(got, ArrayBackend.rope(be, x, pos, style, tables))
    assert np.array_equal(be.rope(x[:1], pos[:1], style, tables), got[:1])

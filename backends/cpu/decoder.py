"""The numpy backend's decode step in one numba call: every layer and the head, run by a
crew of threads that meet at spinning barriers (`step_threads`), as llama.cpp's CPU
backend runs its graph.

Op by op, a decode step of SmolLM2-135M is about 240 kernel calls, each a Python call,
argument checks and a fork-join, which cost about 2 ms of an 11.6 ms step on 2 cores
(docs/benchmarks.md). Here each thread takes its share of each phase and waits at a
barrier before the next one reads what it wrote:

  1. RMS norm of x (every thread its own copy: no barrier), then its columns of q, k, v
  2. per (row, kv head): biases, q/k norms, RoPE and the K/V write, then (after a
     barrier, so a row at p + 1 sees the K/V the row at p of its sequence writes in this
     step) attention by query heads (`decode_attention.share_runs`: a sequence's
     consecutive rows, a decode row and its drafts, are one run whose K/V blocks are
     converted once for all of them, `_attend_run`; a thread takes whole rows or runs
     where it can)
  3. its columns of the output product, added into x (or normed first, gemma3)
  4. norm, its columns of gate and up, act(gate) * up for those columns
  5. its columns of the down product, added into x
  6. the output norm and its columns of the logits

Every element is computed by the functions the op-by-op path calls (`block_tasks` for the
products, `norm_kernels._rms_norm`, `decode_attention`'s RoPE, K/V write and attention,
`activation_kernels`), in the same order, so the step equals `Model.layers_and_head` bit
for bit (tests/backends/test_cpu_decoder.py) and a row's bits never depend on the batch
or on the thread count. A plan (`build_plan`) holds the model's weights, vectors and RoPE
tables by address. It reads the model's features from the same description the op-by-op
path reads (`layer_spec.DecoderSpec`) and is built only when the step implements every
one that is set (`IMPLEMENTS`); models it cannot hold (a feature it lacks, F16/BF16/F32
matrices) keep the op-by-op path. A sequence may have several rows in a step when they are
at its consecutive positions, at most MAX_RUN of them (a decode row and its speculative
drafts); each row's attention then reads the same K/V values, in the same order, as when
its positions are decoded one step each. Prefill chunks run op by op (`Model.forward`
takes this step only when every row's logits are wanted), where attention gathers such a
sequence once for all its rows.

`decode_step` calls code from decode_attention, norm_kernels, activation_kernels,
step_threads and block_tasks; numba's cache folder is keyed on a hash of all of
backends/cpu and backends/quant (backends/cpu/__init__.py), so an edit to any of them
starts a fresh cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np
from numba import njit

from panechat.backends.cpu.activation_kernels import gated_columns
from panechat.backends.cpu.addresses import call_void, f32_at
from panechat.backends.cpu.block_tasks import range_functions, share, step_codes
from panechat.backends.quant import registry
from panechat.backends.cpu.decode_attention import _attend_run, _rope_row, _write_row, share_runs, share_tasks
from panechat.backends.cpu.decode_attention import check_rows as decode_check_rows
from panechat.backends.cpu.norm_kernels import _rms_norm
from panechat.backends.cpu.packed32 import GROUP
from panechat.backends.cpu.numpy_kernels import _JIT
from panechat.backends.cpu.step_threads import barrier
from panechat.backends.layer_spec import OPTIONAL_VECTORS, DecoderSpec

# the features of a `DecoderSpec` this step computes: allowed values, None for any (a
# feature not listed declines unless at its default). The model scales the embeddings
# and caps the logits around either path.
IMPLEMENTS = {"rope_style": ("normal", "neox"), "activation": ("silu", "gelu_tanh"), "attn_q_bias": None,
              "attn_k_bias": None, "attn_v_bias": None, "attn_q_norm": None, "attn_k_norm": None,
              "post_attention_norm": None, "post_ffw_norm": None, "uneven_layers": (False,), "embed_scale": None,
              "logit_softcap": None}

# per-layer vectors, in this order in the plan's table (absent ones: length 0); the
# numba code reads them by these indices (module constants, frozen at compile time)
VECTORS = ("attn_norm", "ffn_norm", *OPTIONAL_VECTORS)
ATTN_NORM, FFN_NORM, Q_BIAS, K_BIAS, V_BIAS, Q_NORM, K_NORM, POST_ATTN_NORM, POST_FFW_NORM = range(len(VECTORS))
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
Q, K, V, OUT, GATE, UP, DOWN = range(len(MATRICES))
N_VECTORS, N_MATRICES = len(VECTORS), len(MATRICES)
# the most rows one sequence may have in the step: a decode row and its drafts (n-gram
# drafts: at most 8); longer runs gather the sequence's K/V once op by op
MAX_RUN = 16
_NO_SCALES = np.zeros((1, 1), np.float32)
_NO_VECTOR = np.zeros(1, np.float32)


@dataclass
class DecoderPlan:
    """A model's weights and shape as the one-call step takes them: each array by its
    address and shape in int64 tables (a numba typed list would compile its methods at
    every start, ~1 s), the arrays themselves held in `keep`. `weights` and `form` are
    `decode_step`'s arguments of the same names, built once here."""

    spec: DecoderSpec  # the description the plan was built from
    mats: np.ndarray  # int64 [L*N_MATRICES + 1, 9]: blocks address, N, bytes a row, step_codes, d address,
    #                   dmin address, d rows, d columns, column group (the head last; d: K-quants'
    #                   per-super-block scales; group 16 for a repacked weight, else 1)
    vectors: np.ndarray  # int64 [L*N_VECTORS + 1, 2]: address, length (0: absent), VECTORS order; output norm last
    has: np.ndarray  # int64 [N_VECTORS]: which of VECTORS the layers have (the spec's flags)
    rope: np.ndarray  # int64 [L, 4]: cos address, sin address, rows, columns
    windows: np.ndarray  # int64 [L]
    fns: np.ndarray  # int64: block_tasks.range_functions of the matrices' types
    keep: list  # every array the tables point into
    n_ff: int
    vocab: int
    max_pos: int
    weights: tuple = field(init=False)  # (fns, mats, vectors, has, rope, windows)
    form: tuple = field(init=False)  # (n_head, n_kv, eps, scale, neox, gelu)

    def __post_init__(self):
        s = self.spec
        self.weights = (self.fns, self.mats, self.vectors, self.has, self.rope, self.windows)
        self.form = (s.n_head, s.n_kv, np.float32(s.eps), np.float32(s.scale), s.rope_style == "neox",
                     s.activation == "gelu_tanh")


def build_plan(spec: DecoderSpec, layers: list[dict], output_norm: np.ndarray, output: Any, rope: list,
               stored: Any) -> DecoderPlan | None:
    """The plan for the model `spec` describes, with these weights (numpy backend forms:
    `stored(w)` -> (qtype, blocks, d, dmin) or None), or None when `spec` has a feature
    the step does not implement (`IMPLEMENTS`) or some part is not one the step computes."""
    if spec.unsupported_by(IMPLEMENTS) or not layers or len(layers) != spec.n_layer:
        return None
    has = np.array([True, True, *(getattr(spec, n) for n in OPTIONAL_VECTORS)], np.int64)
    if any((L[n] is not None) != bool(h) for L in layers for n, h in zip(VECTORS, has)):
        return None  # the layers do not hold what the spec says
    D, hd = spec.n_embd, spec.head_dim
    q_rows, kv_rows = spec.n_head * hd, spec.n_kv * hd
    keep = []

    def address(a: np.ndarray) -> int:
        keep.append(a)
        return a.ctypes.data

    mats = _matrices(layers, output, D, q_rows, kv_rows, spec.n_ff, stored, address)
    sizes = dict(zip(VECTORS, (D, D, q_rows, kv_rows, kv_rows, hd, hd, D, D)))
    vectors = _vectors([(L[n], sizes[n]) for L in layers for n in VECTORS] + [(output_norm, D)], address)
    rope_rows = _rope_rows(rope, hd, address)
    if mats is None or vectors is None or rope_rows is None or len(rope_rows) != len(layers):
        return None
    return DecoderPlan(spec, mats, vectors, has, rope_rows, np.array(spec.windows, np.int64),
                       range_functions(mats[:, 3]), keep, spec.n_ff, int(mats[-1, 1]), int(rope_rows[:, 2].min()))


def _matrices(layers, output, D, q_rows, kv_rows, F, stored, address) -> np.ndarray | None:
    """The `mats` table, or None when a matrix is not of a type and shape the step reads."""
    want = dict(zip(MATRICES, [(q_rows, D), (kv_rows, D), (kv_rows, D), (D, q_rows), (F, D), (F, D), (D, F)]))
    mats, codes = [], step_codes()
    # every shape checked once here: the step reads by address and would not notice
    for w, shape in [(L[name], want[name]) for L in layers for name in MATRICES] + [(output, (None, D))]:
        s = stored(w)
        if s is None or s[0] not in codes or not _blocks_fit(*s, shape):
            return None
        qtype, b, d, dmin = s
        d = _NO_SCALES if d is None else np.ascontiguousarray(d, np.float32)
        dmin = _NO_SCALES if dmin is None else np.ascontiguousarray(dmin, np.float32)
        group = GROUP if registry.get(qtype).cpu_packed else 1  # a repacked weight's columns go by 16
        mats.append((address(b), *b.shape, codes[qtype], address(d), address(dmin), *d.shape, group))
    return np.array(mats, np.int64)


def _vectors(pairs: list, address) -> np.ndarray | None:
    """The `vectors` table of (vector or None, its length) pairs, or None when one's size is wrong."""
    rows = []
    for v, size in pairs:
        if v is None:
            rows.append((address(_NO_VECTOR), 0))
            continue
        v = np.ascontiguousarray(v, np.float32).reshape(-1)
        if v.size != size:
            return None
        rows.append((address(v), v.size))
    return np.array(rows, np.int64)


def _rope_rows(rope: list, head_dim: int, address) -> np.ndarray | None:
    """The `rope` table of each layer's (cos, sin), or None when one is not float32 [P, <= hd/2]."""
    rows = []
    for c, s in rope:
        if not (c.dtype == s.dtype == np.float32 and c.ndim == 2 and c.shape == s.shape and 2 * c.shape[1] <= head_dim):
            return None
        c, s = np.ascontiguousarray(c), np.ascontiguousarray(s)
        rows.append((address(c), address(s), *c.shape))
    return np.array(rows, np.int64).reshape(-1, 4)


def _blocks_fit(qtype: str, blocks: np.ndarray, d, dmin, shape: tuple) -> bool:
    """Whether `blocks` hold a [N, K] matrix of `qtype` (N None: any) and d, dmin its scales."""
    N, K = shape
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or not blocks.flags.c_contiguous or N not in (None, blocks.shape[0]):
        return False
    t = registry.get(qtype)
    if not t.fits(K) or blocks.shape[1] != t.row_bytes(K):
        return False
    sb = (blocks.shape[0], K // t.block_weights)
    if t.cpu_packed:  # a repacked weight's records hold its scales
        return True
    return not t.scales_at_load or (d is not None and dmin is not None and d.shape == sb and dmin.shape == sb)


@njit(**_JIT)
def check_rows(tables, seqs, pos, n_blocks, block_tokens, max_pos, max_run):
    """`decode_attention.check_rows`: 0 when the step can run these rows (a sequence's rows
    at its consecutive positions, at most max_run of them), 1 when it cannot (op by op),
    negative when a row or table entry is out of range."""
    return decode_check_rows(tables, seqs, pos, n_blocks, block_tokens, max_pos, max_run)


@njit(**_JIT)
def _add(x, b, o):
    """x += b[o : o + len(x)] (a bias on one head's slice)."""
    for e in range(x.shape[0]):
        x[e] = x[e] + b[o + e]


@njit(**_JIT)
def _vector(vectors, j):
    return numba.carray(f32_at(vectors[j, 0]), vectors[j, 1])


@njit(**_JIT)
def _product(fns, mats, j, x, out, tid, n):
    """This thread's columns of x @ W.T for matrix j of the plan; returns them (c0, c1)."""
    m = mats[j]
    c0, c1 = share(out.shape[1], x.shape[0], tid, n, m[8])
    if c0 < c1:
        call_void(fns[m[3]], (np.int64(x.ctypes.data), x.shape[0], x.shape[1], m[0], m[1], m[2], m[4], m[5],
                              m[6], m[7], np.int64(out.ctypes.data), out.shape[1], c0, c1))
    return c0, c1


@njit(**_JIT)
def _residual(x, p, vec, has_post, eps, c0, c1, sync, tid, n):
    """x += p (columns c0..c1 of this thread), or x += rms_norm(p, vec) by rows after a barrier."""
    if has_post:
        barrier(sync, n)
        R, D = x.shape
        for r in range(tid, R, n):
            _rms_norm(p[r:r + 1], vec, eps, p[r:r + 1])
            for d in range(D):
                x[r, d] = x[r, d] + p[r, d]
    else:
        for r in range(x.shape[0]):  # row by row: see activation_kernels.gated_columns
            _add_columns(x[r], p[r], c0, c1)


@njit(**_JIT)
def _add_columns(x, p, c0, c1):
    """x[c0:c1] = p + x there (one row)."""
    for c in range(c0, c1):
        x[c] = p[c] + x[c]


@njit(**_JIT)
def decode_step(x, weights, rows, form, bufs, sync, tid, n):
    """One decode step for rows x [R, D] (embedded tokens; updated in place), thread tid of
    n: see the module docstring. `weights` and `form` come from a `DecoderPlan`;
    rows = (k_all, v_all, tables, seqs, pos), checked by `check_rows`; bufs = (hbuf [n, R, D],
    q [R, H*hd], k, v [R, G*hd], qr [R, H, hd], att [R, H*hd], p [R, D], gate, up, act [R, F],
    kr [n, hd], logits [R, V]); sync int64 [2] zeroed."""
    fns, mats, vectors, has, rope, windows = weights
    k_all, v_all, tables, seqs, pos = rows
    n_head, n_kv, eps, scale, neox, gelu = form
    hbuf, q, k, v, qr, att, p, gate, up, act, kr, logits = bufs
    R, D = x.shape
    L = windows.shape[0]
    hd = q.shape[1] // n_head
    grp = n_head // n_kv
    B = k_all.shape[3]
    h = hbuf[tid]
    q3, att3 = q.reshape((R, n_head, hd)), att.reshape((R, n_head, hd))
    # this thread's K/V-write tasks and attention runs depend on the layer's window only:
    # made again where it changes (gemma3's sliding and global layers), not every layer
    window = windows[0]
    tasks = share_tasks(pos, window, n_kv, tid, n)
    runs = share_runs(seqs, pos, window, n_head, tid, n)
    for i in range(L):
        mi, vi = i * N_MATRICES, i * N_VECTORS
        if windows[i] != window:
            window = windows[i]
            tasks = share_tasks(pos, window, n_kv, tid, n)
            runs = share_runs(seqs, pos, window, n_head, tid, n)
        _rms_norm(x, _vector(vectors, vi + ATTN_NORM), eps, h)
        _product(fns, mats, mi + Q, h, q, tid, n)
        _product(fns, mats, mi + K, h, k, tid, n)
        _product(fns, mats, mi + V, h, v, tid, n)
        barrier(sync, n)
        kb, vb = k_all[i], v_all[i]
        c = numba.carray(f32_at(rope[i, 0]), (rope[i, 2], rope[i, 3]))
        s = numba.carray(f32_at(rope[i, 1]), (rope[i, 2], rope[i, 3]))
        for task in tasks:
            r, g0, g1 = task[0], task[1], task[2]
            pr = pos[r]
            blk = tables[seqs[r], pr // B]
            for g in range(g0, g1):
                ko = r * k.shape[1] + g * hd
                kg, vg = k[r, g * hd:(g + 1) * hd], v[r, g * hd:(g + 1) * hd]
                if has[K_BIAS]:
                    _add(kg, _vector(vectors, vi + K_BIAS), g * hd)
                if has[V_BIAS]:
                    _add(vg, _vector(vectors, vi + V_BIAS), g * hd)
                if has[K_NORM]:
                    _rms_norm(kg.reshape((1, hd)), _vector(vectors, vi + K_NORM), eps, kg.reshape((1, hd)))
                o = ((blk * n_kv + g) * B + pr % B) * hd
                kt = kr[tid]
                _rope_row(k, ko, pr, c, s, neox, kt, 0, hd)
                _write_row(kb, o, kt, 0, hd)
                _write_row(vb, o, v, r * v.shape[1] + g * hd, hd)
                for j in range(grp):
                    hh = g * grp + j
                    qh = q3[r, hh]
                    if has[Q_BIAS]:
                        _add(qh, _vector(vectors, vi + Q_BIAS), hh * hd)
                    if has[Q_NORM]:
                        _rms_norm(qh.reshape((1, hd)), _vector(vectors, vi + Q_NORM), eps, qh.reshape((1, hd)))
                    _rope_row(q, (r * n_head + hh) * hd, pr, c, s, neox, qr, (r * n_head + hh) * hd, hd)
        barrier(sync, n)  # every row's K/V written: a sequence's later rows attend its earlier ones
        for task in runs:  # by query heads: even shares
            r = task[0]
            _attend_run(qr, kb, vb, tables[seqs[r]], r, task[1], task[2], task[3], window, pos[r], scale, att3)
        barrier(sync, n)
        c0, c1 = _product(fns, mats, mi + OUT, att, p, tid, n)
        _residual(x, p, _vector(vectors, vi + POST_ATTN_NORM), has[POST_ATTN_NORM], eps, c0, c1, sync, tid, n)
        barrier(sync, n)
        _rms_norm(x, _vector(vectors, vi + FFN_NORM), eps, h)
        g0, g1 = _product(fns, mats, mi + GATE, h, gate, tid, n)
        _product(fns, mats, mi + UP, h, up, tid, n)  # the same columns: same N
        gated_columns(gate, up, act, g0, g1, gelu)
        barrier(sync, n)
        c0, c1 = _product(fns, mats, mi + DOWN, act, p, tid, n)
        _residual(x, p, _vector(vectors, vi + POST_FFW_NORM), has[POST_FFW_NORM], eps, c0, c1, sync, tid, n)
        barrier(sync, n)
    _rms_norm(x, _vector(vectors, L * N_VECTORS), eps, h)
    _product(fns, mats, L * N_MATRICES, h, logits, tid, n)

"""Decode steps through per-bucket graphs (backends/cuda/step_graphs.py), on the emulated
CuPy backend: the padding to the bucket, the static buffers (block tables too), the spare
KV block (and the spare slot made of it) and the eager fallback. The CUDA graph itself needs a device (scripts/gpu_check.py replays it
against the eager step bit for bit)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.cuda.step_graphs import BUCKETS, ReplayByRerun, bucket_for
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.forward import Batch, Model

PROMPTS = [[1, 90, 198, 26, 35], [1, 40, 198, 26], [50, 23, 63]]


def test_bucket_for():
    assert [bucket_for(r) for r in (1, 2, 3, 5, 16, 17, 64, 65, 256)] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bucket_for(BUCKETS[-1] + 1) is None


def _prefilled(model: Model, n_slots: int):
    a = model.args
    kv = model.backend.new_kv(n_slots, a.n_layer, a.n_kv_head, 32, a.head_dim)
    toks, slots, pos, last = [], [], [], []
    for i, p in enumerate(PROMPTS):
        toks += p
        slots += [i] * len(p)
        pos += range(len(p))
        last.append(len(toks) - 1)
    model.forward(kv, Batch(np.array(toks, np.int32), np.array(slots, np.int32), np.array(pos, np.int32),
                            np.array(last)))
    return kv


def _decode(model: Model, kv, rows: list[int]) -> np.ndarray:
    """One decode step for the sequences `rows` (in that row order)."""
    return model.forward(kv, Batch(np.array([7 + r for r in rows], np.int32), np.array(rows, np.int32),
                                   np.array([len(PROMPTS[r]) for r in rows], np.int32), np.arange(len(rows))))


@pytest.fixture(scope="module")
def qwen(tiny):
    path, _ = tiny("qwen2", "Q8_0", False)
    return GGUFFile.open(path)


def test_padded_graph_step_equals_the_eager_step_bit_for_bit(qwen):
    graphed = Model.load(qwen, CupyBackend.emulated_on_cpu(), max_positions=32)
    eager_be = CupyBackend.emulated_on_cpu()
    eager_be.graphs = None
    eager = Model.load(qwen, eager_be, max_positions=32)
    kv_g, kv_e = _prefilled(graphed, 3), _prefilled(eager, 3)
    real = kv_g.n_blocks  # 3 slots of 2 blocks (32 positions)
    assert kv_g.spare_slot == 3 and real == 6 and kv_g.spare_block == 6 and kv_g.k[0].shape[0] == 7
    spare_before = kv_g.k[0][6].copy()
    cap = graphed.backend.graphs.capturer
    assert isinstance(cap, ReplayByRerun) and cap.captures == 0
    for rows in ([2, 0, 1], [1]):  # bucket 4 (one padded row), then bucket 1
        got, want = _decode(graphed, kv_g, rows), _decode(eager, kv_e, rows)
        assert np.array_equal(got, want), rows
        for layer in range(graphed.args.n_layer):  # the real blocks hold the same keys and values
            assert np.array_equal(kv_g.k[layer][:real], kv_e.k[layer][:real])
            assert np.array_equal(kv_g.v[layer][:real], kv_e.v[layer][:real])
    assert cap.captures == 2
    assert not np.array_equal(kv_g.k[0][6], spare_before)  # the padded row wrote the spare block only
    _decode(graphed, kv_g, [0, 2])  # bucket 2: captured once; [2, 1] again: replayed, no new capture
    _decode(graphed, kv_g, [2, 1])
    assert cap.captures == 3


def _paged(model: Model, tables: np.ndarray):
    """A paged store of 8 blocks with PROMPTS prefilled through the block `tables`."""
    a = model.args
    kv = model.backend.new_paged_kv(8, a.n_layer, a.n_kv_head, a.head_dim)
    toks, seqs, pos, last = [], [], [], []
    for i, p in enumerate(PROMPTS):
        toks += p
        seqs += [i] * len(p)
        pos += range(len(p))
        last.append(len(toks) - 1)
    model.forward(kv, Batch(np.array(toks, np.int32), np.array(seqs, np.int32), np.array(pos, np.int32),
                            np.array(last), tables))
    return kv


def test_graph_steps_through_block_tables_equal_the_eager_steps(qwen):
    """The engine's path: sequences in shuffled blocks, tables of varying width (padded to a
    power of two in the graph with the spare block); padded rows write the spare block only."""
    graphed = Model.load(qwen, CupyBackend.emulated_on_cpu(), max_positions=64)
    eager_be = CupyBackend.emulated_on_cpu()
    eager_be.graphs = None
    eager = Model.load(qwen, eager_be, max_positions=64)
    tables = np.array([[5, 2, 7], [0, 6, 1], [3, 4, 4]], np.int32)  # (the last row's 3rd column: unused)
    kv_g, kv_e = _paged(graphed, tables[:, :1]), _paged(eager, tables[:, :1])
    assert kv_g.spare_block == 8 and kv_g.k[0].shape[0] == 9
    spare_before = kv_g.k[0][8].copy()
    cap = graphed.backend.graphs.capturer
    for step, rows in enumerate(([2, 0, 1], [1], [0, 2, 1], [2, 1])):
        width = 1 if step < 2 else 3  # a wider table: a graph of its own width
        t = tables[rows, :width]
        toks = np.array([7 + r + step for r in rows], np.int32)
        pos = np.array([len(PROMPTS[r]) + step for r in rows], np.int32)
        batch = Batch(toks, np.arange(len(rows), dtype=np.int32), pos, np.arange(len(rows)), t)
        got, want = graphed.forward(kv_g, batch), eager.forward(kv_e, batch)
        assert np.array_equal(got, want), rows
        for layer in range(graphed.args.n_layer):
            assert np.array_equal(kv_g.k[layer][:8], kv_e.k[layer][:8])
            assert np.array_equal(kv_g.v[layer][:8], kv_e.v[layer][:8])
    assert cap.captures == 4  # (4 rows, width 1), (1, 1), (4, 4), (2, 4)
    assert not np.array_equal(kv_g.k[0][8], spare_before)
    # rows naming sequences of a taller table (the start-up invariance check's batches):
    # still through the graph of their row count
    batch = Batch(np.array([9], np.int32), np.array([2], np.int32), np.array([len(PROMPTS[2]) + 4], np.int32),
                  np.arange(1), tables)
    assert np.array_equal(graphed.forward(kv_g, batch), eager.forward(kv_e, batch))
    assert cap.captures == 5  # (1 row, width 4)
    for layer in range(graphed.args.n_layer):
        assert np.array_equal(kv_g.k[layer][:8], kv_e.k[layer][:8])


class _Refuses:
    captures = 0

    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_falls_back_to_eager_and_says_so_once(qwen, caplog):
    be = CupyBackend.emulated_on_cpu()
    model = Model.load(qwen, be, max_positions=32)
    eager_be = CupyBackend.emulated_on_cpu()
    eager_be.graphs = None
    eager = Model.load(qwen, eager_be, max_positions=32)
    be.graphs.capturer = _Refuses()
    kv, kv_e = _prefilled(model, 3), _prefilled(eager, 3)
    with caplog.at_level(logging.WARNING):
        a = _decode(model, kv, [0, 1, 2])
        b = _decode(model, kv, [0])
    assert np.array_equal(a, _decode(eager, kv_e, [0, 1, 2]))
    assert b.shape == (1, model.args.vocab_size)
    assert not be.graphs.enabled and "stream is capturing" in be.graphs.disabled_because
    assert sum("CUDA graphs off" in r.message for r in caplog.records) == 1


def test_a_dropped_kv_store_takes_its_graphs_with_it(qwen):
    """The graphs are keyed weakly by the KV store and never reference it, so a store
    nobody uses any more is freed at once (on a GPU: its memory), graphs and all."""
    import gc
    import weakref

    model = Model.load(qwen, CupyBackend.emulated_on_cpu(), max_positions=32)
    kv = _prefilled(model, 3)
    _decode(model, kv, [0, 1])
    gone = weakref.ref(kv)
    gc.disable()  # no cycle collector: plain reference counting must free it
    try:
        del kv
        assert gone() is None
    finally:
        gc.enable()
    assert len(model.backend.graphs._by_kv) == 0

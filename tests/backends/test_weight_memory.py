"""Memory for repacked weights on 2 MiB pages (backends/cpu/weight_memory.py), and the CPU
backend putting a model's repacked weights there while it loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from panechat.backends.cpu import repack
from panechat.backends.cpu.numpy_backend import NumpyBackend, PackedWeight
from panechat.backends.cpu.weight_memory import HUGE, WeightArena
from panechat.backends.quant.gguf_tensor import GGUFTensor

from .test_repacked import _blocks


def _span(a):
    return a.ctypes.data, a.ctypes.data + a.nbytes


def test_arrays_are_separate_aligned_and_writable_a_big_one_mapped_alone():
    arena = WeightArena(chunk=4 * HUGE)
    first = arena.empty((100, 144), np.uint8)
    assert first.ctypes.data % HUGE == 0  # a chunk starts on a huge page
    arrays = [first] + [arena.empty(shape, dt) for shape, dt in
                        [((3, 5), np.float32), ((1000, 1000), np.uint8), ((16, 8), np.int16), ((5 * HUGE,), np.uint8)]]
    for a in arrays:
        assert a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % 4096 == 0
        a[...] = 7
    spans = sorted(_span(a) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
    assert arrays[2].shape == (1000, 1000) and arrays[1].dtype == np.float32
    assert arrays[-1].ctypes.data % HUGE == 0  # larger than a chunk: a mapping of its own
    assert all((a == 7).all() for a in arrays)


def _thp_madvise() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return p.exists() and "[never]" not in p.read_text()


def _huge_kb_at(lo: int, hi: int) -> int:
    """AnonHugePages (kB) of this process's mappings that overlap [lo, hi)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            a, b = (int(v, 16) for v in head.split("-"))
            inside = a < hi and lo < b
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not _thp_madvise(), reason="transparent huge pages are off on this kernel")
def test_touched_arena_memory_is_on_huge_pages():
    arena = WeightArena()
    a = arena.empty((3 * HUGE,), np.uint8)
    a[:] = 1
    assert _huge_kb_at(*_span(a)) >= 2048  # at least one 2 MiB page (the kernel may split a few)


def test_a_model_loads_its_repacked_weights_into_an_arena_with_the_same_bytes():
    rng = np.random.default_rng(3)
    blocks = _blocks(rng, "Q4_K", 40, 512)
    t = GGUFTensor("w", (40, 512), "Q4_K", blocks)
    be = NumpyBackend()
    with be.loading_weights():
        w = be.linear_weight(t)
        assert be._arena is not None
    assert be._arena is None
    assert isinstance(w, PackedWeight)
    assert w.data.ctypes.data % HUGE == 0  # the arena's first array
    assert np.array_equal(w.data, repack.pack(blocks, "Q4_K"))
    outside = be.linear_weight(t)  # outside a load: numpy's memory, the same bytes
    assert np.array_equal(outside.data, w.data)


def test_load_model_puts_the_models_repacked_weights_in_an_arena(model_path):
    """Through `load_model`, as `panechat serve` loads: the default model's first repacked
    weight (blk.0 attn_q, Q4_1) starts the arena's first chunk, on a 2 MiB boundary, and a
    later one lies in the same chunk (not a numpy allocation of its own)."""
    from panechat.engine.model.loader import load_model

    lm = load_model(model_path, "numpy", max_positions=256)
    layers = getattr(lm, "model", lm).layers
    first, later = layers[0].attn_q, layers[3].ffn_up
    assert isinstance(first, PackedWeight) and isinstance(later, PackedWeight)
    assert first.data.ctypes.data % HUGE == 0
    assert 0 < later.data.ctypes.data - first.data.ctypes.data < 64 << 20

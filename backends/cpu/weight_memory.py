"""Memory for the weights the CPU backend copies at load (repacked records): 2 MiB pages.

The kernels stream every weight once a step, and with 4 KiB pages each page costs its own
TLB walk. numpy asks for transparent huge pages (MADV_HUGEPAGE) inside each allocation of
4 MiB and more, but a page of 2 MiB must lie whole inside one mapping, 2 MiB-aligned: the
1B shape's 2.4 MB q and o matrices, its 0.6 MB k and v, and every array's unaligned ends
stayed on 4 KiB pages (457 of the 750 MB the 1B Q4_K_M shape holds were huge). A
`WeightArena` hands out arrays from 2 MiB-aligned chunks of anonymous memory advised
MADV_HUGEPAGE (651 MB huge; the one-row step 2-3% faster and the verify step 5%, on the
480 MiB-L3 Xeon, alternating). Each chunk lives as long as an array in it: a model's arena
holds only its weights, so unloading the model frees them. Where the kernel gives no huge
pages (or madvise is missing) the chunks are plain anonymous memory.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE = 2 << 20  # bytes of a transparent huge page (x86-64, arm64 with 4 KiB base pages)
CHUNK = 64 << 20  # bytes a chunk maps (more for an array larger than that)
ALIGN = 4096  # each array starts on a page of its own (a 64-byte line would do for the kernels)


class WeightArena:
    """Arrays carved from 2 MiB-aligned, huge-page-advised chunks, one after another."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._base: np.ndarray | None = None  # the current chunk's bytes
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype=np.uint8) -> np.ndarray:
        """An uninitialised C-contiguous array of `shape` and `dtype`, in the arena."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n > self.chunk:
            return _mapped(n)[:n].view(dtype).reshape(shape)
        if self._base is None or self._used + n > self._base.size:
            self._base, self._used = _mapped(self.chunk), 0
        a = self._base[self._used:self._used + n]
        self._used += -(-n // ALIGN) * ALIGN
        return a.view(dtype).reshape(shape)


def _mapped(n: int) -> np.ndarray:
    """uint8 [>= n]: fresh private anonymous memory from a 2 MiB boundary, advised huge."""
    size = -(-n // HUGE) * HUGE
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: small pages
            pass
    whole = np.frombuffer(m, np.uint8)  # keeps m alive as long as a view of it lives
    at = -whole.ctypes.data % HUGE
    return whole[at:at + size]

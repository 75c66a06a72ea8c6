"""Freed memory kept for reuse: glibc's allocator told not to hand large blocks back.

A step allocates its activations afresh (a product's output, a quantized copy of its
input, the FFN's gated activation: 4 MiB each at a 128-token prefill of a 1B model), and
glibc serves blocks that large by mmap and returns them by munmap when freed, so every
step touched new pages, and the kernels' threads took the page faults together. In the
VMs this runs on those faults serialise: the gated activation of a 128 x 8192 prefill took
7 ms writing a fresh output from two threads and 0.7 ms writing one already touched (every
other layer, as glibc's threshold moved); op by op, a 128-token Q6_K 1B prefill took
577-600 ms with the blocks kept against 597-666 ms without (in `bench sweep`, within its
noise). Raising mmap's threshold and the heap's trim threshold makes freed blocks stay in
the heap for the next step, as a server's allocator (jemalloc, tcmalloc) would; the peak
memory is the same (`bench chat` on a 1B Q4_K_M shape: 901 / 1,660 MiB peak RSS at 1 / 4
clients, 895 / 1,638 without), only not returned between steps. The setting is the
process's: the numpy backend makes it when it is built, for every allocation after.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap (glibc's default: 128 KiB, rising to 32 MiB)
TRIM_THRESHOLD = 512 << 20  # free memory the heap keeps at its top before giving it back

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where the C library
    is not glibc (musl, macOS: their allocators keep their own policies) or refuses."""
    global _done
    if _done is None:
        _done = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):
                return False
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done

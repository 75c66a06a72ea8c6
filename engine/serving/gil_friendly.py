"""A short GIL switch interval while a model loads beside serving ones.

A CPU-bound thread keeps the GIL for the whole switch interval (5 ms by default) each time
another thread asks for it, and a serving engine's step asks many times (its crew threads
start and finish, its Python glue runs between kernels): a load's Python loops would stretch
every step of the other models. While a load runs beside them the interval is short.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

__all__ = ["gil_friendly"]

SWITCH_INTERVAL_S = 0.0005
_lock = threading.Lock()
_depth = 0
_saved = 0.005


@contextlib.contextmanager
def gil_friendly() -> Iterator[None]:
    """Inside: a short GIL switch interval for the whole process; as before on leaving
    (the outermost of nested uses restores it)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, SWITCH_INTERVAL_S))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                sys.setswitchinterval(_saved)

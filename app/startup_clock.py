"""Seconds since this process started, for the start-up line ("ready in 0.84 s").

Counted from the process's start as Linux records it (/proc/self/stat), so interpreter
start-up and imports are in the figure; elsewhere from when this module was imported."""

from __future__ import annotations

import os
import time

_IMPORTED = time.monotonic()


def _process_age() -> float | None:
    """Seconds since the kernel started this process (clock-tick resolution), or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name may hold spaces and ")"
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


_AGE_AT_IMPORT = _process_age()


def since_start() -> float:
    """Seconds since the process started (since this module's import where unknown)."""
    elapsed = time.monotonic() - _IMPORTED
    return elapsed + (_AGE_AT_IMPORT if _AGE_AT_IMPORT is not None and _AGE_AT_IMPORT >= 0 else 0.0)

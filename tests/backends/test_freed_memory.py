"""The CPU backend keeps freed memory for the next step: once a numpy backend is built, a
large array freed and allocated again reuses touched pages instead of faulting in new ones
(`backends/cpu/freed_memory`, set by `NumpyBackend` as `panechat serve` and the TUI build it)."""

import subprocess
import sys

import pytest

_FAULTS = """
import resource, sys
import numpy as np
if sys.argv[1] == "backend":
    from panechat.backends.cpu.numpy_backend import NumpyBackend
    NumpyBackend()
for step in range(4):  # a step: a 64 MiB activation written, then freed (a 2k-token prefill's)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(16 << 20, np.float32)
    a.fill(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del a
print(faults)
"""


def _last_step_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_activation_is_reused_without_page_faults():
    # 64 MiB is 16,384 pages of 4 KiB (or 32 huge pages); glibc alone maps a block over its
    # 32 MiB ceiling afresh each time
    assert _last_step_faults("default") >= 8
    assert _last_step_faults("backend") <= 2

"""`panechat bench kernels` as a subprocess: the read bandwidth and each cell's GB/s and
GFLOP/s, consistent with the cell's own time and shape; a type without a CPU kernel is a
one-line usage error. Small on purpose (a few MB, one shipped type), never a speed check."""

import json
import subprocess
import sys
from pathlib import Path

PANECHAT = str(Path(sys.executable).parent / "panechat")


def _bench(*args, timeout=600):
    return subprocess.run([PANECHAT, "bench", "kernels", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_cells_report_bandwidth_and_flops():
    r = _bench("--types", "Q8_0", "--ms", "1,3", "--shapes", "k,v", "--pool-mb", "2", "--min-time", "0.01",
               "--read-mb", "32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["read_GB_s"] > 0
    cells = out["cells"]
    assert [(c["type"], c["matrix"], c["N"], c["K"], c["M"]) for c in cells] == [
        ("Q8_0", "k,v", 512, 2048, 1), ("Q8_0", "k,v", 512, 2048, 3)]
    for c in cells:
        s = c["ms"] / 1e3
        assert abs(c["GFLOP_s"] - 2 * c["M"] * c["N"] * c["K"] / s / 1e9) <= 1e-6 * c["GFLOP_s"]
        assert abs(c["GB_s"] - 512 * 2048 // 32 * 34 / s / 1e9) <= 1e-6 * c["GB_s"]  # Q8_0: 34 bytes / 32
        assert abs(c["pct_bw"] - 100 * c["GB_s"] / out["read_GB_s"]) <= 1e-6 * c["pct_bw"]


def test_float32_times_the_path_before_repacking():
    """--float32 runs Q8_0 by its float32 kernel on the blocks as stored: the same cells,
    and the output says which path ran."""
    args = ("--types", "Q8_0", "--ms", "1", "--shapes", "k,v", "--pool-mb", "2", "--min-time", "0.01",
            "--read-mb", "32")
    r = _bench(*args, "--float32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["float32"] is True and [c["M"] for c in out["cells"]] == [1]
    assert json.loads(_bench(*args, "--json").stdout)["float32"] is False
    assert "float32 pair-loader kernels" in _bench(*args, "--float32").stdout


def test_an_unknown_type_is_one_line():
    r = _bench("--types", "Q9_9", timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Q9_9" in r.stderr and "--types" in r.stderr

"""`panechat bench spec` as a user runs it: a short cell, the replies identical on and off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PANECHAT = str(Path(sys.executable).parent / "panechat")


def test_bench_spec_reports_identical_replies_and_the_drafts():
    p = subprocess.run([PANECHAT, "bench", "spec", "--json", "--clients", "1",
                        "--workloads", "quote", "--rounds", "1", "-n", "12"],
                       capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    cost = out["verify_cost"]  # a verify step of 5 rows of one sequence, in the one-call step
    assert cost["rows"] == 5 and cost["one_call"] is True and cost["verify_ms"] > 0 and cost["one_row_ms"] > 0
    assert cost["verify_op_by_op_ms"] > 0  # timed in a loop of its own, after the one-call steps
    (row,) = out["rows"]
    assert row["workload"] == "quote" and row["B"] == 1 and row["identical"] is True
    assert row["tok_s_off"] > 0 and row["tok_s_on"] > 0 and 0 <= row["accepted"] <= row["drafted"]
    tps = row["tokens_per_verify_step"]  # None only when no step checked a draft
    assert tps is None if row["drafted"] == 0 else 1.0 <= tps <= 1 + row["drafted"]

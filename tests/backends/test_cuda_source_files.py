"""The CUDA source lives in .cu / .cuh files (backends/cuda/kernels/): read into one string
with every part inlined once, documented at the top of each program (the -D defines and an
nvcc line that compiles it standalone), and compiled standalone by nvcc when it is on PATH."""

from __future__ import annotations

import itertools
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from panechat.backends.cuda.kernels import constants, cu_files, mma_source, source

KERNELS_DIR = Path(cu_files.__file__).parent
NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)
# program -> (the source string built from it, its NVRTC options, the kernels it defines itself)
PROGRAMS = {
    "kernels.cu": (source.SOURCE, source.OPTIONS, [n for n in source.KERNEL_NAMES if not n.startswith("linear_")]),
    "mma.cu": (mma_source.MMA_SOURCE, mma_source.MMA_OPTIONS, ["mma_split_x"]),
}


def _included(name: str) -> list[str]:
    return re.findall(r'^#include "([\w.]+)"', (KERNELS_DIR / name).read_text(), re.M)


def _own_text(name: str) -> str:
    """A file's lines without its #include and #pragma once lines."""
    lines = (KERNELS_DIR / name).read_text().splitlines(keepends=True)
    return "".join(ln for ln in lines if not ln.startswith(("#include", "#pragma once")))


def test_every_part_is_inlined_once_and_no_directive_is_left():
    text = source.SOURCE
    assert "#include" not in text and "#pragma once" not in text
    parts = sorted(p.name for p in KERNELS_DIR.glob("*.cuh"))
    assert sorted(_included("kernels.cu")) == parts  # kernels.cu names every part
    for part in parts:
        assert text.count(_own_text(part)) == 1, part


def test_a_part_included_twice_is_inlined_once(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text('#pragma once\nint a;\n')
    (tmp_path / "b.cuh").write_text('#pragma once\n#include "a.cuh"\nint b;\n')
    (tmp_path / "main.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n#include "a.cuh"\nint m;\n')
    monkeypatch.setattr(cu_files, "files", lambda package: tmp_path)
    assert cu_files.read_cu("main.cu") == "int a;\nint b;\nint m;\n"


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_source_is_the_file_then_the_entry_points(program):
    text, _, own = PROGRAMS[program]
    assert text.startswith(cu_files.read_cu(program))
    defined = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\w+\)\s*)?(\w+)\(',
                         cu_files.read_cu(program))
    assert sorted(defined) == sorted(own)


def _header(program: str) -> str:
    """The comment block at the top of a program."""
    lines = (KERNELS_DIR / program).read_text().splitlines(keepends=True)
    return "".join(itertools.takewhile(lambda ln: ln.startswith("//"), lines))


def _documented_nvcc(program: str) -> list[str]:
    """The nvcc command line the program's header documents."""
    line = next(ln for ln in _header(program).splitlines() if ln.lstrip("/ ").startswith("nvcc "))
    return shlex.split(line.lstrip("/ "))


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_header_documents_every_define_and_the_real_options(program):
    head, args = _header(program), _documented_nvcc(program)
    _, options, _ = PROGRAMS[program]
    assert args[:3] == ["nvcc", "-ptx", args[2]] and args[2].startswith("-arch=sm_")
    assert args[3:-1] == list(options)
    assert args[-1] == program
    for name in ("NT", "WARPS") if program == "mma.cu" else constants.CUDA_DEFINES:
        assert re.search(rf"^//\s+{name}\s", head, re.M), f"{program} does not document -D{name}"


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("program", PROGRAMS)
def test_nvcc_compiles_each_file_standalone(program, tmp_path):
    """The documented nvcc line, run on the file itself (nvcc resolves the includes)."""
    args = _documented_nvcc(program)
    out = tmp_path / "out.ptx"
    r = subprocess.run([NVCC, *args[1:-1], str(KERNELS_DIR / program), "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(re.findall(r"\.entry (\w+)", out.read_text())) == sorted(PROGRAMS[program][2])

"""numba's kernel cache is keyed on the sources a kernel can inline (backends/cpu/__init__.py).

numba checks only the file of the function it compiled; these tests show that any edit under
backends/cpu or backends/quant moves the cache to a new folder, so a kernel compiled from older
source is never served.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from panechat.backends import cpu

ROOT = Path(cpu.__file__).resolve().parents[2]


def _copy_sources(tmp_path: Path) -> tuple[Path, Path]:
    kernels, quant = tmp_path / "cpu", tmp_path / "quant"
    for src, dst in zip(cpu.KERNEL_SOURCES, (kernels, quant)):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return kernels, quant


def test_an_edit_to_an_inlined_helper_moves_the_cache(tmp_path):
    kernels, quant = _copy_sources(tmp_path)
    before = cpu.sources_digest((kernels, quant))
    assert before == cpu.sources_digest(cpu.KERNEL_SOURCES)  # the copy hashes like the tree
    helper = kernels / "block_linear.py"  # inlined into quant_kernels' and the one-call step's kernels
    helper.write_text(helper.read_text() + "\n# an edit\n")
    after_cpu = cpu.sources_digest((kernels, quant))
    gguf_tensor = quant / "gguf_tensor.py"
    gguf_tensor.write_text(gguf_tensor.read_text().replace("\n", "\n\n", 1))
    after_quant = cpu.sources_digest((kernels, quant))
    assert len({before, after_cpu, after_quant}) == 3
    (kernels / "__pycache__").mkdir(exist_ok=True)
    (kernels / "__pycache__" / "x.nbi").write_bytes(b"cache files do not count")
    assert cpu.sources_digest((kernels, quant)) == after_quant


def test_numba_compiles_into_the_folder_of_the_current_sources(tmp_path):
    """A fresh process: NUMBA_CACHE_DIR names the digest, numba's config follows it, and a cached
    kernel's files land there."""
    code = ("import numba, os\n"
            "from panechat.backends import cpu\n"
            "from panechat.backends.cpu import norm_kernels\n"
            "import numpy as np\n"
            "x = np.ones((2, 8), np.float32); w = np.ones(8, np.float32)\n"
            "norm_kernels.rms_norm(x, w, 1e-5)\n"
            "print(os.environ['NUMBA_CACHE_DIR']); print(numba.config.CACHE_DIR); print(cpu.sources_digest())\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "ignored")  # ours wins: a user's folder could hold stale kernels
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    env_dir, config_dir, digest = out.stdout.split()
    assert env_dir == config_dir and Path(env_dir).name == f"numba-{digest}"
    assert any(Path(env_dir).rglob("*.nbi")), "numba wrote no index into the cache folder"
    assert not (tmp_path / "ignored").exists()


def test_make_clean_removes_the_kernel_cache(tmp_path):
    """`make clean` (through clean-kernels) removes the cache folders, in the tree and in the user cache."""
    tree, home = tmp_path / "tree", tmp_path / "home"
    shutil.copy(ROOT / "Makefile", tree.mkdir() or tree / "Makefile")
    kept = tree / "backends" / "cpu" / "keep.py"
    folders = [tree / "backends/cpu/__pycache__/numba-0123", home / ".cache/panechat/numba-4567"]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "k.nbi").write_bytes(b"")
    kept.write_text("")
    env = {**os.environ, "HOME": str(home)}
    env.pop("XDG_CACHE_HOME", None)
    subprocess.run(["make", "-s", "clean-kernels"], cwd=tree, env=env, check=True, timeout=60)
    assert not any(f.exists() for f in folders) and kept.exists()

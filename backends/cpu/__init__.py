"""The numpy (CPU) backend and its numba kernels.

numba's on-disk cache checks only the source file of the function it compiled, but a kernel here
inlines functions from other files (block_linear's loops into quant_kernels, the loaders into the
one-call step), so an edit to one of those would leave a stale kernel in the cache. The cache
therefore lives in a folder named by a hash of every source a CPU kernel can read (this package and
backends/quant): after any edit there, numba starts a fresh folder and never serves a kernel
compiled from older source. Importing this package sets it (NUMBA_CACHE_DIR) before any kernel is
decorated; `make clean` removes the folders.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = (_HERE, _HERE.parent / "quant")  # every folder a numba kernel here inlines code from
CACHE_PREFIX = "numba-"


def sources_digest(folders=KERNEL_SOURCES) -> str:
    """A hash of every .py file under `folders` (names and bytes): the key of the kernel cache."""
    h = hashlib.blake2b(digest_size=8)
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            h.update(path.relative_to(folder).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def kernel_cache_dir(digest: str) -> Path:
    """`backends/cpu/__pycache__/numba-<digest>` in a checkout, else the user cache (an installed wheel)."""
    base = _HERE / "__pycache__"
    if not _writable(base):
        from platformdirs import user_cache_dir

        base = Path(user_cache_dir("panechat"))
    return base / f"{CACHE_PREFIX}{digest}"


def _prune(current: Path) -> None:
    """Remove the cache folders of older sources (each is the cache of a tree that no longer exists)."""
    for old in current.parent.glob(CACHE_PREFIX + "*"):
        if old != current and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _use_kernel_cache() -> None:
    folder = kernel_cache_dir(sources_digest())
    if not folder.is_dir():
        _prune(folder)
    os.environ["NUMBA_CACHE_DIR"] = str(folder)  # numba reads it at import and again before each compile
    config = sys.modules.get("numba.core.config")
    if config is not None:  # numba was imported before us
        config.CACHE_DIR = str(folder)


_use_kernel_cache()

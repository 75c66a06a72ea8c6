"""A model's CPU kernels compiled in a child process before it loads beside serving models.

numba compiles while holding the GIL: a model whose quant types were never compiled here
costs a minute or more of it, and in-process every other model's stream would stop for as
long. The child loads the model and starts an engine on it, whose start-up self-check calls
every kernel prefill and decode use; numba writes each to its on-disk cache (NUMBA_CACHE_DIR,
set by `panechat.backends.cpu`), from where the serving process then loads it. A marker per
model (its size and header) in that cache folder says it was done, so later loads skip the
child; the folder itself changes whenever kernel source does.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["warm_kernels"]

#: The child's limit: a cold compile of a new model's types takes minutes on 2 busy cores.
WARMUP_TIMEOUT_S = 1800.0
_HEAD_BYTES = 8 << 20  # a 262k-token vocabulary's header is ~6 MB


def _marker(path: Path, kv_dtype: str) -> Path | None:
    """The marker of `path`'s kernels: named by its size and first bytes (its header: the
    architecture and tensor types the kernels depend on) and the KV type."""
    import panechat.backends.cpu  # noqa: F401  (sets NUMBA_CACHE_DIR: the folder keyed on the kernels' sources)

    folder = os.environ.get("NUMBA_CACHE_DIR")
    if not folder:
        return None
    h = hashlib.sha256(f"{path.stat().st_size}\0{kv_dtype}\0".encode())  # what was warmed
    with open(path, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
    return Path(folder) / "warmed" / h.hexdigest()[:32]


def warm_kernels(path: str | Path, kv_dtype: str = "f16") -> bool:
    """Make sure numba's cache holds every CPU kernel the model at `path` runs, compiling
    them in a child process if they may not be there. True when they are (known or just
    compiled); False when the child failed (loading in-process then compiles what is
    missing, as before, or fails with its own message)."""
    path = Path(path)
    try:
        marker = _marker(path, kv_dtype)
    except OSError:
        return False
    if marker is None or marker.exists():
        return marker is not None
    try:
        rc = subprocess.run([sys.executable, "-m", "panechat.engine.serving.kernel_warmup", str(path), kv_dtype],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            timeout=WARMUP_TIMEOUT_S).returncode
    except (OSError, subprocess.TimeoutExpired):
        return False
    if rc != 0:
        return False
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass
    return True


def _child(path: str, kv_dtype: str) -> None:
    """Load `path` on the CPU backend and start (then stop) an engine with a small KV cache:
    its self-check runs prefill and decode, compiling what they call into the cache."""
    try:
        os.nice(5)  # the serving engines come first on the shared CPUs
    except OSError:
        pass
    from panechat.engine.model.loader import load_model
    from panechat.engine.serving.config import EngineConfig
    from panechat.engine.serving.engine import Engine

    cfg = EngineConfig(max_concurrent=2, ctx_size=256, kv_sessions=2, kv_dtype=kv_dtype, verify_invariance=True)
    lm = load_model(path, "numpy", max_positions=cfg.ctx_size)
    Engine(lm, cfg).start().stop()


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])

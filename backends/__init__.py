"""Array backends behind one small interface (`base.Backend`): numpy, MLX, CuPy."""

from __future__ import annotations

import platform
import sys

from panechat.backends.base import Backend
from panechat.backends.errors import BackendUnavailable  # noqa: F401 - callers import it from here

BACKENDS = ("auto", "numpy", "mlx", "cupy")


def get_backend(name: str = "auto") -> Backend:
    """Instantiate a backend by name; 'auto' prefers CUDA, then Apple silicon, then numpy."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend '{name}'; choose one of: {', '.join(BACKENDS)}")
    if name == "auto":
        name = _auto()
        if name != "numpy":
            try:
                return get_backend(name)
            except BackendUnavailable:
                name = "numpy"  # a device without a usable toolchain: fall back to the CPU
    if name == "numpy":
        from panechat.backends.cpu.numpy_backend import cpu_backend

        return cpu_backend()
    if name == "mlx":
        try:
            from panechat.backends.mlx.mlx_backend import MLXBackend
        except ImportError as e:
            raise BackendUnavailable(
                f"the MLX backend needs mlx ({e}); install it with: pip install 'panechat[mlx]'"
            ) from None
        return MLXBackend()
    try:
        from panechat.backends.cuda.cupy_backend import CupyBackend
    except ImportError as e:
        raise BackendUnavailable(
            f"the CuPy backend needs cupy and a CUDA GPU ({e}); install with: pip install 'panechat[cuda]'"
        ) from None
    return CupyBackend()


def _auto() -> str:
    if _has_cuda():
        return "cupy"
    if sys.platform == "darwin" and platform.machine() == "arm64" and _importable("mlx.core"):
        return "mlx"
    return "numpy"


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _has_cuda() -> bool:
    if not _importable("cupy"):
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False

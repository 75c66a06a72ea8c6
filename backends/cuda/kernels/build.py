"""Compiling the CuPy backend's kernels with NVRTC: PTX without a GPU (`compile_ptx`), and
the device's own module, cached on disk (`build_module`)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from panechat.backends.cuda.kernels.source import OPTIONS, SOURCE


def _nvrtc_compile(source: str, target: str, options: tuple, kind: str) -> bytes:
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, "panechat_kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [target, *options])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC ({target}): {e}\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_ptx(arch: str = "compute_90", source: str = SOURCE, options: tuple = OPTIONS) -> bytes:
    """Compile `source` to PTX with NVRTC for `arch`, without a GPU (needs libnvrtc, e.g.
    from the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12`). Raises RuntimeError
    with NVRTC's log on a compile error."""
    return _nvrtc_compile(source, f"-arch={arch}", options, "ptx")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "panechat" / "cuda"


def build_module(cp: Any, cache_dir: str | Path | None = None, source: str = SOURCE,
                 options: tuple = OPTIONS, stem: str = "kernels") -> Any:
    """Compile `source` (SOURCE; mma_source.MMA_SOURCE with stem "mma") with NVRTC for the
    current device and load it as a cupy.RawModule.

    NVRTC is called directly rather than through ``cupy.RawModule(code=...)``, because
    CuPy appends ``-ftz=true`` to every compilation (the last -ftz option wins), which
    would flush subnormals in every kernel. The result (cubin for the device's own
    architecture, else PTX for the newest one NVRTC knows) is cached on disk, keyed by
    source, options, target and NVRTC version (``$XDG_CACHE_HOME/panechat/cuda``).
    """
    from cupy.cuda import nvrtc

    cc = int(cp.cuda.Device().compute_capability)
    archs = [a for a in nvrtc.getSupportedArchs() if a <= cc]
    if not archs:
        raise RuntimeError(f"this NVRTC supports no architecture up to sm_{cc}")
    target, kind = (f"-arch=sm_{cc}", "cubin") if cc in archs else (f"-arch=compute_{max(archs)}", "ptx")
    key = hashlib.sha256(repr((source, options, target, nvrtc.getVersion())).encode()).hexdigest()[:24]
    for folder in ([Path(cache_dir)] if cache_dir else [_cache_dir(), Path(tempfile.gettempdir()) / "panechat-cuda"]):
        path = folder / f"{stem}-{key}.{kind}"
        if path.is_file():
            return cp.RawModule(path=str(path))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            data = _nvrtc_compile(source, target, options, kind)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return cp.RawModule(path=str(path))
        except OSError:
            continue  # an unwritable cache folder: try the next one
    raise RuntimeError("no writable folder for the compiled CUDA kernels")


def compile_ptx_nvcc(arch: str = "sm_90", source: str = SOURCE, options: tuple = OPTIONS,
                     nvcc: str = "nvcc") -> bytes:
    """Compile `source` to PTX with the CUDA toolkit's nvcc (`nvcc -ptx -arch=<arch>`) and
    the same options NVRTC gets, without a GPU or cupy: a check that every kernel compiles
    where only the toolkit is installed. Raises RuntimeError with nvcc's output on an error."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "panechat_kernels.cu", Path(tmp) / "panechat_kernels.ptx"
        src.write_text(source)
        r = subprocess.run([nvcc, "-ptx", f"-arch={arch}", *options, str(src), "-o", str(out)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc ({arch}): {r.stderr.strip() or r.stdout.strip()}")
        return out.read_bytes()

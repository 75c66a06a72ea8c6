"""The wheel holds every module of the source tree, under the panechat.* names, and each
one imports from the installed wheel (not from this checkout); the CUDA source files ship
too, and the kernels' source read from the installed wheel is the checkout's."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"app": "panechat.app", "engine": "panechat.engine",
           "backends": "panechat.backends", "themes": "panechat.themes"}
# Modules that need an optional extra (or a GPU) to import.
OPTIONAL = {"mlx": "panechat.backends.mlx", "cupy": "panechat.backends.cupy"}


def source_modules() -> set[str]:
    names = set()
    for folder, pkg in FOLDERS.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.add(".".join((pkg, *parts)))
    return names


def source_data_files() -> set[str]:
    """The CUDA source files (.cu, .cuh) of the source tree, as paths inside the wheel."""
    found = set()
    for folder, pkg in FOLDERS.items():
        for f in (*(ROOT / folder).rglob("*.cu"), *(ROOT / folder).rglob("*.cuh")):
            found.add("/".join((*pkg.split("."), *f.relative_to(ROOT / folder).parts)))
    return found


def _cuda_source_digest() -> str:
    from panechat.backends.cuda.kernels.mma_source import MMA_SOURCE
    from panechat.backends.cuda.kernels.source import SOURCE

    return hashlib.sha256((SOURCE + MMA_SOURCE).encode()).hexdigest()


def test_wheel_installs_and_imports_every_module(tmp_path):
    # built from a clean copy: a stale build/ or *.egg-info in the checkout would add files
    # (a listed SOURCES.txt ships even what setup.py no longer names)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("panechat-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n[:-3].replace("/", ".").removesuffix(".__init__") for n in z.namelist() if n.endswith(".py")}
        data = set(z.namelist()) & source_data_files()
        z.extractall(tmp_path / "site")
    modules = source_modules()
    assert modules - in_wheel == set(), "modules missing from the wheel"
    assert "panechat/backends/cuda/kernels/kernels.cu" in source_data_files()
    assert source_data_files() - data == set(), "CUDA source files missing from the wheel"

    importable = sorted(m for m in modules
                        if not any(m.startswith(p) and _missing(extra) for extra, p in OPTIONAL.items()))
    probe = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for m in json.loads(sys.argv[1]):\n"
        "    out[m] = importlib.import_module(m).__file__\n"
        "from panechat.backends.cuda.kernels import mma_source, source\n"
        "import hashlib\n"
        "cuda = hashlib.sha256((source.SOURCE + mma_source.MMA_SOURCE).encode()).hexdigest()\n"
        "print(json.dumps({'files': out, 'cuda': cuda}))\n"
    )
    # -I: ignore PYTHONPATH and the user site; the wheel's folder goes first on sys.path,
    # ahead of the editable install of this checkout.
    site = tmp_path / "site"
    code = f"import sys; sys.path.insert(0, {str(site)!r}); exec({probe!r})"
    res = subprocess.run([sys.executable, "-I", "-c", code, json.dumps(importable)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    probed = json.loads(res.stdout)
    files = probed["files"]
    assert probed["cuda"] == _cuda_source_digest(), "the CUDA source read from the wheel differs"
    outside = {m: f for m, f in files.items() if f is None or not f.startswith(str(site))}
    assert not outside, f"imported from outside the wheel: {outside}"


def _missing(extra: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(extra) is None

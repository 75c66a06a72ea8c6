"""The wheel holds every module of the source tree, under the panechat.* names, and each
one imports from the installed wheel (not from this checkout)."""

from __future__ import annotations

import json
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


def test_wheel_installs_and_imports_every_module(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("panechat-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n[:-3].replace("/", ".").removesuffix(".__init__") for n in z.namelist() if n.endswith(".py")}
        z.extractall(tmp_path / "site")
    modules = source_modules()
    assert modules - in_wheel == set(), "modules missing from the wheel"

    importable = sorted(m for m in modules
                        if not any(m.startswith(p) and _missing(extra) for extra, p in OPTIONAL.items()))
    probe = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for m in json.loads(sys.argv[1]):\n"
        "    out[m] = importlib.import_module(m).__file__\n"
        "print(json.dumps(out))\n"
    )
    # -I: ignore PYTHONPATH and the user site; the wheel's folder goes first on sys.path,
    # ahead of the editable install of this checkout.
    site = tmp_path / "site"
    code = f"import sys; sys.path.insert(0, {str(site)!r}); exec({probe!r})"
    res = subprocess.run([sys.executable, "-I", "-c", code, json.dumps(importable)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    files = json.loads(res.stdout)
    outside = {m: f for m, f in files.items() if f is None or not f.startswith(str(site))}
    assert not outside, f"imported from outside the wheel: {outside}"


def _missing(extra: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(extra) is None

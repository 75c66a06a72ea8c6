"""The GGUF models on this machine: where panechat looks, and what each file is.

Looks, in this order (the first of two equal names wins; a different file under a taken
name is listed as SOURCE:NAME):
  path      --models-dir folders, then $PANECHAT_MODELS (os.pathsep-separated files or folders)
  package   Python packages that ship a GGUF (shipped_models.py)
  hf        the Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else
            $XDG_CACHE_HOME/huggingface/hub (default ~/.cache): models--ORG--NAME/snapshots/REV/
  lmstudio  ~/.lmstudio/models/PUBLISHER/REPO/, and the older ~/.cache/lm-studio/models
  llama.cpp $LLAMA_CACHE, else llama.cpp's cache folder (~/.cache/llama.cpp, ~/Library/Caches/llama.cpp)
  ollama    $OLLAMA_MODELS, else ~/.ollama/models: manifests/REGISTRY/NAMESPACE/MODEL/TAG name a blob
Only headers are read (gguf_header.py); a file that cannot be used gets a reason, never an
exception. Nothing is downloaded and a listing writes nothing: a package model made of
chunks is described from its first chunk's header, and assembled into the cache only when
it is loaded (`find_model`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from panechat.engine.gguf.file import ModelFileError
from panechat.engine.gguf.header import GGUFHeader, GGUFHeaderError, read_gguf_header
from panechat.engine.model.args import ROPE_SCALING_TYPES, SUPPORTED_ARCHITECTURES
from panechat.engine.catalog.shipped_models import (SHIPPED, ShippedModel, assemble, cache_dir, chunk_files,
                                                    is_installed, packaged_file)

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
_LATER_SHARD = re.compile(r"-(\d{5})-of-\d{5}\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelEntry:
    """One model file as `panechat models` lists it. `loadable` is False with a short
    `reason` when panechat cannot use it; unreadable facts are None."""

    name: str
    path: Path
    source: str
    architecture: str | None = None
    quant: str | None = None
    size: int | None = None
    context_length: int | None = None
    loadable: bool = False
    reason: str = ""
    base_model: bool = False  # no tokenizer.chat_template: a base model, it completes text


@dataclass(frozen=True)
class _Candidate:
    """A model found by name and path, before its header is read."""

    name: str
    source: str
    path: Path
    shipped: ShippedModel | None = None  # set for a package model assembled on first use
    problem: str = ""  # known to be unusable before reading (a missing blob, a bad manifest)


def search_roots(dirs: Sequence[str | Path] = (), env: Mapping[str, str] | None = None,
                 home: Path | None = None) -> list[tuple[str, Path]]:
    """(source, file or folder) pairs in search order, packages aside."""
    env = os.environ if env is None else env
    home = Path.home() if home is None else home
    xdg_cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    roots = [("path", Path(d).expanduser()) for d in dirs]
    roots += [("path", Path(p).expanduser()) for p in env.get("PANECHAT_MODELS", "").split(os.pathsep) if p]
    if env.get("HF_HUB_CACHE"):
        hf = Path(env["HF_HUB_CACHE"])
    else:
        hf = (Path(env["HF_HOME"]) if env.get("HF_HOME") else xdg_cache / "huggingface") / "hub"
    roots += [("hf", hf.expanduser()),
              ("lmstudio", home / ".lmstudio" / "models"), ("lmstudio", home / ".cache" / "lm-studio" / "models")]
    if env.get("LLAMA_CACHE"):
        llama = Path(env["LLAMA_CACHE"]).expanduser()
    elif sys.platform == "darwin":
        llama = home / "Library" / "Caches" / "llama.cpp"
    else:
        llama = xdg_cache / "llama.cpp"
    roots.append(("llama.cpp", llama))
    ollama = Path(env["OLLAMA_MODELS"]).expanduser() if env.get("OLLAMA_MODELS") else home / ".ollama" / "models"
    roots.append(("ollama", ollama))
    return roots


def find_models(dirs: Sequence[str | Path] = (), *, env: Mapping[str, str] | None = None,
                home: Path | None = None, shipped: Sequence[ShippedModel] = SHIPPED) -> list[ModelEntry]:
    """Every model found, in search order, each with its header facts or the reason it
    cannot be loaded. Writes nothing: a package model not assembled yet is described from
    its chunks."""
    entries = []
    for cand in _candidates(dirs, env, home, shipped):
        if cand.shipped is not None and not cand.path.is_file():
            entries.append(_describe_chunks(cand))
        else:
            entries.append(_describe(cand))
    return entries


def find_model(name: str, dirs: Sequence[str | Path] = (), *, env: Mapping[str, str] | None = None,
               home: Path | None = None, shipped: Sequence[ShippedModel] = SHIPPED) -> Path | None:
    """The file of the model listed as `name` (an Ollama name may omit `:latest`), or None.
    Reads no headers; assembles only that model if it is a package's. Raises
    ModelFileError when the name is known but its file cannot be had."""
    by_name = {c.name: c for c in _candidates(dirs, env, home, shipped)}
    cand = by_name.get(name) or by_name.get(f"{name}:latest")
    if cand is None:
        return None
    if cand.problem:
        raise ModelFileError(f"model '{name}': {cand.problem}")
    return assemble(cand.shipped) if cand.shipped is not None else cand.path


def _candidates(dirs: Sequence[str | Path], env: Mapping[str, str] | None, home: Path | None,
                shipped: Sequence[ShippedModel]) -> list[_Candidate]:
    roots = search_roots(dirs, env, home)
    found = [c for source, root in roots if source == "path" for c in _explicit(root)]
    found += _packages(shipped)
    found += [c for source, root in roots if source != "path" for c in _scan(source, root)]
    return _unique(found)


def _scan(source: str, root: Path) -> list[_Candidate]:
    """One store's models; a store that cannot be read (permissions) is one line, not an error."""
    try:
        return _SCANNERS[source](root)
    except OSError as e:
        return [_Candidate(str(root), source, root, problem=f"cannot read this folder ({e.strerror or e})")]


def _unique(found: Iterable[_Candidate]) -> list[_Candidate]:
    """First of two equal names wins; a different file under a taken name becomes SOURCE:NAME."""
    taken: dict[str, _Candidate] = {}
    for cand in found:
        if cand.name in taken:
            if _same_file(taken[cand.name].path, cand.path):
                continue
            cand = replace(cand, name=f"{cand.source}:{cand.name}")
            if cand.name in taken:
                continue
        taken[cand.name] = cand
    return list(taken.values())


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a == b


def _gguf_files(root: Path, recursive: bool = True) -> list[Path]:
    """The .gguf files under `root` (file symlinks included), sorted; later split shards left out."""
    if not root.is_dir():
        return []
    if recursive:
        files = [Path(folder) / f for folder, _, names in os.walk(root) for f in names]
    else:
        files = [p for p in root.iterdir() if not p.is_dir()]
    return sorted(f for f in files if f.name.lower().endswith(".gguf") and not _later_shard(f.name))


def _later_shard(filename: str) -> bool:
    m = _LATER_SHARD.search(filename)
    return m is not None and int(m.group(1)) > 1


def _folder(root: Path, source: str, recursive: bool = True) -> list[_Candidate]:
    """A model per .gguf file, named by its path under `root` without the suffix."""
    return [_Candidate(f.relative_to(root).as_posix()[: -len(".gguf")], source, f)
            for f in _gguf_files(root, recursive)]


def _explicit(path: Path) -> list[_Candidate]:
    if path.is_dir():
        return _folder(path, "path")
    if path.is_file():
        return [_Candidate(path.stem if path.suffix.lower() == ".gguf" else path.name, "path", path)]
    return [_Candidate(str(path), "path", path, problem="no such file or folder")]


def _packages(shipped: Sequence[ShippedModel]) -> list[_Candidate]:
    found = []
    for model in shipped:
        path = packaged_file(model)
        if path is not None:
            found.append(_Candidate(model.name, "package", path))
        elif model.assembled and is_installed(model):
            found.append(_Candidate(model.name, "package", cache_dir() / model.file, shipped=model))
    return found


def _hf_cache(hub: Path) -> list[_Candidate]:
    """models--ORG--NAME/snapshots/REV/**.gguf, named ORG/NAME/FILE; the main revision first."""
    found = []
    for repo_dir in sorted(hub.glob("models--*")):
        repo = repo_dir.name[len("models--"):].replace("--", "/")
        seen = set()
        for snapshot in _snapshots(repo_dir):
            for cand in _folder(snapshot, "hf"):
                if cand.name not in seen:
                    seen.add(cand.name)
                    found.append(_Candidate(f"{repo}/{cand.name}", "hf", cand.path))
    return found


def _snapshots(repo_dir: Path) -> list[Path]:
    """Snapshot folders, the one refs/main names first, then newest first."""
    snaps = [p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()]
    snaps.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    try:
        main = (repo_dir / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        main = ""
    return sorted(snaps, key=lambda p: p.name != main)


def _lmstudio(root: Path) -> list[_Candidate]:
    return _folder(root, "lmstudio")


def _llama_cache(root: Path) -> list[_Candidate]:
    """llama.cpp keeps downloads as flat files (ORG_REPO_FILE.gguf) or in the hub layout."""
    return _folder(root, "llama.cpp", recursive=False) + [replace(c, source="llama.cpp") for c in _hf_cache(root)]


def _ollama(root: Path) -> list[_Candidate]:
    """manifests/REGISTRY/NAMESPACE/MODEL/TAG: the model layer's digest names blobs/sha256-HEX."""
    manifests = root / "manifests"
    found = []
    for manifest in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()):
        registry, namespace, model, tag = manifest.relative_to(manifests).parts
        name = f"{model}:{tag}"
        if namespace != "library" or registry != OLLAMA_REGISTRY:
            name = f"{namespace}/{name}"
        if registry != OLLAMA_REGISTRY:
            name = f"{registry}/{name}"
        blob, problem = _ollama_blob(root, manifest)
        found.append(_Candidate(name, "ollama", blob or manifest, problem=problem))
    return found


def _ollama_blob(root: Path, manifest: Path) -> tuple[Path | None, str]:
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None, "unreadable Ollama manifest"
    except StopIteration:
        return None, "the Ollama manifest names no model layer"
    blob = root / "blobs" / str(digest).replace(":", "-")
    return blob, "" if blob.is_file() else f"missing Ollama blob {blob.name}"


_SCANNERS = {"hf": _hf_cache, "lmstudio": _lmstudio, "llama.cpp": _llama_cache, "ollama": _ollama}


def _describe(cand: _Candidate) -> ModelEntry:
    """The entry for one candidate, its header read; failures become the reason."""
    base = dict(name=cand.name, path=cand.path, source=cand.source)
    if cand.problem:
        return ModelEntry(**base, reason=cand.problem)
    try:
        size = cand.path.stat().st_size
    except OSError:
        broken = cand.path.is_symlink()
        return ModelEntry(**base, reason="broken link (incomplete download?)" if broken else "file missing")
    try:
        header = read_gguf_header(cand.path)
    except GGUFHeaderError as e:
        return ModelEntry(**base, size=size, reason=str(e))
    except Exception as e:  # a listing never fails on one file
        return ModelEntry(**base, size=size, reason=f"unreadable ({type(e).__name__})")
    arch = header.architecture
    facts = dict(architecture=arch, quant=header.quant, size=size, context_length=header.context_length,
                 base_model=_is_base(header))
    return ModelEntry(**base, **facts, **_verdict(header))


def _describe_chunks(cand: _Candidate) -> ModelEntry:
    """The entry of a package model not assembled yet: the header of its first chunk, the
    size of all its chunks together (what the assembled file will have)."""
    base = dict(name=cand.name, path=cand.path, source=cand.source)
    chunks = chunk_files(cand.shipped)
    if chunks is None:
        return ModelEntry(**base, reason=f"its chunk files are missing; reinstall it with: {cand.shipped.install}")
    size = sum(p.stat().st_size for p in chunks)
    try:
        header = replace(read_gguf_header(chunks[0]), file_size=size)
    except GGUFHeaderError as e:
        return ModelEntry(**base, size=size, reason=str(e))
    except Exception as e:  # a listing never fails on one file
        return ModelEntry(**base, size=size, reason=f"unreadable ({type(e).__name__})")
    facts = dict(architecture=header.architecture, quant=header.quant, size=size,
                 context_length=header.context_length, base_model=_is_base(header))
    return ModelEntry(**base, **facts, **_verdict(header))


def _is_base(header: GGUFHeader) -> bool:
    """No chat template in the file: the ChatML fallback would be used (chat_template.py)."""
    source = header.metadata.get("tokenizer.chat_template")
    return not isinstance(source, str) or not source.strip()


def _verdict(header: GGUFHeader) -> dict:
    arch, split_count = header.architecture, header.metadata.get("split.count")
    if header.truncated:
        return dict(reason=f"truncated file ({header.file_size:,} of {header.data_end:,} bytes)")
    if isinstance(split_count, int) and split_count > 1:
        return dict(reason=f"split into {split_count} files (merge them with llama-gguf-split --merge)")
    if arch is None:
        return dict(reason="no general.architecture in the header")
    if arch not in SUPPORTED_ARCHITECTURES:
        return dict(reason=f"unsupported architecture '{arch}'")
    scaling = header.metadata.get(f"{arch}.rope.scaling.type", "linear")
    if scaling not in ROPE_SCALING_TYPES:
        return dict(reason=f"unsupported RoPE scaling type '{scaling}'")
    if header.unread_types:
        return dict(reason=f"tensor type {', '.join(header.unread_types)} not read by panechat")
    return dict(loadable=True)

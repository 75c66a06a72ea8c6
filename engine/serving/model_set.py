"""Several models in one process: one `Engine` per model, under a memory budget.

Each model keeps its own Engine (its own compute thread, KV slots and batch), so a
conversation batches with the others of its model and nothing changes inside an Engine.
`ModelSet` only decides which Engines exist: it loads a model by name or path on first
use, the first one given being the default, and keeps the sum of the resident weight
bytes and KV bytes of the loaded models under `memory` (--models-memory). A model that
would not fit first makes room by unloading idle models, least recently used first, never
one with a stream queued or running and never the default; if that is not enough it is refused in
one line naming the budget and what is loaded.

One model is the single-model path as before: `ModelSet.of(engine)` holds one started
Engine, and nothing about that Engine differs.
"""

from __future__ import annotations

import contextlib

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from panechat.backends.paged_kv import bytes_per_block
from panechat.engine.serving.config import EngineConfig
from panechat.engine.default_model import resolve_model_path
from panechat.engine.serving.engine import Engine
from panechat.backends.cpu.threads import reserve_core
from panechat.engine.serving.gil_friendly import gil_friendly
from panechat.engine.serving.kernel_warmup import warm_kernels
from panechat.engine.gguf.header import read_gguf_header
from panechat.engine.kv.blocks import blocks_for
from panechat.engine.model.loader import load_model
from panechat.engine.model.args import ModelArgs
from panechat.engine.catalog.model_catalog import find_model
from panechat.engine.catalog.model_names import ModelDoesNotFit, UnknownModel, model_name, parse_model_list
from panechat.engine.serving.stats import EngineStats

__all__ = ["ModelSet", "UnknownModel", "ModelDoesNotFit", "model_name", "parse_model_list"]

#: After a model is handed out, the seconds it counts as busy although its stats show no
#: stream yet (the caller is still rendering the prompt; the engine thread publishes a new
#: request's stream on its next loop).
HANDOUT_BUSY_S = 5.0


@dataclass
class _Held:
    """One loaded model."""

    name: str
    engine: Engine
    nbytes: int  # resident weights + KV
    last_used: float  # time.monotonic() it was last handed out


def engine_bytes(engine: Engine) -> int:
    """Resident bytes of a started Engine: its weights and its paged KV cache (the KV
    budget's blocks, `PagedKV.nbytes`), and those of its draft model (--spec draft)."""
    kv = getattr(engine, "kv", None)
    kv_bytes = getattr(kv, "nbytes", None)
    if not isinstance(kv_bytes, int):  # a stand-in engine without a PagedKV: blocks x bytes per block
        kv_bytes = 0
        if kv is not None:
            stats = engine.stats()
            kv_bytes = int(stats.kv_bytes_per_block or 0) * int(stats.kv_total or 0)
    total = int(getattr(getattr(engine.lm, "model", None), "weight_bytes", 0)) + kv_bytes
    draft = getattr(engine, "draft", None)
    if draft is not None:
        total += int(draft.lm.model.weight_bytes) + int(draft.kv.nbytes)
    return total


def estimate_bytes(path: Path, cfg: EngineConfig) -> int:
    """What loading `path` will hold at least, from its header alone: the tensor data as
    stored (weights stay in their block format) and the KV cache the config asks for; with
    --spec draft, the draft model's too (its file, and its KV blocks beside the target's)."""
    header = read_gguf_header(path)
    draft_file, draft_block = _draft_sizes(cfg)
    weights = header.file_size + draft_file
    try:
        a = ModelArgs.from_metadata(header.metadata)
    except Exception:  # the loader will say what is wrong; the weights are estimate enough
        return weights
    if cfg.kv_memory is not None:  # the budget holds the draft's blocks too
        return weights + cfg.kv_memory
    ctx = min(cfg.ctx_size, a.context_length)
    contexts = cfg.kv_sessions or 2 * cfg.max_concurrent  # (the default budget is known only at start)
    per_block = bytes_per_block(a.n_layer, a.n_kv_head, a.head_dim, cfg.kv_dtype) + draft_block
    return weights + contexts * blocks_for(ctx) * per_block


def _draft_sizes(cfg: EngineConfig) -> tuple[int, int]:
    """(file bytes, KV bytes per block) of the config's draft model; (0, 0) without one, or
    when it cannot be read (loading it then says why)."""
    if cfg.spec != "draft" or not cfg.draft_model:
        return 0, 0
    try:
        header = read_gguf_header(resolve_model_path(cfg.draft_model))
        a = ModelArgs.from_metadata(header.metadata)
    except Exception:
        return 0, 0
    return header.file_size, bytes_per_block(a.n_layer, a.n_kv_head, a.head_dim, cfg.kv_dtype)


def _on_cpu(engine: Engine) -> bool:
    """Whether `engine` runs on the numba CPU backend (whose kernels compile holding the GIL)."""
    backend = getattr(getattr(getattr(engine, "lm", None), "model", None), "backend", None)
    return getattr(backend, "name", None) == "numpy"


def _mib(n: int) -> str:
    """A byte count for a message: GiB, MiB or KiB, whichever reads best."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1024:.3g} KiB"


class ModelSet:
    """The models this process holds: name -> started Engine, the first one the default.

    `get(name)` returns the model's Engine, loading it on first use (blocking: seconds; call
    it off an event loop) within `memory` bytes (None: no budget). With a budget and no
    --kv-memory / --kv-sessions, each engine's KV budget is 2 x max-concurrent contexts
    (the default share of free memory would make its size depend on the load order).
    Thread-safe."""

    def __init__(self, config: EngineConfig | None = None, backend: str = "auto", memory: int | None = None,
                 *, start: Callable[[Path], Engine] | None = None,
                 on_load: Callable[[str, Engine], None] | None = None,
                 on_unload: Callable[[str, str], None] | None = None):
        self.config = config or EngineConfig()
        if memory is not None and self.config.kv_memory is None and self.config.kv_sessions is None:
            # under --models-memory each engine's KV must be a known size (what
            # estimate_bytes counts), not a share of whatever memory is free at its start
            self.config = replace(self.config, kv_sessions=2 * self.config.max_concurrent)
        self.backend = backend
        self.memory = memory
        self._start = start or self._start_engine
        self.on_load = on_load  # told of every model loaded (the CLI prints its start-up lines)
        self.on_unload = on_unload  # told (name, why) of every model unloaded to make room (the CLI logs it)
        self._held: dict[str, _Held] = {}
        self._aliases: dict[str, str] = {}  # any accepted spelling -> name
        self.default: str | None = None  # the first model loaded; never unloaded to make room
        self._lock = threading.RLock()  # the dicts above; never held while a model loads
        self._loading = threading.Lock()  # one load at a time
        self.handout_busy_s = HANDOUT_BUSY_S
        self.lazy = True  # False: only the models added are served, get() loads nothing

    @classmethod
    def of(cls, engine: Engine, name: str | None = None) -> "ModelSet":
        """One started Engine as a ModelSet (the single-model path): nothing else loads."""
        ms = cls(engine.cfg if isinstance(getattr(engine, "cfg", None), EngineConfig) else None)
        ms.lazy = False
        file = str(engine.lm.name)
        ms.add(name or (file[:-len(".gguf")] if file.lower().endswith(".gguf") else file), engine)
        return ms

    # -- what is held ---------------------------------------------------------------------
    def add(self, name: str, engine: Engine, spec: str | None = None) -> None:
        """Hold a started `engine` as `name` (the first one added is the default); `spec` is
        the path or name it was loaded from (one more name it answers to)."""
        with self._lock:
            self._held[name] = _Held(name, engine, engine_bytes(engine), time.monotonic())
            file = str(engine.lm.name)
            for alias in (name, spec, file, file[:-len(".gguf")] if file.lower().endswith(".gguf") else file):
                if alias:
                    self._aliases[alias] = name
            if self.default is None:
                self.default = name

    def names(self) -> list[str]:
        """Loaded models, the default first, then in load order."""
        with self._lock:
            return sorted(self._held, key=lambda n: n != self.default)

    def engines(self) -> dict[str, Engine]:
        with self._lock:
            return {n: self._held[n].engine for n in self.names()}

    def find(self, name: str | None = None) -> Engine | None:
        """The loaded Engine called `name` (any of its spellings; None: the default), or None."""
        with self._lock:
            key = self.resolve_name(name)
            held = self._held.get(key) if key else None
            return held.engine if held else None

    def resolve_name(self, name: str | None) -> str | None:
        """The loaded name `name` stands for (None: the default), or None when not loaded."""
        with self._lock:
            key = self.default if not name else self._aliases.get(name)
            return key if key in self._held else None

    def stats(self) -> dict[str, EngineStats]:
        """One snapshot per loaded model (each Engine's own batch), the default first."""
        return {n: e.stats() for n, e in self.engines().items()}

    def used_bytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._held.values())

    @property
    def engine(self) -> Engine | None:
        """The default model's Engine (None before one is loaded)."""
        return self.find(None)

    # -- loading ----------------------------------------------------------------------------
    def get(self, name: str | None = None, *, paths: bool = True) -> Engine:
        """The Engine of `name` (None: the default), loading it first if it is not held.
        `paths=False` (a server's clients) loads only names `panechat models` lists.

        Raises UnknownModel (neither held nor a file nor a name `panechat models` lists),
        ModelDoesNotFit, and what loading raises (ModelFileError, BackendUnavailable).
        Loads run one at a time; the loaded models keep serving meanwhile."""
        engine = self._touch(name)
        if engine is not None:
            return engine
        with self._loading:
            engine = self._touch(name)  # loaded by another caller meanwhile
            return engine if engine is not None else self._load(name, paths)

    def _touch(self, name: str | None) -> Engine | None:
        with self._lock:
            key = self.resolve_name(name)
            if key is None:
                return None
            held = self._held[key]
            held.last_used = time.monotonic()
            return held.engine

    def _load(self, spec: str | None, paths: bool = True) -> Engine:
        if not self.lazy:
            raise UnknownModel(f"unknown model '{(spec or '')[:200]}'; this process serves "
                               f"{', '.join(self.names()) or 'no model'}")
        if spec and paths and Path(spec).expanduser().exists():
            path = Path(spec).expanduser()
        elif spec:
            found = find_model(spec)  # a listed model whose file cannot be had: ModelFileError
            if found is None:
                raise UnknownModel(f"unknown model '{spec[:200]}'; loaded: {', '.join(self.names()) or 'none'} "
                                   "(`panechat models` lists the others that can be loaded)")
            path = found
        else:  # no name: the default model, the first one loaded
            path = resolve_model_path(None)
        name = model_name(spec)
        if name in self._held:  # another file by the same name: tell them apart by its path
            name = str(path)
        if self.memory is not None:
            self._make_room(name, estimate_bytes(path, self.config), "about ")
        engine = self._start(path)
        if self.memory is not None:
            try:
                self._make_room(name, engine_bytes(engine), "")
            except ModelDoesNotFit:
                engine.stop()
                raise
        self.add(name, engine, spec)
        if self.on_load is not None:
            self.on_load(name, engine)
        return engine

    def _start_engine(self, path: Path) -> Engine:
        with self._lock:
            serving = [h.engine for h in self._held.values()]
        if not serving:
            return Engine(load_model(path, self.backend, max_positions=self.config.ctx_size), self.config).start()
        # Beside serving models, what holds the GIL for long happens in child processes, so
        # their streams keep flowing: numba's compiling of kernels not yet cached, and the
        # tokenizer's seconds of one Rust call (and its encoding after).
        # and the load's own work on the CPUs (its Python, then its self-check on one thread)
        # has a core of its own: the CPU engines run one thread fewer
        on_cpu = any(_on_cpu(e) for e in serving)
        if on_cpu:
            warm_kernels(path, self.config.kv_dtype)
        with gil_friendly(), (reserve_core() if on_cpu else contextlib.nullcontext()):
            lm = load_model(path, self.backend, max_positions=self.config.ctx_size, tokenizer_in_process=False)
            return Engine(lm, self.config).start(beside_others=True)

    def _busy(self, held: _Held, now: float) -> bool:
        s = held.engine.stats()
        return bool(s.streams) or bool(s.queue_depth) or now - held.last_used < self.handout_busy_s

    def _make_room(self, name: str, need: int, about: str) -> None:
        """Unload idle models, least recently used first, until `need` more bytes fit the
        budget; refuse (unloading nothing) when even every idle one would not do. The
        default model stays (requests that name no model use it)."""
        now = time.monotonic()
        with self._lock:
            held = sorted(self._held.values(), key=lambda h: h.last_used)
        idle = [h for h in held if h.name != self.default and not self._busy(h, now)]
        used = sum(h.nbytes for h in held)
        if not held and need > self.memory:
            raise ModelDoesNotFit(f"model '{name}' needs {about}{_mib(need)} but --models-memory is "
                                  f"{_mib(self.memory)}; raise --models-memory")
        if used - sum(h.nbytes for h in idle) + need > self.memory:
            loaded = ", ".join(f"{h.name} ({_mib(h.nbytes)}"
                               f"{', the default' if h.name == self.default else ', busy' if h not in idle else ''})"
                               for h in held)
            raise ModelDoesNotFit(
                f"model '{name}' needs {about}{_mib(need)} but --models-memory is {_mib(self.memory)} with "
                f"{_mib(used)} held by {loaded or 'no model'}; raise --models-memory, or wait until a model "
                "is idle so it can be unloaded")
        for h in idle:
            if used + need <= self.memory:
                break
            self.unload(h.name, f"idle, to make room for '{name}' within --models-memory {_mib(self.memory)}")
            used -= h.nbytes

    def unload(self, name: str, why: str | None = None) -> None:
        """Stop and forget the model `name` (its streams, if any, end with reason 'cancelled');
        `on_unload` is told `why` when one is given."""
        with self._lock:
            held = self._held.pop(name, None)
            if held is None:
                return
        held.engine.stop()
        tokenizer = getattr(getattr(held.engine, "lm", None), "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "close"):
            tokenizer.close()  # its process, if it has one
        if why is not None and self.on_unload is not None:
            self.on_unload(name, why)

    def stop(self) -> None:
        """Stop every Engine."""
        for name in self.names():
            self.unload(name)

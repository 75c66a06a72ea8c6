"""What Ollama's API answers, in Ollama's field names (docs/protocol.md, "Ollama API"): a
model's facts for `/api/tags`, `/api/show` and `/api/ps`, the timestamps, and the counts
and durations (nanoseconds) that end a reply.

A model's facts come from its GGUF header (engine/gguf/header.py), read once per file
version and kept: a listing re-reads nothing until a file changes.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from panechat.engine.gguf.header import read_gguf_header
from panechat.engine.serving.events import FinishEvent
from .openai_api import timings_of

#: What `expires_at` says of a loaded model: panechat unloads by memory (--models-memory),
#: never by time, as Ollama writes a model kept with `keep_alive: -1`.
NEVER = "2318-01-01T00:00:00Z"
_BLOB = re.compile(r"^sha256-([0-9a-f]{64})$")
_TEMPLATE_KEY = "tokenizer.chat_template"


def timestamp(t: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes `created_at` and `modified_at`."""
    when = datetime.fromtimestamp(time.time() if t is None else t, timezone.utc)
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class ModelFacts:
    """One GGUF file as Ollama's listings describe it (unreadable facts empty)."""

    size: int = 0
    modified: float = 0.0
    digest: str = ""
    architecture: str = ""
    quant: str = ""
    parameters: int = 0
    template: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # the header's scalar metadata, the template aside

    def details(self) -> dict:
        """Ollama's `details` object."""
        arch = self.architecture
        return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
                "parameter_size": parameter_size(self.parameters), "quantization_level": self.quant}


def parameter_size(n: int) -> str:
    """A parameter count as Ollama shows it: 135M, 3.2B ("" when unknown)."""
    if n <= 0:
        return ""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _digest(path: Path, size: int, mtime_ns: int) -> str:
    """An Ollama blob's own sha256 (its name says it); for other files a digest of the path,
    size and modification time, not of the bytes (hashing gigabytes per listing is too slow)."""
    m = _BLOB.match(path.name)
    if m:
        return m.group(1)
    return hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode("utf-8", "replace")).hexdigest()


_facts: dict[tuple[str, int, int], ModelFacts] = {}
_facts_lock = threading.Lock()


def model_facts(path: str | Path) -> ModelFacts:
    """The facts of the GGUF at `path`, read once per (path, size, mtime); blocking (call it
    off the event loop). A file that cannot be read gives empty facts, never an exception."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return ModelFacts()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _facts_lock:
        known = _facts.get(key)
    if known is not None:
        return known
    base = dict(size=st.st_size, modified=st.st_mtime, digest=_digest(path, st.st_size, st.st_mtime_ns))
    try:
        header = read_gguf_header(path)
        meta = header.metadata
        facts = ModelFacts(**base, architecture=header.architecture or "", quant=header.quant or "",
                           parameters=sum(header.type_elements.values()),
                           template=str(meta.get(_TEMPLATE_KEY) or ""),
                           info={k: v for k, v in meta.items() if k != _TEMPLATE_KEY and _is_json_scalar(v)})
    except Exception:  # a listing never fails on one file
        facts = ModelFacts(**base)
    with _facts_lock:
        _facts[key] = facts
    return facts


def _is_json_scalar(v) -> bool:
    if isinstance(v, (bool, int, str)):
        return True
    return isinstance(v, float) and json.dumps(v) not in ("NaN", "Infinity", "-Infinity")


def listed_model(name: str, facts: ModelFacts) -> dict:
    """One entry of `/api/tags`."""
    return {"name": name, "model": name, "modified_at": timestamp(facts.modified), "size": facts.size,
            "digest": facts.digest, "details": facts.details()}


def running_model(name: str, facts: ModelFacts, resident: int, on_device: bool, ctx: int) -> dict:
    """One entry of `/api/ps`: `resident` bytes (weights + KV), all of them in `size_vram`
    on a GPU backend; `ctx` the context this server runs it with."""
    return {"name": name, "model": name, "size": resident, "digest": facts.digest, "details": facts.details(),
            "expires_at": NEVER, "size_vram": resident if on_device else 0, "context_length": ctx}


def shown_model(name: str, facts: ModelFacts, template: str, stops: tuple[str, ...] | list[str],
                capabilities: list[str]) -> dict:
    """`/api/show`: the template the server renders with, the stop strings as Modelfile
    parameters, the header's metadata as `model_info`."""
    return {"modelfile": f"# panechat serves this model from its local catalog (panechat models)\nFROM {name}\n",
            "parameters": "\n".join(f"stop {json.dumps(s)}" for s in stops), "template": template,
            "details": facts.details(), "model_info": facts.info, "capabilities": capabilities,
            "modified_at": timestamp(facts.modified)}


def done_reason(fin: FinishEvent) -> str:
    """Ollama's `done_reason`: "length" when max_tokens (`num_predict`) or the context ended it."""
    return "length" if fin.reason == "length" else "stop"


def final_fields(fin: FinishEvent, total_ns: int, load_ns: int) -> dict:
    """The fields that end a reply: done, done_reason, the token counts and the durations in
    nanoseconds. `prompt_eval_count` counts the whole prompt (tokens reused from the KV cache
    too, as OpenAI's `prompt_tokens`); `eval_duration` runs from the first token to the last."""
    t = timings_of(fin)
    return {"done": True, "done_reason": done_reason(fin), "total_duration": total_ns, "load_duration": load_ns,
            "prompt_eval_count": fin.usage.get("prompt_tokens", 0),
            "prompt_eval_duration": int(t["prompt_ms"] * 1e6),
            "eval_count": fin.usage.get("completion_tokens", 0), "eval_duration": int(t["predicted_ms"] * 1e6)}


def ollama_message(message: dict) -> dict:
    """An OpenAI-shaped assistant message as Ollama's: `tool_calls` with `arguments` as an
    object (OpenAI sends a JSON string), no ids."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"].get("arguments"))}}
                             for c in calls]
    return out


def _arguments(v):
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v if v is not None else {}

"""What the engine reports about itself: one typed snapshot that every reader shares.

`Engine.stats()` returns an `EngineStats`; the TUI dashboard, Prometheus, `/health`, the
websocket stats subscription and every ChatBackend read (or build) this same type. States
and numbers are data; the words ("prefill 42%") are the UI's. `to_dict()` / `from_dict()`
are the websocket wire form (docs/protocol.md).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["StreamState", "StreamStats", "IdleConversation", "TTFTHistogram", "EngineStats"]


class StreamState(str, enum.Enum):
    """Where a stream stands (its value is the wire string)."""

    WAITING = "waiting"  # sent to a server that reports no queue or prefill (an OpenAI API); no token yet
    QUEUED = "queued"  # in the engine's queue, no KV slot yet
    PREFILLING = "prefilling"  # computing its prompt: prefill_done of prefill_total tokens
    DECODING = "decoding"  # generating tokens


@dataclass(frozen=True)
class StreamStats:
    """One running or queued generation."""

    id: str
    conversation: str
    state: StreamState
    tokens: int = 0  # generated so far
    tok_s: float = 0.0  # since its first token
    ttft_ms: float | None = None  # None until the first token
    prefill_done: int = 0  # prompt tokens whose KV is computed (reused ones included)
    prefill_total: int = 0  # prompt tokens
    client: str = ""  # who it is attributed to ("" unknown or the engine's own)
    spec_acceptance: float | None = None  # accepted / drafted tokens of its speculation (None: no drafts yet)
    spec_tokens_per_step: float | None = None  # tokens per verify step of its speculation (None: no drafts yet)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StreamStats":
        """The inverse of to_dict; ValueError/TypeError for a malformed entry."""
        return cls(id=str(d["id"]), conversation=str(d["conversation"]), state=StreamState(d["state"]),
                   tokens=int(d.get("tokens") or 0), tok_s=float(d.get("tok_s") or 0.0),
                   ttft_ms=None if d.get("ttft_ms") is None else float(d["ttft_ms"]),
                   prefill_done=int(d.get("prefill_done") or 0), prefill_total=int(d.get("prefill_total") or 0),
                   client=str(d.get("client") or ""),
                   spec_acceptance=None if d.get("spec_acceptance") is None else float(d["spec_acceptance"]),
                   spec_tokens_per_step=None if d.get("spec_tokens_per_step") is None
                   else float(d["spec_tokens_per_step"]))


@dataclass(frozen=True)
class IdleConversation:
    """A conversation whose KV stays cached between turns (its next turn reuses it):
    `slot` is its first KV block, `cached_tokens` the leading tokens still cached."""

    conversation: str
    slot: int
    cached_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "IdleConversation":
        return cls(str(d["conversation"]), int(d["slot"]), int(d["cached_tokens"]))


@dataclass(frozen=True)
class TTFTHistogram:
    """Time to first token, cumulative: counts[i] requests at or under le[i] seconds, the
    last count over the top (Prometheus buckets)."""

    le: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    sum: float = 0.0

    def to_dict(self) -> dict:
        return {"le": list(self.le), "counts": list(self.counts), "sum": self.sum}

    @classmethod
    def from_dict(cls, d: dict) -> "TTFTHistogram":
        return cls(tuple(float(x) for x in d.get("le", ())), tuple(int(x) for x in d.get("counts", ())),
                   float(d.get("sum", 0.0)))


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of one engine (or what a backend knows of one).

    A field left None is one this backend cannot know: an OpenAI-compatible API reports
    only this terminal's own streams, so its batch, queue and KV fields are None."""

    batch_now: int | None = None  # sequences in the latest step
    batch_max: int | None = None  # --max-concurrent
    rows_now: int = 0  # rows (tokens) in the latest step
    steps: int = 0
    step_hist: tuple[int, ...] = ()  # step_hist[n]: steps that computed n sequences
    tok_s: float = 0.0  # tokens generated over the last second
    queue_depth: int | None = None
    kv_in_use: int | None = None  # KV blocks held by running generations
    kv_resident: int | None = None  # KV blocks holding tokens (in use, or cached for reuse)
    kv_total: int | None = None  # KV blocks in the budget (--kv-memory)
    kv_bytes_per_block: int | None = None
    kv_block_tokens: int | None = None
    kv_shared: int = 0  # blocks held by more than one generation (a shared prefix)
    kv_peak_in_use: int = 0  # most KV blocks ever held by running generations at once
    evictions: int = 0  # cached blocks reused for other tokens
    preemptions: int = 0  # generations sent back to the queue when KV memory ran out
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found computed (not prefilled again)
    kv_snapshots_written: int = 0  # conversations' KV written to disk
    kv_snapshots_restored: int = 0  # ... and read back instead of prefilled
    spec_draft_tokens: int = 0  # draft tokens checked by speculative decoding
    spec_accepted: int = 0  # of those, accepted (each one a token without a step of its own)
    spec_steps: int = 0  # a sequence's steps that checked drafts: (spec_steps + spec_accepted) / spec_steps tokens each
    streams: tuple[StreamStats, ...] = ()  # running, then queued
    idle: tuple[IdleConversation, ...] = ()
    requests_total: int = 0  # admitted to a KV slot
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    refused: int = 0  # queue full
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0
    ttft_hist: TTFTHistogram = TTFTHistogram()
    batching: bool | None = None  # False: the invariance self-check failed, one sequence per step
    ctx: int | None = None  # context per conversation (tokens)
    terminals: int | None = None  # connected terminals, where a server counts them
    kv_snapshots_written: int = 0  # KV snapshot files written (evicted or idle at stop)
    kv_snapshots_restored: int = 0  # requests whose prompt prefix was read from a snapshot

    def with_terminals(self, n: int | None) -> "EngineStats":
        return replace(self, terminals=n)

    def to_dict(self) -> dict:
        """JSON-ready (the websocket `stats` frame body)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["step_hist"] = list(self.step_hist)
        d["streams"] = [s.to_dict() for s in self.streams]
        d["idle"] = [c.to_dict() for c in self.idle]
        d["requests_finished"] = dict(self.requests_finished)
        d["ttft_hist"] = self.ttft_hist.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineStats":
        """Rebuild from `to_dict()` output; unknown keys (a frame's `type`, `model`, ...) are
        ignored, missing ones take their defaults. ValueError/TypeError when malformed."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "step_hist" in kw:
            kw["step_hist"] = tuple(int(x) for x in kw["step_hist"])
        if "streams" in kw:
            kw["streams"] = tuple(StreamStats.from_dict(s) for s in kw["streams"])
        if "idle" in kw:
            kw["idle"] = tuple(IdleConversation.from_dict(c) for c in kw["idle"])
        if "requests_finished" in kw:
            kw["requests_finished"] = {str(k): int(v) for k, v in kw["requests_finished"].items()}
        if "ttft_hist" in kw:
            kw["ttft_hist"] = TTFTHistogram.from_dict(kw["ttft_hist"])
        return cls(**kw)

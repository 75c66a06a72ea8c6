"""What a pane needs from a model server: `ChatBackend`, its streams and their events.

Three implementations share this interface: the embedded engine (`local`), a panechat
server over websockets (`remote_ws`) and any OpenAI-compatible HTTP server
(`openai_http`). Panes only ever see the events below, so the UI code is the same for all.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator

from panechat.engine.serving.stats import EngineStats


class BackendError(Exception):
    """The backend cannot be reached or refused us (one line, shown to the user)."""


@dataclass
class GenParams:
    """Sampling settings a pane sends with each prompt (the engine's SamplingParams subset,
    named and defaulted as the request schema's `/ws` column)."""

    temperature: float = 0.0
    max_tokens: int = 512
    seed: int | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    response_format: dict | None = None  # OpenAI's: JSON mode or a JSON schema (a pane setting)
    stop: tuple[str, ...] = ()  # the reply ends before any of them (besides the template's own)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    spec: bool = True  # speculative drafts (the reply is the same either way; issue 27)


@dataclass(frozen=True)
class Queued:
    """Accepted and waiting for a batch slot: the prompt's tokens (None when the backend
    does not say) and how many of the oldest turns were left out to fit the context."""

    prompt_tokens: int | None = None
    dropped: int = 0


@dataclass(frozen=True)
class Prefill:
    """Prompt tokens computed so far out of the total."""

    done: int
    total: int


@dataclass(frozen=True)
class Delta:
    """Reply text for one sampled token (tokens=0 for text flushed without a new token)."""

    text: str
    tokens: int = 1


@dataclass(frozen=True)
class Finished:
    """The last event of every stream. reason: stop, length, cancelled or error."""

    reason: str
    text: str
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    error: str | None = None


StreamEvent = Queued | Prefill | Delta | Finished


@dataclass(frozen=True)
class Followed:
    """A turn another terminal takes in a conversation this one follows read-only: event
    'user' (its prompt in `text`; `replaces`: it took an unanswered prompt's place),
    'delta' (reply text) or 'finished' (the whole reply in `text`, its `reason`)."""

    event: str
    text: str = ""
    reason: str = ""
    replaces: bool = False


@dataclass(frozen=True)
class Reconnected:
    """The connection to the server came back after it was lost (open the conversation again)."""


@dataclass(frozen=True)
class HolderChanged:
    """Who may send to a conversation changed: `holder` is the other terminal holding it
    now, or None when this terminal does."""

    holder: str | None


@dataclass
class BackendInfo:
    """What the dashboard shows about the backend."""

    kind: str  # local, remote, openai
    model: str = ""
    backend: str = ""  # short (e.g. "numpy"); `detail` carries the long description
    detail: str = ""
    ctx: int | None = None
    max_concurrent: int | None = None
    batching: bool | None = None
    chat_template: str = ""  # "gguf", "chatml-fallback" (a base model), "" when the server does not say
    url: str = ""
    ready_s: float | None = None  # local engine: seconds from the process's start to serving


@dataclass(frozen=True)
class ModelChoice:
    """A model the model picker lists: loaded ones and the ones the backend can load;
    `reason` says why one cannot be chosen."""

    name: str
    detail: str = ""  # "loaded", or architecture, quant, size, context
    loaded: bool = False
    loadable: bool = True
    reason: str = ""
    base: bool = False  # a base model (no chat template): a pane on it completes text


class ChatStream(ABC):
    """One generation: iterate its events (ends with exactly one Finished), or cancel it."""

    def __init__(self) -> None:
        self.id = ""

    @abstractmethod
    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...

    @abstractmethod
    def cancel(self) -> None:
        """Ask the server to stop; the stream still ends with Finished(reason='cancelled')."""


class QueueStream(ChatStream):
    """A ChatStream fed through an asyncio.Queue by a reader task (remote backends)."""

    def __init__(self, on_cancel=None) -> None:
        super().__init__()
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._on_cancel = on_cancel
        self.done = False

    def put(self, ev: StreamEvent) -> None:
        if not self.done:
            self.done = isinstance(ev, Finished)
            self.queue.put_nowait(ev)

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        while True:
            ev = await self.queue.get()
            yield ev
            if isinstance(ev, Finished):
                return

    def cancel(self) -> None:
        if not self.done and self._on_cancel is not None:
            self._on_cancel(self)


class ChatBackend(ABC):
    """The model server behind the panes (data down as calls, events up as streams)."""

    info: BackendInfo
    profile: str  # the key pane layouts are stored under

    @abstractmethod
    async def start(self) -> BackendInfo:
        """Load or connect; raises BackendError with a one-line reason."""

    async def close(self) -> None:
        """Release the engine or the connection."""

    async def attach(self, conversation: str, system: str, history: list[dict], *,
                     take: bool = False) -> list[dict] | None:
        """Called when a pane opens `conversation` holding `history` (user/assistant turns);
        a backend that keeps histories (the websocket server) returns its copy, seeded from
        `history` when it has none (after a server restart, say); the others return None.
        `take`: hold it even if another terminal does (see `holder_of`)."""
        return None

    def holder_of(self, conversation: str) -> str | None:
        """The other terminal that holds `conversation` (this one may then only follow it,
        read-only), or None when this terminal may send to it."""
        return None

    def replying(self, conversation: str) -> str | None:
        """The text so far of a reply in flight when `conversation` was attached (another
        terminal's, followed from there), or None."""
        return None

    def watch(self, conversation: str, listener) -> None:
        """Call `listener` with each Followed and HolderChanged of `conversation` (on the
        event loop; None stops)."""

    async def release(self, conversation: str) -> None:
        """This terminal no longer shows `conversation` (a pane closed): its hold passes on."""

    def trouble(self) -> str | None:
        """What is wrong with the connection right now, in a few words ("disconnected,
        retrying"), or None."""
        return None

    @abstractmethod
    def stream(self, conversation: str, messages: list[dict], params: GenParams, system: str = "",
               model: str = "") -> ChatStream:
        """Start generating the reply to `messages` (the full history, user turn last, no
        system message; `system` is separate) on `model` ('' = the backend's default).
        Errors arrive as Finished(reason='error')."""

    def respond(self, conversation: str, messages: list[dict], params: GenParams, system: str = "",
                model: str = "") -> ChatStream:
        """What a pane sends: `stream` on a chat model; on a base model (see `completes_text`)
        the completion of the conversation's text instead, where the backend can do that."""
        return self.stream(conversation, messages, params, system, model)

    def completes_text(self, model: str = "") -> bool:
        """True when `model` ('' = the default) is known to be a base model that `respond`
        completes text on (no chat template); False for chat models and when unknown."""
        return False

    def model_loaded(self, model: str = "") -> bool:
        """False while `model` ('' = the default) would first have to be loaded."""
        return True

    async def model_choices(self) -> list[ModelChoice]:
        """The models a pane may be put on (the model picker's list); this backend's one
        model when it offers no choice."""
        return [ModelChoice(self.info.model, "loaded", loaded=True)] if self.info.model else []

    def model_stats(self) -> dict[str, EngineStats]:
        """One snapshot per model the backend holds, when it holds several (the dashboard's
        batch line per model); empty when it knows of one model only."""
        return {}

    @abstractmethod
    def stats(self) -> EngineStats | None:
        """The latest engine snapshot (see Engine.stats; fields this backend cannot know
        are None), or None before the first one. Cheap: the dashboard calls it a few
        times a second."""


class StreamMeter:
    """Per-stream tok/s, time to first token and token count, computed from the stream itself."""

    def __init__(self) -> None:
        self.t_send = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.tokens = 0

    def on_tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.t_first is None and n:
            self.t_first = now
        self.tokens += n
        self.t_last = now

    @property
    def ttft_ms(self) -> float | None:
        return None if self.t_first is None else 1000 * (self.t_first - self.t_send)

    def tok_s(self, now: float | None = None) -> float:
        if self.t_first is None or self.tokens < 2:
            return 0.0
        dt = (now or time.perf_counter()) - self.t_first
        return (self.tokens - 1) / dt if dt > 0 else 0.0

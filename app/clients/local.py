"""The embedded engine as a ChatBackend: panes submit straight into its batch."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from ...engine.engine import Engine, Generation
from ...engine.events import FinishEvent, PrefillEvent, TokenEvent
from ...engine.sampling import SamplingParams
from ...engine.stats import EngineStats
from ..engine_errors import QUEUE_FULL, classify
from .base import BackendInfo, ChatBackend, ChatStream, Delta, Finished, GenParams, Prefill, Queued


class LocalStream(ChatStream):
    """Engine events translated to StreamEvents; submit errors become Finished('error')."""

    def __init__(self, gen: Generation | None, error: str | None = None):
        super().__init__()
        self.gen, self.error = gen, error
        self.id = gen.id if gen else ""

    async def __aiter__(self) -> AsyncIterator:
        if self.gen is None:
            yield Finished("error", "", error=self.error)
            return
        yield Queued()
        async for ev in self.gen.aevents():
            if isinstance(ev, TokenEvent):
                yield Delta(ev.text, 0 if ev.token_id < 0 else 1)
            elif isinstance(ev, PrefillEvent):
                yield Prefill(ev.done, ev.total)
            elif isinstance(ev, FinishEvent):
                yield Finished(ev.reason, ev.text, ev.usage, ev.timings, ev.error)

    def cancel(self) -> None:
        if self.gen is not None:
            self.gen.cancel()


class LocalBackend(ChatBackend):
    """Wraps an Engine, or builds one from CLI args in a thread so the UI starts at once."""

    profile = "local"

    def __init__(self, engine: Engine | None = None, *, build: Callable[[], Engine] | None = None,
                 own_engine: bool = False):
        self.engine = engine
        self._build = build
        self._own = own_engine or engine is None
        self.info = BackendInfo(kind="local")
        self.terminals: Callable[[], int | None] = lambda: None  # set by --share: the server's count

    async def start(self) -> BackendInfo:
        if self.engine is None:
            assert self._build is not None
            self.engine = await asyncio.to_thread(self._build)
        e = self.engine
        be = e.lm.model.backend
        self.info = BackendInfo(kind="local", model=e.lm.name, backend=be.name, detail=be.describe(),
                                ctx=e.ctx, max_concurrent=e.cfg.max_concurrent, batching=e.batching)
        return self.info

    async def close(self) -> None:
        if self.engine is not None and self._own:
            await asyncio.to_thread(self.engine.stop)

    def stream(self, conversation: str, messages: list[dict], params: GenParams, system: str = "") -> ChatStream:
        if self.engine is None:
            return LocalStream(None, "the model is still loading")
        msgs = ([{"role": "system", "content": system}] if system else []) + list(messages)
        sp = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            min_p=params.min_p, seed=params.seed, max_tokens=params.max_tokens)
        try:
            return LocalStream(self.engine.submit(msgs, params=sp, conversation=conversation))
        except Exception as e:
            refusal = classify(e)  # app/engine_errors.py
            if refusal is None:
                raise
            if refusal is QUEUE_FULL:
                return LocalStream(None, "the engine queue is full; try again when a reply finishes")
            return LocalStream(None, str(e))

    def stats(self) -> EngineStats | None:
        if self.engine is None:
            return None
        return self.engine.stats().with_terminals(self.terminals())


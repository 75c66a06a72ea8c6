"""The embedded engine as a ChatBackend: panes submit straight into its batch (the prompt
is rendered and tokenized in a worker thread first, as the server does). With several
models (engine/serving/model_set.py) each pane's model has its own Engine and batch."""

from __future__ import annotations

import asyncio
import weakref
from typing import AsyncIterator, Callable

from panechat.engine.serving.engine import Engine, Generation
from panechat.engine.serving.model_set import ModelSet
from panechat.engine.serving.events import FinishEvent, PrefillEvent, TokenEvent
from panechat.engine.serving.grammar import response_format_grammar
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.stats import EngineStats
from ..completion_text import completion_text
from ..context_fit import ContextFit, fit_context, reply_room
from ..engine_errors import QUEUE_FULL, classify
from ..startup_clock import since_start
from .base import BackendInfo, ChatBackend, ChatStream, Delta, Finished, GenParams, ModelChoice, Prefill, Queued


class LocalStream(ChatStream):
    """Engine events translated to StreamEvents. The prompt is rendered and tokenized in a
    worker thread once iteration starts (never on the UI's event loop), then submitted;
    submit errors become Finished('error'). `complete_base`: on a base model (no chat
    template) the conversation's text is completed raw (`run --raw`) instead."""

    def __init__(self, engine: Engine | Callable[[], Engine] | None, messages: list[dict] | None = None,
                 params: SamplingParams | None = None, conversation: str = "", *, error: str | None = None,
                 stop: tuple[str, ...] = (), complete_base: bool = False):
        super().__init__()
        self.complete_base = complete_base
        # a callable finds (or loads) the pane's model in the worker thread first
        self.engine, self.messages, self.params, self.conversation = engine, messages or [], params, conversation
        self.error = error
        self.stop = tuple(stop)  # the pane's stop strings, besides the template's
        self.gen: Generation | None = None
        self.fit: ContextFit | None = None  # what was sent (turns left out to fit the context)
        self._cancelled = False

    async def _submit(self) -> None:
        """Tokenize off the loop, then queue; sets `gen`, or `error` with the reason."""
        try:
            if callable(self.engine) and not isinstance(self.engine, Engine):
                self.engine = await asyncio.to_thread(self.engine)
            engine = self.engine
            room = reply_room(self.params.max_tokens if self.params else 1, engine.ctx)
            raw = self.complete_base and engine.lm.template.is_fallback
            tokenize = (lambda ms: engine.completion_ids(completion_text(ms))) if raw else engine.prompt_ids
            fit = await asyncio.to_thread(fit_context, self.messages, tokenize, engine.ctx, room)
            gen = engine.submit(prompt_ids=fit.ids, params=self.params, conversation=self.conversation,
                                stop=(*self.stop,) if raw else (*engine.chat_stops, *self.stop))
            self.fit = fit
        except Exception as e:  # refusals (app/engine_errors.py), incl. the engine stopping meanwhile
            refusal = classify(e)
            if refusal is None:
                raise
            self.error = ("the engine queue is full; try again when a reply finishes" if refusal is QUEUE_FULL
                          else str(e))
            return
        self.gen, self.id = gen, gen.id
        if self._cancelled:  # stopped while tokenizing: the engine still sends the Finished
            self.gen.cancel()

    async def __aiter__(self) -> AsyncIterator:
        if self.engine is not None:
            await self._submit()
        if self.gen is None:
            yield Finished("error", "", error=self.error)
            return
        yield Queued(len(self.fit.ids), self.fit.dropped) if self.fit is not None else Queued()
        async for ev in self.gen.aevents():
            if isinstance(ev, TokenEvent):
                yield Delta(ev.text, 0 if ev.token_id < 0 else 1)
            elif isinstance(ev, PrefillEvent):
                yield Prefill(ev.done, ev.total)
            elif isinstance(ev, FinishEvent):
                yield Finished(ev.reason, ev.text, ev.usage, ev.timings, ev.error)

    def cancel(self) -> None:
        self._cancelled = True
        if self.gen is not None:
            self.gen.cancel()


class LocalBackend(ChatBackend):
    """Wraps an Engine or a ModelSet (several models, the first the default), or builds
    one from CLI args in a thread so the UI starts at once."""

    profile = "local"

    def __init__(self, engine: Engine | ModelSet | None = None, *,
                 build: Callable[[], Engine | ModelSet] | None = None, own_engine: bool = False,
                 clock: Callable[[], float] = since_start):
        self.models: ModelSet | None = None
        self.clock = clock  # seconds since the process started, read once the engine serves
        if engine is not None:
            self._hold(engine)
        self._build = build
        self._own = own_engine or engine is None
        self.info = BackendInfo(kind="local")
        self.terminals: Callable[[], int | None] = lambda: None  # set by --share: the server's count
        self._listed_base: set[str] = set()  # base models among those model_choices listed unloaded
        self._streams: weakref.WeakSet[LocalStream] = weakref.WeakSet()  # those not yet collected, for close()

    def _hold(self, engine: Engine | ModelSet) -> None:
        self.models = engine if isinstance(engine, ModelSet) else ModelSet.of(engine)

    @property
    def engine(self) -> Engine | None:
        """The default model's Engine (None while loading)."""
        return self.models.engine if self.models is not None else None

    async def start(self) -> BackendInfo:
        if self.models is None:
            assert self._build is not None
            self._hold(await asyncio.to_thread(self._build))
        e = self.engine
        be = e.lm.model.backend
        self.info = BackendInfo(kind="local", model=self.models.default or e.lm.name, backend=be.name,
                                detail=be.describe(), ctx=e.ctx, max_concurrent=e.cfg.max_concurrent,
                                batching=e.batching,
                                chat_template=e.lm.template.kind, ready_s=self.clock())
        return self.info

    async def close(self) -> None:
        """Cancel this backend's streams (an engine it was given goes on serving others, and
        must not go on generating for an app that quit), then stop an engine it owns."""
        for stream in list(self._streams):
            stream.cancel()
        if self.models is not None and self._own:
            await asyncio.to_thread(self.models.stop)

    def stream(self, conversation: str, messages: list[dict], params: GenParams, system: str = "",
               model: str = "", *, complete_base: bool = False) -> ChatStream:
        if self.models is None:
            return LocalStream(None, error="the model is still loading")
        msgs = ([{"role": "system", "content": system}] if system else []) + list(messages)
        sp = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            min_p=params.min_p, seed=params.seed, max_tokens=params.max_tokens,
                            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                            repeat_penalty=params.repeat_penalty, repeat_last_n=params.repeat_last_n,
                            grammar=response_format_grammar(params.response_format), speculate=params.spec)
        models = self.models
        # found (or loaded on first use, or reloaded after an unload) in the worker thread
        stream = LocalStream(lambda: models.get(model or None), msgs, sp, conversation, stop=params.stop,
                             complete_base=complete_base)
        self._streams.add(stream)
        return stream

    def respond(self, conversation: str, messages: list[dict], params: GenParams, system: str = "",
                model: str = "") -> ChatStream:
        """A chat reply, or on a base model the raw completion of the conversation's text
        (decided once the model is loaded: its file has no chat template)."""
        return self.stream(conversation, messages, params, system, model, complete_base=True)

    def completes_text(self, model: str = "") -> bool:
        engine = self.models.find(model or None) if self.models is not None else None
        if engine is not None:
            return engine.lm.template.is_fallback
        return model in self._listed_base

    def model_loaded(self, model: str = "") -> bool:
        return self.models is None or not self.models.lazy or self.models.find(model or None) is not None

    def stats(self) -> EngineStats | None:
        if self.engine is None:
            return None
        return self.engine.stats().with_terminals(self.terminals())

    async def model_choices(self) -> list[ModelChoice]:
        """The loaded models, then what `panechat models` finds (read in a worker thread)."""
        from panechat.engine.catalog.model_catalog import find_models  # deferred: reads every model header

        loaded = [ModelChoice(n, "loaded", loaded=True, base=self.completes_text(n))
                  for n in (self.models.names() if self.models is not None else [])]
        if self.models is not None and not self.models.lazy:  # an Engine given as is: nothing else loads
            return loaded
        found = await asyncio.to_thread(find_models)
        names = {c.name for c in loaded}
        listed = [ModelChoice(m.name, _describe(m), loadable=m.loadable, reason=m.reason, base=m.base_model)
                  for m in found if (self.models is None or self.models.find(m.name) is None) and m.name not in names]
        self._listed_base |= {c.name for c in listed if c.base}
        return loaded + listed

    def model_stats(self) -> dict[str, EngineStats]:
        if self.models is None or len(self.models.names()) < 2:
            return {}
        return self.models.stats()


def _describe(entry) -> str:
    """A catalog entry in a few words: architecture, quant, size, context."""
    parts = [entry.architecture or "?", entry.quant or ""]
    if entry.size:
        parts.append(f"{entry.size / 2**20:.0f} MiB")
    if entry.context_length:
        parts.append(f"ctx {entry.context_length}")
    return " ".join(p for p in parts if p)

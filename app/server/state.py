"""`ServerState`: what every handler of the server shares (`app.state.panechat`): the
engine (None while loading), the token, the websocket conversations, the terminal count,
and what a shutdown drains (the generations in flight, the open sockets).

Its own module so that the routes (`openai_api`, `websocket`, `prometheus`) and the app
that assembles them (`app`) all import it, and none of them imports another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request

from panechat.engine.serving.engine import PromptTooLong

from ..completion_text import completion_text
from ..context_fit import ContextFit, fit_context, reply_room
from ..engine_errors import CLIENT_QUEUE_FULL, QUEUE_FULL, ShuttingDown, classify
from . import errors
from .attribution import USER_KEY, UsageByClient
from .conversation_db import ConversationDB, ConversationDBError
from .conversations import ConversationStore
from .errors import APIError

if TYPE_CHECKING:
    from panechat.engine.serving.engine import Engine, Generation
    from panechat.engine.catalog.model_catalog import ModelEntry
    from panechat.engine.serving.model_set import ModelSet
    from panechat.engine.serving.sampling import SamplingParams
    from panechat.engine.serving.stats import EngineStats
    from .tokens import NamedTokens

#: The name any request may use for the default model (clients that must send some name).
DEFAULT_ALIAS = "panechat"
CATALOG_TTL_S = 30.0  # /v1/models re-reads the model catalog at most this often

__all__ = ["ServerState", "state_of", "SERVER_NAME"]

SERVER_NAME = "panechat/0.1"


class ServerState:
    """What every handler shares: the models (None while loading; `engine` is the
    default one), the token, the websocket conversations and the terminal count.

    Shutdown (shutdown.py): once `draining`, `submit` refuses (ShuttingDown); `inflight`
    holds each generation submitted here until its handler has sent the client its end
    (handlers call `done`), and `sockets` the open websocket connections."""

    def __init__(self, engine: "Engine | ModelSet | None", token: str | None, max_body: int,
                 logger: logging.Logger, history_memory: int = 256 << 20, state_dir: Path | None = None,
                 tokens: "NamedTokens | None" = None):
        self.models: "ModelSet | None" = None
        self._catalog: tuple[float, list["ModelEntry"]] | None = None
        if engine is not None:
            self.attach(engine)
        self.token = token or None
        self.tokens = tokens  # --tokens: named tokens (then `token` is None)
        self.usage = UsageByClient(named=tokens is not None)
        self.max_body = max_body
        self.log = logger
        self.load_error: str | None = None
        self.conversation_db = _open_db(state_dir, logger)
        self.conversations = ConversationStore(max_bytes=history_memory, db=self.conversation_db)
        self.terminals = 0  # websocket terminals past hello
        self.hosted = 0  # terminals in the server's own process (--share's TUI): counted in the stats too
        self.terminal_ids = itertools.count(1)
        self.started = time.time()
        self.registry = None  # the /metrics CollectorRegistry, made by create_app
        self.drain_until: float | None = None  # time.monotonic() when the drain ends; None: serving
        self.inflight: set["Generation"] = set()
        self.sockets: set = set()  # websocket.Connection objects (typed loosely: websocket imports this)

    # -- engine life cycle ----------------------------------------------------------
    def attach(self, engine: "Engine | ModelSet") -> None:
        """Start serving `engine` (already started), or every model of a ModelSet (the
        first the default); /health turns 200."""
        from panechat.engine.serving.model_set import ModelSet  # deferred: the engine loads in a worker thread

        self.models = engine if isinstance(engine, ModelSet) else ModelSet.of(engine)

    @property
    def engine(self) -> "Engine | None":
        """The default model's Engine (None while loading)."""
        return self.models.engine if self.models is not None else None

    def fail(self, message: str) -> None:
        """Loading failed: /health reports it (503) instead of 'loading'."""
        self.load_error = message

    def require_engine(self) -> "Engine":
        if self.engine is None:
            if self.load_error:
                raise APIError(503, f"the model failed to load: {self.load_error}", type="server_error",
                               code="model_load_failed")
            raise errors.loading()
        return self.engine

    async def wait_engine(self, timeout: float | None = None) -> "Engine | None":
        """The engine, waiting for it to load (None on timeout or failed load)."""
        t0 = time.monotonic()
        while self.engine is None and self.load_error is None:
            if timeout is not None and time.monotonic() - t0 > timeout:
                return None
            await asyncio.sleep(0.1)
        return self.engine

    # -- models -----------------------------------------------------------------------
    def model_id(self) -> str:
        """The default model's name."""
        self.require_engine()
        return self.models.default

    async def engine_for(self, model: str | None) -> "Engine":
        """The Engine serving `model` (None, "" or "panechat": the default), loading a model
        `panechat models` lists on first use (in a worker thread). Raises UnknownModel,
        ModelDoesNotFit or ModelFileError (app/engine_errors.py classifies them)."""
        self.require_engine()
        if not model or model == DEFAULT_ALIAS:
            model = None
        engine = self.models.find(model)
        if engine is not None:
            return self.models.get(model)  # marks it used: the least recently used unloads first
        return await asyncio.to_thread(self.models.get, model, paths=False)

    async def catalog(self) -> list["ModelEntry"]:
        """`panechat models`' list (read off the loop, kept CATALOG_TTL_S seconds)."""
        from panechat.engine.catalog.model_catalog import find_models

        now = time.monotonic()
        if self._catalog is None or now - self._catalog[0] > CATALOG_TTL_S:
            self._catalog = (now, await asyncio.to_thread(find_models))
        return self._catalog[1]

    # -- auth -------------------------------------------------------------------------
    def authenticate(self, presented: str | None) -> str | None:
        """Who `presented` lets in: its --tokens name, "" where no name applies (no token
        required, or the shared --token), None when it is refused."""
        if self.tokens is not None:
            return self.tokens.name_of(presented)
        if self.token is None:
            return ""
        if not isinstance(presented, str):
            return None
        ok = hmac.compare_digest(presented.encode("utf-8", "replace"), self.token.encode("utf-8"))
        return "" if ok else None

    def token_ok(self, presented: str | None) -> bool:
        return self.authenticate(presented) is not None

    def check_bearer(self, request: Request) -> None:
        """401 unless the request carries `Authorization: Bearer <token>` (when a token is
        required); a --tokens name is left in the scope for `attribution.client_of`."""
        if self.token is None and self.tokens is None:
            return
        scheme, _, cred = request.headers.get("authorization", "").partition(" ")
        user = self.authenticate(cred.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise errors.unauthorized(named=self.tokens is not None)
        request.scope[USER_KEY] = user

    def shown_stats(self, stats: "EngineStats") -> "EngineStats":
        """`stats` as terminals are shown them: streams name their --tokens name; without
        named tokens no client at all (other people's addresses are not for every terminal)."""
        if self.tokens is not None or not any(x.client for x in stats.streams):
            return stats
        return dataclasses.replace(stats, streams=tuple(dataclasses.replace(x, client="") for x in stats.streams))

    # -- shutdown ---------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self.drain_until is not None

    def begin_drain(self, grace: float) -> None:
        """Refuse new generations from now on; running ones have `grace` seconds."""
        self.drain_until = time.monotonic() + grace

    def check_admitting(self) -> None:
        """ShuttingDown (503 `shutting_down`) once the server is draining."""
        if self.drain_until is not None:
            raise ShuttingDown("the server is shutting down; retry shortly (on another instance, "
                               "or this one once restarted)", self.drain_until - time.monotonic() + 1)

    def close(self) -> None:
        """The server has stopped: close the conversation store's file (every change is
        already in it)."""
        if self.conversation_db is not None:
            self.conversation_db.close()

    def done(self, gen: "Generation") -> None:
        """The handler of `gen` has sent its client the end (or the client left); its
        tokens are counted to its client (once)."""
        if gen in self.inflight and gen.finish is not None:
            u = self.usage.of(gen.client)
            u.prompt_tokens += gen.finish.usage.get("prompt_tokens", 0)
            u.completion_tokens += gen.finish.usage.get("completion_tokens", 0)
        self.inflight.discard(gen)

    # -- generation -------------------------------------------------------------------
    async def submit(self, messages: list[dict], params: "SamplingParams", stop: list[str] | tuple = (),
                     conversation: str | None = None, engine: "Engine | None" = None,
                     client: str = "", tools: list[dict] | None = None) -> "Generation":
        """Render and tokenize `messages` (with `tools` for a template that knows them) off
        the event loop, then queue the generation on `engine` (default: the default model's),
        with the template's own stop strings besides `stop`. The caller owns it until it
        calls `done(gen)` (in a `finally`). `client`: who it is attributed to (attribution.py:
        the queue is fair across clients).

        Raises ValueError (bad messages/params), PromptTooLong, QueueFull or EngineStopped, as
        `Engine.submit`, and ShuttingDown."""
        return (await self.submit_n(1, messages, params, stop, conversation, engine, client, tools))[0]

    async def submit_n(self, n: int, messages: list[dict], params: "SamplingParams",
                       stop: list[str] | tuple = (), conversation: str | None = None,
                       engine: "Engine | None" = None, client: str = "",
                       tools: list[dict] | None = None) -> list["Generation"]:
        """`submit` of `n` samples (`Engine.submit_n`); the caller owns each."""
        engine = engine or self.require_engine()
        return await self._submit(engine, lambda: engine.prompt_ids(messages, tools), params,
                                  [*stop, *engine.chat_stops], conversation, client, n)

    async def submit_conversation(self, messages: list[dict], params: "SamplingParams",
                                  stop: list[str] | tuple = (), conversation: str | None = None,
                                  engine: "Engine | None" = None, client: str = "",
                                  complete_text: bool = False) -> tuple["Generation", ContextFit]:
        """`submit` for a stored conversation (the websocket's): a prompt over the context
        loses its oldest turns first (app/context_fit.py, as the TUI's local engine does);
        returns the generation and what was sent. `complete_text` on a base model (no chat
        template): the conversation's text is completed raw, as `run --raw` and a local
        base-model pane do (app/completion_text.py)."""
        engine = engine or self.require_engine()
        fitted: list[ContextFit] = []
        raw = complete_text and engine.lm.template.is_fallback
        tokenize = (lambda ms: engine.completion_ids(completion_text(ms))) if raw else engine.prompt_ids

        def prompt_ids() -> list[int]:
            fitted.append(fit_context(messages, tokenize, engine.ctx, reply_room(params.max_tokens, engine.ctx)))
            return fitted[0].ids

        stops = [*stop] if raw else [*stop, *engine.chat_stops]
        gen, = await self._submit(engine, prompt_ids, params, stops, conversation, client)
        return gen, fitted[0]

    async def submit_text(self, text: str, params: "SamplingParams", stop: list[str] | tuple = (),
                          engine: "Engine | None" = None, client: str = "") -> "Generation":
        """`submit` for a raw prompt (`/v1/completions`): no template, BOS per the file."""
        return (await self.submit_text_n(1, text, params, stop, engine, client))[0]

    async def submit_text_n(self, n: int, prompt: "str | list[int]", params: "SamplingParams",
                            stop: list[str] | tuple = (), engine: "Engine | None" = None,
                            client: str = "") -> list["Generation"]:
        """`submit_text` of `n` samples; `prompt` may also be token ids (taken as they are). A
        prompt over the context is PromptTooLong naming `prompt` (a chat's names `messages`)."""
        engine = engine or self.require_engine()
        ids = (lambda: prompt) if isinstance(prompt, list) else (lambda: engine.completion_ids(prompt))
        try:
            return await self._submit(engine, ids, params, list(stop), None, client, n)
        except PromptTooLong as e:
            e.param = e.param or "prompt"
            raise

    async def _submit(self, engine: "Engine", prompt_ids, params, stop: list[str],
                      conversation: str | None, client: str, n: int = 1) -> list["Generation"]:
        self.check_admitting()
        ids = await asyncio.to_thread(prompt_ids)
        self.check_admitting()  # the drain may have begun meanwhile
        kw = dict(prompt_ids=ids, params=params, conversation=conversation, stop=stop, client=client)
        submit = (lambda: [engine.submit(**kw)]) if n == 1 else (lambda: engine.submit_n(n, **kw))  # noqa: E731
        try:
            # a grammar compiles at submit (milliseconds; the first one builds the vocabulary, seconds)
            gens = await asyncio.to_thread(submit) if params.grammar is not None else submit()
        except Exception as e:
            if classify(e) in (QUEUE_FULL, CLIENT_QUEUE_FULL):
                self.usage.of(client).refused += 1
            raise
        self.usage.of(client).requests += 1
        self.inflight.update(gens)
        return gens


def _open_db(state_dir: Path | None, logger: logging.Logger) -> ConversationDB | None:
    """The conversation store in `state_dir` (None: memory only); one that cannot be used
    is said in one log line and the server keeps conversations in memory."""
    if state_dir is None:
        return None
    try:
        return ConversationDB(state_dir, logger)
    except ConversationDBError as e:
        logger.warning("%s; conversations are kept in memory only", e)
        return None


def state_of(request) -> ServerState:
    return request.app.state.panechat

"""Ollama's API on the same port (docs/protocol.md, "Ollama API"): `/api/version`, `/api/tags`,
`/api/show`, `/api/ps`, `/api/chat` and `/api/generate` (NDJSON streamed unless `stream:
false`), and clear refusals for what panechat does not do (embeddings: 501; pull, push,
create, copy, delete: models come from the local catalog).

A chat or generate request is translated into the OpenAI-shaped body of
`/v1/chat/completions` or `/v1/completions` (ollama_request.py) and then goes the same way
as those routes: the same token, body limit, request schema, engine submit and whole-reply
wait (openai_api.py). Errors are Ollama's `{"error": message}` (the app shapes every error
under /api/, errors.shaped). Model names are the catalog's, `NAME:latest` and `NAME` being
the same model as in Ollama.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from panechat.engine.serving.events import FinishEvent, TokenEvent
from panechat.engine.serving.model_set import engine_bytes
from . import errors
from .attribution import client_of
from .completions_api import parse_completion_request, submit_completion
from .errors import APIError, bad_request
from .ollama_request import OllamaBody, chat_body, generate_body
from .ollama_shapes import (ModelFacts, final_fields, listed_model, model_facts, ollama_message, running_model,
                            shown_model, timestamp)
from .openai_api import (_log_line, _watch_disconnect, chat_choice, engine_for, model_field, parse_chat_request,
                         read_json, shutdown_error, submit_chat, submitted, whole_reply)
from .request_log import set_log_detail
from .request_schema import CHAT, FIELDS, HONOURED
from .state import ServerState, state_of

__all__ = ["ollama_routes", "OLLAMA_ROUTES", "OLLAMA_VERSION"]

#: The Ollama API version whose routes and fields this follows (`GET /api/version`).
OLLAMA_VERSION = "0.9.0"
#: The routes a 404 under /api/ points to.
OLLAMA_ROUTES = "GET /api/tags, GET /api/ps, POST /api/show, POST /api/chat, POST /api/generate"
_GPU_BACKENDS = ("cupy", "mlx")  # their weights and KV live in device (or unified) memory: size_vram
_LATEST = ":latest"


# -- models ---------------------------------------------------------------------------------------
def _spellings(name: str | None) -> list[str | None]:
    """The names `name` may stand for: Ollama's `NAME` is `NAME:latest` and the other way round."""
    if not name:
        return [None]
    if name.endswith(_LATEST):
        return [name, name[:-len(_LATEST)]]
    return [name, name + _LATEST] if ":" not in name else [name]


def _not_found(st: ServerState, name: str) -> APIError:
    served = ", ".join(st.models.names())
    return errors.not_found(f"model '{name[:200]}' not found; this server serves {served} "
                            "(`panechat models` lists the ones it can load)", param="model", code="model_not_found")


async def _engine(st: ServerState, name: str | None):
    """The Engine of `name` (loaded on first use, as the OpenAI routes do); Ollama's 404 when
    no spelling of it is a model."""
    for spelling in _spellings(name):
        try:
            return await engine_for(st, spelling)
        except APIError as e:
            if e.status != 404:
                raise
    raise _not_found(st, name or "")


def _loaded(st: ServerState, name: str | None):
    """(name, Engine) of a loaded model `name` stands for, or None (loads nothing)."""
    for spelling in _spellings(name):
        key = st.models.resolve_name(spelling)
        if key is not None:
            return key, st.models.find(key)
    return None


def _capabilities() -> list[str]:
    """What `/api/show` says a model can do: completion, and tools once the chat schema
    honours them."""
    tools = any(f.name == "tools" and f.status == HONOURED and CHAT in f.defaults for f in FIELDS)
    return ["completion", *(["tools"] if tools else [])]


async def _catalog_rest(st: ServerState) -> list:
    """The loadable catalog entries that are not loaded (a lazy server loads them on use)."""
    if not st.models.lazy:
        return []
    return [m for m in await st.catalog() if m.loadable and st.models.find(m.name) is None]


def _checked(request: Request) -> ServerState:
    st = state_of(request)
    st.check_bearer(request)
    st.require_engine()
    return st


async def tags(request: Request) -> Response:
    """`GET /api/tags`: the loaded models (the default first), then the catalog's others."""
    st = _checked(request)
    named = [(n, e.lm.path) for n, e in st.models.engines().items()]
    named += [(m.name, m.path) for m in await _catalog_rest(st)]
    facts = await asyncio.to_thread(lambda: [model_facts(p) for _, p in named])
    return JSONResponse({"models": [listed_model(n, f) for (n, _), f in zip(named, facts)]})


async def ps(request: Request) -> Response:
    """`GET /api/ps`: the loaded models, their resident bytes and the context they run with."""
    st = _checked(request)
    loaded = list(st.models.engines().items())
    facts = await asyncio.to_thread(lambda: [model_facts(e.lm.path) for _, e in loaded])
    return JSONResponse({"models": [
        running_model(n, f, engine_bytes(e), e.lm.model.backend.name in _GPU_BACKENDS, e.ctx)
        for (n, e), f in zip(loaded, facts)]})


async def show(request: Request) -> Response:
    """`POST /api/show {"model"}` (or the older `name`): a loaded model's template and stop
    strings as it serves them, a catalog model's from its file; nothing is loaded."""
    st = state_of(request)
    data = await read_json(request, st)
    name = model_field({"model": data.get("model") or data.get("name")} if isinstance(data, dict) else data)
    held = _loaded(st, name)
    if held is not None:
        key, engine = held
        facts = await asyncio.to_thread(model_facts, engine.lm.path)
        return JSONResponse(shown_model(key, facts, engine.lm.template.source, engine.chat_stops, _capabilities()))
    spellings = _spellings(name)
    entry = next((m for m in await _catalog_rest(st) if m.name in spellings), None)
    if entry is None:
        raise _not_found(st, name or "")
    facts: ModelFacts = await asyncio.to_thread(model_facts, entry.path)
    return JSONResponse(shown_model(entry.name, facts, facts.template, (), _capabilities()))


# -- chat and generate ------------------------------------------------------------------------------
async def chat(request: Request) -> Response:
    """`POST /api/chat`: as `/v1/chat/completions`, in Ollama's shapes."""
    return await _generation(request, lambda data, engine: chat_body(data), "message")


async def generate(request: Request) -> Response:
    """`POST /api/generate`: the prompt as one user turn of a chat (`raw`: as `/v1/completions`)."""
    return await _generation(request, lambda data, engine: generate_body(data, engine.ctx), "response")


async def _generation(request: Request, translate: Callable[[dict, object], OllamaBody], kind: str) -> Response:
    """Read, translate, validate and submit as the OpenAI routes do; then the NDJSON stream
    or one JSON object. `kind`: "message" (chat) or "response" (generate)."""
    t0 = time.monotonic_ns()
    st = state_of(request)
    data = await read_json(request, st)
    name = model_field(data)
    t_model = time.monotonic_ns()
    engine = await _engine(st, name)
    shown = name or st.model_id()
    load_ns = time.monotonic_ns() - t_model
    ob = translate(data, engine)
    if ob.load_only:  # Ollama's way to load a model: no prompt, no messages
        return JSONResponse({"model": shown, "created_at": timestamp(), **_text(kind, ""), "done": True,
                             "done_reason": "load"})
    parse, submit = (parse_chat_request, submit_chat) if ob.protocol == CHAT else \
        (parse_completion_request, submit_completion)
    try:
        req = parse(ob.body, engine, shown)
    except APIError as e:
        raise ob.reworded(e) from None
    if ob.num_ctx is not None and ob.num_ctx < engine.ctx:
        req = await _within(st, req, engine, ob.num_ctx)
    gen, = await submitted(st, lambda: submit(st, req, engine, client_of(request)))  # n is 1 here

    def last(fin: FinishEvent, buffered: bool) -> dict:
        if kind == "message":
            body = {"message": ollama_message(chat_choice(req, engine, fin, 0)["message"]) if buffered else
                    {"role": "assistant", "content": ""}}
        else:
            body = _text(kind, fin.text if buffered else "")
        return {"model": shown, "created_at": timestamp(), **body,
                **final_fields(fin, time.monotonic_ns() - t0, load_ns)}

    if req.stream:
        # with tools the reply is parsed into tool_calls only once whole: sent in the last line
        return NDJSONStream(request, gen, lambda text: {"model": shown, "created_at": timestamp(),
                                                        **_text(kind, text), "done": False},
                            last, buffered=kind == "message" and bool(ob.body.get("tools")))
    return JSONResponse(last(await whole_reply(request, st, gen), True))


def _text(kind: str, text: str) -> dict:
    return {"message": {"role": "assistant", "content": text}} if kind == "message" else {"response": text}


async def _within(st: ServerState, req, engine, num_ctx: int):
    """`req` with max_tokens capped so prompt and reply fit `options.num_ctx` tokens; 400
    when the prompt alone does not."""
    prompt = getattr(req, "messages", None)
    try:
        ids = await asyncio.to_thread(engine.prompt_ids if prompt is not None else engine.completion_ids,
                                      prompt if prompt is not None else req.prompt)
    except Exception as e:
        raise errors.from_engine(e, st.log, "tokenizing a prompt") from None
    room = num_ctx - len(ids)
    if room < 1:
        raise bad_request(f"the prompt is {len(ids)} tokens, which leaves no room for a reply within "
                          f"options.num_ctx ({num_ctx})", param="options.num_ctx", code="context_length_exceeded")
    req.params = replace(req.params, max_tokens=min(req.params.max_tokens, room))
    return req


class NDJSONStream(Response):
    """Ollama's stream: one JSON object per line, `line(text)` per token's text, then
    `last(finish, buffered)` (done: true, the counts and durations), or `{"error"}` when the
    generation failed. `buffered`: no per-token lines, the whole reply in the last one.

    As the OpenAI stream (openai_api.SSEResponse): a watcher cancels the generation the
    moment the client disconnects, so its KV slot is freed at once."""

    media_type = "application/x-ndjson"

    def __init__(self, request: Request, gen, line: Callable[[str], dict],
                 last: Callable[[FinishEvent, bool], dict], buffered: bool = False):
        self.request, self.gen, self.line, self.last, self.buffered = request, gen, line, last, buffered
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        gen = self.gen
        watcher = asyncio.create_task(_watch_disconnect(self.request, gen))
        alive = True

        async def emit(obj: dict | None) -> None:
            nonlocal alive
            if not alive:
                return
            data = b"" if obj is None else json.dumps(obj, ensure_ascii=False).encode() + b"\n"
            try:
                await send({"type": "http.response.body", "body": data, "more_body": obj is not None})
            except OSError:  # the client is gone: stop generating
                alive = False
                gen.cancel()

        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for ev in gen.aevents():
                if isinstance(ev, TokenEvent) and ev.text and not self.buffered:
                    await emit(self.line(ev.text))
            fin = gen.finish
            set_log_detail(self.request, _log_line(fin, True))
            if fin.reason == "shutdown":
                await emit({"error": shutdown_error(fin).message})
            elif fin.reason == "error":
                await emit({"error": fin.error or "generation failed"})
            elif fin.reason != "cancelled":
                await emit(self.last(fin, self.buffered))
            await emit(None)
        finally:
            watcher.cancel()
            if gen.finish is None:
                gen.cancel()
            state_of(self.request).done(gen)


# -- what panechat does not do ---------------------------------------------------------------------
def _not_served(message: str):
    async def refuse(request: Request) -> Response:
        state_of(request).check_bearer(request)
        return errors.ollama_error(501, message)
    return refuse


_CATALOG = ("is not supported: panechat serves the GGUF models of its local catalog (`panechat models` "
            "lists them: --models-dir, $PANECHAT_MODELS, the Hugging Face and Ollama caches)")
_NO_EMBEDDINGS = "embeddings are not supported by this server: its models are served for generation only"


async def root(request: Request) -> Response:
    """`GET /` (and HEAD): the liveness answer Ollama's clients probe before anything else."""
    return PlainTextResponse("panechat is running (Ollama's API under /api/, OpenAI's under /v1/)")


async def version(request: Request) -> Response:
    """`GET /api/version`: no token needed (it says nothing about the models, as /health)."""
    return JSONResponse({"version": OLLAMA_VERSION})


def ollama_routes() -> list[Route]:
    """The routes of Ollama's API, for the app's route list."""
    refused = [Route(f"/api/{op}", _not_served(f"{op} {_CATALOG}"), methods=["POST", "DELETE"])
               for op in ("pull", "push", "create", "copy", "delete")]
    return [
        Route("/", root, methods=["GET"]),
        Route("/api/version", version, methods=["GET"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/embed", _not_served(_NO_EMBEDDINGS), methods=["POST"]),
        Route("/api/embeddings", _not_served(_NO_EMBEDDINGS), methods=["POST"]),
        Route("/api/blobs/{digest:path}", _not_served(f"blobs {_CATALOG}"), methods=["HEAD", "POST"]),
        *refused,
    ]

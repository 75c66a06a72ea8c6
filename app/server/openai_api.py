"""OpenAI-compatible routes: `POST /v1/chat/completions` (streaming or not), `GET /v1/models`;
what `/v1/completions` (completions_api.py) shares with them: the sampling fields, the
wait for a whole reply, the SSE stream, usage and timings.

Requests are validated up front (400 in OpenAI's error shape, naming the parameter); the
whole message history is passed to the engine, whose KV slots reuse the longest cached
prefix, so a client that resends its history prefills only the new turn. `usage` reports
the reused tokens as `prompt_tokens_details.cached_tokens`, and `timings` follows
llama.cpp's server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from panechat.engine.serving.events import FinishEvent, TokenEvent
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.text.tool_calls import GENERIC, GenericCallStream, GenericResponseStream, ToolCall
from . import errors
from .attribution import client_of
from .errors import APIError, bad_request
from .request_fields import FieldError, parse_json
from .logprobs_json import chat_content, chat_logprobs
from .request_schema import CHAT, read_fields, sampling_params, unknown_fields
from .request_log import set_log_detail
from .structured_output import OutputPlan, output_plan
from .state import DEFAULT_ALIAS, ServerState, state_of

log = logging.getLogger("panechat.server")

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int = 1
    plan: OutputPlan = OutputPlan()


# -- validation -----------------------------------------------------------------------------
def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text is supported
        out = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": str}} "
                                  "(only text content is supported)", param=f"messages[{i}].content")
            out.append(part["text"])
        return "".join(out)
    if c is None and (m.get("tool_calls") or m.get("role") == "tool"):  # an assistant's calls alone
        return ""
    raise bad_request(f"messages[{i}].content must be a string", param=f"messages[{i}].content",
                      code="invalid_type")


def parse_messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad_request("'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                          param="messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of system, user, assistant, tool",
                              param=f"messages[{i}].role")
        out.append(_tool_fields(m, i, {"role": ROLES[role], "content": _content(m, i)}))
    return out


def _tool_fields(m: dict, i: int, out: dict) -> dict:
    """`out` with the tools protocol's fields of message `m`: an assistant's `tool_calls`
    (then its content may be null), a tool result's `tool_call_id` and `name`."""
    calls = m.get("tool_calls")
    if calls is not None and out["role"] == "assistant":
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  and isinstance(c["function"].get("name"), str) for c in calls):
            raise bad_request(f"messages[{i}].tool_calls must be a list of "
                              '{"id", "type": "function", "function": {"name", "arguments"}}',
                              param=f"messages[{i}].tool_calls")
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if out["role"] == "tool" and isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def model_field(body) -> str | None:
    """The request's `model` (None: absent, the default model); 400 unless a string."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model", code="invalid_type")
    return model or None


async def engine_for(st: ServerState, model: str | None):
    """The Engine of the model a request names, loaded on first use; 404 naming the
    available models for an unknown one, 503 when it does not fit --models-memory."""
    try:
        return await st.engine_for(model)
    except Exception as e:
        err = errors.from_engine(e, st.log, "loading a model")
        if err.status == 404:
            names = ", ".join(st.models.names())
            err = errors.not_found(f"the model '{model[:200]}' does not exist; this server serves {names} "
                                   "(see GET /v1/models for the ones it can load)", param="model",
                                   code="model_not_found")
        raise err from None


@dataclass
class GenerationFields:
    """What a chat and a legacy completion request both say about generating: `samples`
    are run, the `n` best by total logprob are returned (all of them unless `best_of`)."""

    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int = 1
    samples: int = 1
    echo: bool = False
    plan: OutputPlan = OutputPlan()


def parse_generation_fields(body: dict, engine, protocol: str = CHAT) -> GenerationFields:
    """The generation fields of `protocol` (request_schema.py: its defaults, ranges and
    refusals), validated as 400s naming the parameter. Keys no field names are ignored,
    named in one log line."""
    try:
        f = read_fields(body, protocol)
        params = sampling_params(f, engine.ctx)
        plan = output_plan(f, engine.lm.template.source)
    except FieldError as e:
        raise bad_request(e.worded(f"'{e.key}'"), param=e.key, code=e.code) from None
    unknown = unknown_fields(body, protocol)
    if unknown:
        log.info("ignored request fields OpenAI's API does not define: %s", ", ".join(k[:40] for k in unknown[:20]))
    include_usage = bool((f["stream_options"] or {}).get("include_usage", False))
    n, samples = f["n"], f.get("best_of") or f["n"]
    if samples < n:
        raise bad_request(f"'best_of' ({samples}) must be at least 'n' ({n})", param="best_of",
                          code="invalid_value")
    if samples > n:
        if f["stream"]:
            raise bad_request("'best_of' above 'n' cannot be streamed (the best are known at the end); "
                              "send stream: false", param="best_of", code="invalid_value")
        if params.logprobs is None:  # the total logprob picks the best
            params = replace(params, logprobs=0)
    params = replace(params, grammar=plan.grammar)
    return GenerationFields(params, list(f["stop"]), f["stream"], include_usage, n, samples,
                            bool(f.get("echo")), plan)


def parse_chat_request(body, engine, model: str) -> ChatRequest:
    """The validated request for `engine`, the engine of `model`."""
    messages = parse_messages(body.get("messages"))
    f = parse_generation_fields(body, engine, CHAT)
    return ChatRequest(model, f.plan.prompt_messages(messages), f.params, f.stop, f.stream, f.include_usage, f.n,
                       f.plan)


def best_of(fins: list[FinishEvent], n: int) -> list[FinishEvent]:
    """The `n` samples with the highest total logprob (OpenAI's best_of), in sample order
    among equals."""
    total = [sum(lp.logprob for lp in f.logprobs or ()) for f in fins]
    best = sorted(range(len(fins)), key=lambda i: (-total[i], i))[:n]
    return [fins[i] for i in best]


# -- responses --------------------------------------------------------------------------------
def usage_of(fin: FinishEvent, others: list[FinishEvent] = ()) -> dict:
    """OpenAI's usage of `fin` and the `others` samples of its prompt (one prompt counted,
    every sample's tokens)."""
    u = fin.usage
    p, c = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    c += sum(o.usage.get("completion_tokens", 0) for o in others)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": u.get("reused_tokens", 0)}}


def timings_of(fin: FinishEvent) -> dict:
    """llama.cpp server's `timings` object, plus panechat's queue/ttft/total times."""
    u, t = fin.usage, fin.timings
    cache_n = u.get("reused_tokens", 0)
    prompt_n = max(0, u.get("prompt_tokens", 0) - cache_n)
    prompt_ms = t.get("prompt_ms") or 0.0
    n = u.get("completion_tokens", 0)
    ttft = t.get("ttft_ms")
    predicted_ms = max(0.0, t.get("total_ms", 0.0) - ttft) if ttft is not None else 0.0
    tok_s = t.get("decode_tok_s") or 0.0
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": 1000.0 / tok_s if tok_s else 0.0,
        "predicted_per_second": tok_s,
        "queue_ms": t.get("queue_ms"),
        "ttft_ms": ttft,
        "total_ms": t.get("total_ms"),
    }


def _finish_reason(fin: FinishEvent, calls: bool = False) -> str:
    if calls and fin.reason == "stop":
        return "tool_calls"
    return fin.reason if fin.reason in ("stop", "length") else "stop"


def _log_line(fin: FinishEvent, stream: bool) -> str:
    u, t = fin.usage, fin.timings
    ttft = t.get("ttft_ms")
    rate = t.get("decode_tok_s")
    return (f"{'stream ' if stream else ''}prompt={u.get('prompt_tokens')} reused={u.get('reused_tokens')} "
            f"out={u.get('completion_tokens')} ttft={ttft / 1000 if ttft is not None else 0:.2f}s "
            f"{rate or 0:.1f}tok/s {fin.reason}")


def shutdown_error(fin: FinishEvent) -> APIError:
    """The server shut down before the reply was complete (docs/protocol.md, "Shutdown")."""
    n = fin.usage.get("completion_tokens", 0)
    return APIError(503, f"the server shut down before the reply was complete ({n} tokens generated); "
                    "send the request again", type="server_error", code="shutting_down",
                    headers={"Retry-After": "1"})


async def _watch_disconnect(request: Request, gen) -> None:
    """Cancel `gen` when the client goes away (the body is already read, so the next
    ASGI message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            gen.cancel()
            return


async def read_json(request: Request, st: ServerState):
    """The checked request's JSON body (401, 503 while loading, 413, 400 as for every route)."""
    st.check_bearer(request)
    st.require_engine()
    body = await read_body(request, st.max_body)
    try:
        return parse_json(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def submitted(st: ServerState, submit):
    """The Generation `submit()` queues; engine refusals as their HTTP errors, anything else
    (a bug) as a 500 logged once."""
    try:
        return await submit()
    except Exception as e:
        raise errors.from_engine(e, st.log, "submitting a generation") from None


async def submit_chat(st: ServerState, req: ChatRequest, engine, client: str) -> list:
    """Queue the validated chat request's `n` samples on `engine` for `client`
    (attribution.client_of; its messages through the chat template): a Generation each."""
    return await st.submit_n(req.n, req.messages, req.params, req.stop, engine=engine, client=client,
                             tools=req.plan.template_tools)


def chat_choice(req: ChatRequest, engine, fin: FinishEvent, i: int) -> dict:
    """Choice i of a whole chat reply: the assistant message `fin` ends (its tool calls
    parsed out by the request's output plan), with its logprobs when asked for."""
    content, calls = req.plan.reply(fin.text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [tool_call_obj(c) for c in calls]
    return {"index": i, "message": message, "logprobs": chat_logprobs(engine.lm.tokenizer, fin.logprobs),
            "finish_reason": _finish_reason(fin, bool(calls))}


async def chat_completions(request: Request) -> Response:
    return await generation_route(request, parse_chat_request, submit_chat, chat_stream, "chatcmpl",
                                  "chat.completion", chat_choice)


def tool_call_obj(c) -> dict:
    """OpenAI's shape of one tool call."""
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def chat_stream(request: Request, gens: list, req: ChatRequest, cid: str, created: int, engine) -> Response:
    """The chat SSE stream; with tools offered, the one that sends tool-call deltas."""
    cls = ToolCallSSE if req.plan.tool_format is not None else SSEResponse
    return cls(request, gens, req, cid, created, engine)


async def generation_route(request: Request, parse, submit, sse_class, id_prefix: str, object_name: str,
                           choice) -> Response:
    """What every generation route does: read the body, resolve the engine of the model it
    names (loaded on first use), validate it with `parse(body, engine, model)`, submit
    with `submit(state, req, engine, client)` (the client: attribution.client_of; a Generation
    per sample), then stream `sse_class` events or return the whole reply, whose choice i is
    `choice(req, engine, finish_event, i)`."""
    st = state_of(request)
    data = await read_json(request, st)
    model = model_field(data)
    engine = await engine_for(st, model)
    req = parse(data, engine, model or st.model_id())
    gens = await submitted(st, lambda: submit(st, req, engine, client_of(request)))
    gens = gens if isinstance(gens, list) else [gens]  # one Generation, or one per sample
    cid = f"{id_prefix}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if req.stream:
        return sse_class(request, gens, req, cid, created, engine)
    fins = await whole_replies(request, st, gens)
    n = getattr(req, "n", 1)
    kept = best_of(fins, n) if len(fins) > n else fins
    usage = usage_of(fins[0], fins[1:])
    if getattr(req, "prompt_only", False):  # echo with max_tokens 0: the one token computed is not shown
        usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
    return JSONResponse({
        "id": cid, "object": object_name, "created": created, "model": req.model,
        "system_fingerprint": "panechat",
        "choices": [choice(req, engine, fin, i) for i, fin in enumerate(kept)],
        "usage": usage,
        "timings": timings_of(fins[0]),
    })


async def whole_replies(request: Request, st: ServerState, gens: list) -> list[FinishEvent]:
    """Wait for every one of `gens` to finish (all cancelled if the client leaves); their
    FinishEvents, or the APIError the first bad end means (500 error, 503 shutdown or
    cancelled)."""
    watcher = asyncio.create_task(_watch_disconnect(request, _Together(gens)))
    try:
        for gen in gens:
            async for _ev in gen.aevents():
                pass
    finally:
        watcher.cancel()
        for gen in gens:
            if gen.finish is None:
                gen.cancel()
            st.done(gen)
    fins = [gen.finish for gen in gens]
    set_log_detail(request, _log_line(fins[0], False))
    for fin in fins:
        if fin.reason == "error":
            raise APIError(500, fin.error or "generation failed", type="server_error", code="generation_error")
        if fin.reason == "shutdown":  # a 503 the client retries, not a cut reply passed off as whole
            raise shutdown_error(fin)
        if fin.reason == "cancelled":  # the client left
            raise APIError(503, "the generation was cancelled", type="server_error", code="cancelled")
    return fins


async def whole_reply(request: Request, st: ServerState, gen) -> FinishEvent:
    """`whole_replies` of one generation."""
    return (await whole_replies(request, st, [gen]))[0]


class _Together:
    """The samples of one request, cancelled together (what `_watch_disconnect` calls)."""

    def __init__(self, gens: list):
        self.gens = gens

    def cancel(self) -> None:
        for g in self.gens:
            g.cancel()


async def merged_events(gens: list):
    """(sample index, event) of every one of `gens` as they come, until each has finished."""
    if len(gens) == 1:
        async for ev in gens[0].aevents():
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for ev in gen.aevents():
                await q.put((i, ev))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, ev = await q.get()
            if ev is None:
                left -= 1
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()


class SSEResponse(Response):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; with n > 1
    the choices' chunks interleave, each naming its `index`.

    A watcher task cancels the generations the moment the client disconnects (also while
    they still wait in the queue), so their KV blocks are freed at once."""

    media_type = "text/event-stream"
    object_name = "chat.completion.chunk"

    def __init__(self, request: Request, gens: list, req, cid: str, created: int, engine=None):
        self.request, self.gens, self.req, self.cid, self.created = request, gens, req, cid, created
        self.engine = engine
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _logprobs(self, lps: list | None):
        """A chunk's `logprobs` for the tokens `lps` it carries (None when not asked for)."""
        if self.req.params.logprobs is None:
            return None
        return {"content": chat_content(self.engine.lm.tokenizer, lps or []), "refusal": None}

    def _choice(self, text: str | None, finish: str | None, index: int = 0, lps: list | None = None) -> dict:
        """The choice of a chunk adding `text` (None: the opening one, naming the role)."""
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": self._logprobs(lps) if text is not None else None,
                "finish_reason": finish}

    def pieces(self, text: str, index: int, lps: list | None) -> list[bytes]:
        """The chunks that send `text`, new reply text of choice `index` (with the logprobs
        `lps` of its tokens), now."""
        return [self._chunk(text, index=index, lps=lps)]

    def closing(self, fin: FinishEvent, index: int) -> tuple[list[bytes], bool]:
        """Chunks sent at the end of choice `index`, before its finishing chunk, and whether
        they are tool calls (none here)."""
        return [], False

    def _chunk(self, text: str | None, finish: str | None = None, index: int = 0, lps: list | None = None,
               **extra) -> bytes:
        obj = {"id": self.cid, "object": self.object_name, "created": self.created,
               "model": self.req.model, "system_fingerprint": "panechat",
               "choices": [self._choice(text, finish, index, lps)], **extra}
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    async def __call__(self, scope, receive, send) -> None:
        gens, req = self.gens, self.req
        watcher = asyncio.create_task(_watch_disconnect(self.request, _Together(gens)))
        alive = True

        async def emit(data: bytes, more: bool = True) -> None:
            nonlocal alive
            if not alive:
                return
            try:
                await send({"type": "http.response.body", "body": data, "more_body": more})
            except OSError:  # the client is gone: stop generating
                alive = False
                for g in gens:
                    g.cancel()

        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for i in range(len(gens)):
                opening = self._chunk(None, index=i)
                if opening:
                    await emit(opening)
            pending: list[list] = [[] for _ in gens]  # logprobs of tokens whose text is not out yet
            fins: list[FinishEvent] = []
            async for i, ev in merged_events(gens):
                if isinstance(ev, TokenEvent):
                    if ev.logprob is not None:
                        pending[i].append(ev.logprob)
                    if ev.text:
                        for data in self.pieces(ev.text, i, pending[i]):
                            await emit(data)
                        pending[i] = []
                elif isinstance(ev, FinishEvent):
                    fins.append(ev)
                    if ev.reason in ("error", "shutdown", "cancelled"):
                        continue
                    closing, calls = self.closing(ev, i)
                    for data in closing:
                        await emit(data)
                    last = len(fins) == len(gens)  # the last one also carries the usage and timings
                    extra = {"usage": usage_of(fins[0], fins[1:]), "timings": timings_of(fins[0])} if last else {}
                    await emit(self._chunk("", _finish_reason(ev, calls), index=i, lps=pending[i], **extra))
            set_log_detail(self.request, _log_line(fins[0], True))
            bad = next((f for f in fins if f.reason in ("error", "shutdown")), None)
            if bad is not None:
                err = (shutdown_error(bad).body() if bad.reason == "shutdown" else
                       errors.error_body(bad.error or "generation failed", "server_error", None, "generation_error"))
                await emit(b"data: " + json.dumps(err).encode() + b"\n\n")
            elif all(f.reason != "cancelled" for f in fins) and req.include_usage:
                obj = {"id": self.cid, "object": self.object_name, "created": self.created,
                       "model": req.model, "system_fingerprint": "panechat", "choices": [],
                       "usage": usage_of(fins[0], fins[1:])}
                await emit(b"data: " + json.dumps(obj).encode() + b"\n\n")
            await emit(b"data: [DONE]\n\n")
            await emit(b"", more=False)
        finally:
            watcher.cancel()
            for g in gens:
                if g.finish is None:
                    g.cancel()
                state_of(self.request).done(g)


# -- body -----------------------------------------------------------------------------------
async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 when it exceeds `limit` bytes (the rest is drained, up to
    64x the limit, so the client reads the error instead of a reset connection)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > 64 * limit:
                raise errors.too_large(limit)
        except ValueError:
            raise bad_request("bad Content-Length header") from None
    buf = bytearray()
    over = 0
    async for chunk in request.stream():
        if over or len(buf) + len(chunk) > limit:
            over += len(chunk)
            if over > 64 * limit:
                break
            continue
        buf += chunk
    if over:
        raise errors.too_large(limit)
    return bytes(buf)


# -- models ---------------------------------------------------------------------------------
# GET /v1/models lists the loaded models first ("loaded": true, the default first), then the
# models `panechat models` finds that this server can load on first use ("loaded": false).
def _loaded_model_obj(st: ServerState, name: str, e) -> dict:
    return {"id": name, "object": "model", "created": int(st.started), "owned_by": "panechat",
            "chat_template": e.lm.template.kind,  # "chatml-fallback": a base model, chatting in ChatML
            "meta": {"loaded": True, "default": name == st.models.default, "file": str(e.lm.name),
                     "ctx": e.ctx, "max_concurrent": e.cfg.max_concurrent, "batching": e.batching,
                     "backend": e.lm.model.backend.describe()}}


def _catalog_model_obj(st: ServerState, entry) -> dict:
    return {"id": entry.name, "object": "model", "created": int(st.started), "owned_by": "panechat",
            "meta": {"loaded": False, "default": False, "source": entry.source,
                     "architecture": entry.architecture, "quant": entry.quant, "size": entry.size,
                     "context_length": entry.context_length}}


async def list_models(request: Request) -> Response:
    st = state_of(request)
    st.check_bearer(request)
    st.require_engine()
    loaded = st.models.engines()
    data = [_loaded_model_obj(st, name, e) for name, e in loaded.items()]
    if st.models.lazy:  # this server loads a listed model on its first request
        data += [_catalog_model_obj(st, m) for m in await st.catalog()
                 if m.loadable and st.models.find(m.name) is None]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    st = state_of(request)
    st.check_bearer(request)
    st.require_engine()
    name = request.path_params["model"]
    engine = st.models.find(None if name == DEFAULT_ALIAS else name)
    if engine is not None:
        key = st.models.resolve_name(None if name == DEFAULT_ALIAS else name)
        return JSONResponse(_loaded_model_obj(st, key, engine))
    catalog = await st.catalog() if st.models.lazy else []
    entry = next((m for m in catalog if m.name == name and m.loadable), None)
    if entry is None:
        raise errors.not_found(f"the model '{name[:200]}' does not exist", param="model", code="model_not_found")
    return JSONResponse(_catalog_model_obj(st, entry))


class ToolCallSSE(SSEResponse):
    """The chat stream of a request offered tools, sending OpenAI's tool-call deltas and
    finishing "tool_calls". The generic format's call streams as it comes: one chunk with
    its index, id and name, then its arguments piece by piece; its `{"response": text}` as
    content, unescaped. Native replies are read whole
    (a native call is known once its JSON is), then sent as content or as calls (per call:
    one chunk with index, id and name, one with its arguments). With n > 1 each choice
    has its own reader."""

    def __init__(self, *args):
        super().__init__(*args)
        generic = self.req.plan.tool_format == GENERIC
        self.readers = [_ToolCallReader(generic) for _ in self.gens]

    def pieces(self, text: str, index: int, lps: list | None) -> list[bytes]:
        r = self.readers[index]
        r.text += text
        if r.call is None:
            return []
        name, args = r.call.push(text)  # the generic format's call streams its arguments
        content = r.response.push(text)  # and its text reply its text
        out = [self._delta({"content": content}, index)] if content else []
        if name is not None:
            r.call_id = ToolCall(name, "").with_id().id
            out.append(self._delta({"tool_calls": [{"index": 0, "id": r.call_id, "type": "function",
                                                    "function": {"name": name, "arguments": ""}}]}, index))
        if args:
            out.append(self._delta({"tool_calls": [{"index": 0, "function": {"arguments": args}}]}, index))
        return out

    def closing(self, fin: FinishEvent, index: int) -> tuple[list[bytes], bool]:
        r = self.readers[index]
        if r.call_id is not None:
            rest = r.call.finish()
            return ([self._delta({"tool_calls": [{"index": 0, "function": {"arguments": rest}}]}, index)]
                    if rest else []), True
        if r.response is not None and r.response.started:
            rest = r.response.finish()
            return ([self._delta({"content": rest}, index)] if rest else []), False
        content, calls = self.req.plan.reply(r.text)
        if not calls:
            return ([self._delta({"content": content}, index)] if content else []), False
        return [self._delta({"tool_calls": [d]}, index) for i, c in enumerate(calls) for d in (
            {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}},
            {"index": i, "function": {"arguments": c.arguments}})], True

    def _delta(self, delta: dict, index: int) -> bytes:
        obj = {"id": self.cid, "object": self.object_name, "created": self.created, "model": self.req.model,
               "system_fingerprint": "panechat",
               "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class _ToolCallReader:
    """One choice's reply read for tool calls as it streams."""

    __slots__ = ("text", "call", "response", "call_id")

    def __init__(self, generic: bool):
        self.text = ""
        self.call = GenericCallStream() if generic else None
        self.response = GenericResponseStream() if generic else None
        self.call_id: str | None = None  # of the call streamed as it came

"""`/ws`: the panechat websocket protocol, version 1 (docs/protocol.md).

One `Connection` per socket: a receive loop that answers frames in order, one pump task
per generation forwarding engine events as frames, and an optional stats task. Sends go
through one lock. A bad frame gets an `error` frame; the connection stays usable.

Until its `hello` passes the token check a socket is on probation (limits.py): it is
closed (4408) after `auth_grace` seconds, or sooner when `max_unauthed` newer sockets wait
for theirs, and a frame over `preauth_frame` bytes closes it (1009) unparsed. The Origin
check and the cap on such sockets run before the handshake (security.BrowserGuard). With
--tokens a socket is its token's name's (attribution.py) and is closed (4401) within about
a second once that token leaves the file.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

from starlette.websockets import WebSocket, WebSocketDisconnect

from panechat.engine.serving.events import FinishEvent, PrefillEvent, TokenEvent
from ..engine_errors import classify, retry_after
from .conversations import Conversation, HistoryTooLarge, message_bytes
from .request_fields import FieldError, is_num, parse_json
from .request_schema import WS, read_fields, sampling_params, unknown_field
from .structured_output import output_plan
from .state import SERVER_NAME, ServerState
from .tokens import POLL_S

PROTOCOL = 1
MAX_ID = 256  # characters in a conversation or request id


class FrameError(Exception):
    """Answered with an `error` frame; `extra` fields go into it (e.g. `retry_after`)."""

    def __init__(self, code: str, message: str, request: str | None = None, **extra):
        super().__init__(message)
        self.code, self.message, self.request, self.extra = code, message, request, extra


def _id(frame: dict, key: str, required: bool, request: str | None = None) -> str | None:
    v = frame.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_ID:
        raise FrameError("bad_frame", f"'{key}' must be a non-empty string of at most {MAX_ID} characters",
                         request)
    return v


def _opt_str(frame: dict, key: str, request: str | None = None) -> str | None:
    v = frame.get(key)
    if v is not None and not isinstance(v, str):
        raise FrameError("bad_frame", f"'{key}' must be a string", request)
    return v


def _seed_messages(frame: dict) -> list[dict] | None:
    """The optional `messages` of an `open` frame: earlier user/assistant turns that a client
    kept (the system prompt travels in `system`)."""
    v = frame.get("messages")
    if v is None:
        return None
    if not isinstance(v, list):
        raise FrameError("bad_frame", "'messages' must be a list of {role, content} objects")
    for i, m in enumerate(v):
        if (not isinstance(m, dict) or m.get("role") not in ("user", "assistant")
                or not isinstance(m.get("content"), str)):
            raise FrameError("bad_frame", f"messages[{i}] must be an object with role \"user\" or "
                             "\"assistant\" and string content (send the system prompt as 'system')")
    return [{"role": m["role"], "content": m["content"]} for m in v]


def _base_turns(frame: dict, conv, rid: str) -> list[dict] | None:
    """The turns a `send` continues when it rewrites them: the first `keep` of the
    conversation's, or its `messages`; None when it leaves them as they are."""
    keep, rewrite = frame.get("keep"), frame.get("messages")
    if keep is not None and rewrite is not None:
        raise FrameError("bad_frame", "give 'keep' or 'messages', not both", rid)
    if rewrite is not None:
        try:
            return _seed_messages(frame)
        except FrameError as e:
            raise FrameError(e.code, e.message, rid) from None
    if keep is None:
        return None
    turns = conv.turns()
    if not isinstance(keep, int) or isinstance(keep, bool) or not 0 <= keep <= len(turns):
        raise FrameError("bad_frame", f"'keep' must be a whole number from 0 to {len(turns)} (the "
                         "conversation's turns)", rid)
    return turns[:keep]


def _bytes(turns: list[dict]) -> int:
    return sum(message_bytes(m["role"], m["content"]) for m in turns)


def parse_params(p, ctx: int, request: str | None):
    """SamplingParams and stop strings from a `send` frame's `params`: the websocket column
    of the request schema (request_schema.py: greedy, 256 tokens)."""
    if p is None:
        p = {}
    if not isinstance(p, dict):
        raise FrameError("bad_params", "'params' must be an object", request)
    unknown = unknown_field(p, WS)
    if unknown is not None:
        raise FrameError("bad_params", f"params.{unknown} is not a field of this protocol "
                         "(docs/protocol.md, 'Request fields')", request)
    try:
        f = read_fields(p, WS)
        grammar = output_plan(f, "").grammar  # response_format or grammar: the websocket has no tools
    except FieldError as e:
        raise FrameError("bad_params", e.worded(f"params.{e.key}"), request) from None
    return replace(sampling_params(f, ctx), grammar=grammar), list(f["stop"])


class Connection:
    """One websocket client ("terminal")."""

    def __init__(self, st: ServerState, ws: WebSocket):
        self.st, self.ws = st, ws
        self.terminal: str | None = None
        self.user = ""  # its --tokens name ("" without named tokens)
        self._presented: str | None = None  # the token its hello gave, checked again while it is open
        self.authed = False  # welcomed
        self.token_ok = False  # past the token check (the welcome may still wait for the model)
        self.guard = ws.app.state.guard
        self.closed = False
        self.lock = asyncio.Lock()
        self.gens: dict[str, object] = {}  # request id -> Generation in flight
        self.opened: set[Conversation] = set()  # conversations this socket has opened (kept from eviction first)
        self.models: dict[str, str | None] = {}  # conversation id -> the model its `open` named (None: default)
        self.pumps: set[asyncio.Task] = set()
        self.stats_task: asyncio.Task | None = None
        self.token_watch: asyncio.Task | None = None
        self.closing_task: asyncio.Task | None = None  # give_way's close, kept from garbage collection
        client = ws.client
        self.peer = f"{client.host}:{client.port}" if client else "-"

    @property
    def client(self) -> str:
        """Who its generations are attributed to: its --tokens name, else its terminal."""
        return self.user or self.terminal or self.peer

    async def send(self, obj: dict) -> None:
        if self.closed:
            return
        data = json.dumps(obj, ensure_ascii=False)
        async with self.lock:
            try:
                await self.ws.send_text(data)
            except Exception:  # noqa: BLE001 - any failure means the peer is gone
                self.closed = True

    async def error(self, code: str, message: str, request: str | None = None, **extra) -> None:
        frame = {"type": "error", "code": code, "message": message}
        if request is not None:
            frame["request"] = request
        await self.send({**frame, **extra})

    # -- main loop --------------------------------------------------------------------------
    async def run(self) -> None:
        probation = asyncio.create_task(self.close_unless_hello())
        ticket = self.ws.scope.get("panechat.preauth")
        if ticket is not None and ticket.open:
            ticket.give_way = self.give_way
        self.st.sockets.add(self)
        try:
            while not self.closed:
                try:
                    msg = await self.ws.receive()
                except (WebSocketDisconnect, RuntimeError):
                    break
                if msg["type"] == "websocket.disconnect":
                    break
                await self.on_message(msg)
        finally:
            probation.cancel()
            if self.token_watch is not None:
                self.token_watch.cancel()
            await self.shutdown()

    async def close_unless_hello(self) -> None:
        grace = self.guard.limits.auth_grace
        await asyncio.sleep(grace)
        if not self.token_ok:
            self.guard.log.count("ws_auth_grace")
            await self.error("hello_timeout", f"no valid hello within {grace:g} s")
            await self.close(4408)

    def give_way(self) -> None:
        """Close (4408) before a hello, because newer sockets awaiting theirs need the room."""
        self.closing_task = asyncio.get_running_loop().create_task(self.close_for_room())

    async def close_for_room(self) -> None:
        await self.error("hello_timeout", f"closed before a hello: {self.guard.limits.max_unauthed} newer "
                         "sockets were waiting for theirs; connect again and send hello at once")
        await self.close(4408)

    async def close(self, code: int) -> None:
        if self.closed:
            return
        self.closed = True
        async with self.lock:
            try:
                await self.ws.close(code=code)
            except Exception:  # noqa: BLE001 - already gone
                pass

    async def close_when_token_removed(self) -> None:
        """--tokens: close this socket (4401) once its token is no longer in the file."""
        tokens = self.st.tokens
        while not self.closed:
            await asyncio.sleep(POLL_S)
            if not tokens.still_valid(self.user, self._presented):
                self.st.log.info("ws %s %s: the token of %s was removed from --tokens; closing",
                                 self.peer, self.terminal, self.user)
                await self.error("unauthorized", f"the token of {self.user!r} is no longer accepted "
                                 "(removed from panechat serve --tokens)")
                await self.close(4401)
                return

    def passed_token_check(self) -> None:
        """Off probation: counted as authenticated, full-size frames allowed."""
        self.token_ok = True
        scope = self.ws.scope
        if "panechat.preauth" in scope:
            scope["panechat.preauth"].done()
        if "panechat.lift_frame_limit" in scope:
            scope["panechat.lift_frame_limit"]()

    async def on_message(self, msg: dict) -> None:
        text = msg.get("text")
        size = len(text) if text is not None else len(msg.get("bytes") or b"")
        if not self.token_ok and size > self.guard.limits.preauth_frame:  # a fallback: the websocket
            self.guard.log.count("ws_preauth_frame")  # layer (limits.py) stops these first
            await self.close(1009)
            return
        if text is None:
            if msg.get("bytes") is not None:
                await self.error("bad_frame", "binary frames are not supported; send JSON text frames")
            return
        limit = self.st.max_body
        if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
            await self.error("too_large", f"frame is larger than {limit} bytes")
            return
        try:
            frame = parse_json(text)
        except ValueError as e:
            await self.error("bad_frame", f"not valid JSON: {e}")
            return
        if not isinstance(frame, dict):
            await self.error("bad_frame", "a frame must be a JSON object with a \"type\"")
            return
        kind = frame.get("type")
        rid = frame.get("request") if isinstance(frame.get("request"), str) else None
        if not isinstance(kind, str):
            await self.error("bad_frame", "missing or non-string \"type\"", rid)
            return
        handler = HANDLERS.get(kind)
        if handler is None:
            await self.error("unknown_type", f"unknown frame type {kind[:64]!r}", rid)
            return
        if not self.authed and kind != "hello":
            await self.error("hello_required", "send {\"type\": \"hello\", \"protocol\": 1} first", rid)
            return
        try:
            await handler(self, frame)
        except FrameError as e:
            await self.error(e.code, e.message, e.request, **e.extra)
        except Exception as e:  # a bug must not take the connection down
            self.st.log.exception("ws %s: internal error on a %r frame", self.peer, kind)
            await self.error("internal", f"internal server error: {type(e).__name__}", rid)

    async def going_away(self) -> None:
        """The server is shutting down and this socket's generations have ended: close it
        (1001, going away)."""
        await self.close(1001)

    async def shutdown(self) -> None:
        self.st.sockets.discard(self)
        self.closed = True
        for conv in list(self.opened):  # the hold passes to the oldest other viewer
            await self.hide(conv)
        if self.stats_task is not None:
            self.stats_task.cancel()
        for gen in list(self.gens.values()):
            gen.cancel()
        if self.pumps:  # let them record the partial replies
            _, pending = await asyncio.wait(self.pumps, timeout=10)
            for t in pending:
                t.cancel()
        if self.authed:
            self.st.terminals -= 1
            self.st.log.info("ws %s %s disconnected", self.peer, self.terminal)

    # -- frames -----------------------------------------------------------------------------
    async def on_hello(self, frame: dict) -> None:
        proto = frame.get("protocol", PROTOCOL)
        try:
            if isinstance(proto, bool):
                raise ValueError
            major = int(proto) if is_num(proto) else int(str(proto).split(".")[0])
        except (ValueError, OverflowError):
            raise FrameError("bad_frame", "'protocol' must be a version number such as 1") from None
        if major > PROTOCOL:
            raise FrameError("protocol", f"this server speaks protocol {PROTOCOL}; client asked for {proto}")
        user = self.st.authenticate(frame.get("token"))
        if user is None:
            given = "your token in panechat serve --tokens FILE" if self.st.tokens else \
                "the one given to panechat serve --token"
            await self.error("unauthorized", f"missing or wrong token ({given})")
            await self.close(4401)
            return
        if self.st.tokens is not None and self.token_watch is None:
            self.user, self._presented = user, frame.get("token")
            self.token_watch = asyncio.create_task(self.close_when_token_removed())
        self.passed_token_check()
        if self.st.draining:
            await self.error("shutting_down", "the server is shutting down; connect again shortly")
            await self.close(1001)
            return
        engine = await self.st.wait_engine()
        if engine is None:
            raise FrameError("unavailable", f"the model failed to load: {self.st.load_error}")
        if not self.authed:
            self.authed = True
            self.terminal = f"t-{next(self.st.terminal_ids)}"
            self.st.terminals += 1
            self.st.log.info("ws %s %s connected (%s%s)", self.peer, self.terminal,
                             str(frame.get("client", "?"))[:64], f", user {self.user}" if self.user else "")
        await self.send({
            "type": "welcome", "protocol": PROTOCOL, "server": SERVER_NAME,
            "model": self.st.models.default or engine.lm.name,  # the name /v1/models and `open` use
            "backend": engine.lm.model.backend.describe(), "ctx": engine.ctx,
            "max_concurrent": engine.cfg.max_concurrent, "batching": engine.batching,
            "chat_template": engine.lm.template.kind, "terminal": self.terminal, "models": self.st.models.names(),
            "base_models": [n for n, e in self.st.models.engines().items() if e.lm.template.is_fallback],
        })

    async def engine_for(self, model: str | None, rid: str | None = None):
        """The Engine of `model` (loaded on first use), or FrameError `unknown_model` (naming
        the models served), `models_memory` or `model_not_loadable`."""
        if model is not None and not isinstance(model, str):
            raise FrameError("bad_frame", "'model' must be a string", rid)
        try:
            return await self.st.engine_for(model)
        except Exception as e:
            refusal = classify(e)
            if refusal is None:
                raise
            raise FrameError(refusal.ws_code, str(e), rid) from None

    async def on_open(self, frame: dict) -> None:
        cid = _id(frame, "conversation", required=False)
        model = frame.get("model") or None
        await self.engine_for(model)  # an unknown model is refused before the conversation exists
        system = _opt_str(frame, "system")
        seed = _seed_messages(frame)
        take = frame.get("take", False)
        if not isinstance(take, bool):
            raise FrameError("bad_frame", "'take' must be true or false")
        store = self.st.conversations
        conv, created = store.open(cid)
        if not (seed and conv.busy is None and not conv.has_turns):
            seed = None
        try:
            store.check_fits(conv, conv.system_delta(system)
                             + sum(message_bytes(m["role"], m["content"]) for m in seed or ()))
        except HistoryTooLarge as e:
            if created:
                store.discard(conv)
            raise FrameError("history_too_large", str(e)) from None
        if seed:
            conv.seed(seed)  # the server lost it (a restart, or dropped it for memory) and the client kept a copy
        if system is not None:
            conv.set_system(system)
        self.opened.add(conv)
        previous = conv.holder
        changed = conv.show_to(self, take=take)
        self.models[conv.id] = model
        opened = {"type": "opened", "conversation": conv.id, "created": created,
                  "messages": conv.snapshot(), "unanswered": conv.unanswered,
                  "model": model or self.st.models.default, "holder": conv.holder.terminal}
        if conv.busy is not None:  # the reply in flight so far: where a follower starts
            opened["replying"] = "".join(conv.replying)
        await self.send(opened)
        if changed and previous is not None:
            await self.tell_holder(conv)

    async def on_close(self, frame: dict) -> None:
        """This terminal no longer shows the conversation: it stops following it, and its
        hold passes on."""
        cid = _id(frame, "conversation", required=True)
        conv = next((c for c in self.opened if c.id == cid), None)
        if conv is not None:
            await self.hide(conv)

    async def hide(self, conv: Conversation) -> None:
        self.opened.discard(conv)
        if conv.hide_from(self):
            await self.tell_holder(conv)

    async def tell_holder(self, conv: Conversation) -> None:
        """Every socket showing `conv` learns who holds it now."""
        frame = {"type": "holder", "conversation": conv.id,
                 "holder": conv.holder.terminal if conv.holder is not None else None}
        for sock in list(conv.viewers):
            await sock.send(frame)

    async def tell_followers(self, conv: Conversation, frame: dict) -> None:
        """A `follow` frame to every other socket showing `conv` (they follow its replies)."""
        for sock in conv.viewers:
            if sock is not self:
                await sock.send({"type": "follow", "conversation": conv.id, **frame})

    async def on_list(self, frame: dict) -> None:
        await self.send({"type": "conversations", "conversations": self.st.conversations.list()})

    async def on_send(self, frame: dict) -> None:
        rid = _id(frame, "request", required=True)
        cid = _id(frame, "conversation", required=True, request=rid)
        content = frame.get("content")
        if content is not None and not isinstance(content, str):
            raise FrameError("bad_frame", "'content' must be a string", rid)
        system = _opt_str(frame, "system", rid)
        complete = frame.get("complete", False)
        if not isinstance(complete, bool):
            raise FrameError("bad_frame", "'complete' must be true or false", rid)
        engine = await self.engine_for(frame.get("model") or self.models.get(cid), rid)
        params, stop = parse_params(frame.get("params"), engine.ctx, rid)
        if rid in self.gens:
            raise FrameError("duplicate_request", f"request {rid!r} is already running on this connection", rid)
        store = self.st.conversations
        conv = store.get(cid)
        base = _base_turns(frame, conv, rid) if conv is not None and conv.busy is None else None
        unanswered = conv is not None and (conv.unanswered if base is None else bool(base)
                                           and base[-1]["role"] == "user")
        if content is None and (conv is None or conv.busy is None and not unanswered):
            raise FrameError("bad_frame", "'content' must be a string (leave it out only to answer the "
                             "conversation's unanswered turn)", rid)
        if conv is None:
            raise FrameError("unknown_conversation", f"no conversation {cid!r}; send open first "
                             "(with the turns you kept: the server may have dropped it for memory)", rid)
        if conv.holder is not None and conv.holder is not self:
            raise FrameError("conversation_held", f"conversation {cid!r} is held by terminal "
                             f"{conv.holder.terminal}; open it with \"take\": true to take it over", rid)
        if conv.busy is not None:
            raise FrameError("conversation_busy", f"conversation {cid!r} is already generating "
                             f"(request {conv.busy!r}); wait for it or cancel it", rid)
        try:
            store.check_fits(conv, (message_bytes("user", content) if content is not None else 0)
                             + conv.system_delta(system)
                             + (0 if base is None else _bytes(base) - _bytes(conv.turns())))
        except HistoryTooLarge as e:
            raise FrameError("history_too_large", str(e), rid) from None
        # the new turn takes the unanswered one's place, unless the send says the turns before it
        replaces = content is not None and base is None and unanswered
        messages = conv.snapshot()
        if base is not None:  # applied to the conversation only once the send is accepted
            messages = [m for m in messages if m["role"] == "system"] + [dict(m) for m in base]
        if replaces:
            messages.pop()
        if system is not None:  # applied to the conversation only once the send is accepted
            if messages and messages[0]["role"] == "system":
                messages.pop(0)
            if system:
                messages.insert(0, {"role": "system", "content": system})
        if content is not None:
            messages.append({"role": "user", "content": content})
        conv.busy = rid  # reserved while the prompt is tokenized off the loop
        try:
            gen, fit = await self.st.submit_conversation(messages, params, stop, conversation=cid, engine=engine,
                                                         client=self.client, complete_text=complete)
        except Exception as e:
            conv.busy = None
            refusal = classify(e)  # app/engine_errors.py
            if refusal is None:
                raise
            wait = retry_after(e, refusal)
            raise FrameError(refusal.ws_code, str(e), rid, **({"retry_after": wait} if wait else {})) from None
        self.gens[rid] = gen
        # the pump owns gen from here (it calls done); it sends only after `queued`: the send
        # lock is taken in call order
        task = asyncio.create_task(self.pump(rid, conv, gen))
        self.pumps.add(task)
        task.add_done_callback(self.pumps.discard)
        if system is not None:
            conv.set_system(system)
        if base is not None:
            conv.set_turns(base)
        if replaces:
            conv.drop_last_user_turn()
        if content is not None:
            conv.append("user", content)
        await self.send({"type": "queued", "request": rid, "conversation": cid, "prompt_tokens": len(fit.ids),
                         "dropped": fit.dropped})
        if conv.sockets > 1:
            await self.tell_followers(conv, {"event": "user", "content": content,
                                             "replaces": replaces or content is None})

    async def pump(self, rid: str, conv: Conversation, gen) -> None:
        conv.replying = []
        try:
            async for ev in gen.aevents():
                if isinstance(ev, TokenEvent):
                    conv.replying.append(ev.text)
                    await self.send({"type": "delta", "request": rid, "text": ev.text, "token_id": ev.token_id})
                    if conv.sockets > 1:  # other terminals follow it read-only
                        await self.tell_followers(conv, {"event": "delta", "text": ev.text})
                elif isinstance(ev, PrefillEvent):
                    await self.send({"type": "prefill", "request": rid, "done": ev.done, "total": ev.total})
            fin: FinishEvent = gen.finish
            if fin.text:  # a reply its terminal left (or the server's stop) ended is kept, marked
                conv.append("assistant", fin.text, cut_off=fin.reason == "shutdown" or (
                    self.closed and fin.reason == "cancelled"))
            frame = {"type": "finished", "request": rid, "conversation": conv.id, "reason": fin.reason,
                     "text": fin.text, "usage": fin.usage, "timings": fin.timings}
            if fin.error:
                frame["error"] = fin.error
            await self.send(frame)
            if conv.sockets > 1:
                await self.tell_followers(conv, {"event": "finished", "reason": fin.reason, "text": fin.text})
            u, t = fin.usage, fin.timings
            self.st.log.info("ws %s %s %s %s prompt=%s reused=%s out=%s ttft=%.2fs %.1ftok/s %s",
                             self.peer, self.terminal, conv.id, rid, u.get("prompt_tokens"),
                             u.get("reused_tokens"), u.get("completion_tokens"),
                             (t.get("ttft_ms") or 0) / 1000, t.get("decode_tok_s") or 0, fin.reason)
        finally:
            if gen.finish is None:
                gen.cancel()
            self.gens.pop(rid, None)
            if conv.busy == rid:
                conv.busy = None
                conv.replying = []
            self.st.done(gen)

    async def on_cancel(self, frame: dict) -> None:
        rid = _id(frame, "request", required=True)
        gen = self.gens.get(rid)
        if gen is not None:
            gen.cancel()

    async def on_subscribe(self, frame: dict) -> None:
        iv = frame.get("interval_ms", 250)
        if not is_num(iv):
            raise FrameError("bad_frame", "'interval_ms' must be a number (100..5000)")
        iv = min(5000.0, max(100.0, float(iv)))
        if self.stats_task is not None:
            self.stats_task.cancel()
        self.stats_task = asyncio.create_task(self.push_stats(iv / 1000.0))

    async def on_unsubscribe(self, frame: dict) -> None:
        if self.stats_task is not None:
            self.stats_task.cancel()
            self.stats_task = None

    async def push_stats(self, interval: float) -> None:
        engine = self.st.engine
        model, backend = self.st.models.default or engine.lm.name, engine.lm.model.backend.describe()
        nxt = time.monotonic()
        while not self.closed:
            stats = self.st.shown_stats(engine.stats()).with_terminals(self.st.terminals + self.st.hosted)
            frame = {"type": "stats", **stats.to_dict(), "model": model, "backend": backend}
            engines = self.st.models.engines()
            if len(engines) > 1:  # one snapshot per model (the top level is the default one's)
                frame["models"] = {name: self.st.shown_stats(e.stats()).to_dict() for name, e in engines.items()}
            await self.send(frame)
            nxt += interval
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))


HANDLERS = {
    "hello": Connection.on_hello,
    "open": Connection.on_open,
    "list": Connection.on_list,
    "send": Connection.on_send,
    "cancel": Connection.on_cancel,
    "close": Connection.on_close,
    "subscribe": Connection.on_subscribe,
    "unsubscribe": Connection.on_unsubscribe,
}


async def websocket_endpoint(ws: WebSocket) -> None:
    await ws.accept()  # Origin and the cap on unauthenticated sockets: security.BrowserGuard
    await Connection(ws.app.state.panechat, ws).run()

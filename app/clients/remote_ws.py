"""A panechat server as a ChatBackend, over the websocket protocol v1 (docs/protocol.md).

One connection carries every pane: frames are tagged with a client-chosen request id and
a reader task routes them to per-request queues. The stats subscription keeps the latest
snapshot of the server's shared batch (an EngineStats rebuilt from the frame) for the
dashboard, other terminals' streams included.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import websockets
from websockets.asyncio.client import ClientConnection, connect

from panechat.engine.serving.stats import EngineStats
from .base import (BackendError, BackendInfo, ChatBackend, ChatStream, Delta, Finished, Followed, GenParams,
                   HolderChanged, ModelChoice, Prefill, QueueStream, Queued, Reconnected)

PROTOCOL = 1
CLIENT = "panechat-tui/0.1"
RETRY_S = 1.0  # seconds between tries to connect again after the connection is lost


class RemoteBackend(ChatBackend):
    """`panechat --connect ws://HOST:PORT [--token T] [--model NAME]`."""

    def __init__(self, url: str, token: str | None = None, *, stats_interval_ms: int = 250,
                 connect_timeout: float = 10.0, model: str | None = None):
        self.model = model or ""  # --model: the server model this terminal's panes use by default
        self.url = url.rstrip("/")
        if not self.url.endswith("/ws"):
            self.url += "/ws"
        self.profile = url
        self.token = token
        self.stats_interval_ms = stats_interval_ms
        self.connect_timeout = connect_timeout
        self.info = BackendInfo(kind="remote", url=url)
        self.terminal: str | None = None
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task | None = None
        self._streams: dict[str, QueueStream] = {}
        self._opening: dict[str, asyncio.Future] = {}
        self._opened: set[str] = set()
        self._holders: dict[str, str | None] = {}  # conversation -> the terminal holding it (its opened/holder)
        self._replying: dict[str, str] = {}  # conversation -> another terminal's reply so far, at open
        self._watchers: dict[str, object] = {}  # conversation -> listener of its Followed/HolderChanged
        self._model_stats: dict[str, EngineStats] = {}
        self.models: list[str] = []  # the models the server holds (its welcome)
        self.base_models: set[str] = set()  # those of them with no chat template (its welcome)
        # request id -> the stream's arguments, until the server has queued it: a send to a
        # conversation the server dropped (for memory, see --history-memory) reopens it with
        # the history and sends again, once
        self._unqueued: dict[str, tuple] = {}
        # conversation -> the (role, content) turns the server holds, as far as this terminal
        # knows: a send whose earlier turns differ (an edit, a regenerate, a delete) says so
        self._held: dict[str, list[tuple[str, str]]] = {}
        self._sent: dict[str, tuple[str, list[tuple[str, str]]]] = {}  # request -> its turns once queued
        self._ids = itertools.count(1)
        self._stats: EngineStats | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.last_error: str | None = None
        self._closing = False  # close() called: a lost connection is not retried
        self._retrying: asyncio.Task | None = None

    # -- connection ---------------------------------------------------------------------
    async def start(self) -> BackendInfo:
        async with self._lock:
            if self._ws is None:
                await self._connect()
        return self.info

    async def _connect(self) -> None:
        try:
            ws = await asyncio.wait_for(connect(self.url, max_size=2**22, open_timeout=self.connect_timeout),
                                        self.connect_timeout)
        except (OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as e:
            raise BackendError(f"cannot connect to {self.url}: {e or type(e).__name__}") from None
        hello = {"type": "hello", "protocol": PROTOCOL, "client": CLIENT}
        if self.token:
            hello["token"] = self.token
        try:
            await ws.send(json.dumps(hello))
            frame = json.loads(await asyncio.wait_for(ws.recv(), self.connect_timeout))
        except websockets.exceptions.ConnectionClosed as e:
            raise BackendError(self._closed_reason(e)) from None
        except (asyncio.TimeoutError, json.JSONDecodeError):
            await ws.close()
            raise BackendError(f"{self.url} did not answer the panechat hello") from None
        if frame.get("type") != "welcome":
            await ws.close()
            msg = frame.get("message", "unexpected reply")
            hint = "; pass the server's --token" if frame.get("code") == "unauthorized" else ""
            raise BackendError(f"{self.url} refused the connection: {msg}{hint}")
        self.info = BackendInfo(
            kind="remote", model=str(frame.get("model", "")), backend=str(frame.get("backend", "")).split(" ")[0],
            detail=str(frame.get("backend", "")), ctx=frame.get("ctx"), max_concurrent=frame.get("max_concurrent"),
            batching=frame.get("batching"), url=self.profile, chat_template=str(frame.get("chat_template", "")))
        self.terminal = frame.get("terminal")
        self.models = [str(m) for m in frame.get("models") or [] if isinstance(m, str)]
        self.base_models = {str(m) for m in frame.get("base_models") or [] if isinstance(m, str)}
        if self.info.chat_template == "chatml-fallback":  # an older server names only the default's
            self.base_models.add(self.info.model)
        if self.model:
            self.info.model = self.model
        self._ws = ws
        self._opened.clear()
        self._holders.clear()
        await ws.send(json.dumps({"type": "subscribe", "interval_ms": self.stats_interval_ms}))
        self._reader = asyncio.create_task(self._read(ws))

    @staticmethod
    def _closed_reason(e: websockets.exceptions.ConnectionClosed) -> str:
        if e.rcvd is not None and e.rcvd.code == 4401:
            return "unauthorized: the server needs the right --token"
        return f"connection closed: {e}"

    async def close(self) -> None:
        self._closing = True
        if self._retrying is not None:
            self._retrying.cancel()
        for t in list(self._tasks):
            t.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        self._ws = None

    async def _read(self, ws: ClientConnection) -> None:
        reason = "connection lost"
        try:
            async for raw in ws:
                try:
                    frame = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                if isinstance(frame, dict):
                    self._dispatch(frame)
        except websockets.exceptions.ConnectionClosed as e:
            reason = self._closed_reason(e)
        finally:
            if self._ws is ws:
                self._ws = None
            self.last_error = reason
            for s in list(self._streams.values()):
                s.put(Finished("error", "", error=reason))
            self._streams.clear()
            self._unqueued.clear()
            self._sent.clear()
            for fut in self._opening.values():
                if not fut.done():
                    fut.set_exception(BackendError(reason))
            self._opening.clear()
            if not self._closing and self._retrying is None:
                self._retrying = asyncio.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        """Connect again every RETRY_S until the server is back, then tell the panes."""
        try:
            while self._ws is None and not self._closing:
                await asyncio.sleep(RETRY_S)
                try:
                    await self.start()
                except BackendError as e:
                    self.last_error = str(e)
        finally:
            self._retrying = None
        for listener in list(self._watchers.values()):
            listener(Reconnected())

    def trouble(self) -> str | None:
        return "disconnected, retrying" if self._retrying is not None else None

    def _dispatch(self, f: dict) -> None:
        kind = f.get("type")
        if kind == "stats":
            try:
                self._stats = EngineStats.from_dict(f)
                per = f.get("models") or {}
                self._model_stats = {str(k): EngineStats.from_dict(v) for k, v in per.items()}
            except (TypeError, ValueError, KeyError, AttributeError):
                pass  # a malformed frame: keep the last good snapshot
            return
        if kind == "opened":
            cid = f.get("conversation", "")
            self._holders[cid] = f.get("holder")
            if isinstance(f.get("replying"), str):
                self._replying[cid] = f["replying"]
            fut = self._opening.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_result(f.get("messages", []))
            return
        if kind in ("holder", "follow"):
            self._followed(f)
            return
        stream = self._streams.get(f.get("request", ""))
        if stream is not None and kind != "delta":
            again = self._unqueued.pop(stream.id, None)
            if kind == "error" and f.get("code") == "unknown_conversation" and again is not None:
                self._streams.pop(stream.id, None)
                self._opened.discard(again[0])
                self._spawn(self._start_stream(stream, *again, retry=False))
                return
        if kind == "error":
            msg = f.get("message") or f.get("code") or "error"
            if stream is not None:
                self._sent.pop(stream.id, None)
                self._finish(stream, Finished("error", "", error=msg))
            elif self._opening and f.get("code") in ("unknown_conversation", "bad_frame", "unknown_model",
                                                     "models_memory", "model_not_loadable"):
                cid, fut = next(iter(self._opening.items()))
                self._opening.pop(cid)
                if not fut.done():
                    fut.set_exception(BackendError(msg))
            else:
                self.last_error = msg
            return
        if stream is None:
            return
        if kind in ("queued", "finished"):
            self._track(stream.id, kind, f)
        if kind == "queued":
            n, dropped = f.get("prompt_tokens"), f.get("dropped")
            stream.put(Queued(n if isinstance(n, int) else None, dropped if isinstance(dropped, int) else 0))
        elif kind == "prefill":
            stream.put(Prefill(int(f.get("done", 0)), int(f.get("total", 0))))
        elif kind == "delta":
            tid = f.get("token_id")
            stream.put(Delta(f.get("text", ""), 0 if isinstance(tid, int) and tid < 0 else 1))
        elif kind == "finished":
            self._finish(stream, Finished(f.get("reason", "stop"), f.get("text", ""), f.get("usage") or {},
                                          f.get("timings") or {}, f.get("error") or f.get("message")))

    def _followed(self, f: dict) -> None:
        """A `holder` or `follow` frame, handed to the conversation's listener."""
        cid = f.get("conversation", "")
        if f["type"] == "holder":
            self._holders[cid] = f.get("holder")
            ev = HolderChanged(self.holder_of(cid))
        else:
            ev = Followed(str(f.get("event", "")), f.get("text") or f.get("content") or "", str(f.get("reason", "")),
                          bool(f.get("replaces")))
        listener = self._watchers.get(cid)
        if listener is not None:
            listener(ev)

    def _track(self, rid: str, kind: str, f: dict) -> None:
        """Follow the server's copy: the turns of a queued send, then its reply."""
        if kind == "queued" and rid in self._sent:
            conversation, turns = self._sent[rid]
            self._held[conversation] = list(turns)
        elif kind == "finished":
            sent = self._sent.pop(rid, None)
            if sent is not None and f.get("text") and sent[0] in self._held:
                self._held[sent[0]].append(("assistant", f.get("text", "")))

    def _finish(self, stream: QueueStream, ev: Finished) -> None:
        stream.put(ev)
        self._streams.pop(stream.id, None)

    async def _send(self, frame: dict) -> None:
        if self._ws is None:
            raise BackendError(self.last_error or "not connected")
        await self._ws.send(json.dumps(frame))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- ChatBackend -------------------------------------------------------------------
    async def attach(self, conversation: str, system: str, history: list[dict],
                     model: str = "", *, take: bool = False) -> list[dict] | None:
        await self.start()  # reconnects after a lost connection
        fut = self._opening.get(conversation)
        if fut is None:
            fut = self._opening[conversation] = asyncio.get_running_loop().create_future()
            self._replying.pop(conversation, None)
            frame = {"type": "open", "conversation": conversation}
            if take:
                frame["take"] = True
            if model or self.model:  # the server's default otherwise
                frame["model"] = model or self.model
            if system:
                frame["system"] = system
            if history:  # the server takes it only if its copy has no turns
                frame["messages"] = history
            await self._send(frame)
        messages = await asyncio.wait_for(asyncio.shield(fut), 30)
        self._opened.add(conversation)
        self._held[conversation] = [(m["role"], m["content"]) for m in messages if m.get("role") != "system"]
        return [{"role": m["role"], "content": m["content"], **({"cut_off": True} if m.get("cut_off") else {})}
                for m in messages if m.get("role") != "system"]

    def holder_of(self, conversation: str) -> str | None:
        holder = self._holders.get(conversation)
        return holder if holder and holder != self.terminal else None

    def replying(self, conversation: str) -> str | None:
        return self._replying.get(conversation)

    def watch(self, conversation: str, listener) -> None:
        if listener is None:
            self._watchers.pop(conversation, None)
        else:
            self._watchers[conversation] = listener

    async def release(self, conversation: str) -> None:
        self._watchers.pop(conversation, None)
        self._holders.pop(conversation, None)
        if conversation in self._opened:
            self._opened.discard(conversation)
            await self._send_quiet({"type": "close", "conversation": conversation})

    def stream(self, conversation: str, messages: list[dict], params: GenParams, system: str = "",
               model: str = "", *, complete: bool = False) -> ChatStream:
        """A chat reply; `complete`: on a base model the server completes the conversation's
        text instead (the send's `complete`, docs/protocol.md)."""
        s = QueueStream(on_cancel=self._cancel)
        s.id = f"r-{next(self._ids)}"
        self._spawn(self._start_stream(s, conversation, messages, params, system, model, complete))
        return s

    def respond(self, conversation: str, messages: list[dict], params: GenParams, system: str = "",
                model: str = "") -> ChatStream:
        """A chat reply, or on a base model the raw completion of the conversation's text
        (`run --raw`), as the server decides from the model's file."""
        return self.stream(conversation, messages, params, system, model, complete=True)

    def completes_text(self, model: str = "") -> bool:
        return (model or self.model or self.info.model) in self.base_models

    async def _start_stream(self, s: QueueStream, conversation: str, messages: list[dict], params: GenParams,
                            system: str, model: str = "", complete: bool = False, retry: bool = True) -> None:
        try:
            if conversation not in self._opened or self._ws is None:
                await self.attach(conversation, system, messages[:-1], model)
            if s.done:  # cancelled while the conversation was opening
                return
            self._streams[s.id] = s
            if retry:
                self._unqueued[s.id] = (conversation, messages, params, system, model, complete)
            frame = {"type": "send", "conversation": conversation, "request": s.id, "content": messages[-1]["content"],
                     "params": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                                "min_p": params.min_p, "max_tokens": params.max_tokens, "seed": params.seed,
                                **_json_mode(params), **_extra_fields(params)},
                     "system": system}
            if model or self.model:
                frame["model"] = model or self.model
            if complete:
                frame["complete"] = True
            frame.update(self._rewrite(conversation, messages[:-1]))
            self._sent[s.id] = (conversation, [(m["role"], m["content"]) for m in messages])
            await self._send(frame)
        except (BackendError, asyncio.TimeoutError, websockets.exceptions.WebSocketException, OSError) as e:
            self._streams.pop(s.id, None)
            self._unqueued.pop(s.id, None)
            self._sent.pop(s.id, None)
            s.put(Finished("error", "", error=str(e) or type(e).__name__))

    def _rewrite(self, conversation: str, before: list[dict]) -> dict:
        """What a send frame adds when the turns before it are not the server's (docs/protocol.md):
        `keep` when they are the start of its copy (an edit, a regenerate), else `messages`."""
        turns = [(m["role"], m["content"]) for m in before]
        held = self._held.get(conversation)
        if held is None or held == turns:
            return {}
        if held[:len(turns)] == turns:
            return {"keep": len(turns)}
        return {"messages": [{"role": r, "content": c} for r, c in turns]}

    def _cancel(self, s: QueueStream) -> None:
        if s.id in self._streams:
            self._spawn(self._send_quiet({"type": "cancel", "request": s.id}))
        else:  # not sent yet, or the connection is gone
            s.put(Finished("cancelled", ""))

    async def _send_quiet(self, frame: dict) -> None:
        try:
            await self._send(frame)
        except (BackendError, websockets.exceptions.WebSocketException):
            pass

    def stats(self) -> EngineStats | None:
        return self._stats if self._ws is not None else None

    async def model_choices(self) -> list[ModelChoice]:
        """The models the server holds (its welcome)."""
        return [ModelChoice(m, "on the server", loaded=True, base=m in self.base_models)
                for m in self.models] or await super().model_choices()

    def model_stats(self) -> dict[str, EngineStats]:
        return self._model_stats if self._ws is not None else {}



def _extra_fields(params: GenParams) -> dict:
    """Stop strings, penalties and drafts turned off in a send frame's params, only those
    set away from the defaults (the frame stays what an older server reads)."""
    out = {k: getattr(params, k) for k, default in _PENALTY_DEFAULTS.items() if getattr(params, k) != default}
    if params.stop:
        out["stop"] = list(params.stop)
    if not params.spec:
        out["spec"] = False
    return out


_PENALTY_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0, "repeat_last_n": 64}


def _json_mode(params: GenParams) -> dict:
    """`response_format` in a send frame's params, only when set (an older server knows no such key)."""
    return {} if params.response_format is None else {"response_format": params.response_format}

"""Any OpenAI-compatible server as a ChatBackend: POST /chat/completions with SSE streaming.

Such servers expose no batch statistics, so the dashboard shows what the API gives: the
model, and this terminal's own streams with tok/s and time to first token measured from
the stream itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import httpx

from panechat.engine.serving.stats import EngineStats, StreamState, StreamStats
from .base import (BackendError, BackendInfo, ChatBackend, Delta, Finished, GenParams, QueueStream, Queued,
                   StreamMeter)


class OpenAIBackend(ChatBackend):
    """`panechat --connect http(s)://HOST/v1 [--api-key K]`."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.profile = self.base_url
        self.api_key = api_key
        self.model = model
        self.timeout = timeout
        self.info = BackendInfo(kind="openai", url=self.base_url)
        self._client: httpx.AsyncClient | None = None
        self._active: dict[str, tuple[StreamMeter, str]] = {}  # stream id -> (meter, conversation)
        self._tasks: dict[str, asyncio.Task] = {}
        self._n = 0

    async def start(self) -> BackendInfo:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                         timeout=httpx.Timeout(self.timeout, connect=10.0))
        try:
            r = await self._client.get("/models")
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach {self.base_url}: {e or type(e).__name__}") from None
        if r.status_code in (401, 403):
            raise BackendError(f"{self.base_url} refused the API key (HTTP {r.status_code}); pass --api-key")
        listed: list[dict] = []
        if r.status_code == 200:
            try:
                listed = [m for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
            except (ValueError, AttributeError):
                listed = []
        models = [m["id"] for m in listed]
        if not self.model:
            if not models:
                raise BackendError(f"{self.base_url}/models lists no model; pass --model NAME")
            self.model = models[0]
        host = urlsplit(self.base_url).netloc
        template = next((m.get("chat_template") for m in listed if m["id"] == self.model), None)  # panechat's field
        self.info = BackendInfo(kind="openai", model=self.model, backend="openai-api",
                                detail=f"OpenAI-compatible API at {host}", url=self.base_url,
                                chat_template=template if isinstance(template, str) else "")
        return self.info

    async def close(self) -> None:
        for t in list(self._tasks.values()):
            t.cancel()
        if self._client is not None:
            await self._client.aclose()

    def stream(self, conversation: str, messages: list[dict], params: GenParams, system: str = "",
               model: str = "") -> QueueStream:
        self._n += 1
        s = QueueStream(on_cancel=self._cancel)
        s.id = f"h-{self._n}"
        body = {
            "model": model or self.model,
            "messages": ([{"role": "system", "content": system}] if system else []) + list(messages),
            "stream": True, "stream_options": {"include_usage": True},
            "temperature": params.temperature, "max_tokens": params.max_tokens, "top_p": params.top_p,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.response_format is not None:
            body["response_format"] = params.response_format
        if params.top_k:  # extensions many servers take (panechat, llama.cpp, vLLM): sent only when set
            body["top_k"] = params.top_k
        if params.min_p:
            body["min_p"] = params.min_p
        if params.stop:
            body["stop"] = list(params.stop)
        if not params.spec:  # panechat's extension: sent only when off
            body["spec"] = False
        for key, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),  # OpenAI's own
                             ("repeat_penalty", 1.0), ("repeat_last_n", 64)):  # llama.cpp's, sent only when set
            if getattr(params, key) != default:
                body[key] = getattr(params, key)
        self._tasks[s.id] = asyncio.create_task(self._run(s, conversation, body))
        return s

    def _cancel(self, s: QueueStream) -> None:
        task = self._tasks.get(s.id)
        if task is not None:
            task.cancel()

    async def _run(self, s: QueueStream, conversation: str, body: dict) -> None:
        meter = StreamMeter()
        self._active[s.id] = (meter, conversation)
        text, reason, usage, error = [], "stop", {}, None
        s.put(Queued())
        try:
            assert self._client is not None
            async with self._client.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise BackendError(_error_message(await r.aread(), r.status_code))
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        raise BackendError(_error_message(data.encode(), 200))
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or ""
                        if piece:
                            meter.on_tokens(1)
                            text.append(piece)
                            s.put(Delta(piece, 1))
                        reason = choice.get("finish_reason") or reason
        except asyncio.CancelledError:
            reason = "cancelled"
        except (BackendError, httpx.HTTPError, json.JSONDecodeError) as e:
            reason, error = "error", str(e) or type(e).__name__
        finally:
            self._active.pop(s.id, None)
            self._tasks.pop(s.id, None)
        total_ms = 1000 * (time.perf_counter() - meter.t_send)
        timings = {"ttft_ms": meter.ttft_ms, "decode_tok_s": meter.tok_s(meter.t_last) or None, "total_ms": total_ms}
        s.put(Finished(reason, "".join(text), usage, timings, error))

    def stats(self) -> EngineStats | None:
        """Only this terminal's own streams are known; the batch, queue and KV fields stay None."""
        now = time.perf_counter()
        streams = tuple(StreamStats(sid, conv, StreamState.DECODING if m.t_first else StreamState.WAITING,
                                    tokens=m.tokens, tok_s=m.tok_s(now), ttft_ms=m.ttft_ms)
                        for sid, (m, conv) in self._active.items())
        return EngineStats(tok_s=sum(s.tok_s for s in streams), streams=streams)


def _error_message(body: bytes, status: int) -> str:
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        msg = body.decode("utf-8", "replace")[:200]
    return f"HTTP {status}: {msg}" if status != 200 else msg

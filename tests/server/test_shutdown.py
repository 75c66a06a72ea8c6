"""SIGTERM on `panechat serve` (a real process): every client in flight gets a proper end.

With `--shutdown-grace 1` and three long generations running (an SSE stream, a plain
request, a /ws generation), SIGTERM must: refuse new work with 503 `shutting_down` while
draining (and /health say `draining`); end the SSE body with an error event in OpenAI's
shape and `data: [DONE]`; answer the plain request with a JSON 503 `shutting_down`; send
the /ws client `finished` with reason `shutdown`, then close with 1001; and exit 0 within
the grace and a few seconds. Generations shorter than the grace complete normally.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from .serve_process import ServeProcess
from .test_websocket import HELLO, recv

LONG = "Write a very long story about a dragon and a knight, with many chapters."
#: after the grace: the drain (ends within a step), uvicorn's shutdown, the engine's join
EXIT_SLACK_S = 4.0


class Serve(ServeProcess):
    """`panechat serve --port 0 --ctx-size 1024 FLAGS` in a subprocess (serve_process.py),
    with this process's environment; `term()` sends SIGTERM and returns when."""

    def __init__(self, model_path, *flags: str):
        super().__init__(model_path, {**os.environ, "PYTHONUNBUFFERED": "1"}, "--ctx-size", "1024", *flags)

    def term(self) -> float:
        self.p.send_signal(signal.SIGTERM)
        return time.monotonic()


async def _sse(url: str, max_tokens: int, out: dict) -> None:
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": max_tokens, "stream": True,
            "temperature": 0}
    out["data"] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            out["status"] = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out["data"].append(line[len("data: "):])
    out["ended"] = True


async def _plain(url: str, max_tokens: int, out: dict) -> None:
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": max_tokens, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        r = await c.post("/v1/chat/completions", json=body)
    out["status"], out["json"], out["headers"] = r.status_code, r.json(), r.headers


async def _ws(url: str, max_tokens: int, out: dict) -> None:
    out["frames"] = []
    async with connect(url) as ws:
        await ws.send(json.dumps(HELLO))
        assert (await recv(ws))["type"] == "welcome"
        await ws.send(json.dumps({"type": "open", "conversation": "c"}))
        assert (await recv(ws))["type"] == "opened"
        await ws.send(json.dumps({"type": "send", "conversation": "c", "request": "r", "content": LONG,
                                  "params": {"max_tokens": max_tokens}}))
        try:
            while True:
                out["frames"].append(await recv(ws, 120))
        except ConnectionClosed as e:
            out["close"] = e.rcvd.code if e.rcvd else None


def _started(sse: dict, ws: dict) -> bool:
    return (any('"content": "' in d and '"content": ""' not in d for d in sse.get("data", []))
            and any(f["type"] == "delta" for f in ws.get("frames", [])))


async def _admitted(c: httpx.AsyncClient) -> int:
    """Generations the engine has taken (admitted, or waiting in its queue)."""
    text = (await c.get("/metrics")).text
    return sum(int(float(m)) for m in re.findall(
        r"^panechat_(?:requests_admitted_total|requests_waiting)(?:\{[^}]*\})? (\S+)$", text, re.M))


async def _three(srv: Serve, max_tokens: int):
    """Start a plain request (and see it reach the engine), then an SSE stream and a /ws one."""
    sse, plain, ws = {}, {}, {}
    tasks = [asyncio.create_task(_plain(srv.url, max_tokens, plain))]
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        while await _admitted(c) < 1:
            assert time.monotonic() - t0 < 60, "the plain request never reached the engine"
            await asyncio.sleep(0.02)
    tasks += [asyncio.create_task(_sse(srv.url, max_tokens, sse)),
              asyncio.create_task(_ws(srv.ws_url, max_tokens, ws))]
    return tasks, sse, plain, ws


def test_sigterm_ends_every_stream_properly(model_path):
    grace = 1.0
    srv = Serve(model_path, "--shutdown-grace", str(grace))
    try:
        srv.wait_ready()

        async def main():
            tasks, sse, plain, ws = await _three(srv, 900)
            t0 = time.monotonic()
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                while not (_started(sse, ws) and (await c.get("/health")).json()["running"] == 3):
                    assert time.monotonic() - t0 < 60, "the three generations never ran together"
                    await asyncio.sleep(0.1)
                t_sig = srv.term()
                await asyncio.sleep(0.3)  # the drain starts at the server's next tick (0.1 s)
                # while draining: new work is refused, /health says so
                r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 2})
                refused = (r.status_code, r.json()["error"]["code"], r.headers.get("retry-after"))
                health = await c.get("/health")
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return t_sig, sse, plain, ws, refused, health

        t_sig, sse, plain, ws, refused, health = asyncio.run(main())
        rc = srv.p.wait(timeout=grace + EXIT_SLACK_S + 5)
        took = time.monotonic() - t_sig
    finally:
        srv.close()
    assert refused[:2] == (503, "shutting_down") and int(refused[2]) >= 1, refused
    assert health.status_code == 503 and health.json()["status"] == "draining"
    # SSE: some content, then an error event in OpenAI's shape, then [DONE]
    assert sse["status"] == 200 and sse.get("ended")
    assert sse["data"][-1] == "[DONE]", sse["data"][-3:]
    err = json.loads(sse["data"][-2])["error"]
    assert err["code"] == "shutting_down" and err["type"] == "server_error" and err["message"], err
    # the plain request: a JSON 503 an OpenAI client retries
    assert plain["status"] == 503 and plain["json"]["error"]["code"] == "shutting_down", plain
    assert plain["headers"]["retry-after"]
    # /ws: finished with reason shutdown and the partial text, then close 1001
    fin = [f for f in ws["frames"] if f["type"] == "finished"]
    assert len(fin) == 1 and fin[0]["reason"] == "shutdown" and fin[0]["text"], ws["frames"][-2:]
    assert ws["close"] == 1001
    assert rc == 0, srv.err
    assert took < grace + EXIT_SLACK_S, f"exited {took:.1f} s after SIGTERM"
    assert "Traceback" not in srv.err
    assert re.search(r"shutdown: 0 generation\(s\) finished, 3 ended with reason 'shutdown'", srv.err), srv.err


def test_generations_shorter_than_the_grace_complete(model_path):
    grace = 20.0  # far longer than 12 tokens take, even on a busy machine: the exit must not wait for it
    srv = Serve(model_path, "--shutdown-grace", str(grace))
    try:
        srv.wait_ready()

        async def main():
            tasks, sse, plain, ws = await _three(srv, 12)
            t0 = time.monotonic()
            while not (sse.get("data") and any(f["type"] == "queued" for f in ws.get("frames", []))):
                assert time.monotonic() - t0 < 60
                await asyncio.sleep(0.02)
            t_sig = srv.term()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return t_sig, sse, plain, ws

        t_sig, sse, plain, ws = asyncio.run(main())
        rc = srv.p.wait(timeout=30)
        took = time.monotonic() - t_sig
    finally:
        srv.close()
    assert sse["data"][-1] == "[DONE]"
    last = json.loads(sse["data"][-2])
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and "error" not in last
    assert plain["status"] == 200 and plain["json"]["choices"][0]["finish_reason"] in ("stop", "length")
    fin = [f for f in ws["frames"] if f["type"] == "finished"]
    assert len(fin) == 1 and fin[0]["reason"] in ("stop", "length")
    assert ws["close"] == 1001
    assert rc == 0, srv.err
    assert took < grace / 2, f"exited {took:.1f} s after SIGTERM: it waited for the grace, not the work"
    assert re.search(r"shutdown: 3 generation\(s\) finished, 0 ended", srv.err), srv.err


async def test_a_hosted_server_drains_only_its_own_generations(live):
    """ServerThread.stop() (what `panechat --share` calls at exit): its websocket client gets
    `finished` with reason `shutdown`; another server on the same engine keeps its own."""
    from panechat.app.server import ServerThread, create_app

    live.wait_idle()
    srv = ServerThread(create_app(live.engine), "127.0.0.1", 0).start()
    stopped = False
    try:
        async with connect(live.ws_url) as other, connect(srv.ws_url) as ws:
            for sock, rid in ((other, "keep"), (ws, "cut")):
                await sock.send(json.dumps(HELLO))
                assert (await recv(sock))["type"] == "welcome"
                await sock.send(json.dumps({"type": "open", "conversation": rid}))
                assert (await recv(sock))["type"] == "opened"
                await sock.send(json.dumps({"type": "send", "conversation": rid, "request": rid,
                                            "content": LONG, "params": {"max_tokens": 40 if rid == "keep" else 900}}))
            while (await recv(ws))["type"] != "delta":
                pass
            stopping = asyncio.create_task(asyncio.to_thread(srv.stop))
            frames, close = [], None
            try:
                while True:
                    frames.append(await recv(ws))
            except ConnectionClosed as e:
                close = e.rcvd.code if e.rcvd else None
            await stopping
            stopped = True
            fin = [f for f in frames if f["type"] == "finished"]
            assert len(fin) == 1 and fin[0]["reason"] == "shutdown" and close == 1001, frames[-2:]
            while (f := await recv(other))["type"] != "finished":
                pass
            assert f["reason"] in ("stop", "length")  # the other server's generation ran to its end
    finally:
        if not stopped:
            srv.stop()

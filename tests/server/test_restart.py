"""Conversations survive a server restart (issue 14): a `/ws` conversation of 2,000+ tokens
on the real server (default model, loopback, a real websocket client); the server stops
gracefully and starts again on the same state folder and KV snapshot folder; the next turn
gets the same reply as on the server that never stopped, and its prompt's KV was restored
from a snapshot, not re-prefilled. A third start without snapshots re-prefills (the cold
case) and agrees too. TTFTs are printed (warm, after restart, cold), never asserted."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
from websockets.asyncio.client import connect

from panechat.app.server import ServerThread, create_app
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.model.loader import load_model
from panechat.engine.serving.sampling import SamplingParams

from .test_websocket import ask, generation, hello

ANIMALS = ["cat", "heron", "otter", "lynx", "badger", "gecko", "falcon", "newt"]
CITIES = ["Lyon", "Oslo", "Quito", "Perth", "Nagoya", "Tunis", "Cork", "Riga"]


def _history() -> list[dict]:
    """Earlier turns a client kept: 12 exchanges of numbered facts (about 2,300 tokens)."""
    turns = []
    for t in range(12):
        facts = " ".join(f"Fact {t * 6 + i}: the {ANIMALS[(t + i) % 8]} of {CITIES[(t * 3 + i) % 8]} "
                         f"counts {(t * 6 + i) * 7 % 97} stones." for i in range(6))
        turns.append({"role": "user", "content": f"Remember these. {facts}"})
        turns.append({"role": "assistant", "content": f"Noted, {6} facts from batch {t}: {facts[:160]}"})
    return turns


@pytest.fixture(scope="module")
def lm(model_path):
    return load_model(model_path, "numpy", max_positions=4096)


class Run:
    """One server life: an engine (snapshots in `kv`, or off) and the app on `state`."""

    def __init__(self, lm, state, kv):
        cfg = EngineConfig(max_concurrent=1, kv_sessions=2, ctx_size=4096, verify_invariance=False,
                           kv_snapshot_dir=str(kv) if kv else None)
        self.engine = Engine(lm, cfg).start()
        # the kernels' first call on this thread loads them (numba): not part of any TTFT
        self.engine.submit([{"role": "user", "content": "Hi"}], params=SamplingParams(max_tokens=2)).result()
        self.srv = ServerThread(create_app(self.engine, state_dir=state), "127.0.0.1", 0).start()

    def stop(self):
        self.srv.stop(grace=5)  # the drain, as on SIGTERM
        self.engine.stop()  # writes the idle conversations' KV snapshots


async def _turn(url, cid, content, seed=None):
    async with connect(url, max_size=None) as ws:
        await hello(ws)
        frame = {"type": "open", "conversation": cid}
        if seed is not None:
            frame["messages"] = seed
        opened = await ask(ws, frame)
        assert opened["type"] == "opened", opened
        await ws.send(json.dumps({"type": "send", "request": "r", "conversation": cid,
                                                "content": content, "params": {"max_tokens": 12}}))
        _, fin = await generation(ws, "r")
        assert fin["reason"] in ("stop", "length"), fin
        return opened, fin


async def test_a_long_conversation_continues_after_a_restart(lm, tmp_path):
    state, kv = tmp_path / "state", tmp_path / "kv"
    seed = _history()
    a = Run(lm, state, kv)
    try:
        assert len(a.engine.prompt_ids([*seed, {"role": "user", "content": "x"}])) > 2000
        _, first = await _turn(a.srv.ws_url, "x", "Which animal lives in Oslo?", seed)
        history = seed + [{"role": "user", "content": "Which animal lives in Oslo?"},
                          {"role": "assistant", "content": first["text"]}]
        # the same next turn without a restart: a twin conversation on the same server,
        # its prompt's KV resident (warm)
        _, warm = await _turn(a.srv.ws_url, "twin", "How many stones in Riga?", history)
        assert warm["usage"]["reused_tokens"] > 2000
    finally:
        a.stop()
    assert a.engine.stats().kv_snapshots_written >= 1
    cold_state = tmp_path / "cold-state"
    shutil.copytree(state, cold_state)

    b = Run(lm, state, kv)  # the restart
    try:
        opened, restarted = await _turn(b.srv.ws_url, "x", "How many stones in Riga?")
        assert not opened["created"] and opened["messages"] == history  # the server kept it
        s = b.engine.stats()
        async with httpx.AsyncClient(base_url=b.srv.url) as http:
            metrics = (await http.get("/metrics")).text
        assert re.search(r'^panechat_kv_snapshots_restored_total\{model="[^"]+"\} 1\.0$', metrics, re.M)
    finally:
        b.stop()
    assert restarted["text"] == warm["text"]
    assert s.kv_snapshots_restored == 1  # restored, not re-prefilled:
    assert restarted["usage"]["reused_tokens"] == restarted["usage"]["prompt_tokens"] - 1

    c = Run(lm, cold_state, None)  # a restart without snapshots: the whole prompt again
    try:
        _, cold = await _turn(c.srv.ws_url, "x", "How many stones in Riga?")
        assert c.engine.stats().kv_snapshots_restored == 0
    finally:
        c.stop()
    # only the warm-up's system prompt was resident: the history was prefilled again
    assert cold["text"] == warm["text"] and cold["usage"]["reused_tokens"] < 64
    n = restarted["usage"]["prompt_tokens"]
    print(f"\nrestart TTFT, {n}-token prompt: warm {warm['timings']['ttft_ms']:.0f} ms, after restart "
          f"(snapshot) {restarted['timings']['ttft_ms']:.0f} ms, cold re-prefill {cold['timings']['ttft_ms']:.0f} ms")

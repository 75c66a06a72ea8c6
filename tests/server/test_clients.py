"""Clients, as `panechat serve --tokens FILE --max-queue-per-client N` sees them (issue 25,
items 6 and 10), through one real server subprocess and real clients (httpx, websockets):

- named tokens: each request and terminal is attributed to its name in /metrics; editing
  the file removes a name, closes its open websocket within seconds, and its next HTTP
  request is 401 while the others carry on;
- fairness: a light client's time to first token beside a client flooding the queue stays
  within 2x of its time alone (it was 70x with one FIFO queue), and the flooding client
  alone is refused with 429 `client_queue_full` once past its cap.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from panechat.app.cli import main
from panechat.app.server.tokens import NamedTokens, TokensFileError, parse_tokens

TOKENS = {"alice": "alice-secret-1", "bob": "bob-secret-22", "carol": "carol-secret-333"}
PER_CLIENT = 6  # --max-queue-per-client
FLOOD = 16  # bob's requests in flight at once, each retried after a 429
LIGHT_TURNS = 4


def write_tokens(path: Path, names) -> None:
    text = "# panechat tokens: name token\n\n" + "".join(f"{n} {TOKENS[n]}  # {n}'s laptop\n" for n in names)
    path.write_text(text)


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    write_tokens(tokens, TOKENS)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-c", "import sys; from panechat.app.cli import main; sys.exit(main())", "serve",
         "--port", "0", "--model", str(model_path), "--ctx-size", "1024", "--max-concurrent", "4",
         "--max-queue", "64", "--max-queue-per-client", str(PER_CLIENT), "--tokens", str(tokens),
         "--kv-memory", "64M", "--kv-snapshots", "off", "--state-dir", "none"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        m = re.search(r"listening on (http://127\.0\.0\.1:(\d+))", p.stderr.readline())
        assert m, "no listening line"
        log: list[str] = []  # read all along: a full pipe would stall the server's log writes
        threading.Thread(target=lambda: log.extend(p.stderr), daemon=True).start()
        url = m.group(1)
        t0 = time.monotonic()
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() - t0 < 300 and p.poll() is None, "the server did not become ready"
            time.sleep(0.2)
        yield url, tokens
    finally:
        p.terminate()
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def metric(text: str, name: str, client: str) -> float:
    m = re.search(rf'^{name}\{{client="{client}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


# -- the file ---------------------------------------------------------------------------------
def test_the_tokens_file_allows_comments_and_names_a_bad_line():
    assert list(parse_tokens("# team\n\nalice  aaaaaaaaaa # laptop\nbob bbbbbbbbbb\n")) == ["alice", "bob"]
    for text, words in (("alice aaaaaaaaaa\nbob\n", "line 2: expected 'name token'"),
                        ("alice aaaaaaaaaa extra\n", "line 1: expected"),
                        ("alice short\n", "shorter than 8"),
                        ("alice aaaaaaaaaa\nalice bbbbbbbbbb\n", "'alice' is named twice"),
                        ("alice aaaaaaaaaa\nbob aaaaaaaaaa\n", "same token as 'alice'"),
                        ("al/ice aaaaaaaaaa\n", "letters, digits")):
        with pytest.raises(TokensFileError, match=re.escape(words)):
            parse_tokens(text, "t.txt")


def test_the_file_is_re_read_and_a_bad_edit_keeps_the_names_it_had(tmp_path):
    path = tmp_path / "tokens.txt"
    write_tokens(path, ["alice", "bob"])
    tokens = NamedTokens(path)
    assert tokens.name_of(TOKENS["bob"]) == "bob" and tokens.name_of("bob-secret-2") is None
    assert tokens.name_of(None) is None
    write_tokens(path, ["alice"])
    tokens.refresh(force=True)
    assert tokens.names == ("alice",) and tokens.name_of(TOKENS["bob"]) is None
    path.write_text("alice\n")  # a half-written edit
    tokens.refresh(force=True)
    assert tokens.name_of(TOKENS["alice"]) == "alice"
    path.write_text("")
    with pytest.raises(TokensFileError, match="names nobody"):
        NamedTokens(path)


def test_a_bad_tokens_file_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "tokens.txt"
    bad.write_text("alice aaaaaaaaaa\nbob\n")
    assert main(["serve", "--port", "0", "--tokens", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert main(["serve", "--port", "0", "--tokens", str(tmp_path / "missing.txt")]) == 2
    assert "--tokens" in capsys.readouterr().err
    write_tokens(bad, ["alice"])
    assert main(["serve", "--port", "0", "--tokens", str(bad), "--token", "shared-token"]) == 2
    assert "not both" in capsys.readouterr().err


# -- attribution and removal ------------------------------------------------------------------
def test_requests_and_terminals_are_attributed_and_a_removed_name_is_let_go(server):
    url, tokens = server
    ws_url = url.replace("http://", "ws://") + "/ws"

    async def main_():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c, \
                connect(ws_url) as carol, connect(ws_url) as alice_ws:
            assert (await c.get("/v1/models")).status_code == 401
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer nobody-at-all"})).status_code == 401
            r = await c.post("/v1/chat/completions", headers=auth("alice"),
                             json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            for ws, name in ((carol, "carol"), (alice_ws, "alice")):
                await ws.send(json.dumps({"type": "hello", "protocol": 1, "token": TOKENS[name]}))
                assert json.loads(await ws.recv())["type"] == "welcome"
            await carol.send(json.dumps({"type": "open", "conversation": "carol-1"}))
            assert json.loads(await carol.recv())["type"] == "opened"
            await carol.send(json.dumps({"type": "send", "request": "q1", "conversation": "carol-1",
                                         "content": "Hello", "params": {"max_tokens": 2}}))
            while json.loads(await carol.recv())["type"] != "finished":
                pass
            text = (await c.get("/metrics", headers=auth("bob"))).text
            assert metric(text, "panechat_client_requests_total", "alice") == 1
            assert metric(text, "panechat_client_requests_total", "carol") == 1
            assert metric(text, "panechat_client_generated_tokens_total", "carol") >= 1
            assert metric(text, "panechat_client_websockets", "carol") == 1
            assert metric(text, "panechat_client_websockets", "alice") == 1
            assert 'client="-"' not in text  # with named tokens every client has its name

            write_tokens(tokens, ["alice", "bob"])  # carol leaves the team
            t0 = time.monotonic()
            frames = []
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    frames.append(json.loads(await asyncio.wait_for(carol.recv(), 10)))
            assert time.monotonic() - t0 < 5
            assert closed.value.rcvd.code == 4401 and frames[-1]["code"] == "unauthorized"
            assert "'carol'" in frames[-1]["message"]
            r = await c.post("/v1/chat/completions", headers=auth("carol"),
                             json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert r.status_code == 401 and "--tokens" in r.json()["error"]["message"]
            r = await c.post("/v1/chat/completions", headers=auth("alice"),
                             json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert r.status_code == 200
            await alice_ws.send(json.dumps({"type": "list"}))  # alice's terminal is still open
            assert json.loads(await asyncio.wait_for(alice_ws.recv(), 10))["type"] == "conversations"
        write_tokens(tokens, TOKENS)

    asyncio.run(main_())


# -- fairness ---------------------------------------------------------------------------------
def light_prompt(i: int) -> list[dict]:
    """A prompt of about 200 tokens, new each time (its prefill is not cached): the
    time to its first token is mostly its own prefill, alone or beside the flood."""
    words = " ".join(f"item{i}-{k}" for k in range(25))
    return [{"role": "user", "content": f"Request {i} at {time.time_ns()}. Count these: {words}"}]


async def light_ttfts(c: httpx.AsyncClient, start: int) -> list[float]:
    """Alice's server-measured times to first token (s), one request after another."""
    out = []
    for i in range(start, start + LIGHT_TURNS):
        r = await c.post("/v1/chat/completions", headers=auth("alice"),
                         json={"messages": light_prompt(i), "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text  # never refused while bob floods
        out.append(r.json()["timings"]["ttft_ms"] / 1000)
    return out


async def flood(c: httpx.AsyncClient, stop: asyncio.Event, statuses: list) -> None:
    """One of bob's requests in flight, again and again (after a 429, a short wait)."""
    n = 0
    while not stop.is_set():
        n += 1
        r = await c.post("/v1/chat/completions", headers=auth("bob"),
                         json={"messages": [{"role": "user", "content": f"Tell me a long story {n}"}],
                               "max_tokens": 32, "temperature": 0})
        err = r.json().get("error") or {} if r.status_code != 200 else {}
        statuses.append((r.status_code, err.get("code"), r.headers.get("retry-after"), err.get("message")))
        if r.status_code == 429:
            await asyncio.sleep(0.2)


def test_a_light_client_beside_a_flood_waits_about_as_long_as_alone(server):
    url, _ = server

    async def main_():
        limits = httpx.Limits(max_connections=FLOOD + 4)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
            await c.post("/v1/chat/completions", headers=auth("alice"),  # warm-up
                         json={"messages": light_prompt(0), "max_tokens": 1})
            alone = await light_ttfts(c, 100)
            stop, statuses = asyncio.Event(), []
            flooders = [asyncio.create_task(flood(c, stop, statuses)) for _ in range(FLOOD)]
            try:
                t0 = time.monotonic()
                while sum(1 for s in statuses if s[0] == 429) < 3:  # the queue is full of bob's
                    assert time.monotonic() - t0 < 60, statuses
                    await asyncio.sleep(0.1)
                beside = await light_ttfts(c, 200)
                text = (await c.get("/metrics", headers=auth("alice"))).text
            finally:
                stop.set()
                for f in flooders:  # bob leaves: his requests are cancelled, not waited for
                    f.cancel()
                await asyncio.gather(*flooders, return_exceptions=True)
            return alone, beside, statuses, text

    alone, beside, statuses, text = asyncio.run(main_())
    ratio = statistics.median(beside) / statistics.median(alone)
    print(f"alice's TTFT alone {alone}, beside bob's flood {beside} (x{ratio:.2f})")
    assert ratio <= 2.0, f"alice's TTFT alone {alone}, beside bob's flood {beside} (x{ratio:.1f})"
    refused = [s for s in statuses if s[0] == 429]
    assert refused and all(code == "client_queue_full" and int(wait) >= 1 for _, code, wait, _ in refused), refused
    assert f"max-queue-per-client {PER_CLIENT}" in refused[0][3] and "'bob'" in refused[0][3]
    assert {s[0] for s in statuses} <= {200, 429}
    assert metric(text, "panechat_client_requests_refused_total", "bob") >= 1
    assert metric(text, "panechat_client_requests_refused_total", "alice") == 0


# -- without named tokens ---------------------------------------------------------------------
def test_without_named_tokens_a_terminal_is_a_client_and_its_id_stays_private(live):
    """The engine attributes a /ws generation to its terminal (the fair queue's client);
    the stats other terminals are pushed name no client (addresses and ids are not theirs)."""
    async def main_():
        async with connect(live.ws_url) as ws:
            await ws.send(json.dumps({"type": "hello", "protocol": 1}))
            terminal = json.loads(await ws.recv())["terminal"]
            await ws.send(json.dumps({"type": "open", "conversation": f"fair-{terminal}"}))
            assert json.loads(await ws.recv())["type"] == "opened"
            await ws.send(json.dumps({"type": "send", "request": "r1", "conversation": f"fair-{terminal}",
                                      "content": "Tell me a story", "params": {"max_tokens": 24}}))
            await ws.send(json.dumps({"type": "subscribe", "interval_ms": 100}))
            seen, pushed = set(), set()
            while True:
                f = json.loads(await asyncio.wait_for(ws.recv(), 60))
                seen |= {x.client for x in live.engine.stats().streams if x.conversation == f"fair-{terminal}"}
                if f["type"] == "stats":
                    pushed |= {x["client"] for x in f["streams"]}
                if f["type"] == "finished":
                    return terminal, seen, pushed

    terminal, seen, pushed = asyncio.run(main_())
    assert seen == {terminal} and pushed <= {""}

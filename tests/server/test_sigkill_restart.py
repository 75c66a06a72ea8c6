"""SIGKILL, then restart (issue 25: item 7 and the probe "SIGKILL during snapshot writes
under load").

Server K1 runs with little KV memory under several concurrent HTTP clients, each sending
long distinct prompts, so finished requests' cached KV is evicted and written as snapshots
all the time; two /ws conversations are mid-reply. K1 is killed with SIGKILL while a
snapshot is being written (a temporary file is seen in the snapshot folder). Server K2
starts on the same folders: no file is refused as torn, the temporary files are gone,
every request K1 answered gets the same reply again (its first answer was a fresh
prefill's), some of them from snapshots; the two conversations end on their unanswered
user message, marked `unanswered`, and the next `send` answers it (no content) or replaces
it (content), never making two user turns in a row."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from websockets.sync.client import connect

from .serve_process import ServeProcess, kv_files, private_env

FLAGS = ("--ctx-size", "1024", "--max-concurrent", "4", "--kv-memory", "32M", "--shutdown-grace", "1")
WORDS = ["amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "iris", "juniper"]
CLIENTS, PER_CLIENT, MAX_TOKENS = 3, 8, 8
WS_QUESTIONS = ["Tell me a long story about a lighthouse keeper and a storm.",
                "Describe, in great detail, how a river shapes a valley over time."]


def _prompt(client: int, j: int) -> list[dict]:
    """A distinct prompt of about 330 tokens (over the 256 a snapshot needs)."""
    facts = " ".join(f"Note {k}: {WORDS[(client + k) % 10]} {WORDS[(j * 3 + k) % 10]} weighs {(k * 13 + j) % 89} grams."
                     for k in range(28))
    return [{"role": "user", "content": f"Client {client}, list {j}. {facts} Which note is the heaviest?"}]


def _chat(url: str, messages: list[dict]) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=300,
                   json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def _client(url: str, i: int, answered: list, stop: threading.Event) -> None:
    for j in range(PER_CLIENT):
        if stop.is_set():
            return
        try:
            answered.append((_prompt(i, j), _text(_chat(url, _prompt(i, j)))))
        except (httpx.HTTPError, AssertionError):  # killed under it
            return


def _hello(ws) -> None:
    ws.send(json.dumps({"type": "hello", "protocol": 1, "client": "pytest/0"}))
    assert json.loads(ws.recv(60))["type"] == "welcome"


def _frame(ws, kind: str, timeout: float = 120) -> dict:
    """The next frame of type `kind` (others skipped)."""
    t_end = time.monotonic() + timeout
    while True:
        f = json.loads(ws.recv(max(0.1, t_end - time.monotonic())))
        assert f["type"] != "error", f
        if f["type"] == kind:
            return f


def _mid_turn(url: str, question: str, started: threading.Event, out: dict) -> None:
    """Open a conversation and ask `question`; set `started` at its first delta, then read
    until the server goes away."""
    try:
        with connect(url, max_size=None) as ws:
            _hello(ws)
            ws.send(json.dumps({"type": "open"}))
            out["conversation"] = _frame(ws, "opened")["conversation"]
            ws.send(json.dumps({"type": "send", "request": "r1", "conversation": out["conversation"],
                                "content": question, "params": {"max_tokens": 300}}))
            _frame(ws, "delta", 300)
            started.set()
            while True:
                out.setdefault("frames", []).append(json.loads(ws.recv(300)))
    except Exception as e:  # noqa: BLE001 - the connection dies with the server
        out["ended"] = repr(e)
    finally:
        started.set()


def _kill_while_writing(k1: ServeProcess, folder, timeout: float = 60) -> bool:
    """SIGKILL `k1` as soon as a snapshot's temporary file is in `folder` (True), or after
    `timeout` seconds (False)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if any(folder.glob("*/.*.tmp")):
            k1.kill()
            return True
        time.sleep(0.002)
    k1.kill()
    return False


def _send(ws, cid: str, content: str | None) -> dict:
    frame = {"type": "send", "request": "after", "conversation": cid, "params": {"max_tokens": MAX_TOKENS}}
    if content is not None:
        frame["content"] = content
    ws.send(json.dumps(frame))
    return _frame(ws, "finished", 300)


@pytest.fixture(scope="module")
def killed(model_path, tmp_path_factory):
    """K1's life under load, ended by SIGKILL mid-write: what it answered, the two
    conversations it was answering, and the folders it left."""
    root = tmp_path_factory.mktemp("sigkill")
    k1 = ServeProcess(model_path, private_env(root), *FLAGS).wait_ready()
    answered: list = []
    stop = threading.Event()
    convs = [{}, {}]
    try:
        clients = [threading.Thread(target=_client, args=(k1.url, i, answered, stop), daemon=True)
                   for i in range(CLIENTS)]
        for t in clients:
            t.start()
        t0 = time.monotonic()
        while k1.metric("panechat_kv_snapshots_written_total") < 1:  # evictions are being written
            assert time.monotonic() - t0 < 400 and k1.p.poll() is None, k1.err
            time.sleep(0.2)
        started = [threading.Event() for _ in convs]
        talkers = [threading.Thread(target=_mid_turn, args=(k1.ws_url, q, s, c), daemon=True)
                   for q, s, c in zip(WS_QUESTIONS, started, convs)]
        for t in talkers:
            t.start()
        for s in started:
            assert s.wait(300), k1.err
        assert all("conversation" in c and "ended" not in c for c in convs), convs
        mid_write = _kill_while_writing(k1, root / "cache" / "panechat" / "kv")
    finally:
        stop.set()
        k1.close()
    for t in clients + talkers:
        t.join(60)
    print(f"\nK1 killed {'while writing a snapshot' if mid_write else 'after 60 s'}; "
          f"{len(answered)} replies, {len(kv_files(root))} snapshot files left")
    return {"root": root, "answered": answered, "convs": convs, "err": k1.err}


@pytest.fixture(scope="module")
def restarted(model_path, killed):
    k2 = ServeProcess(model_path, private_env(killed["root"]), *FLAGS).wait_ready()
    yield k2
    k2.close()


def test_after_sigkill_under_load_every_reply_is_a_fresh_prefills(killed, restarted):
    assert len(killed["answered"]) >= CLIENTS, killed["err"]
    refused = [line for line in restarted.lines if "ignored and deleted" in line or "KV snapshots off" in line]
    assert not refused, refused  # no torn file: each one is whole or was never renamed into place
    assert not list((killed["root"] / "cache" / "panechat" / "kv").glob("*/.*.tmp"))
    replies = {}

    def replay(items):
        for messages, _ in items:
            replies[json.dumps(messages)] = _text(_chat(restarted.url, messages))

    threads = [threading.Thread(target=replay, args=(killed["answered"][i::CLIENTS],)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for messages, text in killed["answered"]:
        assert replies[json.dumps(messages)] == text
    assert restarted.metric("panechat_kv_snapshots_restored_total") >= 1  # the snapshots were used


def test_a_turn_cut_by_sigkill_is_unanswered_and_the_next_send_answers_or_replaces_it(killed, restarted):
    answer, replace = killed["convs"]
    with connect(restarted.ws_url, max_size=None) as ws:
        _hello(ws)
        for conv, question in zip(killed["convs"], WS_QUESTIONS):
            ws.send(json.dumps({"type": "open", "conversation": conv["conversation"]}))
            opened = _frame(ws, "opened")
            assert not opened["created"] and opened["unanswered"] is True
            assert opened["messages"][-1] == {"role": "user", "content": question}
        answered = _send(ws, answer["conversation"], None)  # answer it as it stands
        replaced = _send(ws, replace["conversation"], "Just say hello.")  # replace it
        ws.send(json.dumps({"type": "list"}))
        listed = {c["conversation"]: c for c in _frame(ws, "conversations")["conversations"]}
        ws.send(json.dumps({"type": "open", "conversation": replace["conversation"]}))
        after = _frame(ws, "opened")
    assert answered["reason"] in ("stop", "length") and replaced["reason"] in ("stop", "length")
    roles = [m["role"] for m in after["messages"] if m["role"] != "system"]
    assert roles == ["user", "assistant"] and after["messages"][-2]["content"] == "Just say hello."
    assert not after["unanswered"] and not listed[answer["conversation"]]["unanswered"]
    # each reply is the one a fresh conversation of the same turns gets
    assert answered["text"] == _text(_chat(restarted.url, [{"role": "user", "content": WS_QUESTIONS[0]}]))
    assert replaced["text"] == _text(_chat(restarted.url, [{"role": "user", "content": "Just say hello."}]))

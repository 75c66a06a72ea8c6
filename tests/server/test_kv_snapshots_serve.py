"""KV snapshots through `panechat serve` as users run it (issue 25, items 1, 4, 5 and 9).

Server A answers two plain HTTP requests (not /ws conversations), one sharing a system
prompt of 1,000+ tokens, cold, and stops with SIGTERM; the snapshots it writes then let
server B (a second process, the same folders) answer the same request with a TTFT of at
most a quarter of A's cold one and the same reply. Server C starts on a copy whose big
snapshot was edited with its checksum recomputed, beside a file whose header claims 2^40
tokens: both are deleted with one line naming them, the reply is the cold one, and the
other snapshot is still restored. Neither server assembles a model it does not load."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import httpx
import pytest

from panechat.engine.kv.snapshot import MAGIC, VERSION

from .serve_process import ServeProcess, kv_files, private_env, stream_chat

ANIMALS = ["cat", "heron", "otter", "lynx", "badger", "gecko", "falcon", "newt"]
CITIES = ["Lyon", "Oslo", "Quito", "Perth", "Nagoya", "Tunis", "Cork", "Riga"]
SYSTEM = "You keep these rules. " + " ".join(
    f"Rule {i}: the {ANIMALS[i % 8]} of {CITIES[(3 * i) % 8]} keeps {i * 7 % 97} stones." for i in range(75))
SHARED = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many stones does the newt keep?"}]
OTHER = [{"role": "system", "content": "You list colours. " + " ".join(
    f"Colour {i} is {['red', 'green', 'blue', 'amber'][i % 4]}." for i in range(60))},
    {"role": "user", "content": "Which colour is number 7?"}]
FLAGS = ("--ctx-size", "2048", "--max-concurrent", "2")
MAX_TOKENS = 12


def _serve(model_path, root) -> ServeProcess:
    srv = ServeProcess(model_path, private_env(root), *FLAGS).wait_ready()
    stream_chat(srv.url, [{"role": "user", "content": "Hi"}], 2)  # the first request: not timed
    return srv


@pytest.fixture(scope="module")
def cold(model_path, tmp_path_factory):
    """Server A's life: the replies to SHARED and OTHER, cold, and the folders it left."""
    root = tmp_path_factory.mktemp("serve-a")
    a = _serve(model_path, root)
    try:
        shared, other = stream_chat(a.url, SHARED, MAX_TOKENS), stream_chat(a.url, OTHER, MAX_TOKENS)
        assert httpx.get(a.url + "/v1/models", timeout=60).status_code == 200  # lists the catalog
    finally:
        rc = a.stop()
    assert rc == 0, a.err
    assert shared["usage"]["prompt_tokens"] >= 1000 and shared["usage"]["prompt_tokens_details"]["cached_tokens"] < 64
    assert "KV snapshots off" not in a.err, a.err
    return {"root": root, "shared": shared, "other": other, "err": a.err}


def test_a_second_server_answers_from_the_snapshots_a_stop_wrote(model_path, cold, tmp_path):
    files = kv_files(cold["root"])
    assert len(files) == 2, cold["err"]  # both plain HTTP requests' KV (the warm-up is too short)
    # item 9: serve lists models (/v1/models) and loads its own, but assembles none
    assert not (cold["root"] / "cache" / "panechat" / "models").exists()
    b = _serve(model_path, cold["root"])
    try:
        warm = stream_chat(b.url, SHARED, MAX_TOKENS)
        restored = b.metric("panechat_kv_snapshots_restored_total")
    finally:
        assert b.stop() == 0, b.err
    c = cold["shared"]
    print(f"\n{c['usage']['prompt_tokens']}-token prompt: TTFT cold {1000 * c['ttft_s']:.0f} ms (server "
          f"{c['timings']['ttft_ms']:.0f}), from the snapshot {1000 * warm['ttft_s']:.0f} ms (server "
          f"{warm['timings']['ttft_ms']:.0f})")
    assert warm["text"] == c["text"]
    assert restored == 1 and warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1000
    assert warm["ttft_s"] <= 0.25 * c["ttft_s"]


def _forge(path) -> None:
    """Change one K value and recompute a plain checksum over the file (blake2b-256, as
    version 1 of the format had), as someone who can write the cache folder would."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    data[-32:] = hashlib.blake2b(bytes(data[:-32]), digest_size=32).digest()
    path.write_bytes(bytes(data))


def _huge(path) -> None:
    """A file whose header claims 2^40 tokens."""
    head = json.dumps({"model_id": path.parent.name, "dtype": "float16", "n_layer": 30, "n_kv": 3,
                       "head_dim": 64, "n_tokens": 1 << 40}, sort_keys=True).encode()
    path.write_bytes(struct.pack("<8sII", MAGIC, VERSION, len(head)) + head + b"\0" * 4096)


def test_forged_and_impossible_snapshots_are_deleted_and_never_change_a_reply(model_path, cold, tmp_path):
    root = tmp_path / "serve-c"
    shutil.copytree(cold["root"], root)
    big, small = sorted(kv_files(root), key=lambda p: -p.stat().st_size)
    _forge(big)
    huge = big.with_name("f" * 32 + ".kvsnap")
    _huge(huge)
    c = _serve(model_path, root)
    try:
        shared = stream_chat(c.url, SHARED, MAX_TOKENS)
        other = stream_chat(c.url, OTHER, MAX_TOKENS)
        restored = c.metric("panechat_kv_snapshots_restored_total")
    finally:
        assert c.stop() == 0, c.err
    assert shared["text"] == cold["shared"]["text"]  # the forged KV was never used ...
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] < 64  # ... the prompt was prefilled
    assert other["text"] == cold["other"]["text"] and restored == 1  # the good file still serves
    lines = [line for line in c.lines if "ignored and deleted" in line]
    assert len(lines) == 2, c.err
    assert any(str(big) in line and "checksum mismatch" in line for line in lines), lines
    assert any(str(huge) in line and "impossible sizes" in line for line in lines), lines
    assert not huge.exists() and "KV snapshots off" not in c.err

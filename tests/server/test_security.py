"""What a web page may do to the server (docs/protocol.md, "Threat model"): no blind
cross-site POSTs, Origin checked against the public URL and loopback (never the client's
Host header), and the start-up warning for an open bind without a token."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from panechat.app.server.security import Origins, bind_warning

from .conftest import guarded_server

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize("headers", [
    {"content-type": "text/plain"},  # what an HTML form or a no-cors fetch can send
    {"content-type": "application/x-www-form-urlencoded"},
    {"content-type": "multipart/form-data; boundary=x"},
    {},  # a fetch() with a Blob body sends no Content-Type at all
])
def test_415_for_non_json_posts(live, http, headers):
    before = live.engine.stats().requests_finished
    r = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "Hi"}]}',
                  headers=headers)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
    assert "application/json" in err["message"]
    assert live.engine.stats().requests_finished == before  # nothing was generated
    ok = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "Hi"}], '
                   b'"max_tokens": 2}', headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200
    assert http.post("/v1/chat/completions").status_code == 400  # no body at all: nothing to refuse


def _ws_status(port: int, origin: str, host: str) -> int:
    """The HTTP status of a websocket handshake with these Origin and Host headers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall((f"GET /ws HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\nUpgrade: websocket\r\n"
                   "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                   "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = s.recv(4096)
    return int(head.split(b" ", 2)[1])


def test_origin_is_checked_against_loopback_not_the_host_header(live):
    port = live.srv.port
    # DNS rebinding: the page's own name resolves to 127.0.0.1, so Host names it too
    evil = f"rebind.example:{port}"
    assert _ws_status(port, f"http://{evil}", evil) == 403
    r = httpx.post(live.url + "/v1/chat/completions", json=CHAT, timeout=60,
                   headers={"Origin": f"http://{evil}", "Host": evil})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert httpx.get(live.url + "/v1/models", headers={"Origin": "null"}).status_code == 403
    # loopback pages (any port) may; so may clients that send no Origin
    assert _ws_status(port, "http://localhost:5173", evil) == 101
    assert _ws_status(port, f"http://127.0.0.1:{port}", f"127.0.0.1:{port}") == 101
    r = httpx.get(live.url + "/v1/models", headers={"Origin": "http://[::1]:3000"})
    assert r.status_code == 200


def test_public_url_is_the_one_other_allowed_origin(server_engine):
    with guarded_server(server_engine, public_url="https://chat.example.com") as (srv, log):
        assert _ws_status(srv.port, "https://chat.example.com", "chat.example.com") == 101
        assert _ws_status(srv.port, "https://chat.example.com", "evil.example") == 101  # Host is not read
        assert _ws_status(srv.port, "http://chat.example.com", "chat.example.com") == 403  # other scheme
        assert _ws_status(srv.port, "https://chat.example.com:8443", "chat.example.com") == 403  # other port
        assert _ws_status(srv.port, "https://evil.example", "chat.example.com") == 403
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "https://chat.example.com"})
        assert r.status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"Origin": "https://evil.example"}).status_code == 403
        assert not log.bad(), log.bad()


def test_default_public_url_follows_the_bind_address():
    o = Origins()
    o.bound("0.0.0.0", 8765)
    assert o.public_url == f"http://{socket.gethostname().lower()}:8765"
    assert o.allowed(f"http://{socket.gethostname()}:8765") and not o.allowed("http://other-host:8765")
    o.bound("192.0.2.7", 80)
    assert o.public_url == "http://192.0.2.7" and o.allowed("http://192.0.2.7") and not o.allowed("https://192.0.2.7")
    with pytest.raises(ValueError, match="--public-url"):
        Origins("chat.example.com")  # not absolute


def test_bearer_scheme_is_case_insensitive(live_token):
    for scheme in ("Bearer", "bearer", "BEARER"):  # RFC 7235: auth schemes are case-insensitive
        r = httpx.get(live_token.url + "/v1/models", headers={"Authorization": f"{scheme} sekrit"})
        assert r.status_code == 200, scheme
    assert httpx.get(live_token.url + "/v1/models", headers={"Authorization": "Basic sekrit"}).status_code == 401


def test_open_bind_without_token_warns_once_at_start(model_path):
    assert bind_warning("127.0.0.1", None) is None and bind_warning("::1", None) is None
    assert bind_warning("0.0.0.0", "t") is None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-c", "import sys; from panechat.app.cli import main; sys.exit(main())",
                          "serve", "--host", "0.0.0.0", "--port", "0", "--model", str(model_path)],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:  # no traffic: the server is only started and stopped
        first, second = p.stderr.readline(), p.stderr.readline()
    finally:
        p.kill()
        p.communicate(timeout=30)
    assert "listening on" in first, first
    assert second.startswith("panechat serve: warning: listening on 0.0.0.0 without --token"), second

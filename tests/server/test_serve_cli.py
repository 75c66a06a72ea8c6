"""`panechat serve` as a user runs it: banner, 503 while loading then 200, one log line
per request, Ctrl-C; and one-line errors for a busy port or a bad model."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from panechat.app.cli import main


def test_port_in_use_is_a_one_line_error(capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        rc = main(["serve", "--port", str(s.getsockname()[1])])
    finally:
        s.close()
    err = capsys.readouterr().err
    assert rc == 2 and "cannot listen on 127.0.0.1:" in err and "--port" in err
    assert "Traceback" not in err


def test_bad_model_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    rc = main(["serve", "--port", "0", "--model", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and "panechat: error:" in err and "Traceback" not in err


def test_bad_flag_is_a_one_line_error(capsys):
    assert main(["serve", "--port", "0", "--max-concurrent", "0"]) == 2
    assert "--max-concurrent" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--history-memory", "256"), ("--shutdown-grace", "-1"),
                                        ("--max-queue", "5000")])
def test_bad_limit_is_a_one_line_error(capsys, flag, value):
    assert main(["serve", "--port", "0", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_size_that_is_no_size_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--history-memory", "lots"])
    assert e.value.code == 2 and "is not a size" in capsys.readouterr().err


def test_serve_end_to_end(model_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-c", "import sys; from panechat.app.cli import main; sys.exit(main())", "serve", "--port", "0", "--ctx-size", "512",
                          "--max-concurrent", "2", "--model", str(model_path)],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        first = p.stderr.readline()
        m = re.search(r"listening on (http://127\.0\.0\.1:(\d+))", first)
        assert m, first
        url = m.group(1)
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/health").status_code in (200, 503)
            t0 = time.monotonic()
            while c.get("/health").status_code != 200:
                assert time.monotonic() - t0 < 120 and p.poll() is None
                time.sleep(0.2)
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 3})
            assert r.status_code == 200
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    for want in ("model: ", "backend: ", "context: ", "concurrency: ", "OpenAI API: ", "websocket: "):
        assert want in err, want
    assert re.search(r"^ready in \d+\.\d\d s \(from the process's start; weights prepared in \d+\.\d\d s\)$", err, re.M), err
    assert re.search(r'"POST /v1/chat/completions" 200 .*prompt=\d+ reused=\d+ out=\d+', err), err
    assert "Traceback" not in err


def test_server_log_follows_a_replaced_stderr(monkeypatch):
    """The log handler made by the first server in a process writes to the stderr of the
    moment: after that stderr is replaced and closed (as pytest does between tests, or a
    caller redirecting it), lines go to the new one and nothing raises."""
    import io
    import logging

    from panechat.app.server.serve import server_logger

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log = server_logger()
    log.info("one")
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    first.close()
    errors = []
    monkeypatch.setattr(logging, "raiseExceptions", True)
    monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: errors.append(record))
    log.info("two")
    assert "two" in second.getvalue() and not errors

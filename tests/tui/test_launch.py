"""`panechat` flag errors: one line on stderr, exit code 2, before the screen opens."""

from __future__ import annotations

import socket

from panechat.app.cli import main


def test_connect_needs_a_known_scheme(capsys, data_dir):
    assert main(["--connect", "ftp://example"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("panechat: error: --connect needs ws://") and "\n" not in err


def test_share_and_connect_do_not_mix(capsys, data_dir):
    assert main(["--share", "--connect", "ws://127.0.0.1:1"]) == 2
    assert "cannot be combined with --connect" in capsys.readouterr().err


def test_bad_engine_flags_fail_fast(capsys, data_dir):
    assert main(["--max-concurrent", "0"]) == 2
    assert "--max-concurrent must be between" in capsys.readouterr().err


def test_share_on_a_busy_port_fails_fast(capsys, data_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["--share", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


def test_missing_model_file_fails_fast(capsys, data_dir, tmp_path):
    assert main(["--model", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf" in capsys.readouterr().err


async def test_a_model_that_fails_to_load_exits_with_one_line(store):
    from panechat.app.clients.local import LocalBackend
    from panechat.app.tui.app import PanechatApp
    from panechat.engine.gguf.file import ModelFileError

    def build():
        raise ModelFileError("bad.gguf is not a GGUF model file (bad magic); pass a .gguf file")

    app = PanechatApp(LocalBackend(build=build), store)
    async with app.run_test() as pilot:
        for _ in range(100):
            if app.fatal_error:
                break
            await pilot.pause(0.05)
    assert app.fatal_error.startswith("bad.gguf is not a GGUF model file")
    assert app.return_code == 2

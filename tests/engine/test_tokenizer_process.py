"""A tokenizer whose Hugging Face part runs in a child process (engine/text/tokenizer_process.py,
what a model loaded beside serving ones gets) encodes exactly as the in-process one: llama.cpp's
golden ids for the default model and for gemma-3-270m (the vocabulary whose in-process build
held the GIL for seconds), with and without special-token parsing, also after its child died. Building it holds the GIL
for no long stretch, and a file it cannot build fails in one line."""

from __future__ import annotations

import threading
import time

import pytest

from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.loader import load_tokenizer
from panechat.engine.text.tokenizer import Tokenizer
from panechat.engine.text.tokenizer_process import TokenizerProcess


@pytest.fixture(scope="module")
def gemma_file(gemma_path):
    return GGUFFile.open(gemma_path)


@pytest.fixture(scope="module")
def remote_gemma(gemma_file):
    tok = load_tokenizer(gemma_file, in_process=False)
    tok.wait_ready()
    yield tok
    tok.close()


def test_the_default_model_encodes_as_llamacpp_through_the_process(model_path, golden, tokenizer):
    remote = load_tokenizer(GGUFFile.open(model_path), in_process=False)
    try:
        for case in golden["tokenize"]:
            assert remote.encode(case["text"]) == case["ids"], case["text"]
            assert remote.encode(case["text"], parse_special=False) == tokenizer.encode(case["text"], parse_special=False)
        assert remote.stop_ids == tokenizer.stop_ids and remote.token_bytes(100) == tokenizer.token_bytes(100)
        remote._encoder._p.kill()  # a child that dies (out of memory, killed) is started again
        remote._encoder._p.wait(10)
        assert remote.encode(golden["tokenize"][0]["text"]) == golden["tokenize"][0]["ids"]
    finally:
        remote.close()
    with pytest.raises(RuntimeError, match="closed"):
        remote.encode("hi")


def test_gemma_encodes_as_llamacpp_through_the_process(remote_gemma, gemma_golden):
    for case in gemma_golden["tokenize"]:
        assert remote_gemma.encode(case["text"], add_bos=False, parse_special=True) == case["ids"], case["text"]
    for case in gemma_golden["completion"]:
        assert remote_gemma.encode(case["prompt"], add_bos=None, parse_special=True) == case["prompt_ids"]
    text = "<start_of_turn>user\nHi<end_of_turn>"
    plain = remote_gemma.encode(text, add_bos=False, parse_special=False)
    assert remote_gemma.decode(plain) == text and len(plain) > 4  # the markers as text, not as ids
    assert remote_gemma.encode("", add_bos=False) == []


def test_building_beside_a_thread_never_holds_the_gil_long(gemma_file, gemma):
    """The in-process part of the build (vocabulary passes in slices) beside a thread that
    sleeps 1 ms at a time: no wait of that thread over 250 ms (the in-process HF build held
    it for 1-3 s). The same tokens, types and stop ids as the in-process tokenizer."""
    waits, stop = [], threading.Event()

    def sleeper():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            waits.append(now - last)
            last = now

    t = threading.Thread(target=sleeper)
    t.start()
    try:
        remote = Tokenizer.from_metadata(gemma_file.metadata, encoder=TokenizerProcess(gemma_file.path))
    finally:
        stop.set()
        t.join()
    try:
        assert max(waits) < 0.25, f"the GIL was held {max(waits) * 1e3:.0f} ms"
        local = gemma.tokenizer
        assert remote.stop_ids == local.stop_ids and remote.vocab_size == local.vocab_size
        assert all(remote.token_bytes(i) == local.token_bytes(i) for i in range(0, local.vocab_size, 97))
        remote.wait_ready()
    finally:
        remote.close()


def test_a_file_the_process_cannot_build_fails_in_one_line(tmp_path, model_path):
    bad = tmp_path / "gone.gguf"
    bad.write_bytes(model_path.read_bytes()[:4096])  # a header cut short
    proc = TokenizerProcess(bad)
    with pytest.raises(ValueError) as e:
        proc.wait_ready()
    assert "\n" not in str(e.value) and str(e.value)
    with pytest.raises(ValueError):
        proc.encode("hi", True)
    proc.close()
    assert proc._p.poll() is not None

"""Tokenizer tests: the default model against llama.cpp's golden ids, StreamDecoder,
and small synthetic vocabularies for the pre-tokenizer and SentencePiece paths."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from panechat.engine.text.tokenizer import (
    BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, StreamDecoder, Tokenizer,
    _bytes_to_unicode,
)

# ------------------------------------------------------------ default model vs llama.cpp


def test_golden_tokenize(tokenizer, golden):
    cases = golden["tokenize"]
    assert cases
    wrong = [(c["text"], tokenizer.encode(c["text"]), c["ids"])
             for c in cases if tokenizer.encode(c["text"]) != c["ids"]]
    assert not wrong, f"{len(wrong)}/{len(cases)} differ from llama.cpp: {wrong[:5]}"


def test_golden_ids_decode_to_text(tokenizer, golden):
    for c in golden["tokenize"]:
        assert tokenizer.decode(c["ids"]) == c["text"]
        assert b"".join(tokenizer.token_bytes(i) for i in c["ids"]) == c["text"].encode()


def test_model_facts_follow_metadata(tokenizer, gguf_meta):
    tokens = gguf_meta["tokenizer.ggml.tokens"]
    assert tokenizer.vocab_size == len(tokens)
    assert tokenizer.bos_id == gguf_meta["tokenizer.ggml.bos_token_id"]
    assert tokenizer.eos_id == gguf_meta["tokenizer.ggml.eos_token_id"]
    assert tokenizer.bos_text == tokens[tokenizer.bos_id]
    assert tokenizer.eos_text == tokens[tokenizer.eos_id]
    assert tokenizer.add_bos == gguf_meta["tokenizer.ggml.add_bos_token"]
    assert tokenizer.encode("Hi", add_bos=True) == [tokenizer.bos_id, *tokenizer.encode("Hi")]
    assert tokenizer.encode("Hi", add_eos=True)[-1] == tokenizer.eos_id


def test_every_control_token_parses_as_one_token(tokenizer, gguf_meta):
    tokens = gguf_meta["tokenizer.ggml.tokens"]
    control = [i for i, t in enumerate(gguf_meta["tokenizer.ggml.token_type"]) if t == CONTROL]
    assert control
    for i in control:
        assert tokenizer.encode(tokens[i]) == [i]
        ids = tokenizer.encode(f"x {tokens[i]}y")
        assert ids.count(i) == 1 and tokenizer.decode(ids) == f"x {tokens[i]}y"


def test_parse_special_false_keeps_control_text_as_text(tokenizer):
    text = f"{tokenizer.bos_text}user\nHi{tokenizer.eos_text}"
    ids = tokenizer.encode(text, parse_special=False)
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text)[0] == tokenizer.bos_id


def test_stop_ids(tokenizer, gguf_meta):
    tokens = gguf_meta["tokenizer.ggml.tokens"]
    assert tokenizer.eos_id in tokenizer.stop_ids
    for text in ("<|im_end|>", "<|endoftext|>"):
        assert tokens.index(text) in tokenizer.stop_ids
    assert tokenizer.bos_id not in tokenizer.stop_ids


def test_token_bytes_rejects_ids_outside_vocab(tokenizer):
    for bad in (-1, tokenizer.vocab_size):
        with pytest.raises(IndexError):
            tokenizer.token_bytes(bad)


# ------------------------------------------------------------------------ StreamDecoder


def _stream(tokenizer, ids):
    dec = StreamDecoder(tokenizer)
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


@pytest.mark.parametrize("text", ["héllo 世界 🙂 naïve", "👨\u200d👩\u200d👧 日本語のテキスト"])
def test_stream_decoder_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text)

    def is_utf8(b):
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    # The case must be real: some token must carry only part of a character.
    assert any(not is_utf8(tokenizer.token_bytes(i)) for i in ids)
    pieces, rest = _stream(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + rest == tokenizer.decode(ids) == text


def test_stream_decoder_flush_and_invalid_bytes(tokenizer):
    by_bytes = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    lead, a = by_bytes[b"\xf0"], by_bytes[b"a"]
    dec = StreamDecoder(tokenizer)
    assert dec.push(lead) == ""  # may still become a character
    assert dec.flush() == "\ufffd"  # never did
    assert dec.push(a) == "a"  # reusable after flush
    # A lead byte followed by ASCII can never complete: replaced at once, like decode().
    assert dec.push(lead) + dec.push(a) == tokenizer.decode([lead, a]) == "\ufffda"
    assert dec.flush() == ""


# ------------------------------------------------------- synthetic byte-level vocabularies

_BYTE_CHARS = [_bytes_to_unicode()[b] for b in range(256)]


def _gpt2_meta(pre, extra=(), merges=(), types=None, **keys):
    tokens = [*_BYTE_CHARS, *extra]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types or [NORMAL] * len(tokens),
        "tokenizer.ggml.merges": list(merges),
        **keys,
    }


_DIGITS = dict(extra=["12", "123", "1234"], merges=["1 2", "12 3", "123 4"])


@pytest.mark.parametrize(("pre", "pieces"), [
    ("gpt-2", ["1234"]),  # \p{N}+
    ("smollm", ["1", "2", "3", "4"]),  # \p{N} isolated first
    ("llama-bpe", ["123", "4"]),  # \p{N}{1,3}
    ("qwen2", ["1", "2", "3", "4"]),  # \p{N}
    ("deepseek-llm", ["1234"]),  # \p{N}+
    ("default", ["123", "4"]),  # ... then [0-9][0-9][0-9]
    ("no-such-pre", ["123", "4"]),  # llama.cpp falls back to 'default'
])
def test_pre_tokenizer_regexes_follow_llama_cpp(pre, pieces):
    tok = Tokenizer.from_metadata(_gpt2_meta(pre, **_DIGITS))
    assert [tok.decode([i]) for i in tok.encode("1234", add_bos=False)] == pieces


def test_llama3_matches_whole_words_before_merging():
    # "abc" is in the vocabulary but no merge reaches it: llama3 (ignore_merges) still
    # finds it, gpt-2 cannot.
    meta = dict(extra=["ab", "abc"], merges=["a b"])
    assert Tokenizer.from_metadata(_gpt2_meta("llama-bpe", **meta)).encode(
        "abc", add_bos=False) == [256 + 1]
    assert Tokenizer.from_metadata(_gpt2_meta("gpt-2", **meta)).encode("abc") == [256, ord("c")]


def test_add_bos_default_and_override():
    extra = ["<|begin_of_text|>"]
    types = [NORMAL] * 256 + [CONTROL]
    llama3 = _gpt2_meta("llama-bpe", extra, types=types, **{"tokenizer.ggml.bos_token_id": 256})
    assert Tokenizer.from_metadata(llama3).encode("a") == [256, ord("a")]
    llama3["tokenizer.ggml.add_bos_token"] = False
    assert Tokenizer.from_metadata(llama3).encode("a") == [ord("a")]


def test_special_and_user_defined_tokens():
    extra = ["<ctl>", "<usr>", "<|im_end|>"]
    types = [NORMAL] * 256 + [CONTROL, USER_DEFINED, NORMAL]
    tok = Tokenizer.from_metadata(_gpt2_meta("gpt-2", extra, types=types))
    ctl, usr, im_end = 256, 257, 258
    assert tok.encode("a<ctl>b<usr>c") == [ord("a"), ctl, ord("b"), usr, ord("c")]
    plain = tok.encode("a<ctl>b<usr>c", parse_special=False)
    assert ctl not in plain and usr in plain  # user-defined tokens always parse
    # llama.cpp treats end-of-turn texts as control tokens even when typed NORMAL.
    assert tok.encode("x<|im_end|>") == [ord("x"), im_end]
    assert im_end in tok.stop_ids
    assert tok.token_bytes(ctl) == b"<ctl>"


@pytest.mark.parametrize(("change", "fragment"), [
    ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer model"),
    ({"tokenizer.ggml.pre": "kimi-k2"}, "unsupported pre-tokenizer"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.token_type": [1]}, "token_type"),
])
def test_unsupported_metadata_is_a_one_line_value_error(change, fragment):
    meta = {**_gpt2_meta("gpt-2"), **change}
    with pytest.raises(ValueError, match=fragment) as err:
        Tokenizer.from_metadata(meta)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------- synthetic SentencePiece


def _llama_cpp_spm(text, tokens, scores):
    """Straight port of llama.cpp's llm_tokenizer_spm_session::tokenize (one fragment,
    space prefix added) used as the reference for the SPM path."""
    vocab = {t: i for i, t in enumerate(tokens)}
    text = ("\u2581" + text.replace(" ", "\u2581")) if text else ""
    sym = [[c, i - 1, i + 1 if i + 1 < len(text) else -1] for i, c in enumerate(text)]
    queue, rev_merge = [], {}

    def try_add_bigram(left, right):
        if left < 0 or right < 0:
            return
        merged = sym[left][0] + sym[right][0]
        if merged in vocab:  # highest score first, then leftmost
            heapq.heappush(queue, (-scores[vocab[merged]], left, right, len(merged)))
            rev_merge[merged] = (sym[left][0], sym[right][0])

    for i in range(1, len(sym)):
        try_add_bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not sym[left][0] or not sym[right][0] \
                or len(sym[left][0]) + len(sym[right][0]) != size:
            continue  # outdated bigram
        sym[left][0] += sym[right][0]
        sym[right][0] = ""
        sym[left][2] = sym[right][2]
        if sym[right][2] >= 0:
            sym[sym[right][2]][1] = left
        try_add_bigram(sym[left][1], left)
        try_add_bigram(left, sym[left][2])
    out = []

    def resegment(piece):
        if piece in vocab:
            out.append(vocab[piece])
        elif piece in rev_merge:
            for part in rev_merge[piece]:
                resegment(part)
        else:
            out.extend(vocab[f"<0x{b:02X}>"] for b in piece.encode())

    i = 0 if sym else -1
    while i != -1:
        resegment(sym[i][0])
        i = sym[i][2]
    return out


@pytest.fixture(scope="module")
def spm():
    rng = random.Random(1234)
    alphabet = "abcdeh\u2581"
    pieces = set(alphabet)
    while len(pieces) < 150:
        pieces.add("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5))))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *sorted(pieces)]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0] * 259 + [-rng.random() * 100 for _ in pieces]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    return Tokenizer.from_metadata(meta), meta, rng


def test_spm_matches_llama_cpp_algorithm(spm):
    tok, meta, rng = spm
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    for _ in range(500):
        text = "".join(rng.choice("abcdeh  xé") for _ in range(rng.randint(1, 24)))
        assert tok.encode(text, add_bos=False) == _llama_cpp_spm(text, tokens, scores), text


def test_spm_bos_space_prefix_and_byte_fallback(spm):
    tok, meta, _ = spm
    ids = tok.encode("é a")
    assert ids[0] == 1  # SPM models add BOS unless the GGUF says otherwise
    assert tok.decode(ids) == "<s> é a"  # prefix space; é via <0xC3><0xA9>
    # The space prefix is added again after a special token, as llama.cpp does.
    assert tok.decode(tok.encode("a</s>b", add_bos=False)) == " a</s> b"
    no_prefix = Tokenizer.from_metadata({**meta, "tokenizer.ggml.add_space_prefix": False})
    assert no_prefix.decode(no_prefix.encode("a b", add_bos=False)) == "a b"
    assert tok.eos_id in tok.stop_ids


def _spm_cache_files(root):
    return sorted((root / "panechat" / "derived").glob("spm-merges-*.npy"))


def test_spm_merges_are_cached_and_a_damaged_cache_is_rebuilt(spm, tmp_path, monkeypatch):
    """The SPM merge list (seconds of Python for a 262k vocabulary) is kept in the XDG cache
    under a hash of the vocabulary; a cached, a garbled and a bit-flipped entry all give the
    tokenizer llama.cpp's algorithm gives, and a bad entry is replaced."""
    _, meta, _ = spm
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    rng = random.Random(7)
    texts = ["".join(rng.choice("abcdeh  xé") for _ in range(rng.randint(1, 24))) for _ in range(200)]
    want = [_llama_cpp_spm(t, tokens, scores) for t in texts]

    def check() -> None:
        tok = Tokenizer.from_metadata(meta)
        assert [tok.encode(t, add_bos=False) for t in texts] == want

    check()  # builds and stores
    (entry,) = _spm_cache_files(tmp_path)
    good = entry.read_bytes()
    check()  # from the cache
    entry.write_bytes(b"not an array")
    check()
    assert entry.read_bytes() == good  # rewritten
    flipped = np.load(entry)
    flipped[5, 1] += 1  # still a well-formed array: the checksum catches it
    np.save(entry, flipped)
    check()
    assert entry.read_bytes() == good
    # another vocabulary (one score changed) gets its own entry
    Tokenizer.from_metadata({**meta, "tokenizer.ggml.scores": [*scores[:-1], scores[-1] - 1]})
    assert len(_spm_cache_files(tmp_path)) == 2


def test_an_unwritable_cache_only_costs_time(spm, tmp_path, monkeypatch):
    _, meta, _ = spm
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("abc deh", add_bos=False) == _llama_cpp_spm("abc deh", meta["tokenizer.ggml.tokens"],
                                                                   meta["tokenizer.ggml.scores"])

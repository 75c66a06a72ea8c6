"""The vocabulary a grammar engine needs: our GGUF tokenizer as an `llguidance.LLTokenizer`.

Reference followed: llguidance's `llamacpp.py` (`lltokenizer_from_vocab`): each token's
bytes as llama.cpp's `token_to_piece` renders them, special tokens prefixed with 0xFF so
that a grammar's text never matches them, and the model's own tokenizer for the text a
grammar forces. Building one walks the whole vocabulary (about a second), so it is built
once per tokenizer, on first use, and shared (an LLTokenizer is immutable).
"""

from __future__ import annotations

import threading
import weakref

import llguidance

from panechat.engine.text.tokenizer import Tokenizer

_SPECIAL = b"\xff"  # llguidance's mark of a special token
_built: "weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _Vocab:
    """What `llguidance.TokenizerWrapper` reads: token bytes, BOS/EOS, special ids and an
    encoder (text or UTF-8 bytes -> ids, special-token text left as text)."""

    def __init__(self, tok: Tokenizer):
        n = tok.vocab_size
        special = [i for i in range(n) if tok.is_special(i)]
        marked = set(special)
        self.tokens = [(_SPECIAL if i in marked else b"") + tok.token_bytes(i) for i in range(n)]
        self.special_token_ids = special
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.stop_ids, default=0)
        self.bos_token_id = tok.bos_id
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, parse_special=False, add_eos=False)


def ll_tokenizer(tok: Tokenizer) -> llguidance.LLTokenizer:
    """The LLTokenizer of `tok`, built on the first call and the same object after (its
    EOS tokens: every stop id of the model, so a finished grammar may end on any)."""
    with _lock:
        built = _built.get(tok)
        if built is None:
            vocab = _Vocab(tok)
            eos = sorted(tok.stop_ids) or [vocab.eos_token_id]
            built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=tok.vocab_size,
                                           eos_token=eos)
            _built[tok] = built
        return built

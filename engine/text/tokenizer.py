"""Text <-> token ids for a GGUF model, matching llama.cpp.

Reference followed: llama.cpp ``src/llama-vocab.cpp`` (vocab loading, pre-tokenizer
regexes per ``tokenizer.ggml.pre``, special-token partitioning, ``token_to_piece``).
The BPE merging itself is done by the Hugging Face ``tokenizers`` library, which is
configured from the GGUF metadata so that it splits and merges the way llama.cpp does:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE.  The text is cut by the regexes
  llama.cpp uses for the model's pre-tokenizer (applied one after the other, each
  one keeping both its matches and the text between them, like llama.cpp's
  ``unicode_regex_split``), then mapped to GPT-2 byte characters and merged by
  merge rank.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE.  Spaces become
  ``U+2581``, a space is prefixed to each text fragment (``add_space_prefix``), pieces
  are merged highest score first, and characters not in the vocabulary fall back to
  ``<0xNN>`` byte tokens.

Control, unknown and user-defined tokens are matched in the raw text before any of
that, as llama.cpp's ``tokenizer_st_partition`` does; with ``parse_special=False`` only
user-defined tokens are.
"""

from __future__ import annotations

import codecs
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from panechat.engine.text.derived_cache import content_key, load_rows, save_rows
from panechat.engine.text.tokenizer_process import TokenizerProcess

__all__ = ["Tokenizer", "StreamDecoder"]

log = logging.getLogger(__name__)

# gguf TokenType values (gguf.constants.TokenType / llama.cpp LLAMA_TOKEN_TYPE_*).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Tokens per C-level pass over a vocabulary (a few ms each): between passes the GIL is let go,
# so a model loading beside serving ones never stops their streams for a whole vocabulary.
_SLICE = 16384

# Tokens llama.cpp treats as end-of-generation by their text (llama-vocab.cpp,
# special_eog_ids), plus DeepSeek's, which it finds as the EOT token.  llama.cpp also
# forces these to CONTROL type, so they parse as single tokens.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
    "<end_of_utterance>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
)

# ---------------------------------------------------------------------------------
# Pre-tokenizer regexes, copied from llm_tokenizer_bpe's constructor in llama-vocab.cpp.
# ---------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Cased letters of DeepSeek-LLM's tokenizer.json, written as escapes because several of
# them (U+1FBE, U+2126, U+212A, ...) change under Unicode normalisation.
_DEEPSEEK_CASED = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57"
    "\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
    "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f"
    "\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK3_MAIN = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class _Pre:
    """One llama.cpp pre-tokenizer type: its regexes and the flags it sets."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # whole word in vocab -> one token, no merging
    add_bos: bool = False  # default for add_bos_token when the GGUF does not say


_DEFAULT = _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE_GPT2 = _Pre((_GPT2,))
_PRE_LLAMA3 = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_STARCODER = _Pre((r"\p{N}", _GPT2))
_PRE_QWEN2 = _Pre((_QWEN2,))


def _names(names: str, pre: _Pre) -> dict[str, _Pre]:
    return dict.fromkeys(names.split(), pre)


# tokenizer.ggml.pre -> pre-tokenizer, as in llama_vocab::impl::load.
_PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _DEFAULT,
    # "gpt2" is not a name llama.cpp knows (it writes "gpt-2"); accepted as an alias.
    **_names("gpt2 gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 "
             "mellum jina-v1-en jina-v2-code roberta-bpe mpt olmo jais trillion "
             "granite-docling exaone4", _PRE_GPT2),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
             _PRE_LLAMA3),
    **_names("dbrx smaug-bpe", _Pre((_LLAMA3,))),
    **_names("glm4 chatglm-bpe", _Pre((_LLAMA3,))),
    "deepseek-llm": _Pre((
        "[\r\n]",
        "\\s?[" + _DEEPSEEK_CASED + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK_HANGUL,
        r"\p{N}+",
    )),
    "deepseek-coder": _Pre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    **_names("deepseek-v3 hunyuan-dense", _Pre((
        r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK3_MAIN))),
    "falcon": _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b",
             _PRE_STARCODER),
    **_names("qwen2 deepseek-r1-qwen kormo megrez stablelm2 hunyuan", _PRE_QWEN2),
    **_names("poro-chat bloom gpt3-finnish", _Pre((_PORO,))),
    "viking": _Pre((_PORO, r"\p{N}")),
    "tekken": _Pre((_TEKKEN,), ignore_merges=True, add_bos=True),
    **_names("gpt-4o llama4 minimax-m2", _Pre((_GPT4O,))),
    "chameleon": _Pre((
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ), add_bos=True),
    "seed-coder": _Pre((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "grok-2": _PRE_QWEN2,
    **_names("bailingmoe bailingmoe2 llada-moe", _Pre((
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",))),
}

# Pre-tokenizers llama.cpp implements with hand-written code rather than a regex.
_UNSUPPORTED_PRE = frozenset({"kimi-k2", "afmoe", "superbpe"})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (llama.cpp unicode.cpp)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_OF_CHAR: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_bytes(text: str) -> bytes:
    """Raw bytes of a byte-level BPE token text (characters outside the table: UTF-8)."""
    out = bytearray()
    for ch in text:
        b = _BYTE_OF_CHAR.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _spm_byte(text: str) -> int | None:
    """The byte of an SPM byte token such as ``<0x0A>``, or None if it is not one."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _get_id(meta: Mapping[str, Any], key: str, n_vocab: int, default: int | None) -> int | None:
    value = meta.get(key)
    if value is None:
        return default
    value = int(value)
    if not 0 <= value < n_vocab:
        log.warning("ignoring %s = %d: outside the vocabulary of %d tokens", key, value, n_vocab)
        return default
    return value


class Tokenizer:
    """A GGUF model's tokenizer: encodes text the way llama.cpp does and decodes ids.

    Build it with :meth:`from_metadata`.  Instances are immutable and safe to share
    between threads.
    """

    def __init__(
        self,
        *,
        tokens: list[str],
        token_types: list[int],
        piece_bytes: list[bytes],
        hf: _HFTokenizer | None,
        model: str,
        pre: str,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        encoder: TokenizerProcess | None = None,
    ) -> None:
        """Internal: use :meth:`from_metadata`."""
        self._encoder = encoder
        self._tokens = tokens
        self._types = token_types
        self._bytes = piece_bytes
        self._hf = hf
        self._hf_plain: _HFTokenizer | None = None
        self._hf_plain_lock = threading.Lock()
        self._model = model
        self._pre = pre
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._stop_ids = stop_ids
        self._add_bos = add_bos
        self._add_eos = add_eos

    # ----------------------------------------------------------------------- build

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], encoder: TokenizerProcess | None = None) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (``{key: field.contents()}``).

        ``encoder``: a `TokenizerProcess` of the same file, which then builds and runs the
        Hugging Face part (seconds of one GIL-holding call for a large vocabulary) in its
        own process; the ids are the same.

        Supports ``tokenizer.ggml.model`` ``"gpt2"`` (byte-level BPE, any
        ``tokenizer.ggml.pre`` llama.cpp implements with regexes; an unknown or missing
        name falls back to llama.cpp's ``default`` pre-tokenizer, as llama.cpp does) and
        ``"llama"`` (SentencePiece BPE with byte fallback).  Raises ``ValueError`` with a
        one-line message for other models, for pre-tokenizers llama.cpp implements with
        custom code, and for missing or malformed vocabulary metadata.
        """
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
        raw_tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(raw_tokens, (list, tuple)) or not raw_tokens \
                or set(map(type, raw_tokens)) != {str}:
            raise ValueError("GGUF metadata has no usable tokenizer.ggml.tokens string list")
        n = len(raw_tokens)
        # llama.cpp renames empty tokens so that every text maps back to one id.
        tokens = list(raw_tokens)
        if "" in tokens:
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        raw_types = meta.get("tokenizer.ggml.token_type")
        if raw_types is None:
            types = [NORMAL] * n
        elif len(raw_types) != n:
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(raw_types)} entries for {n} tokens")
        else:
            types = _in_slices(lambda part: list(map(int, part)), raw_types)
        # text -> id, which only the in-process HF build needs (a 262k-entry dict is tens of
        # ms of GIL even in slices); the end-of-generation ids are found without it
        vocab = None if encoder else _vocab_of(tokens)

        # End-of-generation tokens found by text are forced to CONTROL, as in llama.cpp.
        eog_by_text = {vocab[t] for t in _EOG_TEXTS if t in vocab} if vocab is not None \
            else _last_ids(tokens, _EOG_TEXTS)
        for i in eog_by_text:
            types[i] = CONTROL

        if model == "gpt2":
            pre_name = str(meta.get("tokenizer.ggml.pre") or "default")
            if pre_name in _UNSUPPORTED_PRE:
                raise ValueError(
                    f"unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre): llama.cpp "
                    "implements it with custom code that panechat does not replicate")
            pre = _PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                log.warning("unknown pre-tokenizer %r, using llama.cpp's 'default'", pre_name)
                pre = _DEFAULT
            hf = None if encoder else _build_byte_level(meta, vocab, pre)
            piece_bytes = _all_piece_bytes(tokens, types, _piece_bytes_bpe, _byte_level_all)
            add_bos_default, bos_default, eos_default = pre.add_bos, None, None
        else:
            pre_name = "spm"
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            hf = None if encoder else _build_spm(meta, tokens, types, vocab, add_space_prefix)
            piece_bytes = _all_piece_bytes(tokens, types, _piece_bytes_spm, _spm_all)
            add_bos_default, bos_default, eos_default = True, 1, 2

        if hf is not None:
            _add_special_tokens(hf, tokens, types)

        bos_id = _get_id(meta, "tokenizer.ggml.bos_token_id", n, bos_default)
        eos_id = _get_id(meta, "tokenizer.ggml.eos_token_id", n, eos_default)
        eot_id = _get_id(meta, "tokenizer.ggml.eot_token_id", n, None)
        eom_id = _get_id(meta, "tokenizer.ggml.eom_token_id", n, None)
        stop = set(eog_by_text)
        stop.update(i for i in (eos_id, eot_id, eom_id) if i is not None)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        return cls(
            tokens=tokens, token_types=types, piece_bytes=piece_bytes, hf=hf, model=model,
            pre=pre_name, bos_id=bos_id, eos_id=eos_id, stop_ids=frozenset(stop),
            add_bos=add_bos, add_eos=add_eos, encoder=encoder,
        )

    def wait_ready(self) -> None:
        """Return once encoding works; raises ValueError (one line) when the tokenizer's
        process could not build it (an in-process tokenizer is ready when built)."""
        if self._encoder is not None:
            self._encoder.wait_ready()

    def close(self) -> None:
        """End the tokenizer's process, if it has one (encoding then fails); for a model
        being unloaded."""
        if self._encoder is not None:
            self._encoder.close()

    # ----------------------------------------------------------------- properties

    @property
    def model(self) -> str:
        """``tokenizer.ggml.model``: ``"gpt2"`` or ``"llama"``."""
        return self._model

    @property
    def pre(self) -> str:
        """The pre-tokenizer name in use (``"spm"`` for SentencePiece models)."""
        return self._pre

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (ids are ``0 .. vocab_size-1``)."""
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence token id, or None if the model has none."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence token id, or None if the model has none."""
        return self._eos_id

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, eot and eom from the metadata, plus every
        end-of-turn token llama.cpp recognises by text (``<|im_end|>``, ``<|eot_id|>``,
        ``<|endoftext|>``, ``<|end|>``, ``<end_of_turn>``, ...) present in the vocab."""
        return self._stop_ids

    @property
    def bos_text(self) -> str:
        """Text of the BOS token ("" if the model has none)."""
        return "" if self._bos_id is None else self._tokens[self._bos_id]

    @property
    def eos_text(self) -> str:
        """Text of the EOS token ("" if the model has none)."""
        return "" if self._eos_id is None else self._tokens[self._eos_id]

    @property
    def add_bos(self) -> bool:
        """Whether :meth:`encode` adds BOS by default (``tokenizer.ggml.add_bos_token``)."""
        return self._add_bos

    # -------------------------------------------------------------------- encode

    def encode(
        self,
        text: str,
        add_bos: bool | None = None,
        parse_special: bool = True,
        add_eos: bool | None = None,
    ) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize`` gives them.

        ``add_bos``/``add_eos``: None follows the model's ``add_bos_token`` /
        ``add_eos_token`` flags.  ``parse_special``: when True, control tokens written
        in the text (``<|im_start|>``) become their single ids; when False only
        user-defined tokens do and control-token text is tokenized as plain text.
        Raises ``ValueError`` if BOS/EOS is asked for but the model has none.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        if not text:
            ids = []
        elif self._encoder is not None:
            ids = self._encoder.encode(text, parse_special)
        else:
            hf = self._hf if parse_special else self._plain_hf()
            # encode_batch releases the GIL (encode holds it: seconds for a 1 MB prompt, during
            # which a server's event loop could answer nothing); one input, the same ids. The
            # _fast form (tokenizers >= 0.20) keeps no offsets: freeing a 280k-token encoding,
            # which holds the GIL, takes 2 ms instead of 30-40 ms
            ids = getattr(hf, "encode_batch_fast", hf.encode_batch)([text], add_special_tokens=False)[0].ids
        if self._add_bos if add_bos is None else add_bos:
            if self._bos_id is None:
                raise ValueError("cannot add BOS: this model has no BOS token")
            ids.insert(0, self._bos_id)
        if self._add_eos if add_eos is None else add_eos:
            if self._eos_id is None:
                raise ValueError("cannot add EOS: this model has no EOS token")
            ids.append(self._eos_id)
        return ids

    def _plain_hf(self) -> _HFTokenizer:
        """A copy of the HF tokenizer that leaves control-token text unparsed."""
        if self._hf_plain is None:
            with self._hf_plain_lock:
                if self._hf_plain is None:
                    plain = _HFTokenizer.from_str(self._hf.to_str())
                    plain.encode_special_tokens = True
                    self._hf_plain = plain
        return self._hf_plain

    # -------------------------------------------------------------------- decode

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one token stands for (llama.cpp ``token_to_piece`` with special
        tokens rendered): byte-level BPE characters mapped back to bytes, SPM ``▁`` to
        a space and ``<0xNN>`` to that byte, control/user-defined tokens as their UTF-8
        text, unused tokens as ``b""``.  Raises ``IndexError`` for ids outside the vocab.
        """
        i = int(token_id)
        if not 0 <= i < len(self._bytes):
            raise IndexError(f"token id {i} outside the vocabulary (0..{len(self._bytes) - 1})")
        return self._bytes[i]

    def is_special(self, token_id: int) -> bool:
        """True for a control, unknown or user-defined token written like one (``<...>``):
        a token that stands for a marker rather than for its text (llguidance's
        llama.cpp vocabulary treats the same tokens as special)."""
        ttype = self._types[int(token_id)]
        text = self._tokens[int(token_id)]
        return ttype in (CONTROL, UNKNOWN) or (ttype == USER_DEFINED and text.startswith("<") and text.endswith(">"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids: the concatenated :meth:`token_bytes` decoded as
        UTF-8 with invalid bytes replaced by U+FFFD.  Special tokens are kept as text
        and no leading space is stripped, so it equals what a :class:`StreamDecoder`
        yields for the same ids."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self._model!r}, pre={self._pre!r}, "
                f"vocab_size={self.vocab_size}, bos_id={self._bos_id}, eos_id={self._eos_id})")


# --------------------------------------------------------------------- builders


def _build_byte_level(meta: Mapping[str, Any], vocab: dict[str, int], pre: _Pre) -> _HFTokenizer:
    """HF byte-level BPE with llama.cpp's regex split for ``pre``."""
    raw_merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(raw_merges, (list, tuple)):
        raise ValueError("GGUF metadata has no tokenizer.ggml.merges list (needed for 'gpt2')")
    merges: list[tuple[str, str]] = []
    for m in raw_merges:
        # llama.cpp splits at the first space after the first character.
        pos = m.find(" ", 1)
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1:]
        # HF needs both parts and the result in the vocabulary; a merge that makes an
        # unknown token could never yield a token anyway.
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
        raise ValueError(f"cannot build BPE from GGUF vocabulary: {e}") from None
    hf = _HFTokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf


def _build_spm(
    meta: Mapping[str, Any],
    tokens: list[str],
    types: list[int],
    vocab: dict[str, int],
    add_space_prefix: bool,
) -> _HFTokenizer:
    """HF BPE that reproduces llama.cpp's SPM tokenizer.

    llama.cpp repeatedly merges the adjacent pair whose concatenation is the vocabulary
    token with the highest score.  That is BPE with one merge ``(left, right)`` for every
    way of splitting each token into two vocabulary tokens, ranked by the merged token's
    score (highest first).
    """
    n = len(tokens)
    raw_scores = meta.get("tokenizer.ggml.scores")
    scores = [0.0] * n if raw_scores is None else list(map(float, raw_scores))
    if len(scores) != n:
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    ranked = _spm_merge_cuts(tokens, types, scores, vocab)
    unk_id = _get_id(meta, "tokenizer.ggml.unknown_token_id", n, 0)
    try:
        bpe = models.BPE(
            vocab=vocab,
            merges=[(tokens[tid][:cut], tokens[tid][cut:]) for tid, cut in ranked],
            unk_token=tokens[unk_id] if unk_id is not None else None,
            byte_fallback=True,
        )
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot build SentencePiece BPE from GGUF vocabulary: {e}") from None
    hf = _HFTokenizer(bpe)
    steps = [normalizers.Replace(" ", _SPM_SPACE)]
    if add_space_prefix:
        # Applied to every text fragment between special tokens, like llama.cpp's
        # "prefix with space if previous is special".
        steps.append(normalizers.Prepend(_SPM_SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    return hf


def _spm_merge_cuts(tokens: list[str], types: list[int], scores: list[float],
                    vocab: dict[str, int]) -> list[tuple[int, int]]:
    """The SPM merges as (token id, cut) in rank order: every split of a token into two
    vocabulary tokens, the merged token's score highest first (ties by id, then cut).

    A 262k-token vocabulary has ~0.5M of them and finding them costs seconds of Python, so
    they are kept in the user cache (`derived_cache`) under a hash of the vocabulary,
    types and scores; a cached list that does not fit the vocabulary is rebuilt."""
    key = content_key("spm-merges-v1", "\x00".join(tokens).encode("utf-8", "surrogatepass"),
                      np.asarray(types, np.int64).tobytes(), np.asarray(scores, np.float64).tobytes())
    cached = load_rows(key, 2)
    if cached is not None:
        lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
        tid, cut = cached[:, 0].astype(np.int64), cached[:, 1].astype(np.int64)
        if len(tid) == 0 or (tid.min() >= 0 and tid.max() < len(tokens) and cut.min() >= 1
                             and bool(np.all(cut < lengths[np.clip(tid, 0, len(tokens) - 1)]))):
            return list(zip(tid.tolist(), cut.tolist()))
    ranked: list[tuple[float, int, int]] = []
    for tid, text in enumerate(tokens):
        n = len(text)
        if n < 2 or types[tid] == BYTE or vocab[text] != tid:
            continue
        cuts = [c for c in range(1, n) if text[:c] in vocab and text[c:] in vocab]
        if cuts:
            neg = -scores[tid]
            ranked.extend((neg, tid, c) for c in cuts)
    ranked.sort()
    out = [(tid, cut) for _, tid, cut in ranked]
    save_rows(key, np.array(out, np.int32).reshape(-1, 2))
    return out


def _add_special_tokens(hf: _HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Register control/unknown tokens as special and user-defined ones as added tokens,
    all matched on the raw text (llama.cpp's special-token cache)."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)


def _in_slices(fn, items: list) -> list:
    """`fn(items)` for a function that maps a list element-wise, done `_SLICE` items at a
    time with the GIL let go between slices; the same list."""
    if len(items) <= _SLICE:
        return fn(items)
    out: list = []
    for a in range(0, len(items), _SLICE):
        out += fn(items[a:a + _SLICE])
        time.sleep(0)  # lets a waiting thread take the GIL
    return out


def _vocab_of(tokens: list[str]) -> dict[str, int]:
    """text -> id; on duplicates the last id wins, like llama.cpp's token_to_id (built in
    slices, in order, so the last one still wins)."""
    vocab: dict[str, int] = {}
    for a in range(0, len(tokens), _SLICE):
        vocab.update(zip(tokens[a:a + _SLICE], range(a, a + _SLICE)))
        time.sleep(0)
    return vocab


def _last_ids(tokens: list[str], texts: Iterable[str]) -> set[int]:
    """The id each of `texts` has in the vocabulary (the last one on duplicates, as
    `_vocab_of` gives), for those present."""
    backwards = tokens[::-1]
    found = set()
    for t in texts:
        try:
            found.add(len(tokens) - 1 - backwards.index(t))
        except ValueError:
            pass
        time.sleep(0)
    return found


def _all_piece_bytes(tokens: list[str], types: list[int], one, normal_all) -> list[bytes]:
    """Every token's bytes (`_piece_bytes_of`), `_SLICE` tokens at a time."""
    out: list[bytes] = []
    for a in range(0, len(tokens), _SLICE):
        out += _piece_bytes_of(tokens[a:a + _SLICE], types[a:a + _SLICE], one, normal_all)
        time.sleep(0)
    return out


def _piece_bytes_of(tokens: list[str], types: list[int], one, normal_all) -> list[bytes]:
    """The bytes of these tokens: `normal_all` renders them all as NORMAL tokens in a few
    C-level string passes (None when it cannot), then the other types one by one."""
    others = np.flatnonzero(np.asarray(types) != NORMAL).tolist()
    texts = list(tokens)
    for i in others:
        texts[i] = ""
    out = normal_all(texts)
    if out is None:
        return [one(t, ty) for t, ty in zip(tokens, types)]
    for i in others:
        out[i] = one(tokens[i], types[i])
    return out


def _joined(tokens: list[str]) -> str | None:
    """The tokens joined by NUL, or None when a token holds a NUL itself."""
    joined = "\x00".join(tokens)
    return joined if joined.count("\x00") == len(tokens) - 1 else None


def _spm_all(tokens: list[str]) -> list[bytes] | None:
    joined = _joined(tokens)
    if joined is None:
        return None
    return joined.replace(_SPM_SPACE, " ").encode("utf-8").split(b"\x00")


_TO_BYTE = {ord(c): b for c, b in _BYTE_OF_CHAR.items()}  # str.translate: GPT-2 character -> byte
_BYTE_LEVEL_CHARS = frozenset(_BYTE_OF_CHAR)


def _byte_level_all(tokens: list[str]) -> list[bytes] | None:
    """`_byte_level_bytes` of every token at once, when every character is in GPT-2's table:
    each character is then one byte, so token i is bytes [ends[i-1], ends[i])."""
    joined = "".join(tokens)
    if not set(joined) <= _BYTE_LEVEL_CHARS:
        return None
    data = joined.translate(_TO_BYTE).encode("latin-1")
    ends = np.cumsum(np.fromiter(map(len, tokens), np.int64, len(tokens))).tolist()
    return [data[a:b] for a, b in zip([0, *ends[:-1]], ends)]


def _piece_bytes_bpe(text: str, ttype: int) -> bytes:
    if ttype in (CONTROL, UNKNOWN, USER_DEFINED):
        return text.encode("utf-8")
    if ttype == NORMAL:
        return _byte_level_bytes(text)
    return b""  # unused / byte / undefined: llama.cpp renders nothing


def _piece_bytes_spm(text: str, ttype: int) -> bytes:
    if ttype in (CONTROL, UNKNOWN, USER_DEFINED):
        return text.encode("utf-8")
    if ttype == NORMAL:
        return text.replace(_SPM_SPACE, " ").encode("utf-8")
    if ttype == BYTE:
        b = _spm_byte(text)
        return b"" if b is None else bytes([b])
    return b""


# ------------------------------------------------------------------------ stream


class StreamDecoder:
    """Turns generated token ids into text as they arrive.

    :meth:`push` returns only complete characters: a UTF-8 sequence split across
    tokens is held back until its last byte arrives, so no partial character is ever
    emitted as U+FFFD.  Bytes that can never form a valid character are replaced by
    U+FFFD as soon as that is certain.  Work per token is proportional to that token's
    bytes only.  Concatenating every :meth:`push` result and the final :meth:`flush`
    equals ``tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Return whatever is still held (an incomplete sequence becomes U+FFFD) and
        reset, so the decoder can be reused for a new stream."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text

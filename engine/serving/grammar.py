"""Structured output: a grammar's token mask as a logits processor (llguidance).

Reference followed: llguidance's `numpy.py` (bitmask fill) and vLLM's structured-output
manager (the next step's mask computed while this step runs). The grammar engine is
llguidance: it takes JSON schemas, Lark and (converted) GBNF, and needs no torch;
xgrammar needs torch, outlines-core has no Lark or GBNF.

A row's mask depends on its own tokens only, so a constrained row picks the same tokens
alone and batched. The mask of token n+1 is computed in a worker thread from the moment
token n is known (`prefetch`) while the next forward pass runs (llguidance drops the GIL
while it computes); `apply` then only waits for it and writes -inf where it is 0. Once
the grammar is complete only the model's stop tokens are allowed: the reply ends 'stop'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from panechat.engine.serving.invalid_request import InvalidRequest

#: One worker for every engine's grammar work: it overlaps the forward pass, and masks of
#: one row are computed in order.
_WORKER = ThreadPoolExecutor(1, thread_name_prefix="panechat-grammar")


#: JSON written without free whitespace: a small model held to a schema may otherwise pad
#: with newlines to its token limit (a schema's "x-guidance" options still apply over it).
COMPACT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The tokens so far leave the grammar (cannot happen with the mask applied): the row
    fails alone."""


def json_schema_grammar(schema: dict | bool, param: str = "response_format") -> str:
    """The llguidance grammar of a JSON schema (OpenAI's strict json_schema mode); a schema
    that is not an object is InvalidRequest naming `param`."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{param}: the JSON schema must be an object", param=param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)
    except ValueError as e:
        raise InvalidRequest(f"{param}: the JSON schema is not usable: {e}", param=param) from None


def json_object_grammar() -> str:
    """Any JSON object (`response_format` {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def response_format_grammar(fmt: dict | None) -> str | None:
    """The grammar of OpenAI's `response_format` (already checked: `type` "text",
    "json_object" or "json_schema" with `json_schema.schema`); None for free text."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return json_object_grammar()
    return json_schema_grammar(fmt["json_schema"].get("schema", {"type": "object"}))


def text_grammar(text: str, param: str = "grammar") -> str:
    """The llguidance grammar of a Lark or GBNF grammar (llama.cpp's `grammar` field; GBNF
    is converted to Lark by llguidance); InvalidRequest naming `param` when it does not parse."""
    try:
        return llguidance.grammar_from("gbnf", text)
    except ValueError as e:
        raise InvalidRequest(f"{param} is not a Lark or GBNF grammar: {_one_line(e)}", param=param) from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


class GrammarMask:
    """One request's grammar as a LogitsProcessor: before each token, its logits outside
    the grammar become -inf (the stop tokens allowed only where the grammar may end)."""

    def __init__(self, grammar: str, ll_tokenizer: llguidance.LLTokenizer, stop_ids: frozenset[int],
                 n_logits: int):
        """Compile `grammar` for `ll_tokenizer` (milliseconds for a JSON schema; GIL dropped);
        InvalidRequest (a 400) when it does not compile."""
        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequest(f"the grammar does not compile: {_one_line(self._matcher.get_error())}",
                                 param="grammar")
        self._bits = allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        self._allowed = np.zeros(n_logits, bool)  # ids past the tokenizer's stay banned
        self._n_vocab = min(ll_tokenizer.vocab_size, n_logits)
        self._stops = np.fromiter(sorted(t for t in stop_ids if t < n_logits), np.int64)
        self._consumed = 0  # output tokens the matcher has taken
        self._mask_at = -1  # the `_consumed` the mask in `_allowed` is for
        self._pending: Future | None = None

    def prefetch(self, output_ids: Sequence[int]) -> None:
        """Start the mask for the token after `output_ids` in the worker (called once the
        step's tokens are known, so it runs while the next forward pass does)."""
        if self._pending is None and len(output_ids) != self._mask_at:
            try:
                self._pending = _WORKER.submit(self._advance, list(output_ids[self._consumed:]))
            except RuntimeError:  # the interpreter is shutting down: `apply` computes it in line
                pass

    def apply(self, logits: Any, output_ids: Sequence[int], xp: ModuleType) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        if self._mask_at != len(output_ids):  # no prefetch (the first token, a preempted row)
            self._advance(list(output_ids[self._consumed:]))
        allowed = self._allowed if xp is np else xp.asarray(self._allowed)  # one copy to the device
        logits[...] = xp.where(allowed, logits, np.float32(-np.inf))

    def _advance(self, new: list[int]) -> None:
        """Take `new` tokens, then compute the next mask into `_allowed`."""
        m = self._matcher
        if new and not m.consume_tokens(new):
            raise GrammarError(f"the reply left its grammar: {_one_line(m.get_error())}")
        self._consumed += len(new)
        fill_next_token_bitmask(m, self._bits, 0)  # drops the GIL
        if m.is_error():
            raise GrammarError(f"grammar error: {_one_line(m.get_error())}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        self._allowed[:self._n_vocab] = bits[:self._n_vocab]
        self._allowed[self._stops] = m.is_accepting()
        self._mask_at = self._consumed

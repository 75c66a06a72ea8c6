"""The engine's TokenLogprobs (engine/serving/logprobs.py) in OpenAI's two shapes: chat's
`logprobs.content` (token, logprob, bytes, top_logprobs) and legacy completions' columns
(tokens, token_logprobs, top_logprobs, text_offset), where `echo` puts the prompt's first,
its first token with null (nothing predicts it).

A token's text is its bytes decoded with replacement: a token holding part of a UTF-8
character shows U+FFFD there, and its `bytes` (chat) keep the exact bytes, as OpenAI does.
"""

from __future__ import annotations

from typing import Sequence

from panechat.engine.serving.logprobs import TokenLogprob


def _text(tokenizer, token: int) -> str:
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def _chat_entry(tokenizer, token: int, logprob: float) -> dict:
    b = tokenizer.token_bytes(token)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}


def chat_content(tokenizer, lps: Sequence[TokenLogprob]) -> list[dict]:
    """Chat's `logprobs.content` entries of `lps`, one per token."""
    out = []
    for lp in lps:
        e = _chat_entry(tokenizer, lp.token, lp.logprob)
        e["top_logprobs"] = [_chat_entry(tokenizer, t, v) for t, v in lp.top]
        out.append(e)
    return out


def chat_logprobs(tokenizer, lps: Sequence[TokenLogprob] | None) -> dict | None:
    """A chat choice's `logprobs` (None when not asked for)."""
    if lps is None:
        return None
    return {"content": chat_content(tokenizer, lps), "refusal": None}


def completion_logprobs(tokenizer, lps: Sequence[TokenLogprob], prompt: Sequence[TokenLogprob | None] = (),
                        start: int = 0) -> dict:
    """A legacy choice's `logprobs`: `prompt`'s entries (None: the first prompt token, whose
    logprob is null) then the generated `lps`; text offsets count from `start`."""
    tokens, values, tops, offsets = [], [], [], []
    at = start
    for lp in [*prompt, *lps]:
        if lp is None:
            continue
        text = _text(tokenizer, lp.token)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_text(tokenizer, t): v for t, v in lp.top} if lp.logprob is not None else None)
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echoed_prompt(prompt_ids: Sequence[int], prompt_lps: Sequence[TokenLogprob | None]) -> list:
    """The prompt's entries for `completion_logprobs`: its first token with a null logprob,
    then each later one's TokenLogprob (prompt_lps[p - 1] is token p's)."""
    if not prompt_ids:
        return []
    return [TokenLogprob(prompt_ids[0], None, ()), *prompt_lps]  # type: ignore[arg-type]

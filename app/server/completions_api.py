"""`POST /v1/completions`: OpenAI's legacy text completion of a raw prompt (no chat
template; BOS as the GGUF's add_bos_token flag says, special tokens parsed, as llama.cpp's
server tokenizes a completion prompt). The fields, limits and errors are those of
`/v1/chat/completions` (openai_api.py), with this route's column of the request schema
(request_schema.py: 16 tokens when `max_tokens` is absent, OpenAI's default; `suffix`
refused); the stream is the same SSE with `text_completion` chunks. `prompt` may be token
ids (taken as they are, as lm-evaluation-harness sends them). `echo` puts the prompt
before the reply and, with `logprobs`, the prompt tokens' logprobs before the reply's;
with `max_tokens` 0 too, the prompt alone: what a loglikelihood evaluation needs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from panechat.engine.serving.sampling import SamplingParams
from .errors import bad_request
from .logprobs_json import completion_logprobs, echoed_prompt
from .openai_api import SSEResponse, _finish_reason, generation_route, parse_generation_fields
from .request_schema import COMPLETIONS


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int = 1
    samples: int = 1
    echo: bool = False
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt (and its logprobs) alone
    logprobs: bool = False  # the client asked for them (best_of asks for them itself)
    prompt_text: str | None = None  # the prompt as text, when it came as text


def parse_prompt(v) -> str | list[int]:
    """`prompt`: a non-empty string, or a list holding one, or token ids (one completion
    per request)."""
    if isinstance(v, list) and v and all(type(t) is int for t in v):
        return v
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
        if isinstance(v, list) and v and all(type(t) is int for t in v):
            return v
    if not isinstance(v, str) or not v:
        raise bad_request("'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                          param="prompt", code="invalid_type" if not isinstance(v, str) else "invalid_value")
    return v


def parse_completion_request(body, engine, model: str) -> CompletionRequest:
    """The validated request for `engine`, the engine of `model`."""
    prompt = parse_prompt(body.get("prompt"))
    prompt_only = body.get("echo") is True and body.get("max_tokens") == 0
    if prompt_only:  # the engine computes one token, which is not shown
        body = {**body, "max_tokens": 1}
    f = parse_generation_fields(body, engine, COMPLETIONS)
    if prompt_only and f.stream:
        raise bad_request("'max_tokens' 0 (the prompt alone) cannot be streamed; send stream: false",
                          param="max_tokens", code="invalid_value")
    if f.echo and f.stream and f.params.logprobs is not None:
        raise bad_request("'echo' with 'logprobs' cannot be streamed (the prompt's logprobs come at the end); "
                          "send stream: false", param="echo", code="invalid_value")
    return CompletionRequest(model, prompt, f.params, f.stop, f.stream, f.include_usage, f.n, f.samples,
                             f.echo, prompt_only, body.get("logprobs") is not None and body.get("logprobs") is not False,
                             prompt if isinstance(prompt, str) else None)


async def submit_completion(st, req: CompletionRequest, engine, client: str) -> list:
    """Queue the validated completion request's samples on `engine` for `client` (the raw
    prompt, no template): a Generation each."""
    if req.echo and isinstance(req.prompt, str):  # the ids are needed for the prompt's logprobs
        req.prompt = await asyncio.to_thread(engine.completion_ids, req.prompt_text)
    return await st.submit_text_n(req.samples, req.prompt, req.params, req.stop, engine=engine, client=client)


def completion_choice(req: CompletionRequest, engine, fin, i: int) -> dict:
    """Choice i of a whole reply: the prompt first with `echo`, logprobs when asked for."""
    text = "" if req.prompt_only else fin.text
    lps = None
    if req.logprobs:
        tok = engine.lm.tokenizer
        prompt = echoed_prompt(req.prompt, fin.prompt_logprobs or []) if req.echo else []
        lps = completion_logprobs(tok, [] if req.prompt_only else fin.logprobs or [], prompt)
    if req.echo:
        text = _echo_text(req, engine) + text
    return {"index": i, "text": text, "logprobs": lps,
            "finish_reason": "length" if req.prompt_only else _finish_reason(fin)}


def _echo_text(req: CompletionRequest, engine) -> str:
    if req.prompt_text is not None:
        return req.prompt_text
    return engine.lm.tokenizer.decode(req.prompt)


async def completions(request: Request) -> Response:
    return await generation_route(request, parse_completion_request, submit_completion, CompletionSSE, "cmpl",
                                  "text_completion", completion_choice)


class CompletionSSE(SSEResponse):
    """The chat stream's events as `text_completion` chunks: `choices[i].text` is the new
    text (no opening role chunk; with `echo`, the prompt opens each choice)."""

    object_name = "text_completion"

    def _chunk(self, text: str | None, finish: str | None = None, index: int = 0, lps: list | None = None,
               **extra) -> bytes:
        if text is None:  # completions have no role to announce: the echoed prompt, or nothing
            if not self.req.echo:
                return b""
            text = _echo_text(self.req, self.engine)
        return super()._chunk(text, finish, index, lps, **extra)

    def _choice(self, text: str | None, finish: str | None, index: int = 0, lps: list | None = None) -> dict:
        logprobs = None
        if self.req.logprobs:
            logprobs = completion_logprobs(self.engine.lm.tokenizer, lps or [])
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

"""`POST /v1/completions`: OpenAI's legacy text completion of a raw prompt (no chat
template; BOS as the GGUF's add_bos_token flag says, special tokens parsed, as llama.cpp's
server tokenizes a completion prompt). The fields, limits and errors are those of
`/v1/chat/completions` (openai_api.py), with this route's column of the request schema
(request_schema.py: 16 tokens when `max_tokens` is absent, OpenAI's default; `echo`,
`suffix`, `best_of` refused); the stream is the same SSE with `text_completion` chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from panechat.engine.serving.sampling import SamplingParams
from .errors import bad_request
from .openai_api import SSEResponse, _finish_reason, generation_route, parse_generation_fields
from .request_schema import COMPLETIONS


@dataclass
class CompletionRequest:
    model: str
    prompt: str
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


def parse_prompt(v) -> str:
    """`prompt`: a non-empty string, or a list holding one (one completion per request)."""
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if not isinstance(v, str) or not v:
        raise bad_request("'prompt' must be a non-empty string (one prompt per request)", param="prompt",
                          code="invalid_type" if not isinstance(v, str) else "invalid_value")
    return v


def parse_completion_request(body, engine, model: str) -> CompletionRequest:
    """The validated request for `engine`, the engine of `model`."""
    prompt = parse_prompt(body.get("prompt"))
    f = parse_generation_fields(body, engine, COMPLETIONS)
    return CompletionRequest(model, prompt, f.params, f.stop, f.stream, f.include_usage)


async def completions(request: Request) -> Response:
    return await generation_route(
        request, parse_completion_request,
        lambda st, req, engine: st.submit_text(req.prompt, req.params, req.stop, engine=engine),
        CompletionSSE, "cmpl", "text_completion",
        lambda fin, req: {"index": 0, "text": fin.text, "logprobs": None, "finish_reason": _finish_reason(fin)})


class CompletionSSE(SSEResponse):
    """The chat stream's events as `text_completion` chunks: `choices[0].text` is the new
    text (no opening role chunk)."""

    object_name = "text_completion"

    def _chunk(self, text: str | None, finish: str | None = None, **extra) -> bytes:
        if text is None:  # completions have no role to announce
            return b""
        return super()._chunk(text, finish, **extra)

    def _choice(self, text: str | None, finish: str | None) -> dict:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

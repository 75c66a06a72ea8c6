"""How every protocol classifies an exception from `Engine.submit`: one table, read by the
OpenAI HTTP API (`server/errors.py`: status, type, code), the websocket protocol
(`server/websocket.py`: its error code) and the embedded-engine client (`clients/local.py`).

Each protocol words and shapes the error its own way; which kind of error it is, and so
the status and codes it gets, is decided here (docs/protocol.md lists both protocols').
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.engine import EngineStopped, PromptTooLong, QueueFull


@dataclass(frozen=True)
class Refusal:
    """One kind of refused submission and how each protocol reports it."""

    kind: str
    http_status: int
    http_type: str  # OpenAI's error type
    http_code: str | None  # OpenAI's error code
    http_param: str | None  # the request field at fault
    ws_code: str  # the websocket `error` frame's code
    retry_after: int | None = None  # seconds; the request may be sent again as it is


BAD_INPUT = Refusal("bad_input", 400, "invalid_request_error", None, "messages", "bad_params")
PROMPT_TOO_LONG = Refusal("prompt_too_long", 400, "invalid_request_error", "context_length_exceeded", "messages",
                          "prompt_too_long")
QUEUE_FULL = Refusal("queue_full", 429, "rate_limit_error", "queue_full", None, "queue_full", retry_after=1)
ENGINE_STOPPED = Refusal("engine_stopped", 503, "server_error", "engine_stopped", None, "unavailable")


def classify(e: BaseException) -> Refusal | None:
    """The refusal `e` (raised by `Engine.submit` or while preparing its prompt) stands for,
    or None when it is none: a bug, to be reported as an internal error."""
    if isinstance(e, PromptTooLong):  # before ValueError: it is one
        return PROMPT_TOO_LONG
    if isinstance(e, QueueFull):
        return QUEUE_FULL
    if isinstance(e, EngineStopped):
        return ENGINE_STOPPED
    if isinstance(e, ValueError):
        return BAD_INPUT
    return None

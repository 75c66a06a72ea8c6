"""How every protocol classifies an exception from `Engine.submit`: one table, read by the
OpenAI HTTP API (`server/errors.py`: status, type, code), the websocket protocol
(`server/websocket.py`: its error code) and the embedded-engine client (`clients/local.py`).
The server's own refusal of new work while it shuts down (`ShuttingDown`) is in it too.

Each protocol words and shapes the error its own way; which kind of error it is, and so
the status and codes it gets, is decided here (docs/protocol.md lists both protocols').

Only panechat's own refusals are in the table: the client's mistakes (`InvalidRequest`,
raised by the engine and the server's request schema) and the refusals of load, models
and shutdown. Anything else, a stray ValueError included, is a bug: `classify` gives None
and the protocol answers an internal error (HTTP 500, websocket `internal`), logged once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from panechat.engine.serving.engine import ClientQueueFull, EngineStopped, PromptTooLong, QueueFull
from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.gguf.file import ModelFileError
from panechat.engine.catalog.model_names import ModelDoesNotFit, UnknownModel


@dataclass(frozen=True)
class Refusal:
    """One kind of refused submission and how each protocol reports it."""

    kind: str
    http_status: int
    http_type: str  # OpenAI's error type
    http_code: str | None  # OpenAI's error code
    http_param: str | None  # the request field at fault
    ws_code: str  # the websocket `error` frame's code
    retry_after: int | None = None  # seconds; the request may be sent again as it is (default)


BAD_INPUT = Refusal("bad_input", 400, "invalid_request_error", None, "messages", "bad_params")
PROMPT_TOO_LONG = Refusal("prompt_too_long", 400, "invalid_request_error", "context_length_exceeded", "messages",
                          "prompt_too_long")
QUEUE_FULL = Refusal("queue_full", 429, "rate_limit_error", "queue_full", None, "queue_full", retry_after=1)
#: one client's own requests fill its part of the queue (--max-queue-per-client); others are admitted
CLIENT_QUEUE_FULL = Refusal("client_queue_full", 429, "rate_limit_error", "client_queue_full", None,
                            "client_queue_full", retry_after=1)
ENGINE_STOPPED = Refusal("engine_stopped", 503, "server_error", "engine_stopped", None, "unavailable")
SHUTTING_DOWN = Refusal("shutting_down", 503, "server_error", "shutting_down", None, "shutting_down",
                        retry_after=1)

# the model a request names (several models in one process: engine/serving/model_set.py)
UNKNOWN_MODEL = Refusal("unknown_model", 404, "not_found_error", "model_not_found", "model", "unknown_model")
MODEL_DOES_NOT_FIT = Refusal("model_does_not_fit", 503, "server_error", "models_memory", "model", "models_memory")
MODEL_UNUSABLE = Refusal("model_unusable", 400, "invalid_request_error", "model_not_loadable", "model",
                         "model_not_loadable")


class ShuttingDown(RuntimeError):
    """The server is draining before it exits: it starts no new generation.
    `retry_after`: seconds until the drain is over (then a restarted server may answer)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


#: Exception types and their refusals, in the order `classify` tries them: the subclasses of
#: InvalidRequest (PromptTooLong) before InvalidRequest itself, ClientQueueFull before QueueFull.
_REFUSAL_OF: tuple[tuple[type[BaseException], Refusal], ...] = (
    (PromptTooLong, PROMPT_TOO_LONG), (ShuttingDown, SHUTTING_DOWN),
    (ClientQueueFull, CLIENT_QUEUE_FULL), (QueueFull, QUEUE_FULL),
    (EngineStopped, ENGINE_STOPPED), (UnknownModel, UNKNOWN_MODEL), (ModelDoesNotFit, MODEL_DOES_NOT_FIT),
    (ModelFileError, MODEL_UNUSABLE), (InvalidRequest, BAD_INPUT),
)


def classify(e: BaseException) -> Refusal | None:
    """The refusal `e` (raised by `Engine.submit` or while preparing its prompt) stands for,
    or None when it is none: a bug, to be reported as an internal error (a plain
    ValueError too: only InvalidRequest is the client's mistake)."""
    for kind, refusal in _REFUSAL_OF:
        if isinstance(e, kind):
            return refusal
    return None


def retry_after(e: BaseException, refusal: Refusal) -> int | None:
    """Seconds to wait before sending the refused request again: what the exception
    estimated (`QueueFull.retry_after`, from the queue and the recent pace: engine/serving/metrics.py),
    else the table's default; None when sending it again as it is would not help."""
    if refusal.retry_after is None:
        return None
    return getattr(e, "retry_after", None) or refusal.retry_after

"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; the app turns it (and Starlette's own 404/405) into a JSON
response with that body, so every client library that understands OpenAI errors shows
the message. Under `/api/` (Ollama's API) the same errors take Ollama's shape,
`{"error": message}` (`shaped`).
"""

from __future__ import annotations

import json
import logging

from starlette.responses import JSONResponse

from ..engine_errors import classify, retry_after


class ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote any input."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An HTTP error with an OpenAI-style body; `headers` go on the response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return ErrorJSON(self.body(), status_code=self.status, headers=self.headers)


#: Routes under this prefix are Ollama's API (ollama_api.py): their errors are `{"error": message}`.
OLLAMA_PREFIX = "/api/"


def ollama_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in Ollama's shape, `{"error": message}`, which Ollama's clients show as it is."""
    return ErrorJSON({"error": message}, status_code=status, headers=headers)


def shaped(path: str, status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI-shaped error `body` as the route at `path` answers it: as it is, or
    Ollama's `{"error": message}` under OLLAMA_PREFIX."""
    if path.startswith(OLLAMA_PREFIX):
        return ollama_error(status, body["error"]["message"], headers)
    return ErrorJSON(body, status_code=status, headers=headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(named: bool = False) -> APIError:
    """401; `named`: the server takes the tokens of a --tokens file."""
    given = "your token in panechat serve --tokens FILE" if named else "the token given to panechat serve --token"
    return APIError(401, f"missing or wrong API key: send 'Authorization: Bearer <token>' ({given})",
                    type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, type="not_found_error", param=param, code=code)


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


def refused(e: Exception) -> APIError | None:
    """The HTTP error for an exception from `Engine.submit`, classified by
    app/engine_errors.py (the field at fault, when the exception names one, as `param`);
    None when it is no refusal (a bug: see `internal`)."""
    r = classify(e)
    if r is None:
        return None
    wait = retry_after(e, r)
    return APIError(r.http_status, str(e), type=r.http_type, param=getattr(e, "param", None) or r.http_param,
                    code=r.http_code, headers={"Retry-After": str(wait)} if wait else None)


def from_engine(e: Exception, log: logging.Logger, doing: str) -> APIError:
    """The HTTP error for any exception met while `doing` something with an engine: an
    APIError as it is, a refusal as `refused` words it, anything else as `internal`."""
    if isinstance(e, APIError):
        return e
    return refused(e) or internal(e, log, doing)


def internal(e: Exception, log: logging.Logger, doing: str) -> APIError:
    """The 500 for a bug met while `doing` something: one log record with the traceback; the
    client is told only the exception's type (its message may hold anything)."""
    log.error("internal error while %s: %r", doing, e, exc_info=e)
    return APIError(500, f"internal server error: {type(e).__name__}", type="server_error", code="internal_error")


def loading() -> APIError:
    return APIError(503, "the model is still loading; retry shortly", type="server_error",
                    code="model_loading", headers={"Retry-After": "1"})

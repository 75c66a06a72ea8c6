"""Chat backends the panes talk to: the embedded engine, a panechat server, an OpenAI API."""

from .base import (BackendError, BackendInfo, ChatBackend, ChatStream, Delta, Finished, GenParams, Prefill,
                   Queued, StreamEvent, StreamMeter)

__all__ = ["BackendError", "BackendInfo", "ChatBackend", "ChatStream", "Delta", "Finished", "GenParams",
           "Prefill", "Queued", "StreamEvent", "StreamMeter", "backend_for_url"]


def backend_for_url(url: str, *, token: str | None = None, api_key: str | None = None,
                    model: str | None = None) -> ChatBackend:
    """The backend for `--connect URL`: ws(s):// is a panechat server, http(s):// an OpenAI API."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("ws", "wss"):
        from .remote_ws import RemoteBackend

        return RemoteBackend(url, token, model=model)
    if scheme in ("http", "https"):
        from .openai_http import OpenAIBackend

        return OpenAIBackend(url, api_key, model)
    raise ValueError(f"--connect needs ws://HOST:PORT (a panechat server) or http(s)://HOST/v1 "
                     f"(an OpenAI-compatible API), got {url!r}")

"""`panechat run --connect URL`: one reply from a server instead of the local engine.

A panechat server (ws://HOST:PORT) is asked over its OpenAI-compatible HTTP API on the
same port (http://HOST:PORT/v1, the --token as the bearer key), so a one-off prompt leaves
no conversation behind on the server; an http(s):// URL is any OpenAI-compatible API."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from urllib.parse import urlsplit, urlunsplit

from panechat.engine.serving.sampling import SamplingParams
from .clients.base import BackendError, Delta, Finished, GenParams
from .clients.openai_http import OpenAIBackend
from .usage import UsageError


def http_base(url: str) -> str:
    """The OpenAI base URL for `--connect URL`: ws(s)://HOST:PORT[/ws] becomes
    http(s)://HOST:PORT/v1; an http(s) URL is taken as it is."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        return url.rstrip("/")
    if scheme not in ("ws", "wss"):
        raise UsageError(f"--connect needs ws://HOST:PORT (a panechat server) or http(s)://HOST/v1 "
                         f"(an OpenAI-compatible API), got {url!r}")
    path = parts.path.rstrip("/").removesuffix("/ws")
    return urlunsplit(("https" if scheme == "wss" else "http", parts.netloc, path + "/v1", "", ""))


def run_remote(args: argparse.Namespace, messages: list[dict], params: SamplingParams) -> int:
    """Stream the reply to `messages` from the server to stdout (or print it as JSON)."""
    return asyncio.run(_run(args, messages, params))


async def _run(args: argparse.Namespace, messages: list[dict], params: SamplingParams) -> int:
    scheme = urlsplit(args.connect).scheme.lower()
    key = args.token if scheme in ("ws", "wss") else args.api_key
    backend = OpenAIBackend(http_base(args.connect), key or None, args.model)
    t0 = time.perf_counter()
    try:
        info = await backend.start()
    except BackendError as e:
        msg = str(e)
        if scheme in ("ws", "wss"):  # the bearer key was the server's --token
            msg = msg.replace("refused the API key", "refused the token").replace("pass --api-key",
                                                                                "pass the server's --token")
        raise UsageError(msg) from None
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    turns = messages[1:] if system else messages
    gp = GenParams(temperature=params.temperature, max_tokens=params.max_tokens, seed=params.seed,
                   top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
    fin = Finished("error", "", error="the stream ended without a finish")
    first = True
    try:
        async for ev in backend.stream("", turns, gp, system):
            if first and isinstance(ev, (Delta, Finished)) and not args.quiet:
                first = False
                print(f"panechat: {info.model} at {backend.base_url}: first token in "
                      f"{time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
            if isinstance(ev, Delta) and not args.json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, Finished):
                fin = ev
    finally:
        await backend.close()
    if fin.reason == "error":
        raise UsageError(fin.error or "generation failed")
    if args.json:
        print(json.dumps({"text": fin.text, "prompt_tokens": fin.usage.get("prompt_tokens"),
                          "completion_tokens": fin.usage.get("completion_tokens"), "finish_reason": fin.reason,
                          "model": info.model}))
    else:
        sys.stdout.write("\n")
    return 0

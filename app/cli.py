"""The `panechat` command: argument parsing and dispatch, with one-line errors.

User mistakes (bad paths, bad files, bad numbers) exit with code 2 and one line on
stderr naming the problem and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..backends import BACKENDS


class UsageError(Exception):
    """A user mistake; printed as one line, exit code 2."""


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", metavar="PATH", help="GGUF model file (default: the installed SmolLM2-135M-Instruct)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="array backend (default: auto)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-concurrent", type=int, default=4, metavar="N", help="generations at once (default 4)")
    p.add_argument("--kv-sessions", type=int, default=None, metavar="N", help="KV cache slots (default 2 x max-concurrent)")
    p.add_argument("--max-queue", type=int, default=8, metavar="N", help="waiting requests before refusing (default 8)")
    p.add_argument("--ctx-size", type=int, default=4096, metavar="N", help="context per conversation (default 4096)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N", help="prompt tokens per step (default 512)")
    p.add_argument("--straggler-ms", type=float, default=2.0, metavar="MS",
                   help="wait this long after an idle engine wakes so near-simultaneous requests share the first step (default 2)")


def _server_limit_args(p: argparse.ArgumentParser) -> None:
    """Timeouts, caps and the public address of the server (`serve`, `--share`); see
    docs/protocol.md, "Limits and timeouts". Defaults live in server.limits.Limits."""
    p.add_argument("--header-timeout", type=float, metavar="S",
                   help="close a connection whose request headers take longer (default 10)")
    p.add_argument("--body-timeout", type=float, metavar="S",
                   help="close a request whose body takes longer after its headers (default 30)")
    p.add_argument("--max-connections", type=int, metavar="N",
                   help="open connections (HTTP and websocket) before answering 503 (default 512)")
    p.add_argument("--auth-grace", type=float, metavar="S",
                   help="close a websocket that has not sent a valid hello by then (default 5)")
    p.add_argument("--public-url", metavar="URL",
                   help="the address browsers reach the server at, e.g. https://chat.example.com; web pages "
                        "from other origins than it and loopback are refused (default: from --host/--port)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="panechat", description="Terminal chat with a batch-invariant multi-session LLM engine.")
    _model_args(parser)
    _engine_args(parser)
    parser.add_argument("--connect", metavar="URL", help="ws://HOST:PORT of a panechat server, or http(s)://HOST/v1 of any OpenAI-compatible server")
    parser.add_argument("--token", help="access token for --connect ws:// or --share")
    parser.add_argument("--api-key", help="API key for --connect http(s)://")
    parser.add_argument("--share", action="store_true", help="also serve this engine to other terminals")
    parser.add_argument("--host", default="127.0.0.1", help="bind address for --share")
    parser.add_argument("--port", type=int, default=8765, help="port for --share")
    _server_limit_args(parser)
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="generate one reply and stream it to stdout")
    _model_args(run)
    run.add_argument("--system", "-s", help="system prompt")
    run.add_argument("--messages", metavar="FILE", help="JSON list of {role, content} messages")
    run.add_argument("--max-tokens", "-n", type=int, default=256)
    run.add_argument("--temperature", "-t", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--ctx-size", type=int, default=4096)
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    run.add_argument("prompt", nargs="?", help="the user message")

    tok = sub.add_parser("tokenize", help="print the token ids of TEXT")
    _model_args(tok)
    tok.add_argument("--json", action="store_true")
    tok.add_argument("text")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP + websocket server")
    _model_args(serve)
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8765)
    serve.add_argument("--token", help="require this bearer token")
    _server_limit_args(serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    sweep = bsub.add_parser("sweep", help="llama-batched-bench style PP/TG sweep")
    _model_args(sweep)
    sweep.add_argument("--npp", type=int, default=512)
    sweep.add_argument("--ntg", type=int, default=128)
    sweep.add_argument("--npl", default="1,2,4,8,16,32")
    sweep.add_argument("--json", action="store_true")
    chat = bsub.add_parser("chat", help="multi-turn chat workload against a server")
    _model_args(chat)
    chat.add_argument("--url", help="OpenAI-compatible base URL (default: start our own server per cell)")
    chat.add_argument("--clients", default="1,2,4")
    chat.add_argument("--turns", type=int, default=6)
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        msg = _user_error(e)
        if msg is None:
            raise
        print(f"panechat: error: {msg}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from .oneshot import run

        return run(args)
    if args.command == "tokenize":
        from .oneshot import tokenize

        return tokenize(args)
    if args.command == "serve":
        from .server.serve import serve

        return serve(args)
    if args.command == "bench":
        from .bench import dispatch

        return dispatch(args)
    from .tui.launch import launch

    return launch(args)


def _user_error(e: Exception) -> str | None:
    """The one-line message for a user mistake, or None for a real bug."""
    from ..backends import BackendUnavailable
    from ..engine.gguf_file import ModelFileError

    if isinstance(e, (UsageError, ModelFileError, BackendUnavailable, ValueError, OSError)):
        text = str(e).strip().splitlines()
        return text[0] if text else type(e).__name__
    return None

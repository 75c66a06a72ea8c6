"""The `panechat` command: argument parsing and dispatch, with one-line errors.

User mistakes (bad paths, bad files, bad numbers) exit with code 2 and one line on
stderr naming the problem and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..backends import BACKENDS
from panechat.backends.errors import BackendUnavailable, one_line
from panechat.engine.serving.config import EngineConfig
from panechat.engine.gguf.file import ModelFileError
from panechat.engine.catalog.model_names import ModelDoesNotFit, UnknownModel, parse_model_list
from .models_cmd import add_models_parser, models
from .warm_cmd import add_warm_parser
from .usage import UsageError


_ENGINE = EngineConfig()  # the engine flags' defaults; EngineConfig.validate() holds their limits

#: Defaults of the options the top level and the subcommands share. Such an option works
#: before or after the subcommand (`panechat --model X run` = `panechat run --model X`), so
#: only the top level sets its default (see _parent).
SHARED_DEFAULTS = {
    "model": None, "models": None, "models_memory": None, "backend": "auto", "host": "127.0.0.1", "port": 8765, "token": None,
    "connect": None, "api_key": None,
    **{name: getattr(_ENGINE, name) for name in
       ("ctx_size", "max_concurrent", "kv_sessions", "kv_memory", "kv_dtype", "max_queue", "max_queue_per_client",
        "prefill_chunk", "straggler_ms", "kv_snapshot_memory", "spec", "draft_model")},
    "kv_snapshots": "on",
}
_D = SHARED_DEFAULTS
# the options that shape this process's engine: `web --connect` starts none, so it refuses them
ENGINE_OPTIONS = ("model", "models_memory", "backend", "ctx_size", "max_concurrent", "kv_sessions", "kv_memory",
                  "kv_dtype", "max_queue", "prefill_chunk", "straggler_ms", "kv_snapshot_memory", "spec",
                  "draft_model", "kv_snapshots")


class _ModelsAction(argparse.Action):
    """--model given several times or as a comma list: `models` keeps them all in order,
    `model` the first (the default model; the only one `run`, `tokenize` and `bench` use)."""

    def __call__(self, parser, namespace, values, option_string=None):
        models = parse_model_list([*(getattr(namespace, "models", None) or []), values])
        namespace.models, namespace.model = models, (models[0] if models else None)


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", metavar="PATH|NAME", action=_ModelsAction,
                   help="GGUF model file, or a name `panechat models` lists (default: the installed "
                        "SmolLM2-135M-Instruct); the TUI and serve take several (repeat it, or a comma "
                        "list): all are loaded, the first is the default")
    p.add_argument("--backend", choices=BACKENDS, help=f"array backend (default: {_D['backend']})")


def _context_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ctx-size", type=int, metavar="N", help=f"context per conversation (default {_D['ctx_size']})")


def _batching_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-concurrent", type=int, metavar="N", help=f"generations at once (default {_D['max_concurrent']})")
    p.add_argument("--kv-sessions", type=int, metavar="N",
                   help="KV memory for N whole contexts (an alternative to --kv-memory)")
    p.add_argument("--kv-memory", type=byte_size, metavar="SIZE",
                   help="KV cache budget, e.g. 2GiB (default: a quarter of free memory, shown at start-up)")
    p.add_argument("--kv-dtype", choices=EngineConfig.KV_DTYPES,
                   help=f"KV cache precision (default {_D['kv_dtype']})")
    p.add_argument("--max-queue", type=int, metavar="N", help=f"waiting requests before refusing (default {_D['max_queue']})")
    p.add_argument("--max-queue-per-client", type=int, metavar="N",
                   help="waiting requests of one client (a --tokens name, a terminal, an address) before "
                        "refusing it alone with 429 client_queue_full (default: up to --max-queue)")
    p.add_argument("--prefill-chunk", type=int, metavar="N", help=f"prompt tokens per step (default {_D['prefill_chunk']})")
    _spec_options(p)
    p.add_argument("--models-memory", type=byte_size, metavar="SIZE",
                   help="memory for the models held at once (weights + KV), e.g. 2G; a model that does not "
                        "fit unloads the least recently used idle one (never the first), or is refused "
                        "(default: no limit)")
    p.add_argument("--straggler-ms", type=float, metavar="MS",
                   help="wait this long after an idle engine wakes so near-simultaneous requests share the "
                        f"first step (default {_D['straggler_ms']:g})")
    p.add_argument("--kv-snapshots", choices=("on", "off"),
                   help="write an evicted or idle conversation's KV to the cache folder ($XDG_CACHE_HOME/"
                        "panechat/kv) and read it back instead of re-prefilling, also after a restart "
                        f"(default {_D['kv_snapshots']})")
    p.add_argument("--kv-snapshot-memory", type=byte_size, metavar="SIZE",
                   help="disk space for KV snapshots, e.g. 2G; past it the least recently used go "
                        f"(default {_D['kv_snapshot_memory'] >> 30}G)")


def _spec_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", choices=("ngram", "draft", "off"),
                   help="speculative decoding: n-gram drafts from the conversation's own tokens, or a draft "
                        "model's (draft, with --draft-model), checked exactly so every reply is the one without "
                        f"it (default {_D['spec']})")
    p.add_argument("--draft-model", metavar="PATH|NAME",
                   help="with --spec draft: a small model with the target's vocabulary (a GGUF file or a name "
                        "`panechat models` lists) drafting for every conversation, with KV of its own")


def _listen_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help=f"bind address for serve and --share (default {_D['host']})")
    p.add_argument("--port", type=int, help=f"port for serve and --share (default {_D['port']})")
    _token_option(p)


def _token_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", help="access token: serve and --share then require it from every client (without "
                                   "one they start open to whoever reaches the port); --connect ws:// sends it")


def _connect_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", metavar="URL", help="ws://HOST:PORT of a panechat server, or http(s)://HOST/v1 of "
                                                    "any OpenAI-compatible server")
    p.add_argument("--api-key", help="API key for --connect http(s)://")


def _max_tokens_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, metavar="N", help="tokens per reply at most (run: 256, bench chat: 128)")


def _clients_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", metavar="N[,N...]",
                   help="concurrent clients (bench chat: a list of cells, default 1,2,4; bench prefix: one "
                        "number, default 16)")


def _json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", default=False, help="print JSON instead of text")


def _parent(*declare, defaults: dict | None = None) -> argparse.ArgumentParser:
    """A parser to pass as `parents=`, holding the options `declare` adds. Without defaults
    an option that is not given stays unset: a subcommand must not overwrite what the top
    level parsed with a default of its own (argparse copies the subcommand's namespace over)."""
    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for add in declare:
        add(p)
    p.set_defaults(**(defaults or {}))
    return p


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def byte_size(text: str) -> int:
    """A byte count: N, or N with K, M or G (binary units: 256M = 256 MiB; "MiB", "MB" too)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS else ""
    try:
        n = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with K, M or G "
                                         "(e.g. 256M)") from None
    if not n >= 0 or n == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size")
    return int(n * _SIZE_UNITS[unit])


def _state_dir_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="DIR",
                   help="folder where websocket conversations persist across restarts (default: the "
                        "panechat data folder, $PANECHAT_DATA_DIR; 'none': keep them in memory only)")


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
    p.add_argument("--history-memory", type=byte_size, metavar="SIZE",
                   help="memory for websocket conversation history, e.g. 64M; past it the least recently "
                        "used idle conversations are dropped, terminals resend theirs (default 256M)")
    p.add_argument("--shutdown-grace", type=float, metavar="S",
                   help="on SIGTERM/Ctrl-C, time running generations get to finish before they are "
                        "ended with reason 'shutdown' (default 5)")
    p.add_argument("--public-url", metavar="URL",
                   help="the address browsers reach the server at, e.g. https://chat.example.com; web pages "
                        "from other origins than it and loopback are refused (default: from --host/--port)")


def build_parser() -> argparse.ArgumentParser:
    shared = (_model_options, _context_options, _batching_options, _listen_options, _connect_options)
    model, context, batching, listen, connect = (_parent(add) for add in shared)
    json_out = _parent(_json_option)

    parser = argparse.ArgumentParser(prog="panechat", description="Terminal chat with a batch-invariant multi-session LLM engine.",
                                     parents=[_parent(*shared, defaults=SHARED_DEFAULTS)])
    parser.add_argument("--version", action="version", version=f"panechat {_version()}")
    parser.add_argument("--share", action="store_true", help="also serve this engine to other terminals")
    _server_limit_args(parser)  # for --share; `serve` declares them through a parent
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="generate one reply and stream it to stdout (here, or on the server "
                                     "--connect names)",
                         parents=[model, context, connect, _parent(_token_option), _parent(_spec_options),
                                  _parent(_max_tokens_option, defaults={"max_tokens": 256}), json_out])
    run.add_argument("--system", "-s", help="system prompt")
    run.add_argument("--messages", metavar="FILE", help="JSON list of {role, content} messages")
    run.add_argument("--raw", action="store_true",
                     help="complete PROMPT as raw text: no chat template (base models); BOS as the model file says")
    run.add_argument("--temperature", "-t", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--quiet", "-q", action="store_true",
                     help="no start-up line on stderr (model, backend, time to the first token)")
    run.add_argument("prompt", nargs="?", help="the user message (with --raw: the text to complete); '-' or none "
                                                "with a pipe on stdin: read it from stdin")

    tok = sub.add_parser("tokenize", help="print the token ids of TEXT", parents=[model, json_out])
    tok.add_argument("text")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP + websocket server",
                           parents=[model, context, batching, listen, _parent(_server_limit_args, _state_dir_option, defaults={"state_dir": None})])
    serve.add_argument("--tokens", metavar="FILE",
                       help="named access tokens instead of --token: one 'name token' per line (# comments); "
                            "requests and terminals are attributed to the name, the file is re-read when it "
                            "changes and a removed name's sockets are closed")

    web = sub.add_parser("web", help="the TUI in a browser (textual-serve): each browser session is a terminal "
                                     "of this engine's server (or of the one --connect names)",
                         parents=[model, context, batching, listen, connect,
                                  _parent(_server_limit_args, _state_dir_option, defaults={"state_dir": None})])
    web.add_argument("--max-sessions", type=int, default=8, metavar="N",
                     help="browser sessions at once (each runs a TUI process; default 8)")

    add_models_parser(sub, parents=[json_out])
    add_warm_parser(sub, parents=[model])

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    sweep = bsub.add_parser("sweep", help="llama-batched-bench style PP/TG sweep", parents=[model, json_out])
    sweep.add_argument("--npp", type=int, default=512)
    sweep.add_argument("--ntg", type=int, default=128)
    sweep.add_argument("--npl", default="1,2,4,8,16,32")
    chat = bsub.add_parser("chat", help="multi-turn chat workload against a server",
                           parents=[model, _parent(_max_tokens_option, defaults={"max_tokens": 128}),
                                    _parent(_clients_option, defaults={"clients": "1,2,4"}), json_out])
    chat.add_argument("--url", help="OpenAI-compatible base URL (default: start our own server per cell)")
    chat.add_argument("--turns", type=int, default=6)
    chat.add_argument("--with-schema", action="store_true",
                      help="half the clients (the odd-numbered) ask for replies matching a JSON schema")
    bsub.add_parser("grammar", help="the cost of a grammar's token mask per decode step (JSON schema, greedy)",
                    parents=[model, _parent(_max_tokens_option, defaults={"max_tokens": 48}),
                             _parent(_clients_option, defaults={"clients": "1,16"}), json_out])
    prefix = bsub.add_parser("prefix", help="N clients sharing one long system prompt: KV memory and TTFT "
                             "with prefix sharing on and off",
                             parents=[model, _parent(_max_tokens_option, defaults={"max_tokens": 32}),
                                      _parent(_clients_option, defaults={"clients": "16"}), json_out])
    prefix.add_argument("--system-tokens", type=int, default=1000, help="tokens of the shared system prompt")
    spec = bsub.add_parser("spec", help="speculative decoding (n-gram drafts) on and off: repetitive work "
                           "(rewrite a code file, quote a passage) and an ordinary chat, tok/s and acceptance",
                           parents=[model, _parent(_max_tokens_option, defaults={"max_tokens": 128}),
                                    _parent(_clients_option, defaults={"clients": "1,4"}), _parent(_spec_options),
                                    json_out])
    spec.add_argument("--workloads", default="rewrite,quote,chat", help="comma list of rewrite, quote, chat")
    spec.add_argument("--rounds", type=int, default=2, help="off and on runs of each cell, in turn (median)")
    kern = bsub.add_parser("kernels", help="each weight type's product at Llama-3.2-1B's matrix sizes: GB/s and "
                           "GFLOP/s next to the read bandwidth measured in the same run", parents=[json_out])
    kern.add_argument("--types", default="Q4_K,Q6_K,Q5_K,Q8_0,Q4_0", help="weight types, comma-separated")
    kern.add_argument("--ms", default="1,4,16,64,512", help="row counts M, comma-separated")
    kern.add_argument("--shapes", default="all",
                      help="matrices, ';'-separated among 'q,o', 'k,v', 'gate,up', 'down', 'head' (default all)")
    kern.add_argument("--pool-mb", type=int, default=640,
                      help="MB of weight copies a cell cycles through, more than the L3 (default 640)")
    kern.add_argument("--min-time", type=float, default=0.3, help="seconds each cell runs at least")
    kern.add_argument("--read-mb", type=int, default=1024, help="MiB the read-bandwidth measure streams (default 1024)")
    kern.add_argument("--float32", action="store_true",
                      help="time Q4_0/Q4_1/Q8_0 by the float32 kernels on their blocks as stored (the path "
                           "before repacking), for a before/after in one sitting")
    kern.add_argument("--cpu-time", action="store_true",
                      help="time this thread's CPU time, not the wall clock (a shared machine; NUMBA_NUM_THREADS=1)")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("panechat")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if len(args.models or ()) > 1 and args.command not in (None, "serve", "warm"):
            raise UsageError(f"`panechat {args.command}` uses one model; give --model once "
                             "(several models: the TUI and `panechat serve`)")
        if args.command == "web" and args.connect:
            _refuse_engine_options(args)
        EngineConfig(spec=args.spec, draft_model=args.draft_model)  # --spec/--draft-model: a usage error at once
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
    # Each command imports what it runs when it runs: the engine, the server and the TUI
    # take a second or more to import, which `--help` and `tokenize` need not wait for.
    if args.command == "run":
        from .oneshot import run

        return run(args)
    if args.command == "tokenize":
        from .oneshot import tokenize

        return tokenize(args)
    if args.command == "serve":
        from .server.serve import serve

        return serve(args)
    if args.command == "web":
        from .web.serve_web import web

        return web(args)
    if args.command == "models":
        return models(args)
    if args.command == "warm":
        from .warm_cmd import warm

        return warm(args)
    if args.command == "bench":
        from .bench import dispatch

        return dispatch(args)
    from .tui.launch import launch

    return launch(args)


def _refuse_engine_options(args: argparse.Namespace) -> None:
    """`web --connect` joins another server's engine: an engine option given here would do nothing."""
    given = [name for name in ENGINE_OPTIONS if getattr(args, name, SHARED_DEFAULTS[name]) != SHARED_DEFAULTS[name]]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"panechat web --connect uses that server's engine; drop {flags} (set them on its `serve`)")


def _user_error(e: Exception) -> str | None:
    """The one-line message for a user mistake, or None for a real bug."""
    if isinstance(e, (UsageError, ModelFileError, BackendUnavailable, ValueError, OSError, UnknownModel,
                      ModelDoesNotFit)):
        return one_line(e)
    return None

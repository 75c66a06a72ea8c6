"""`panechat run` and `panechat tokenize`: one reply (or, with --raw, the completion of a
raw prompt) or one tokenization, then exit."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from panechat.engine.default_model import resolve_model_path
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.events import FinishEvent, TokenEvent
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.loader import LoadedModel, load_model, load_tokenizer
from panechat.engine.serving.sampling import SamplingParams
from .startup_clock import since_start
from .usage import UsageError


def prompt_arg(args: argparse.Namespace) -> str | None:
    """PROMPT as given; read from stdin when it is '-', or when it is missing, no
    --messages file is given and stdin is a pipe (`echo hi | panechat run`). The newline
    `echo` ends with is dropped."""
    prompt = args.prompt
    piped = sys.stdin is not None and not sys.stdin.isatty()
    if prompt == "-" or (prompt is None and not getattr(args, "messages", None) and piped):
        if sys.stdin is None:
            raise UsageError("PROMPT is '-' but there is no stdin to read it from")
        prompt = sys.stdin.read().rstrip("\r\n")
    return prompt


def read_messages(args: argparse.Namespace) -> list[dict]:
    """Messages from --messages FILE, --system and PROMPT (or stdin), validated."""
    messages: list[dict] = []
    if args.messages:
        path = Path(args.messages)
        if not path.is_file():
            raise UsageError(f"messages file not found: {path}")
        try:
            messages = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{path} is not valid JSON ({e.msg if hasattr(e, 'msg') else e}); "
                             "it must be a list of {role, content} objects") from None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise UsageError(f"{path} must hold a JSON list of {{\"role\": ..., \"content\": ...}} objects")
    if args.system:
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": args.system})
    if args.prompt is not None:
        messages.append({"role": "user", "content": args.prompt})
    if not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise UsageError("empty prompt: give PROMPT, pipe it on stdin, or --messages FILE with a user message")
    return messages


def raw_prompt(args: argparse.Namespace) -> str:
    """The text `run --raw` completes; the chat-only options are refused."""
    if args.system or args.messages:
        raise UsageError("--raw completes PROMPT as it is; drop --system/--messages (they need the chat template)")
    if not args.prompt:
        raise UsageError("empty prompt: give the text to complete, e.g. panechat run --raw \"Once upon a time\"")
    return args.prompt


def run(args: argparse.Namespace) -> int:
    args.prompt = prompt_arg(args)
    raw = raw_prompt(args) if args.raw else None
    messages = None if args.raw else read_messages(args)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens)
    params.validate()
    if args.connect:
        from .oneshot_remote import run_remote  # deferred: the HTTP client

        if raw is not None:
            raise UsageError("--raw runs on the local engine only; drop --connect (or send a chat prompt)")
        return run_remote(args, messages, params)
    cfg = EngineConfig(max_concurrent=1, kv_sessions=1, max_queue=1, ctx_size=args.ctx_size,
                       verify_invariance=False, spec=args.spec, draft_model=args.draft_model)  # validated: a bad --ctx-size fails before loading
    lm = load_model(resolve_model_path(args.model), args.backend, max_positions=cfg.ctx_size)
    engine = Engine(lm, cfg).start()
    try:
        if raw is not None:  # no template; BOS per the file's add_bos_token (llama.cpp's completion)
            gen = engine.submit(prompt_ids=engine.completion_ids(raw), params=params)
        else:
            gen = engine.submit(messages, params=params, stop=engine.chat_stops)
        first = True
        for ev in gen.events():
            if first and not args.quiet:  # the first token (or the end) has come
                first = False
                print(startup_line(lm, since_start()), file=sys.stderr, flush=True)
            if isinstance(ev, TokenEvent) and not args.json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        fin: FinishEvent = gen.finish
    finally:
        engine.stop()
    if fin.reason == "error":
        raise UsageError(fin.error or "generation failed")
    if args.json:
        print(json.dumps({
            "text": fin.text, "token_ids": fin.token_ids,
            "prompt_tokens": fin.usage["prompt_tokens"], "completion_tokens": fin.usage["completion_tokens"],
            "finish_reason": fin.reason,
        }))
    else:
        sys.stdout.write("\n")
    return 0


def startup_line(lm: LoadedModel, ready_s: float) -> str:
    """The one start-up line of `run` (stderr): what loaded, on what, and the time from the
    process's start to the first token."""
    m = lm.model
    return (f"panechat: {lm.name} ({m.args.architecture}) on {m.backend.name}: ready in {ready_s:.2f} s "
            f"(first token; weights prepared in {m.load_seconds:.2f} s)")


def tokenize(args: argparse.Namespace) -> int:
    tok = load_tokenizer(GGUFFile.open(resolve_model_path(args.model)))
    ids = tok.encode(args.text, add_bos=None, parse_special=True)
    print(json.dumps({"ids": ids}) if args.json else " ".join(map(str, ids)))
    return 0

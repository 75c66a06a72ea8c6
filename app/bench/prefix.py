"""`panechat bench prefix`: N clients whose conversations start with one long system prompt.

Runs the workload twice on an in-process engine, with prefix sharing on and off. Client 1
is submitted alone; at its first token clients 2..N are submitted together (client 1 still
decoding), so all N conversations hold KV at once. Reports the peak KV memory held by
running generations (blocks x bytes per block) and the time to first token of clients
2..N against client 1's (vLLM's automatic prefix caching benchmark, in small).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from panechat.engine.serving.config import format_size
from panechat.engine.serving.events import TokenEvent
from panechat.engine.serving.sampling import SamplingParams

SYSTEM_SENTENCE = ("You are the help desk of a large public library. Answer briefly and politely, "
                   "cite the shelf section when you name a book, and never invent opening hours. ")
QUESTIONS = ["Where are the atlases?", "Can I renew a book online?", "Do you lend e-readers?",
             "Where is the children's section?", "How do I print a document?", "Is there a quiet room?",
             "Can I borrow a laptop?", "Where are the newspapers?", "Do you have board games?",
             "How many books may I borrow?", "Where are the cookbooks?", "Is there free wifi?",
             "Can I donate books?", "Where are the poetry books?", "Do you have a photocopier?",
             "Are there language courses?"]


def system_prompt(engine, n_tokens: int) -> str:
    """The system sentence repeated to about `n_tokens` tokens (with the chat template)."""
    text = SYSTEM_SENTENCE
    while len(engine.prompt_ids([{"role": "system", "content": text}])) < n_tokens:
        text += SYSTEM_SENTENCE
    return text


def run_mode(lm, args: argparse.Namespace, sharing: bool) -> dict:
    from panechat.engine.serving.engine import Engine, EngineConfig

    cfg = EngineConfig(max_concurrent=min(EngineConfig.MAX_CONCURRENT, args.clients),
                       max_queue=args.clients, ctx_size=args.ctx_size, prefix_caching=sharing,
                       kv_memory=args.kv_memory, kv_dtype=args.kv_dtype)
    engine = Engine(lm, cfg).start()
    try:
        system = system_prompt(engine, args.system_tokens)
        params = SamplingParams(max_tokens=args.max_tokens)

        def msgs(i: int) -> list[dict]:
            return [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]

        first = engine.submit(msgs(0), params=params)
        for ev in first.events():
            if isinstance(ev, TokenEvent):
                break
        rest = [engine.submit(msgs(i), params=params) for i in range(1, args.clients)]
        fins = [first.result()] + [g.result() for g in rest]
        errors = sum(1 for f in fins if f.reason not in ("stop", "length"))
        ttft = [f.timings["ttft_ms"] or 0.0 for f in fins]
        s = engine.stats()
        others = sorted(ttft[1:])
        return {
            "sharing": sharing, "clients": args.clients, "prompt_tokens": fins[0].usage["prompt_tokens"],
            "peak_kv_blocks": s.kv_peak_in_use, "peak_kv_bytes": s.kv_peak_in_use * (s.kv_bytes_per_block or 0),
            "ttft_first_ms": round(ttft[0], 1),
            "ttft_others_median_ms": round(others[len(others) // 2], 1) if others else None,
            "ttft_others_max_ms": round(others[-1], 1) if others else None,
            "prefix_cache_hits": s.prefix_cache_hits, "prefix_cache_queries": s.prefix_cache_queries,
            "kv_dtype": engine.kv.dtype, "errors": errors,
        }
    finally:
        engine.stop()


def run_prefix(args: argparse.Namespace) -> int:
    from ..engine_factory import load_model_from_args

    try:
        args.clients = int(args.clients)  # (--clients is shared with bench chat's list)
    except ValueError:
        raise ValueError(f"bench prefix: --clients takes one number, got {args.clients!r}") from None
    if not 2 <= args.clients <= 64 or args.system_tokens < 16 or args.max_tokens < 1:
        raise ValueError("bench prefix: --clients must be 2..64, --system-tokens >= 16, --max-tokens >= 1")
    lm = load_model_from_args(args)
    cells = []
    for sharing in (True, False):
        t0 = time.perf_counter()
        cells.append(run_mode(lm, args, sharing))
        cells[-1]["wall_s"] = round(time.perf_counter() - t0, 1)
        if not args.json:
            print(f"  sharing {'on' if sharing else 'off'}: done in {cells[-1]['wall_s']} s", file=sys.stderr,
                  flush=True)
    on, off = cells
    summary = {
        "peak_kv_ratio": round(on["peak_kv_bytes"] / off["peak_kv_bytes"], 3) if off["peak_kv_bytes"] else None,
        "ttft_ratio": round(on["ttft_others_median_ms"] / on["ttft_first_ms"], 3) if on["ttft_first_ms"] else None,
    }
    if args.json:
        print(json.dumps({"bench": "prefix", "model": lm.name, "cells": cells, **summary}, indent=2))
        return 0
    print(format_table(lm.name, cells, summary))
    return 0


def format_table(model: str, cells: list[dict], summary: dict) -> str:
    c0 = cells[0]
    lines = [f"bench prefix: {c0['clients']} clients, one {c0['prompt_tokens']}-token prompt "
             f"(shared system prompt + a question); model {model}; KV {c0['kv_dtype']}",
             "| sharing | peak KV blocks | peak KV | TTFT client 1 | TTFT clients 2-N median | max | "
             "prefix hits (tokens) | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        lines.append(f"| {'on' if c['sharing'] else 'off'} | {c['peak_kv_blocks']} | "
                     f"{format_size(c['peak_kv_bytes'])} | {c['ttft_first_ms']:.0f} ms | "
                     f"{c['ttft_others_median_ms']:.0f} ms | {c['ttft_others_max_ms']:.0f} ms | "
                     f"{c['prefix_cache_hits']}/{c['prefix_cache_queries']} | {c['errors']} |")
    lines.append(f"peak KV with sharing / without: {summary['peak_kv_ratio']} (target <= 0.40); "
                 f"TTFT of a sharing client / client 1: {summary['ttft_ratio']} (target <= 0.20)")
    return "\n".join(lines)

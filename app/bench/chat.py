"""`panechat bench chat`: N clients each hold a multi-turn conversation over HTTP.

Every client resends its whole history each turn to `POST /v1/chat/completions` (greedy,
fixed distinct prompts per client), exactly as an OpenAI-SDK chat app does, so it runs
against any OpenAI-compatible server. Without --url, each cell starts its own panechat
server on a free loopback port with a fresh engine: --max-concurrent as given, else (left at
its default) max-concurrent = the client count, and a queue that holds every client.

Reports total generated tok/s (all clients, wall clock), p50/p99 turn latency, prompt
tokens and the prompt tokens the server reports as reused from its cache
(`usage.prompt_tokens_details.cached_tokens`, or llama.cpp's `timings.cache_n`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time

import httpx

from panechat.engine.serving.config import EngineConfig

TOPICS = [
    "volcanoes", "honeybees", "the moon", "bread baking", "chess openings", "rainbows", "penguins",
    "the printing press", "black holes", "coral reefs", "bicycles", "jazz music", "origami",
    "glaciers", "the Roman empire", "photosynthesis", "lighthouses", "tea", "comets", "octopuses",
    "windmills", "the violin", "deserts", "paper money", "earthquakes", "sailing ships", "mushrooms",
    "the telescope", "owls", "maple syrup", "the alphabet", "thunderstorms",
]
FOLLOW_UPS = [
    "Tell me one surprising fact about {topic}.",
    "Why is that?",
    "Give me a concrete example.",
    "What is a common misconception about it?",
    "How would you explain it to a child?",
    "Summarize our conversation in one sentence.",
]


def prompt_for(client: int, turn: int) -> str:
    topic = TOPICS[client % len(TOPICS)]
    if client >= len(TOPICS):
        topic += f" (take {client // len(TOPICS) + 1})"
    return FOLLOW_UPS[turn % len(FOLLOW_UPS)].format(topic=topic) + (
        f" (turn {turn + 1})" if turn >= len(FOLLOW_UPS) else "")


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(-(-p * len(v) // 100)) - 1))
    return v[k]


def base_url(url: str) -> str:
    """http://host:port[/v1] -> the OpenAI base URL ending in /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def _model_name(http: httpx.AsyncClient, base: str) -> str:
    try:
        r = await http.get(f"{base}/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception:  # noqa: BLE001 - some servers have no /models; they ignore the name
        return "default"


#: What the odd-numbered clients of `--with-schema` ask their replies to match.
REPLY_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer", "minimum": 0, "maximum": 10}}}}}


async def run_cell(base: str, clients: int, turns: int, max_tokens: int, api_key: str | None = None,
                   timeout: float = 600.0, with_schema: bool = False) -> dict:
    """One cell: `clients` concurrent conversations of `turns` turns each (with
    `with_schema`, every odd-numbered client's replies held to REPLY_SCHEMA)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as http:
        model = await _model_name(http, base)
        latencies: list[float] = []
        totals = {"completion": 0, "prompt": 0, "reused": 0, "reused_known": False, "retries": 0, "errors": 0}

        async def one(i: int) -> None:
            messages: list[dict] = []
            for t in range(turns):
                messages.append({"role": "user", "content": prompt_for(i, t)})
                body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                        "temperature": 0, "seed": 0, "stream": False}
                if with_schema and i % 2:
                    body["response_format"] = REPLY_SCHEMA
                t0 = time.perf_counter()
                while True:
                    try:
                        r = await http.post(f"{base}/chat/completions", json=body)
                    except httpx.HTTPError:
                        totals["errors"] += 1
                        return
                    if r.status_code == 429:
                        totals["retries"] += 1
                        await asyncio.sleep(min(5.0, float(r.headers.get("retry-after", "1") or 1)))
                        continue
                    break
                if r.status_code != 200:
                    totals["errors"] += 1
                    return
                latencies.append(time.perf_counter() - t0)
                data = r.json()
                text = data["choices"][0]["message"].get("content") or ""
                usage = data.get("usage") or {}
                totals["completion"] += int(usage.get("completion_tokens") or 0)
                totals["prompt"] += int(usage.get("prompt_tokens") or 0)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if cached is None:
                    cached = (data.get("timings") or {}).get("cache_n")
                if cached is not None:
                    totals["reused"] += int(cached)
                    totals["reused_known"] = True
                messages.append({"role": "assistant", "content": text})

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return {
        "clients": clients, "turns": turns, "max_tokens": max_tokens, "requests": len(latencies),
        "schema_clients": clients // 2 if with_schema else 0,
        "completion_tokens": totals["completion"], "wall_s": round(wall, 3),
        "tok_s": round(totals["completion"] / wall, 2) if wall > 0 else 0.0,
        "p50_turn_s": round(percentile(latencies, 50), 3), "p99_turn_s": round(percentile(latencies, 99), 3),
        "prompt_tokens": totals["prompt"],
        "reused_prefix_tokens": totals["reused"] if totals["reused_known"] else None,
        "retries_429": totals["retries"], "errors": totals["errors"], "model": model,
    }


def _own_server_cell(args: argparse.Namespace, clients: int) -> dict:
    from ..engine_factory import build_engine  # deferred: with --url no engine or server is needed
    from ..server.serve import start_in_background

    ns = argparse.Namespace(**vars(args))
    given = getattr(args, "max_concurrent", None)
    if given is None or given == EngineConfig().max_concurrent:  # left at its default: one slot per client
        ns.max_concurrent = min(EngineConfig.MAX_CONCURRENT, max(given or 4, clients))
    # the KV budget: --kv-memory / --kv-sessions as given, else the engine's default
    ns.max_queue = max(getattr(args, "max_queue", 8) or 8, clients)
    ns.kv_snapshots = "off"  # a benchmark measures the engine, not the disk, and leaves no files behind
    engine = build_engine(ns, quiet=True)
    try:
        srv = start_in_background(engine, "127.0.0.1", 0)
        try:
            cell = asyncio.run(run_cell(srv.url + "/v1", clients, args.turns, args.max_tokens,
                                        with_schema=args.with_schema))
        finally:
            srv.stop()
        cell["server"] = (f"panechat (max-concurrent {ns.max_concurrent}, "
                          f"{'batched' if engine.batching else 'NOT batched'})")
        cell["backend"] = engine.lm.model.backend.describe()
        s = engine.stats()
        cell["kv_budget_bytes"] = engine.kv.nbytes
        cell["peak_kv_bytes"] = s.kv_peak_in_use * (s.kv_bytes_per_block or 0)
        cell["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB
        return cell
    finally:
        engine.stop()


def run_chat(args: argparse.Namespace) -> int:
    try:
        clients = [int(x) for x in str(args.clients).split(",") if x.strip()]
    except ValueError:
        raise ValueError("--clients must be a comma-separated list of numbers, e.g. 1,2,4") from None
    if not clients or any(c < 1 or c > 256 for c in clients):
        raise ValueError("--clients must list numbers between 1 and 256")
    if args.turns < 1 or args.max_tokens < 1:
        raise ValueError("--turns and --max-tokens must be >= 1")
    api_key = (getattr(args, "api_key", None) or getattr(args, "token", None)
               or os.environ.get("PANECHAT_TOKEN") or os.environ.get("OPENAI_API_KEY"))
    cells = []
    for n in clients:
        if args.url:
            cell = asyncio.run(run_cell(base_url(args.url), n, args.turns, args.max_tokens, api_key,
                                        with_schema=args.with_schema))
            cell["server"] = base_url(args.url)
        else:
            cell = _own_server_cell(args, n)
        cells.append(cell)
        if not args.json:
            print(f"  {n} client(s): {cell['tok_s']} tok/s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"bench": "chat", "turns": args.turns, "max_tokens": args.max_tokens,
                          "url": args.url, "cells": cells}, indent=2))
        return 0
    print(format_table(cells))
    return 0


def format_table(cells: list[dict]) -> str:
    if not cells:
        return ""
    c0 = cells[0]
    head = (f"bench chat: {c0['turns']} turns per client, max_tokens {c0['max_tokens']}, greedy, "
            f"whole history resent each turn; model {c0['model']}; server {c0.get('server', '?')}")
    cols = ["clients", "requests", "gen tok", "wall s", "tok/s", "p50 turn s", "p99 turn s",
            "prompt tok", "reused tok", "429s", "errors"]
    rows = []
    for c in cells:
        reused = c["reused_prefix_tokens"]
        reused_s = "n/a" if reused is None else (
            f"{reused} ({100 * reused / c['prompt_tokens']:.0f}%)" if c["prompt_tokens"] else str(reused))
        rows.append([str(c["clients"]), str(c["requests"]), str(c["completion_tokens"]), f"{c['wall_s']:.1f}",
                     f"{c['tok_s']:.1f}", f"{c['p50_turn_s']:.2f}", f"{c['p99_turn_s']:.2f}",
                     str(c["prompt_tokens"]), reused_s, str(c["retries_429"]), str(c["errors"])])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(cols)]
    lines = [head, "  ".join(h.rjust(w) for h, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    for c in cells:
        if "peak_rss_mib" in c:
            lines.append(f"{c['clients']} client(s): peak KV {c['peak_kv_bytes'] / 2**20:.1f} MiB of a "
                         f"{c['kv_budget_bytes'] / 2**20:.0f} MiB budget; peak RSS of the process so far "
                         f"{c['peak_rss_mib']:.0f} MiB")
    return "\n".join(lines)

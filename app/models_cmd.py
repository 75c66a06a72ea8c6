"""`panechat models`: list the GGUF models on this machine (engine/catalog/model_catalog.py finds them)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from panechat.engine.catalog.model_catalog import ModelEntry, find_models, search_roots


def add_models_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add the `models` subcommand to the CLI's subparsers; `parents` hold the options it
    shares with other subcommands (--json)."""
    p = sub.add_parser("models", help="list the GGUF models on this machine and whether panechat can load each",
                       parents=parents)
    p.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                   help="also look in DIR (repeatable; $PANECHAT_MODELS adds more, os.pathsep-separated)")


def models(args: argparse.Namespace) -> int:
    entries = find_models(args.models_dir)
    if args.json:
        json.dump([_as_json(e) for e in entries], sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif entries:
        sys.stdout.write(format_table(entries))
        print("\nuse one with: panechat --model NAME (or pass the file's path)")
    else:
        print("no GGUF models found; looked in:")
        for source, root in search_roots(args.models_dir):
            print(f"  {source:<9} {root}")
        print("add folders with --models-dir DIR or $PANECHAT_MODELS")
    return 0


def format_table(entries: list[ModelEntry]) -> str:
    """One aligned line per model: name, architecture, quant, size, context, source, status."""
    head = ("NAME", "ARCH", "QUANT", "SIZE", "CONTEXT", "SOURCE", "LOADABLE")
    rows = [head] + [(e.name, e.architecture or "-", e.quant or "-", _size(e.size),
                      str(e.context_length) if e.context_length else "-", e.source,
                      "yes" if e.loadable else f"no: {e.reason}") for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] + "\n" for r in rows)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    i = min(int(math.log10(max(n, 1)) // 3), 4)
    return f"{n} B" if i == 0 else f"{n / 1000 ** i:.1f} {('KB', 'MB', 'GB', 'TB')[i - 1]}"


def _as_json(e: ModelEntry) -> dict:
    return {"name": e.name, "path": str(e.path), "source": e.source, "architecture": e.architecture,
            "quant": e.quant, "size": e.size, "context_length": e.context_length,
            "loadable": e.loadable, "reason": e.reason}

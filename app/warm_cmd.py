"""`panechat warm`: compile the CPU kernels of models into numba's on-disk cache before they
are needed (what `make setup` runs; a container build can too), so the first start of the
TUI or `serve` on them loads compiled kernels instead of compiling for a minute or more.

Each model is warmed by `engine.serving.kernel_warmup` in a child process of its own, all at
once: numba compiles on one core, so two models warm in about the time of one on 2 cores."""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any



def add_warm_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add the `warm` subcommand; `parents` hold --model (repeatable)."""
    sub.add_parser("warm", parents=parents,
                   help="compile the CPU kernels of the models (default: the default model) into the cache, "
                        "so their first start is quick")


def warm(args: argparse.Namespace) -> int:
    from panechat.engine.default_model import resolve_model_path  # deferred: `--help` stays quick
    from panechat.engine.serving.config import EngineConfig
    from panechat.engine.serving.kernel_warmup import warm_kernels

    paths = [resolve_model_path(m) for m in (args.models or [None])]
    kv_dtype = EngineConfig().kv_dtype

    def one(path: Path) -> tuple[Path, bool, float]:
        t0 = time.monotonic()
        ok = warm_kernels(path, kv_dtype)
        return path, ok, time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=len(paths)) as pool:
        results = list(pool.map(one, paths))
    failed = 0
    for path, ok, seconds in results:
        if ok:
            print(f"panechat: {path.name}: kernels cached ({seconds:.1f} s)")
        else:
            failed += 1
            print(f"panechat: error: could not compile the kernels of {path.name}; "
                  f"`panechat run --model {path} hi` shows why", file=sys.stderr)
    return 1 if failed else 0

"""Build the engine from command-line arguments (shared by the TUI, serve and bench)."""

from __future__ import annotations

import argparse
import sys

from ..engine.default_model import resolve_model_path
from ..engine.engine import Engine, EngineConfig
from ..engine.loader import load_model


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the --max-concurrent/--kv-sessions/... flags, validated."""
    cfg = EngineConfig(
        max_concurrent=getattr(args, "max_concurrent", 4),
        kv_sessions=getattr(args, "kv_sessions", None),
        max_queue=getattr(args, "max_queue", 8),
        ctx_size=getattr(args, "ctx_size", 4096),
        prefill_chunk=getattr(args, "prefill_chunk", 512),
        straggler_ms=getattr(args, "straggler_ms", 2.0),
    )
    if cfg.max_concurrent < 1 or cfg.max_concurrent > 64:
        raise ValueError("--max-concurrent must be between 1 and 64")
    if cfg.kv_sessions is not None and cfg.kv_sessions < cfg.max_concurrent:
        raise ValueError("--kv-sessions must be at least --max-concurrent")
    if cfg.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    if cfg.ctx_size < 64:
        raise ValueError("--ctx-size must be at least 64")
    if cfg.prefill_chunk < 1:
        raise ValueError("--prefill-chunk must be >= 1")
    if not 0 <= cfg.straggler_ms <= 1000:
        raise ValueError("--straggler-ms must be between 0 and 1000")
    return cfg


def build_engine(args: argparse.Namespace, *, quiet: bool = False) -> Engine:
    """Load the model named by --model (or the default) on --backend and start the engine.

    Prints the start-up lines to stderr unless quiet."""
    cfg = engine_config(args)
    lm = load_model(resolve_model_path(getattr(args, "model", None)), getattr(args, "backend", "auto"),
                    max_positions=cfg.ctx_size)
    engine = Engine(lm, cfg).start()  # runs the invariance self-check on the compute thread
    if not quiet:
        for line in engine.startup_lines():
            print(line, file=sys.stderr)
    return engine

"""Build the engine from command-line arguments (shared by the TUI, serve and bench)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..engine.default_model import resolve_model_path
from ..engine.engine import Engine, EngineConfig
from ..engine.loader import load_model


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the --max-concurrent/--kv-sessions/... flags, validated by
    EngineConfig itself (ValueError naming the flag); a flag not in `args` keeps its default."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**given)


def load_model_from_args(args: argparse.Namespace):
    """The model --model names (or the default) on --backend, for --ctx-size positions."""
    return load_model(resolve_model_path(getattr(args, "model", None)), getattr(args, "backend", "auto"),
                      max_positions=engine_config(args).ctx_size)


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

"""Build the engine from command-line arguments (shared by the TUI, serve and bench)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from panechat.engine.default_model import resolve_model_path
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.kv.snapshot_store import default_root
from panechat.engine.model.loader import load_model
from panechat.engine.serving.model_set import ModelSet


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the --max-concurrent/--kv-sessions/... flags, validated by
    EngineConfig itself (ValueError naming the flag); a flag not in `args` keeps its default."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**given)


def kv_snapshot_dir(args: argparse.Namespace) -> str | None:
    """Where the engine keeps KV snapshots: the user cache folder with `--kv-snapshots on`
    (the default of serve and the TUI), None (off) otherwise."""
    return str(default_root()) if getattr(args, "kv_snapshots", "off") == "on" else None


def run_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the TUI, `serve` and the benchmarks run with: `engine_config(args)`
    plus where the KV snapshots live (`kv_snapshot_dir`, from --kv-snapshots)."""
    return dataclasses.replace(engine_config(args), kv_snapshot_dir=kv_snapshot_dir(args))


def load_model_from_args(args: argparse.Namespace):
    """The model --model names (or the default) on --backend, for --ctx-size positions."""
    return load_model(resolve_model_path(getattr(args, "model", None)), getattr(args, "backend", "auto"),
                      max_positions=engine_config(args).ctx_size)


def build_engine(args: argparse.Namespace, *, quiet: bool = False) -> Engine:
    """Load the model named by --model (or the default) on --backend and start the engine.

    Prints the start-up lines to stderr unless quiet."""
    cfg = run_config(args)
    lm = load_model(resolve_model_path(getattr(args, "model", None)), getattr(args, "backend", "auto"),
                    max_positions=cfg.ctx_size)
    engine = Engine(lm, cfg).start()  # runs the invariance self-check on the compute thread
    if not quiet:
        for line in engine.startup_lines():
            print(line, file=sys.stderr)
    return engine


def build_models(args: argparse.Namespace, *, quiet: bool = False) -> ModelSet:
    """The models --model names (several: all preloaded, the first the default; none: the
    default model) on --backend within --models-memory. Models asked for later load on
    first use; each load prints its start-up lines to stderr unless quiet, and so does
    each unload (one line naming the model and why)."""
    def report(name: str, engine: Engine) -> None:
        if not quiet:
            for line in engine.startup_lines():
                print(line, file=sys.stderr)

    def report_unload(name: str, why: str) -> None:
        if not quiet:
            print(f"model {name} unloaded ({why})", file=sys.stderr)

    # run_config: with --kv-snapshots on, every engine keeps what its prefix cache held
    models = ModelSet(run_config(args), getattr(args, "backend", "auto"), getattr(args, "models_memory", None),
                      on_load=report, on_unload=report_unload)
    try:
        for spec in getattr(args, "models", None) or [getattr(args, "model", None)]:
            models.get(spec)
    except BaseException:
        models.stop()
        raise
    return models

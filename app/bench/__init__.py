"""`panechat bench ...`: measured speed, never asserted in tests."""

from __future__ import annotations

import argparse


def dispatch(args: argparse.Namespace) -> int:
    if args.bench_command == "sweep":
        from .sweep import run_sweep

        return run_sweep(args)
    if args.bench_command == "grammar":
        from .grammar import run_grammar

        return run_grammar(args)
    if args.bench_command == "kernels":
        from .kernels import run_kernels

        return run_kernels(args)
    if args.bench_command == "prefix":
        from .prefix import run_prefix

        return run_prefix(args)
    if args.bench_command == "spec":
        from .spec import run_spec

        return run_spec(args)
    from .chat import run_chat

    return run_chat(args)

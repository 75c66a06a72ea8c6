"""`panechat bench grammar`: what a grammar's token mask costs per decode step.

B rows decode together (greedy, one engine), first free, then each held to a JSON schema.
Reported per B: the decode step's time free and constrained, and the time the mask takes
on the step's critical path (GrammarMask.apply: waiting for the prefetched mask, then
writing it into the logits) beside the time its computation takes in the worker, which
overlaps the forward pass (GrammarMask._advance), both summed over the step's rows.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import contextmanager

from panechat.engine.default_model import resolve_model_path
from panechat.engine.model.loader import load_model
from panechat.engine.serving import grammar as grammar_mod
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.grammar import json_schema_grammar
from panechat.engine.serving.sampling import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "scores"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}},
                         "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}}}}
PROMPT = [{"role": "user", "content": "Describe a book as JSON with its name, tags and scores."}]


@contextmanager
def _timed(cls, name: str, into: list[float], in_worker: list[bool] | None = None):
    """Add the seconds each call of `cls.name` takes to `into` while inside (and to
    `in_worker` whether it ran in the grammar worker)."""
    real = getattr(cls, name)

    def wrapper(self, *a, **kw):
        t = time.perf_counter()
        try:
            return real(self, *a, **kw)
        finally:
            into.append(time.perf_counter() - t)
            if in_worker is not None:
                in_worker.append(threading.current_thread().name.startswith("panechat-grammar"))

    setattr(cls, name, wrapper)
    try:
        yield
    finally:
        setattr(cls, name, real)


def _cell(engine: Engine, b: int, params: SamplingParams) -> tuple[float, int]:
    """Decode seconds per step (mean over the rows) and the tokens generated."""
    gens = [engine.submit(PROMPT, params=params, conversation=f"g{b}-{i}-{params.grammar is not None}")
            for i in range(b)]
    fins = [g.result() for g in gens]
    rates = [f.timings["decode_tok_s"] for f in fins if f.timings.get("decode_tok_s")]
    return (1.0 / (sum(rates) / len(rates)) if rates else 0.0), sum(len(f.token_ids) for f in fins)


def run_grammar(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in str(args.clients).split(",") if x.strip()]
    lm = load_model(resolve_model_path(args.model), args.backend)
    engine = Engine(lm, EngineConfig(max_concurrent=max(sizes), ctx_size=1024, prefix_caching=False)).start()
    n = args.max_tokens
    free, held = SamplingParams(max_tokens=n), SamplingParams(max_tokens=n, grammar=json_schema_grammar(SCHEMA))
    try:
        _cell(engine, 1, held)  # warm-up: the vocabulary, the kernels
        rows = []
        for b in sizes:
            step_free, _ = _cell(engine, b, free)
            applied, computed, in_worker = [], [], []
            with _timed(grammar_mod.GrammarMask, "apply", applied), \
                    _timed(grammar_mod.GrammarMask, "_advance", computed, in_worker):
                step_held, tokens = _cell(engine, b, held)
            steps = max(1, tokens / b)
            rows.append({"B": b, "step_ms_free": 1000 * step_free, "step_ms_grammar": 1000 * step_held,
                         "mask_ms_critical": 1000 * sum(applied) / steps,
                         "mask_ms_computed": 1000 * sum(computed) / steps,
                         "prefetched": sum(in_worker) / max(1, len(in_worker))})
    finally:
        engine.stop()
    if args.json:
        print(json.dumps({"model": lm.name, "backend": lm.model.backend.describe(), "rows": rows}))
        return 0
    print(f"model: {lm.name}  backend: {lm.model.backend.describe()}  tokens per row: {n}")
    print(f"{'B':>3} {'step free ms':>13} {'step grammar ms':>16} {'mask on path ms':>16} {'% of step':>9} "
          f"{'mask computed ms':>17} {'prefetched':>10}")
    for r in rows:
        pct = 100 * r["mask_ms_critical"] / r["step_ms_grammar"] if r["step_ms_grammar"] else 0.0
        print(f"{r['B']:>3} {r['step_ms_free']:>13.2f} {r['step_ms_grammar']:>16.2f} {r['mask_ms_critical']:>16.3f} "
              f"{pct:>8.1f}% {r['mask_ms_computed']:>17.3f} {r['prefetched']:>9.0%}")
    return 0

"""`panechat bench spec`: what speculative decoding (n-gram drafts, or a draft model's with
`--spec draft --draft-model X`) gains on repetitive work.

Workloads (greedy, one engine; speculation on and off per request, so the same engine and
kernels serve both): `rewrite`, a ~300-token code file to be written out again with one
change; `quote`, a passage to be repeated word for word; `chat`, an ordinary question
(the cost side: few drafts). Each at B=1 and B=4 (B copies at once, each its own
conversation), off and on in turn `--rounds` times. Reported: the median tokens/s off
and on, the speed-up, the drafts' acceptance, and whether every reply was identical
(they must be; the exit status says so). First, the cost of a verify step of 5 rows
against a one-row step (`spec_cost`); `--workloads ""` reports only that.
"""

from __future__ import annotations

import argparse
import json
import time

from panechat.engine.serving.sampling import SamplingParams

from .spec_cost import describe, verify_cost

CODE = '''def parse_line(line):
    """Split a "key = value" line into a pair; None for blanks and comments."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    key, _, value = line.partition("=")
    return key.strip(), value.strip()


def read_config(path):
    """Every key and value of the file at path, in order."""
    pairs = {}
    with open(path) as f:
        for line in f:
            pair = parse_line(line)
            if pair is not None:
                key, value = pair
                pairs[key] = value
    return pairs


def total_size(paths):
    """The sum of the sizes named in each config file."""
    total = 0
    for path in paths:
        config = read_config(path)
        total += int(config.get("size", 0))
    return total
'''

PASSAGE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
           "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of "
           "Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair.")

WORKLOADS = {
    "rewrite": "Here is a Python file:\n\n{code}\nWrite the whole file again, unchanged except that the "
               "function total_size is renamed to {name}. Reply with the code only.",
    "quote": "Repeat this passage exactly, word for word:\n\n{passage}",
    "chat": "Tell me about {name} in a few sentences.",
}
NAMES = ["sum_sizes", "size_total", "all_sizes", "count_size"]
TOPICS = ["the moon", "rivers", "bread", "trains"]


def _messages(workload: str, i: int) -> list[dict]:
    name = TOPICS[i % len(TOPICS)] if workload == "chat" else NAMES[i % len(NAMES)]
    return [{"role": "user", "content": WORKLOADS[workload].format(code=CODE, passage=PASSAGE, name=name)}]


def _cell(engine, workload: str, b: int, n: int, spec: bool) -> dict:
    """B conversations of `workload` at once: tokens/s of decoding (after each one's first
    token, summed over the rows), and the drafts' counts."""
    s0 = engine.stats()
    params = SamplingParams(max_tokens=n, speculate=spec)
    t0 = time.perf_counter()
    gens = [engine.submit(_messages(workload, i), params=params, conversation=f"{workload}-{b}-{i}-{spec}")
            for i in range(b)]
    fins = [g.result() for g in gens]
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    tokens = sum(len(f.token_ids) for f in fins)
    decode_s = max((f.timings["total_ms"] - (f.timings["ttft_ms"] or 0)) / 1000 for f in fins)
    drafted, accepted = s1.spec_draft_tokens - s0.spec_draft_tokens, s1.spec_accepted - s0.spec_accepted
    return {"tok_s": (tokens - b) / decode_s if decode_s > 0 else 0.0, "tokens": tokens, "wall_s": wall,
            "drafted": drafted, "accepted": accepted, "verify_steps": s1.spec_steps - s0.spec_steps,
            "replies": [f.token_ids for f in fins]}


def _compare(engine, workload: str, b: int, n: int, rounds: int) -> dict:
    """Off and on in turn, `rounds` times each (the machine's load drifts): the median
    tok/s of each, the drafts of all the on runs, and whether every reply was identical."""
    offs, ons = [], []
    for _ in range(rounds):
        offs.append(_cell(engine, workload, b, n, False))
        ons.append(_cell(engine, workload, b, n, True))
    off, on = _median(offs), _median(ons)
    drafted, accepted = sum(c["drafted"] for c in ons), sum(c["accepted"] for c in ons)
    steps = sum(c["verify_steps"] for c in ons)
    return {"workload": workload, "B": b, "tok_s_off": off, "tok_s_on": on,
            "speedup": on / off if off else 0.0, "acceptance": accepted / drafted if drafted else 0.0,
            "drafted": drafted, "accepted": accepted, "tokens_per_run": ons[0]["tokens"],
            "tokens_per_verify_step": (steps + accepted) / steps if steps else None,
            "identical": all(c["replies"] == offs[0]["replies"] for c in offs + ons)}


def _median(cells: list[dict]) -> float:
    rates = sorted(c["tok_s"] for c in cells)
    return rates[len(rates) // 2]


def run_spec(args: argparse.Namespace) -> int:
    from panechat.engine.serving.engine import Engine, EngineConfig

    from ..engine_factory import load_model_from_args

    sizes = [int(x) for x in str(args.clients).split(",") if x.strip()]
    workloads = [w for w in str(args.workloads).split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ValueError(f"--workloads: unknown {bad[0]!r}; choose from {', '.join(WORKLOADS)}")
    lm = load_model_from_args(args)
    cost = verify_cost(lm.model)  # before the engine: nothing else runs on the model meanwhile
    draft = getattr(args, "draft_model", None)  # --spec draft --draft-model X: its drafts, else n-gram ones
    engine = Engine(lm, EngineConfig(max_concurrent=max(sizes), ctx_size=2048, prefix_caching=False,
                                     spec="draft" if draft else "ngram", draft_model=draft)).start()
    rows = []
    try:
        _cell(engine, "chat", 1, 8, True)  # warm-up
        for w in workloads:
            for b in sizes:
                rows.append(_compare(engine, w, b, args.max_tokens, args.rounds))
        drafter = _draft_cost(engine)
    finally:
        engine.stop()
    if args.json:
        print(json.dumps({"model": lm.name, "backend": lm.model.backend.describe(), "verify_cost": cost,
                          "rows": rows, "draft": drafter}))
        return 0
    print(f"model: {lm.name}  backend: {lm.model.backend.describe()}  tokens per reply: {args.max_tokens}  "
          f"drafts: {'draft model ' + engine.draft.lm.name if engine.draft else 'n-gram'}")
    print(describe(cost))
    print(f"{'workload':>9} {'B':>3} {'tok/s off':>10} {'tok/s on':>9} {'speed-up':>9} {'accepted':>9} "
          f"{'drafts':>7} {'tok/step':>8} {'identical':>9}")
    for r in rows:
        print(f"{r['workload']:>9} {r['B']:>3} {r['tok_s_off']:>10.1f} {r['tok_s_on']:>9.1f} {r['speedup']:>8.2f}x "
              f"{r['acceptance']:>8.0%} {r['drafted']:>7} "
              f"{'-' if r['tokens_per_verify_step'] is None else format(r['tokens_per_verify_step'], '.2f'):>8} "
              f"{'yes' if r['identical'] else 'NO':>9}")
    if drafter:
        print(f"draft model {drafter['model']}: {drafter['runs']} drafting runs, {drafter['ms_per_run']:.1f} ms each, "
              f"{drafter['ms_per_forward']:.1f} ms per forward pass")
    return 0 if all(r["identical"] for r in rows) else 1


def _draft_cost(engine) -> dict | None:
    """The draft model's passes and their mean time (None: n-gram drafts)."""
    d = engine.draft
    if d is None or not d.runs:
        return None
    return {"model": d.lm.name, "runs": d.runs, "forwards": d.forwards, "ms_per_run": 1000 * d.seconds / d.runs,
            "ms_per_forward": 1000 * d.seconds / d.forwards}

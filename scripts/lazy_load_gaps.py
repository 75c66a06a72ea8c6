"""Stream from model A while model B loads beside it; print the longest gaps between A's
tokens and the longest GIL stalls, each with the phase of B's load it fell in.

    .venv/bin/python scripts/lazy_load_gaps.py [--model-b NAME] [--in-process]

A GIL stall is how late a thread that sleeps 1 ms at a time wakes (CPU contention shows
there too, a little); a token gap over 60 ms with no stall beside it is the CPUs being shared.
`--in-process` loads B as before issue 25 item 8 (tokenizer built in this process, kernels
compiled here, default switch interval), for comparison. Phases are timed by wrapping the
loader's functions, so the figures include nothing the server adds.
"""

from __future__ import annotations

import argparse
import functools
import threading
import time
from collections import defaultdict

import numpy as np

from panechat.engine.gguf import file as gguf_file
from panechat.engine.model import forward, loader
from panechat.engine.serving import engine as engine_mod
from panechat.engine.serving.config import EngineConfig
from panechat.engine.serving.model_set import ModelSet
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.text import chat_template, tokenizer, tokenizer_process

PHASES: list[tuple[str, float, float]] = []


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PHASES.append((name, t0, time.perf_counter()))
    return wrapper


def wrap_phases() -> None:
    gguf_file.GGUFFile.open = classmethod(timed("gguf.open", gguf_file.GGUFFile.open.__func__))
    loader.load_tokenizer = timed("tokenizer", loader.load_tokenizer)
    loader.TokenizerProcess = timed("tokenizer.spawn", tokenizer_process.TokenizerProcess)
    for name in ("_spm_merge_cuts", "_add_special_tokens", "_all_piece_bytes", "_vocab_of", "_build_spm",
                 "_build_byte_level"):
        setattr(tokenizer, name, timed(f"tokenizer.{name.strip('_')}", getattr(tokenizer, name)))
    chat_template.ChatTemplate.from_metadata = classmethod(
        timed("chat_template", chat_template.ChatTemplate.from_metadata.__func__))
    forward.Model.load = classmethod(timed("Model.load", forward.Model.load.__func__))
    tokenizer.Tokenizer.wait_ready = timed("tokenizer.wait_ready", tokenizer.Tokenizer.wait_ready)
    engine_mod.Engine._self_check = timed("engine.self_check", engine_mod.Engine._self_check)


class GilWatch(threading.Thread):
    """Sleeps 1 ms at a time; notes every wake later than 20 ms (start, end)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stalls: list[tuple[float, float]] = []
        self.done = False

    def run(self):
        last = time.perf_counter()
        while not self.done:
            time.sleep(0.001)
            now = time.perf_counter()
            if now - last > 0.02:
                self.stalls.append((last, now))
            last = now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-b", default="gemma-3-270m-q4_k_m")
    ap.add_argument("--in-process", action="store_true", help="load B the old way, for comparison")
    args = ap.parse_args()
    if args.in_process:
        ModelSet._start_engine = lambda self, path: engine_mod.Engine(
            loader.load_model(path, self.backend, max_positions=self.config.ctx_size), self.config).start()
    models = ModelSet(EngineConfig(max_concurrent=2, ctx_size=4096))
    a = models.get(None)
    wrap_phases()
    bar = {str(i): -100.0 for i in a.lm.tokenizer.stop_ids}
    gen = a.submit([{"role": "user", "content": "Write a long story about a dragon."}],
                   params=SamplingParams(max_tokens=3500, temperature=0.8, seed=1,
                                         logit_bias={int(k): v for k, v in bar.items()}))
    times: list[float] = []
    threading.Thread(target=lambda: [times.append(time.perf_counter()) for _ in gen.events()], daemon=True).start()
    watch = GilWatch()
    watch.start()
    time.sleep(3.0)
    t0 = time.perf_counter()
    models.get(args.model_b)
    t1 = time.perf_counter()
    time.sleep(1.0)
    watch.done = True
    gen.cancel()
    models.stop()
    report(np.array(times), watch.stalls, t0, t1)


def phase_at(x: float, t0: float, t1: float) -> str:
    inside = [p for p in PHASES if p[1] <= x <= p[2] and p[1] >= t0]
    return min(inside, key=lambda p: p[2] - p[1])[0] if inside else ("(between phases)" if t0 <= x <= t1 else "-")


def report(t: np.ndarray, stalls, t0: float, t1: float) -> None:
    gaps = np.diff(t)
    before = gaps[t[1:] < t0]
    print(f"B loaded in {t1 - t0:.2f} s; A's gaps before: longest {before.max() * 1e3:.0f} ms, "
          f"median {np.median(before) * 1e3:.0f} ms")
    print("phases of B's load (s from its start):")
    for name, s, e in PHASES:
        if s >= t0:
            print(f"  {name:28s} {s - t0:7.3f} .. {e - t0:7.3f}  ({(e - s) * 1e3:.0f} ms)")
    gap_of, stall_of = defaultdict(float), defaultdict(float)
    for i in np.flatnonzero((t[1:] >= t0) & (t[:-1] <= t1)):
        name = phase_at((t[i] + t[i + 1]) / 2, t0, t1)
        gap_of[name] = max(gap_of[name], gaps[i])
    for s, e in stalls:
        if t0 <= e and s <= t1:
            name = phase_at((s + e) / 2, t0, t1)
            stall_of[name] = max(stall_of[name], e - s)
    print("per phase: A's longest token gap, longest GIL stall (ms; stalls under 20 ms not noted):")
    for name in sorted(set(gap_of) | set(stall_of), key=lambda n: -gap_of.get(n, 0)):
        print(f"  {name:28s} {gap_of.get(name, 0) * 1e3:6.0f} {stall_of.get(name, 0) * 1e3:6.0f}")
    during = gaps[(t[1:] >= t0) & (t[:-1] <= t1)]
    print(f"longest gap while B loaded: {during.max() * 1e3:.0f} ms" if len(during) else "A's stream ended first")


if __name__ == "__main__":
    main()

"""How much the UI costs next to the engine, with 8 panes streaming (docs/benchmarks.md).

A benchmark, not a test (speed is never asserted): deselected from `make test`, run by
`make bench-ui`. Prints one line of figures. The same eight prompts also run on the engine alone, for
the step time without a UI."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.bench

from panechat.app.tui.perf import UI_COST
from panechat.engine.serving.sampling import SamplingParams

from .conftest import make_app, running_engine, type_into, wait_for

MAX_TOKENS = 160
PROMPTS = [f"Write a very long story about {i + 3} dragons" for i in range(8)]
ALONE_PROMPTS = [f"Write a very long story about {i + 3} wizards" for i in range(8)]  # not cached by the UI run


@pytest.fixture(scope="module")
def engine8(loaded_model):
    with running_engine(loaded_model, max_concurrent=8, kv_sessions=16, max_queue=8, ctx_size=512) as engine:
        yield engine


def engine_alone_ms_per_step(engine, prompts: list[str]) -> float:
    s0, t0 = engine.stats().steps, time.perf_counter()
    gens = [engine.submit([{"role": "user", "content": p}], params=SamplingParams(max_tokens=MAX_TOKENS))
            for p in prompts]
    for g in gens:
        g.result()
    return 1000 * (time.perf_counter() - t0) / (engine.stats().steps - s0)


async def test_ui_cost_with_eight_streaming_panes(engine8, store):
    # blocking reads (result()) stay off the event loop; the first run warms the shared prefix
    await asyncio.to_thread(engine_alone_ms_per_step, engine8, ["Hi"] * 8)
    alone_ms = await asyncio.to_thread(engine_alone_ms_per_step, engine8, ALONE_PROMPTS)
    store.set_setting("default_max_tokens", str(MAX_TOKENS))
    app = make_app(engine8, store)
    async with app.run_test(size=(200, 50)) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        for _ in range(7):
            await pilot.press("ctrl+n")
        panes = app.main.panes
        assert len(panes) == 8
        for pane, prompt in zip(panes, PROMPTS):
            await type_into(pilot, pane, prompt)
        steps0 = engine8.stats().steps
        UI_COST.reset()
        for pane in panes:
            pane.send(pane.query_one("PromptInput").text)
        t_end = time.monotonic() + 180
        while not all(p.last_finish and not p.busy for p in panes):  # no pilot here: it costs CPU
            assert time.monotonic() < t_end, "timed out waiting for eight replies"
            await asyncio.sleep(0.05)
        r = UI_COST.report()
        steps = engine8.stats().steps - steps0
        interval = app.main.flush_interval
    tokens = sum(p.last_finish.usage["completion_tokens"] for p in panes)
    step_ms = 1000 * r["wall_s"] / steps
    ui_ms = 1000 * r["ui_code_s"] / steps
    main_ms = 1000 * r["main_thread_cpu_s"] / steps
    by = {k: round(1000 * v / steps, 3) for k, v in r["by_category_s"].items()}
    print(f"\nUI cost, 8 panes x {MAX_TOKENS} tokens ({tokens} tokens, {steps} engine steps in {r['wall_s']:.1f} s): "
          f"{step_ms:.0f} ms/step with the UI vs {alone_ms:.0f} ms/step engine alone; "
          f"pane+dashboard code {ui_ms:.2f} ms/step = {100 * ui_ms / step_ms:.2f}% of a step "
          f"({r['ui_code_ms_per_s']:.1f} ms/s; per step by part {by}); whole UI thread CPU (Textual layout, "
          f"Markdown, rendering) {main_ms:.0f} ms/step = {100 * r['main_thread_cpu_s'] / r['wall_s']:.0f}% of one core; "
          f"flush interval at the end {1000 * interval:.0f} ms")
    assert tokens > 8


async def test_paste_cost(store):
    """A 40 KB and a 1 MB paste, bracketed (one Paste event) and as a terminal without
    bracketed paste sends it (one key event per character): seconds until the box holds
    it, and the latency of the key typed next."""
    from .paste_probe import EchoBackend, filler, paste_figures
    from panechat.app.tui.widgets.prompt_input import PromptInput

    app = make_app(EchoBackend(), store)
    figures = []
    async with app.run_test(size=(160, 45)) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        box = pane.query_one(PromptInput)
        for size, as_keys in ((40_000, False), (1_000_000, False), (40_000, True), (1_000_000, True)):
            box.clear()
            pane.focus_input()
            await pilot.pause()
            text = filler(size).replace("\n", " ") if as_keys else filler(size)
            shown, key = await paste_figures(pilot, box, text, as_keys=as_keys, timeout=600)
            figures.append(f"{size // 1000} KB {'as keys' if as_keys else 'pasted'}: shows in {shown:.2f} s, "
                           f"next key {1000 * key:.0f} ms")
    print("\npaste: " + "; ".join(figures))

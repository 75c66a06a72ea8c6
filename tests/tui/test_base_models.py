"""Base models in the TUI (issue 24 item 8), under Pilot with the real models: the F5
picker and the pane say "base model: completes text", a pane on gemma-3-270m (no chat
template) completes its text as `panechat run --raw` does, and a pane whose model is still
loading says so instead of showing queue figures."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from textual import events
from textual.widgets import OptionList

from panechat.app.clients.local import LocalBackend
from panechat.app.completion_text import completion_text
from panechat.app.tui.app import PanechatApp
from panechat.app.tui.screens.model_picker import ModelPickerScreen
from panechat.app.tui.widgets.pane import BASE_NOTE
from panechat.app.tui.widgets.prompt_input import PromptInput
from panechat.engine.serving.config import EngineConfig
from panechat.engine.serving.engine import Engine
from panechat.engine.serving.model_set import ModelSet
from panechat.engine.serving.sampling import SamplingParams

from .conftest import MAX_TOKENS, type_into, wait_for

GEMMA = "gemma-3-270m-q4_k_m"
SIZE = (160, 45)
PROMPT = "The capital of France is"


def _status(pane) -> str:
    """The pane's status line (its border subtitle) as plain text, without its colour markup."""
    return re.sub(r"\[/?\$[\w-]+\]", "", str(pane.border_subtitle))


async def _open_picker(pilot, app) -> ModelPickerScreen:
    await pilot.press("f5")
    await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), what="the model picker")
    await wait_for(pilot, lambda: bool(app.screen.query(OptionList)), what="the model list")
    return app.screen


async def _choose(pilot, app, picker: ModelPickerScreen, name: str) -> None:
    options = picker.query_one(OptionList)
    options.highlighted = [c.name for c in picker.choices].index(name)
    options.focus()
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, ModelPickerScreen), what="the picker to close")
    await pilot.pause()


def test_completion_text_continues_each_reply_and_puts_later_prompts_on_their_own_line():
    turns = [{"role": "system", "content": "Facts."}, {"role": "user", "content": "Paris is"},
             {"role": "assistant", "content": " in France."}, {"role": "user", "content": "Rome is"}]
    assert completion_text(turns) == "Facts.\nParis is in France.\nRome is"
    assert completion_text([{"role": "user", "content": "Once"}]) == "Once"


async def test_the_picker_marks_the_base_model_listed_by_the_catalog(tui_engine, gemma_path, store, monkeypatch):
    """gemma-3-270m, found through the catalog (not loaded), is listed as a base model; the
    chat model is not; the pane put on it says so before its first prompt."""
    monkeypatch.delenv("PANECHAT_MODELS", raising=False)
    models = ModelSet(EngineConfig(max_concurrent=2, ctx_size=256))
    models.add(tui_engine.lm.name.removesuffix(".gguf"), tui_engine)
    app = PanechatApp(LocalBackend(models), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        picker = await _open_picker(pilot, app)
        names = [c.name for c in picker.choices]
        assert GEMMA in names
        options = picker.query_one(OptionList)
        lines = {n: str(options.get_option_at_index(i).prompt) for i, n in enumerate(names)}
        assert BASE_NOTE in lines[GEMMA] and BASE_NOTE not in lines[names[0]]
        await _choose(pilot, app, picker, GEMMA)
        pane = app.main.panes[0]
        assert pane.model == GEMMA and BASE_NOTE in _status(pane)
        assert models.names() == [names[0]]  # listing and choosing load nothing


async def test_a_base_model_pane_completes_its_text_as_run_raw_does(tui_engine, gemma, store):
    """Two panes: the chat model chats (no note), gemma-3-270m continues the prompt's text
    exactly as `run --raw` (the raw prompt, no template) does, not an empty reply or an echo."""
    cfg = EngineConfig(max_concurrent=2, kv_sessions=2, ctx_size=256, verify_invariance=False)
    base = Engine(gemma, cfg).start()
    models = ModelSet(cfg)
    models.add(tui_engine.lm.name.removesuffix(".gguf"), tui_engine)
    models.add(GEMMA, base)
    try:
        raw = base.submit(prompt_ids=base.completion_ids(PROMPT), params=SamplingParams(max_tokens=MAX_TOKENS))
        alone = raw.result().text
        assert alone.strip() and not alone.strip().startswith(PROMPT)
        app = PanechatApp(LocalBackend(models), store)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, app.backend_ready.is_set, what="the backend")
            chat = app.main.panes[0]
            await pilot.press("ctrl+n")
            await pilot.pause()
            picker = await _open_picker(pilot, app)
            assert [c.base for c in picker.choices[:2]] == [False, True]
            await _choose(pilot, app, picker, GEMMA)
            pane = app.main.panes[1]
            assert pane.model == GEMMA
            await type_into(pilot, pane, PROMPT)
            pane.query_one(PromptInput).post_message(events.Key("enter", None))
            await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, timeout=120,
                           what="the completion")
            assert pane.last_finish.reason in ("stop", "length")
            assert pane.history[-1].content == alone
            assert BASE_NOTE in _status(pane) and BASE_NOTE not in _status(chat)
    finally:
        base.stop()


async def test_a_pane_whose_model_is_loading_says_so(tiny, store, monkeypatch):
    """While the pane's model loads (held here until the test lets it go) the status reads
    `loading <model>...`, with no queue figures; then the reply comes as usual."""
    default, other = tiny("llama", "Q8_0")[0], tiny("qwen2", "F32")[0]
    monkeypatch.setenv("PANECHAT_MODELS", os.pathsep.join(map(str, (default, other))))
    go = threading.Event()
    models = ModelSet(EngineConfig(max_concurrent=2, ctx_size=128, verify_invariance=False), backend="numpy")
    plain_start = models._start

    def held_start(path):
        if Path(path).stem == other.stem:
            go.wait(60)
        return plain_start(path)

    models._start = held_start
    models.get(default.stem)
    app = PanechatApp(LocalBackend(models), store)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, app.backend_ready.is_set, what="the backend")
            picker = await _open_picker(pilot, app)
            await _choose(pilot, app, picker, other.stem)
            pane = app.main.panes[0]
            await type_into(pilot, pane, "hi")
            pane.query_one(PromptInput).post_message(events.Key("enter", None))
            await wait_for(pilot, lambda: _status(pane).startswith("loading"), what="the loading line")
            await pilot.pause(0.3)
            status = _status(pane)
            assert status == f"loading {other.stem}..." and "tok/s" not in status
            go.set()
            await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, what="the reply")
            assert pane.last_finish.reason in ("stop", "length")
            assert _status(pane).startswith("idle")
    finally:
        go.set()
        models.stop()

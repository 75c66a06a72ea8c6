"""Two models in one app (engine/serving/model_set.py), driven with Pilot: the model picker puts
panes on a model, two panes on each model reply at once exactly as each request does
alone, the dashboard has a batch line per model, and a restart reopens each pane on its
model."""

from __future__ import annotations

from textual import events
from textual.widgets import OptionList

from panechat.app.clients.local import LocalBackend
from panechat.app.store import Store
from panechat.app.tui.app import PanechatApp
from panechat.app.tui.screens.model_picker import ModelPickerScreen
from panechat.app.tui.widgets.dashboard import Dashboard
from panechat.app.tui.widgets.prompt_input import PromptInput
from panechat.engine.serving.sampling import SamplingParams

from .conftest import MAX_TOKENS, type_into, wait_for

SMOL = "SmolLM2-135M-Instruct.Q4_1"
TINY = "tiny-gemma3-Q8_0-True"  # tests/conftest.py two_models
SIZE = (180, 50)
PROMPT = "Name a fruit."


async def _pick(pilot, app, name: str) -> None:
    """Choose `name` in the model picker, opened with its key (f5)."""
    await pilot.press("f5")
    await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), what="the model picker")
    picker = app.screen
    await wait_for(pilot, lambda: bool(picker.query(OptionList)), what="the model list")
    index = [c.name for c in picker.choices].index(name)
    options = picker.query_one(OptionList)
    options.highlighted = index
    options.focus()
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, ModelPickerScreen), what="the picker to close")
    await pilot.pause()


async def test_two_panes_on_each_of_two_models_reply_as_alone(two_models, store):
    alone = {m: two_models.get(m).submit([{"role": "user", "content": PROMPT}],
                                         params=SamplingParams(max_tokens=MAX_TOKENS)).result().text
             for m in (SMOL, TINY)}
    assert alone[SMOL] != alone[TINY]
    app = PanechatApp(LocalBackend(two_models), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await _pick(pilot, app, TINY)  # the first pane is empty: it is put on the model
        assert len(app.main.panes) == 1 and app.main.panes[0].model == TINY
        for model in (SMOL, SMOL, TINY):
            await pilot.press("ctrl+n")  # a new pane on the default model
            await pilot.pause()
            if model == TINY:
                await _pick(pilot, app, TINY)
        panes = app.main.panes
        assert [p.model for p in panes] == [TINY, SMOL, SMOL, TINY]
        assert all(p.border_title.endswith(f"· {p.model}") for p in panes)
        for pane in panes:
            await type_into(pilot, pane, PROMPT)
        for pane in panes:  # Enter in each, back to back (see test_app.py)
            pane.query_one(PromptInput).post_message(events.Key("enter", None))
        await wait_for(pilot, lambda: all(p.last_finish is not None and not p.busy for p in panes),
                       timeout=120, what="four replies")
        assert [p.history[-1].content for p in panes] == [alone[p.model] for p in panes]
        dash = app.main.query_one(Dashboard)
        lines = dash.model_lines()
        assert len(lines) == 2 and lines[0].startswith(SMOL[:22]) and lines[1].startswith(TINY)
        assert "\n".join(lines) == str(dash.query_one("#dash-models").render())
        ids = [p.conversation.id for p in panes]
    # a restart reopens each pane on its model
    app = PanechatApp(LocalBackend(two_models), Store.open())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        assert [(p.conversation.id, p.model) for p in app.main.panes] == list(zip(ids, [TINY, SMOL, SMOL, TINY]))
        app.store.close()


async def test_the_picker_lists_catalog_models_and_greys_out_the_unloadable(two_models, store, tmp_path,
                                                                            monkeypatch):
    bad = tmp_path / "models" / "broken.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"not a gguf")
    monkeypatch.setenv("PANECHAT_MODELS", str(bad.parent))
    choices = await LocalBackend(two_models).model_choices()
    names = [c.name for c in choices]
    assert names[:2] == [SMOL, TINY] and all(c.loaded for c in choices[:2])
    broken = choices[names.index("broken")]
    assert not broken.loadable and broken.reason
    app = PanechatApp(LocalBackend(two_models), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), what="the model picker")
        await wait_for(pilot, lambda: bool(app.screen.query(OptionList)), what="the model list")
        options = app.screen.query_one(OptionList)
        assert options.get_option_at_index(names.index("broken")).disabled
        assert not options.get_option_at_index(1).disabled
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, ModelPickerScreen) and app.main.panes[0].model == SMOL


async def test_a_remote_terminal_chooses_its_model(two_models):
    """`panechat --connect ws://... --model NAME`: the websocket client opens its
    conversations on that model; a pane's own model wins; an unknown one is one line."""
    from panechat.app.clients.base import Finished, GenParams
    from panechat.app.clients.remote_ws import RemoteBackend
    from panechat.app.server import ServerThread, create_app

    alone = {m: two_models.get(m).submit([{"role": "user", "content": PROMPT}],
                                         params=SamplingParams(max_tokens=8)).result().text
             for m in (SMOL, TINY)}
    srv = ServerThread(create_app(two_models), "127.0.0.1", 0).start()
    backend = RemoteBackend(srv.ws_url, model=TINY)
    try:
        info = await backend.start()
        assert info.model == TINY and [c.name for c in await backend.model_choices()] == [SMOL, TINY]

        async def reply(conversation: str, model: str = "") -> Finished:
            events = [ev async for ev in backend.stream(conversation, [{"role": "user", "content": PROMPT}],
                                                        GenParams(max_tokens=8), model=model)]
            return events[-1]

        assert (await reply("c-tiny")).text == alone[TINY]
        assert (await reply("c-smol", SMOL)).text == alone[SMOL]
        fin = await reply("c-nope", "gpt-4o")
        assert fin.reason == "error" and "gpt-4o" in fin.error and "\n" not in fin.error
    finally:
        await backend.close()
        srv.stop()


async def test_a_pane_on_a_listed_model_loads_it_with_its_first_prompt(tiny, store, monkeypatch):
    """The picker lists a model `panechat models` finds but nobody loaded; the pane put on
    it loads it with its first prompt, and replies as that model does alone."""
    import os

    from panechat.engine.serving.config import EngineConfig
    from panechat.engine.serving.model_set import ModelSet

    default, other = tiny("llama", "Q8_0")[0], tiny("qwen2", "F32")[0]
    monkeypatch.setenv("PANECHAT_MODELS", os.pathsep.join(map(str, (default, other))))
    models = ModelSet(EngineConfig(max_concurrent=2, ctx_size=128, verify_invariance=False), backend="numpy")
    models.get(default.stem)
    app = PanechatApp(LocalBackend(models), store)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, app.backend_ready.is_set, what="the backend")
            await _pick(pilot, app, other.stem)
            pane = app.main.panes[0]
            assert pane.model == other.stem and models.names() == [default.stem]  # not loaded yet
            await type_into(pilot, pane, PROMPT)
            pane.query_one(PromptInput).post_message(events.Key("enter", None))
            await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, what="the reply")
            assert models.names() == [default.stem, other.stem]
            alone = models.get(other.stem).submit([{"role": "user", "content": PROMPT}],
                                                  params=SamplingParams(max_tokens=MAX_TOKENS)).result()
            assert pane.last_finish.reason in ("stop", "length") and pane.history[-1].content == alone.text
            assert store.get_conversation(pane.conversation.id).model == other.stem
    finally:
        models.stop()

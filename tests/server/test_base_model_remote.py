"""A base-model pane over `panechat --connect URL` completes text as `run --raw` does locally
(issue 24, item 8): a live loopback server holding a base model (a tiny file with no chat
template) and the chat model SmolLM2; the terminal's client (`RemoteBackend`) learns from the
welcome which models are base models, and `respond` on one continues the conversation's text:
the same tokens as the raw completion of that text on the same engine, not a ChatML reply."""

from __future__ import annotations

import pytest

from panechat.app.clients.base import Delta, Finished, GenParams
from panechat.app.clients.remote_ws import RemoteBackend
from panechat.app.completion_text import completion_text
from panechat.app.server import ServerThread, create_app
from panechat.engine.model.loader import load_model
from panechat.engine.serving.config import EngineConfig
from panechat.engine.serving.engine import Engine
from panechat.engine.serving.model_set import ModelSet
from panechat.engine.serving.sampling import SamplingParams

from ..tiny_gguf import ARCH_SHAPES, write_tiny_gguf

N = 8
TURNS = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": " there was"},
         {"role": "user", "content": "a dragon"}]


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory):
    base_path = tmp_path_factory.mktemp("base") / "tiny-base.gguf"
    write_tiny_gguf(base_path, "llama", seed=5, chat_template=False, **ARCH_SHAPES["llama"])
    cfg = EngineConfig(max_concurrent=2, ctx_size=256, verify_invariance=False)
    models = ModelSet(cfg, backend="numpy")
    models.lazy = False
    for path in (model_path, base_path):
        models.add(path.stem, Engine(load_model(path, "numpy", max_positions=256), cfg).start())
    srv = ServerThread(create_app(models), "127.0.0.1", 0).start()
    yield srv, models, base_path.stem
    srv.stop()
    models.stop()


async def _text(stream) -> tuple[str, Finished]:
    out = []
    async for ev in stream:
        if isinstance(ev, Delta):
            out.append(ev.text)
        elif isinstance(ev, Finished):
            return "".join(out), ev
    raise AssertionError("no Finished")


async def test_a_base_model_pane_over_connect_completes_the_conversations_text(served):
    srv, models, base = served
    engine = models.get(base)
    raw = engine.submit(prompt_ids=engine.completion_ids(completion_text(TURNS)),
                        params=SamplingParams(max_tokens=N)).result().text
    chat = engine.submit(TURNS, params=SamplingParams(max_tokens=N)).result().text
    assert raw != chat  # the test can tell the two apart
    client = RemoteBackend(srv.url.replace("http", "ws"), model=base)
    await client.start()
    try:
        assert client.completes_text(base) and not client.completes_text("SmolLM2-135M-Instruct.Q4_1")
        choices = {c.name: c.base for c in await client.model_choices()}
        assert choices == {"SmolLM2-135M-Instruct.Q4_1": False, base: True}
        text, fin = await _text(client.respond("c-base", TURNS, GenParams(max_tokens=N)))
        assert fin.reason in ("length", "stop") and text == raw
        # a chat model's pane chats as before, `respond` or not
        smol = models.get("SmolLM2-135M-Instruct.Q4_1")
        alone = smol.submit(TURNS, params=SamplingParams(max_tokens=N)).result().text
        text, _ = await _text(client.respond("c-chat", TURNS, GenParams(max_tokens=N),
                                             model="SmolLM2-135M-Instruct.Q4_1"))
        assert text == alone
    finally:
        await client.close()

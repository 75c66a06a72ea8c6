"""Several models in one process (engine/serving/model_set.py): two models loaded at once,
each reply equal token for token to the same request run alone; the memory budget
(refusal in one line, least recently used idle model unloaded); unknown names."""

from __future__ import annotations

import pytest

from panechat.engine.serving.config import EngineConfig
from panechat.engine.serving.model_set import ModelDoesNotFit, ModelSet, UnknownModel, estimate_bytes, parse_model_list
from panechat.engine.serving.sampling import SamplingParams

GEMMA = "tiny-gemma3-Q8_0-True"  # tests/conftest.py two_models
SMOL = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = ["Name a color.", "What is 2+2?"]


def _ask(engine, prompt: str, n: int = 8, seed: int | None = None):
    params = SamplingParams(max_tokens=n, temperature=0.8 if seed is not None else 0.0, seed=seed)
    return engine.submit([{"role": "user", "content": prompt}], params=params)


def test_two_models_at_once_reply_as_they_do_alone(two_models):
    assert two_models.names() == [SMOL, GEMMA]
    smol, gemma = two_models.get(SMOL), two_models.get(GEMMA)
    assert smol is not gemma and smol.lm.model.args.architecture != gemma.lm.model.args.architecture
    assert two_models.get() is smol  # the first loaded is the default
    cases = [(e, p, seed) for e in (smol, gemma) for p in PROMPTS for seed in (None, 7)]
    alone = [_ask(e, p, seed=s).result().token_ids for e, p, s in cases]
    together = [_ask(e, p, seed=s) for e, p, s in cases]  # both engines' batches at once
    assert [g.result().token_ids for g in together] == alone
    assert all(len(ids) == 8 for ids in alone)
    assert alone[0] != alone[4]  # two models, two answers: the requests did reach each their own
    stats = two_models.stats()
    assert list(stats) == [SMOL, GEMMA]
    assert all(s.requests_total >= 8 for s in stats.values())


def test_any_spelling_of_a_loaded_model_finds_it(two_models, tiny):
    gemma, gemma_path = two_models.get(GEMMA), tiny("gemma3", "Q8_0")[0]
    for name in (str(gemma_path), gemma_path.name, GEMMA):
        assert two_models.find(name) is gemma
    assert two_models.find("nope") is None


def test_an_unknown_model_is_one_line_naming_the_loaded_ones(two_models):
    with pytest.raises(UnknownModel) as e:
        two_models.get("no-such-model:7b")
    msg = str(e.value)
    assert "\n" not in msg and "no-such-model:7b" in msg and SMOL in msg and GEMMA in msg


def test_model_list_flags():
    assert parse_model_list(None) == []
    assert parse_model_list(["a,b", "c", "a"]) == ["a", "b", "c"]
    assert parse_model_list("x, y") == ["x", "y"]


def _tiny_set(memory):
    # a fixed KV budget (2 contexts), so a model's bytes do not depend on the free memory
    models = ModelSet(EngineConfig(max_concurrent=1, ctx_size=64, kv_sessions=2, verify_invariance=False),
                      backend="numpy", memory=memory)
    models.handout_busy_s = 0.0  # idle as soon as no stream runs (the tests hold no request)
    return models


def test_memory_budget_refuses_unloads_lru_idle_and_never_a_busy_one(tiny):
    d, a, b = tiny("llama", "Q8_0")[0], tiny("llama", "F32")[0], tiny("qwen2", "F32")[0]
    probe = _tiny_set(None)
    sizes = []
    for path in (d, a, b):
        before = probe.used_bytes()
        probe.get(str(path))
        sizes.append(probe.used_bytes() - before)
    probe.stop()
    size_d, size_a, size_b = sizes
    # the default and one of a, b fit; all three do not
    models = _tiny_set(size_d + max(size_a, size_b) + min(size_a, size_b) // 2)
    try:
        models.get(str(d))  # the first model: the default
        ea = models.get(str(a))
        assert models.names() == [d.stem, a.stem] and models.used_bytes() == size_d + size_a
        models.handout_busy_s = 60.0  # `a` was just handed out: a request is on its way
        with pytest.raises(ModelDoesNotFit) as e:
            models.get(str(b))
        msg = str(e.value)
        assert "\n" not in msg and "--models-memory" in msg and f"{a.stem} (" in msg and "busy" in msg
        assert "the default" in msg and d.stem in msg
        assert models.names() == [d.stem, a.stem]  # nothing unloaded, nothing loaded
        models.handout_busy_s = 0.0
        eb = models.get(str(b))  # `a` is idle now: unloaded to make room; the default stays
        assert models.names() == [d.stem, b.stem] and models.used_bytes() == size_d + size_b
        with pytest.raises(Exception):
            ea.submit(prompt_ids=[1, 2], params=SamplingParams(max_tokens=1))  # stopped
        assert eb.submit(prompt_ids=[1, 2], params=SamplingParams(max_tokens=2)).result().reason in ("length", "stop")
        assert models.get(str(a)) is not ea  # loaded again when asked for, `b` unloaded in turn
        assert models.names() == [d.stem, a.stem]
    finally:
        models.stop()


def test_a_model_larger_than_the_budget_is_refused_before_loading(tiny):
    loaded = []
    models = _tiny_set(1 << 10)
    models.on_load = lambda name, engine: loaded.append(name)
    with pytest.raises(ModelDoesNotFit,
                       match=r"needs about [\d.]+ [KM]iB but --models-memory is 1 KiB; raise --models-memory$"):
        models.get(str(tiny("llama", "F32")[0]))
    assert loaded == [] and models.names() == []


def test_the_memory_budget_counts_a_draft_models_weights_and_kv(tiny):
    """--spec draft: a model's bytes are its own and its draft model's (weights and KV
    blocks), in the estimate before loading and in what is held after."""
    target, draft = tiny("llama", "F32")[0], tiny("llama", "Q8_0")[0]  # one synthetic vocabulary
    base = EngineConfig(max_concurrent=1, ctx_size=64, kv_sessions=2, verify_invariance=False)
    with_draft = EngineConfig(max_concurrent=1, ctx_size=64, kv_sessions=2, verify_invariance=False,
                              spec="draft", draft_model=str(draft))
    assert estimate_bytes(target, with_draft) - estimate_bytes(target, base) > draft.stat().st_size
    held = []
    for cfg in (base, with_draft):
        models = ModelSet(cfg, backend="numpy", memory=None)
        try:
            e = models.get(str(target))
            held.append((models.used_bytes(), e))
            if cfg is with_draft:
                assert e.draft is not None
                d = e.draft
                assert models.used_bytes() == (e.lm.model.weight_bytes + e.kv.nbytes
                                               + d.lm.model.weight_bytes + d.kv.nbytes)
        finally:
            models.stop()
    assert held[1][0] > held[0][0] + held[1][1].draft.lm.model.weight_bytes // 2


def test_the_real_gemma3_beside_the_default_model_replies_as_alone(loaded_model, gemma):
    """The same with the real gemma-3-270m (the session's loaded file, shared with
    test_gemma3.py so it is loaded once) beside SmolLM2: two requests on each model at
    once, each reply token for token its reply alone. Short replies: gemma's 262k-token
    vocabulary makes each token cost seconds on a loaded 2-core machine."""
    from panechat.engine.serving.engine import Engine

    cfg = EngineConfig(max_concurrent=2, ctx_size=256, verify_invariance=False)  # checked in test_gemma3.py
    models = ModelSet(cfg)
    try:
        models.add(SMOL, Engine(loaded_model, cfg).start())
        models.add("gemma-3-270m-q4_k_m", Engine(gemma, cfg).start())
        cases = [(models.get(m), p) for m in (SMOL, "gemma-3-270m-q4_k_m") for p in PROMPTS]
        alone = [_ask(e, p, n=4).result().token_ids for e, p in cases]
        together = [_ask(e, p, n=4) for e, p in cases]
        assert [g.result().token_ids for g in together] == alone
        assert models.stats()["gemma-3-270m-q4_k_m"].requests_total == 4
    finally:
        models.stop()

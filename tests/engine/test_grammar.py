"""The grammar mask (engine/serving/grammar.py) in the logits-processor seam: a constrained
row only ever picks tokens its grammar accepts, on the host (numpy backend) and on the
device (the CuPy backend over its numpy emulation), and picks the same tokens alone and
batched beside unconstrained rows, whose tokens do not change either (greedy and seeded)."""

from __future__ import annotations

from dataclasses import replace

import llguidance
import pytest

from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.grammar import json_schema_grammar, text_grammar
from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.text.grammar_vocab import ll_tokenizer

PROMPTS = [[1, 90, 198, 26], [50, 23, 63], [28, 198, 66, 11, 216], [40, 41, 42]]
N = 12
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["ab", "cd"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def _run(lm, jobs):
    eng = Engine(lm, EngineConfig(max_concurrent=len(jobs), ctx_size=64, verify_invariance=False)).start()
    try:
        fins = [g.result() for g in [eng.submit(prompt_ids=p, params=params) for p, params in jobs]]
        assert all(f.reason in ("stop", "length") for f in fins), [f.error for f in fins]
        return [list(f.token_ids) for f in fins]
    finally:
        eng.stop()


def _accepted(lm, grammar: str, ids: list[int]) -> int:
    """How many of `ids` a fresh matcher of `grammar` takes."""
    return llguidance.LLMatcher(ll_tokenizer(lm.tokenizer), grammar, log_level=0).validate_tokens(ids)


PARAMS = [SamplingParams(max_tokens=N), SamplingParams(temperature=1.3, top_k=50, seed=5, max_tokens=N)]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_a_constrained_row_follows_its_grammar_alone_and_batched(tiny_lm, params):
    grammar = json_schema_grammar(SCHEMA)
    plain = _run(tiny_lm, [(p, params) for p in PROMPTS])
    constrained = replace(params, grammar=grammar)
    alone = _run(tiny_lm, [(PROMPTS[0], constrained)])[0]
    assert alone and _accepted(tiny_lm, grammar, alone) == len(alone)
    assert tiny_lm.tokenizer.decode(alone).startswith("{")
    assert _accepted(tiny_lm, grammar, plain[0]) < len(plain[0])  # the random model alone writes no JSON
    beside = _run(tiny_lm, [(PROMPTS[1], params), (PROMPTS[0], constrained), (PROMPTS[2], params),
                            (PROMPTS[3], params)])
    assert beside == [plain[1], alone, plain[2], plain[3]]


def test_a_finished_grammar_ends_the_reply_with_stop(tiny_lm):
    grammar = text_grammar('root ::= "ab" | "abc"')  # GBNF
    tok = tiny_lm.tokenizer
    if not tok.stop_ids:
        pytest.skip("the tiny vocabulary has no stop token")
    eng = Engine(tiny_lm, EngineConfig(max_concurrent=1, ctx_size=64, verify_invariance=False)).start()
    try:
        fin = eng.submit(prompt_ids=PROMPTS[0], params=SamplingParams(max_tokens=N, grammar=grammar)).result()
    finally:
        eng.stop()
    assert fin.reason == "stop" and fin.text in ("ab", "abc")


def test_a_bad_grammar_is_refused():
    with pytest.raises(InvalidRequest, match="not a Lark or GBNF grammar"):
        text_grammar("root ::= (")
    with pytest.raises(InvalidRequest, match="must be an object"):
        json_schema_grammar([1, 2])


def test_a_grammar_that_does_not_compile_is_refused_at_submit(tiny_lm):
    eng = Engine(tiny_lm, EngineConfig(max_concurrent=1, ctx_size=64, verify_invariance=False)).start()
    try:
        with pytest.raises(InvalidRequest, match="grammar does not compile"):
            eng.submit(prompt_ids=PROMPTS[0], params=SamplingParams(grammar=text_grammar("start: missing_rule")))
    finally:
        eng.stop()

"""Issue 27's identity check on both real models: 20 prompts, greedy and seeded at
temperature 0.8, with n-gram drafts off and on, alone and batched beside 3 others: every
token sequence the same. Every draft the n-grams offer is tried (extra rows priced at
nothing), and the drafts must really be accepted, so a verify step that changed a bit
would show. The default suite runs gemma3 on 8 prompts (the default model's are in
test_speculation.py); `make test-slow` runs all 20 on both models."""

from __future__ import annotations

import pytest

from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.sampling import SamplingParams

from .speculation_checks import FreeRows, assert_drafts_change_nothing

#: Raw completions: repetitive ones (lists, code, quotes) where drafts stand, and ordinary
#: prose where few do.
PROMPTS = [
    "apple, banana, cherry, apple, banana, cherry, apple,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The cat sat on the mat. The",
    "1 2 3 4 5 1 2 3 4 5 1 2",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Monday, Tuesday,",
    "<ul>\n  <li>one</li>\n  <li>two</li>\n  <li>three</li>\n  <li>",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in",
    "Once upon a time, in a small village by the sea, there lived",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
    "Q: What is 2 + 2?\nA: 4\nQ: What is 3 + 3?\nA: 6\nQ: What is 4 + 4?\nA:",
    "red green blue red green blue red green",
    "The best way to learn a new language is",
    '{"name": "Ann", "age": 31}\n{"name": "Bob", "age": 42}\n{"name": "Cy",',
    "To be, or not to be, that is the question: whether",
    "SELECT id, name FROM users;\nSELECT id, name FROM orders;\nSELECT id,",
    "In 1969, the first humans landed on",
    "a b c d e f g a b c d e f g a b",
    "Dear Sam,\nThank you for your letter. Thank you for the photos. Thank you",
    "import os\nimport sys\nimport json\nimport",
]
assert len(PROMPTS) == 20


def _params(kind: str, i: int, n: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=n)
    return SamplingParams(max_tokens=n, temperature=0.8, seed=100 + i)


def _check(lm, count: int, n: int) -> None:
    e = Engine(lm, EngineConfig(max_concurrent=4, ctx_size=256, prefix_caching=False)).start()
    e.scheduler.step_cost = FreeRows()
    try:
        assert e.spec_problem is None, e.spec_problem
        prompts = [e.completion_ids(t) for t in PROMPTS[:count]]
        for kind in ("greedy", "seeded"):
            assert_drafts_change_nothing(e, prompts, [_params(kind, i, n) for i in range(count)],
                                         [f"{kind} {t!r}" for t in PROMPTS[:count]])
    finally:
        e.stop()


def test_gemma3_the_same_tokens_with_drafts(gemma):
    _check(gemma, 8, 16)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["default", "gemma3"])
def test_twenty_prompts_the_same_tokens_with_drafts(which, loaded_model, gemma):
    _check(loaded_model if which == "default" else gemma, 20, 24)

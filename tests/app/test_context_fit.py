"""fit_context: the trimming rule the TUI's local engine and the websocket server share."""

from __future__ import annotations

from panechat.app.context_fit import fit_context, reply_room


def words(messages: list[dict]) -> list[int]:
    """A stand-in tokenizer: one token per word, plus 2 per message."""
    return [0] * sum(len(m["content"].split()) + 2 for m in messages)


def turns(n: int, size: int = 10) -> list[dict]:
    out = []
    for i in range(n):
        out += [{"role": "user", "content": f"q{i} " + "w " * (size - 1)},
                {"role": "assistant", "content": f"a{i} " + "w " * (size - 1)}]
    return out


def test_a_prompt_that_fits_is_sent_as_it_is():
    msgs = [{"role": "system", "content": "be brief"}, *turns(3), {"role": "user", "content": "next"}]
    fit = fit_context(msgs, words, ctx=1000, reserve=100)
    assert fit.messages is msgs and fit.dropped == 0 and len(fit.ids) == len(words(msgs))


def test_the_oldest_whole_turns_go_first_and_the_system_prompt_stays():
    system = {"role": "system", "content": "be brief"}
    msgs = [system, *turns(6), {"role": "user", "content": "last question"}]  # 4 + 6*24 + 4 = 152 tokens
    fit = fit_context(msgs, words, ctx=100, reserve=20)
    assert fit.messages[0] == system and fit.messages[-1] == msgs[-1]
    assert fit.messages[1]["role"] == "user"  # roles still alternate from a user turn
    assert fit.messages[1:] == msgs[1 + fit.dropped:]
    assert len(fit.ids) <= 80 and fit.dropped % 2 == 0
    fewer = fit_context(msgs, words, ctx=100 + 24, reserve=20)  # room for one more turn pair
    assert fewer.dropped == fit.dropped - 2  # the fewest that fit


def test_a_last_turn_too_long_alone_is_returned_for_the_engine_to_refuse():
    msgs = [*turns(2), {"role": "user", "content": "w " * 500}]
    fit = fit_context(msgs, words, ctx=100, reserve=20)
    assert fit.messages == msgs[-1:] and fit.dropped == 4 and len(fit.ids) >= 100
    alone = [{"role": "user", "content": "w " * 500}]
    assert fit_context(alone, words, ctx=100, reserve=20).messages is alone


def test_the_reply_gets_max_tokens_at_most_a_quarter_of_the_context():
    assert reply_room(16, 4096) == 16 and reply_room(4096, 4096) == 1024 and reply_room(0, 8) == 1

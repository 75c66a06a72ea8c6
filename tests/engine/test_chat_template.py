"""ChatTemplate tests: the default model's template against llama.cpp's golden prompts,
HF-compatible Jinja environment, ChatML fallback, and one-line ValueErrors."""

from __future__ import annotations

import json

import pytest

from panechat.engine.text.chat_template import CHATML_TEMPLATE, ChatTemplate


@pytest.fixture(scope="module")
def template(gguf_meta, tokenizer):
    return ChatTemplate.from_metadata(gguf_meta, tokenizer)


def test_golden_prompts(template, tokenizer, golden):
    cases = golden["chat_template"]
    assert cases
    assert not template.is_fallback
    for c in cases:
        prompt = template.render(c["messages"])
        assert prompt == c["prompt"]
        assert tokenizer.encode(prompt) == c["prompt_ids"]


def test_without_generation_prompt(template, golden):
    for c in golden["chat_template"]:
        bare = template.render(c["messages"], add_generation_prompt=False)
        assert c["prompt"].startswith(bare) and len(bare) < len(c["prompt"])


def test_chatml_fallback_when_gguf_has_none(gguf_meta, tokenizer):
    meta = {k: v for k, v in gguf_meta.items() if k != "tokenizer.chat_template"}
    tpl = ChatTemplate.from_metadata(meta, tokenizer)
    assert tpl.is_fallback and tpl.source == CHATML_TEMPLATE
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tpl.render(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tpl.kind == "chatml-fallback" and tpl.stop_strings == ("<|im_end|>", "<|im_start|>")
    own = ChatTemplate.from_metadata(gguf_meta, tokenizer)
    assert own.kind == "gguf" and own.stop_strings == ()


@pytest.mark.parametrize("messages", [
    "hi",
    {"role": "user", "content": "hi"},
    ["hi"],
    [{"content": "hi"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": 1, "content": "hi"}],
])
def test_bad_messages_raise_one_line_value_error(template, messages):
    with pytest.raises(ValueError) as err:
        template.render(messages)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("source", "fragment"), [
    ("{{ raise_exception('roles must\nalternate') }}", "roles must alternate"),
    ("{{ messages[0].content.foo.bar }}", "chat template error"),  # undefined
    ("{{ messages.append(1) }}", "chat template error"),  # sandbox: immutable
    ("{{ 1 + 'a' }}", "TypeError"),
])
def test_template_errors_become_one_line_value_error(source, fragment):
    with pytest.raises(ValueError, match=fragment) as err:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert "\n" not in str(err.value)


def test_syntax_error_fails_at_compile():
    with pytest.raises(ValueError, match="does not compile") as err:
        ChatTemplate("{% for m in messages %}\n{{ m }")
    assert "\n" not in str(err.value)


def test_environment_matches_transformers(template, tokenizer):
    msgs = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "x"}]
    tpl = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}|"
        "{{ strftime_now('%Y') | length }}|{{ tools is none }}",
        bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text)
    assert tpl.render(msgs) == (
        f"{tokenizer.bos_text}|{tokenizer.eos_text}|{json.dumps(msgs, ensure_ascii=False)}"
        "|user|4|True")
    # trim_blocks + lstrip_blocks
    assert ChatTemplate("  {% if true %}\nX\n  {% endif %}\nY").render([]) == "X\nY"
    # The model's own template sees the model's special tokens.
    assert ChatTemplate.from_metadata(
        {"tokenizer.chat_template": "{{ bos_token }}{{ eos_token }}"}, tokenizer
    ).render([]) == tokenizer.bos_text + tokenizer.eos_text

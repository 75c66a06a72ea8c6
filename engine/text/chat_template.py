"""Render a conversation into a model's prompt text with its own Jinja chat template.

Reference followed: Hugging Face transformers chat templating
(``utils/chat_template_utils.py``: ``_compile_jinja_template`` / ``render``).  As there,
the template runs in jinja2's ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` with the ``loopcontrols`` extension, a ``{% generation %}`` block
tag, a ``tojson`` filter that does not escape HTML or non-ASCII, and the globals
``raise_exception`` and ``strftime_now``; it gets ``messages``, ``tools`` (None unless given),
``documents`` (None), ``add_generation_prompt``, ``bos_token`` and ``eos_token``.

The template comes from the GGUF key ``tokenizer.chat_template``; a model without one (a
base model) gets ChatML, the template llama.cpp's server falls back to, and says so
(``kind``: "chatml-fallback", shown in the TUI and ``/v1/models``). Such a model rarely
has ChatML's markers as tokens, so the fallback's turn markers are stop strings
(``stop_strings``): the reply ends where the model would start another turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from panechat.engine.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "CHATML_TEMPLATE"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The template used when the GGUF has none (HF transformers' ChatML default, and
llama.cpp's: `llm_chat_apply_template` LLM_CHAT_TEMPLATE_CHATML renders the same text)."""

TEMPLATE_KINDS = ("gguf", "chatml-fallback")
"""`ChatTemplate.kind`: the file's own template, or ChatML because the file has none."""


class ChatTemplateError(ValueError):
    """The template cannot render these messages: they are malformed, or the template
    refuses them (its ``raise_exception``, e.g. roles that do not alternate) or fails on
    them. One line; the engine refuses the request with it."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders its body as is
    (transformers uses it to mark assistant text; rendering is unchanged)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _validate(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ChatTemplateError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, "
            f"not {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', "
                             f"not {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ChatTemplateError(f"messages[{i}] has no {key!r}")
            if not isinstance(m[key], str):
                raise ChatTemplateError(
                    f"messages[{i}][{key!r}] must be str, not {type(m[key]).__name__}")


class ChatTemplate:
    """A compiled chat template.  Immutable; :meth:`render` is safe from any thread."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 is_fallback: bool = False) -> None:
        """Compile ``source``.  Raises ``ValueError`` (one line) if it is not valid Jinja.

        ``bos_token``/``eos_token`` are the texts the template sees under those names.
        """
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {_one_line(e)}") from None
        self._source = source
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._is_fallback = is_fallback

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], tokenizer: Tokenizer) -> ChatTemplate:
        """The model's template from ``tokenizer.chat_template`` (ChatML if absent or
        empty), with ``bos_token``/``eos_token`` taken from ``tokenizer``.  Raises
        ``ValueError`` if the model's template does not compile."""
        source = meta.get("tokenizer.chat_template")
        fallback = not isinstance(source, str) or not source.strip()
        return cls(CHATML_TEMPLATE if fallback else source, bos_token=tokenizer.bos_text,
                   eos_token=tokenizer.eos_text, is_fallback=fallback)

    @property
    def source(self) -> str:
        """The Jinja source in use."""
        return self._source

    @property
    def is_fallback(self) -> bool:
        """True when the GGUF had no template and ChatML is used instead."""
        return self._is_fallback

    @property
    def kind(self) -> str:
        """"gguf" (the file's own template) or "chatml-fallback" (the file has none): the
        name `/v1/models`, the websocket welcome and the dashboard show."""
        return TEMPLATE_KINDS[self._is_fallback]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Text that ends a reply under this template although the model may have no token
        for it: ChatML's turn markers for the fallback, nothing for the file's own."""
        return ("<|im_end|>", "<|im_start|>") if self._is_fallback else ()

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text for ``messages`` (each a dict with str ``role`` and
        ``content``; other keys are passed through to the template).

        With ``add_generation_prompt`` the text ends with the header that opens the
        assistant's reply; ``tools`` (OpenAI function tools) is what the template sees
        under that name (None: the model is offered no tools).  Raises ``ChatTemplateError`` with a one-line message for malformed
        messages, and for any error the template raises (``raise_exception``, undefined
        values, sandbox violations, ...).
        """
        _validate(messages)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=bool(add_generation_prompt),
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - a template is foreign code
            raise ChatTemplateError(
                f"chat template error: {type(e).__name__}: {_one_line(e)}") from None

"""Load a GGUF file into everything generation needs: weights, tokenizer, chat template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from panechat.backends import get_backend
from panechat.backends.base import Backend
from panechat.engine.text.chat_template import ChatTemplate
from panechat.engine.gguf.file import GGUFFile, ModelFileError
from panechat.engine.model.forward import Model
from panechat.engine.model.args import ModelArgs
from panechat.engine.text.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A model ready to generate: forward pass, tokenizer and chat template."""

    path: Path
    model: Model
    tokenizer: Tokenizer
    template: ChatTemplate

    @property
    def name(self) -> str:
        return self.path.name

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render `messages` (and `tools`, for a template that knows them) with the model's
        template and tokenize (special tokens parsed)."""
        text = self.template.render(messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer.encode(text, add_bos=None, parse_special=True)

    def completion_ids(self, text: str) -> list[int]:
        """A raw prompt, no template: tokenized as llama.cpp's completion does (BOS as the
        file's add_bos_token flag says, special tokens parsed)."""
        return self.tokenizer.encode(text, add_bos=None, parse_special=True)


def load_tokenizer(gf: GGUFFile) -> Tokenizer:
    """The file's tokenizer; raises ModelFileError (one line) when unsupported."""
    try:
        return Tokenizer.from_metadata(gf.metadata)
    except ValueError as e:
        raise ModelFileError(f"{gf.path}: {e}") from None


def load_model(path: str | Path, backend: str | Backend = "auto", max_positions: int | None = None) -> LoadedModel:
    """Open, validate and load `path` onto `backend`; raises ModelFileError (one line)."""
    gf = GGUFFile.open(path)
    args = ModelArgs.from_metadata(gf.metadata)  # unsupported architectures fail before anything else
    gf.check_types()  # then tensor types panechat does not read
    be = get_backend(backend) if isinstance(backend, str) else backend
    why = be.unsupported(args)  # and what the backend lacks, before the tokenizer's seconds
    if why:
        raise ModelFileError(f"{gf.path}: {why}")
    tokenizer = load_tokenizer(gf)
    try:
        template = ChatTemplate.from_metadata(gf.metadata, tokenizer)
    except ValueError as e:
        raise ModelFileError(f"{gf.path}: {e}") from None
    model = Model.load(gf, be, max_positions=max_positions)
    return LoadedModel(gf.path, model, tokenizer, template)

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
from panechat.engine.text.tokenizer_process import TokenizerProcess


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


#: Up to this many tokens the Hugging Face build takes a few ms: no child process is worth it.
SMALL_VOCAB = 8192


def load_tokenizer(gf: GGUFFile, in_process: bool = True) -> Tokenizer:
    """The file's tokenizer; raises ModelFileError (one line) when unsupported.
    `in_process=False`: unless the vocabulary is small, its Hugging Face part is built and
    run in a child process (`TokenizerProcess`), which works while this one goes on;
    `Tokenizer.wait_ready` says whether it could be built."""
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    separate = not in_process and isinstance(tokens, (list, tuple)) and len(tokens) > SMALL_VOCAB
    try:
        return Tokenizer.from_metadata(gf.metadata, encoder=TokenizerProcess(gf.path) if separate else None)
    except ValueError as e:
        raise ModelFileError(f"{gf.path}: {e}") from None


def load_model(path: str | Path, backend: str | Backend = "auto", max_positions: int | None = None,
               *, tokenizer_in_process: bool = True) -> LoadedModel:
    """Open, validate and load `path` onto `backend`; raises ModelFileError (one line).
    `tokenizer_in_process=False` (a model loaded while others serve): the tokenizer's
    seconds of GIL-holding build happen in a child process, beside the weights' load."""
    gf = GGUFFile.open(path)
    args = ModelArgs.from_metadata(gf.metadata)  # unsupported architectures fail before anything else
    gf.check_types()  # then tensor types panechat does not read
    be = get_backend(backend) if isinstance(backend, str) else backend
    why = be.unsupported(args)  # and what the backend lacks, before the tokenizer's seconds
    if why:
        raise ModelFileError(f"{gf.path}: {why}")
    tokenizer = load_tokenizer(gf, tokenizer_in_process)
    try:
        template = ChatTemplate.from_metadata(gf.metadata, tokenizer)
        model = Model.load(gf, be, max_positions=max_positions)
        tokenizer.wait_ready()
    except ValueError as e:
        tokenizer.close()
        raise ModelFileError(f"{gf.path}: {e}") from None
    except BaseException:
        tokenizer.close()
        raise
    return LoadedModel(gf.path, model, tokenizer, template)

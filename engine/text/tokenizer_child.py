"""The child process of a `TokenizerProcess`: builds one model's tokenizer and encodes for it.

Run as `python -m panechat.engine.text.tokenizer_child PATH`; it speaks the protocol of
`tokenizer_process` on its stdin and stdout and ends when its stdin closes.
"""

from __future__ import annotations

import sys

import numpy as np

from panechat.engine.gguf.file import GGUFFile, ModelFileError
from panechat.engine.text.tokenizer import Tokenizer
from panechat.engine.text.tokenizer_process import ERROR, OK, read_request, reply


def serve(path: str) -> None:
    """Build the tokenizer of `path` (its Hugging Face part in this process), say whether
    that worked, then answer requests until stdin closes."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed must not reach the protocol stream
    try:
        tok = Tokenizer.from_metadata(GGUFFile.open(path).metadata)
    except (ValueError, ModelFileError) as e:
        reply(out, ERROR, str(e).encode())
        return
    reply(out, OK, b"")
    while (request := read_request(inp)) is not None:
        text, parse_special = request
        try:
            ids = tok.encode(text, add_bos=False, add_eos=False, parse_special=parse_special)
            reply(out, OK, np.asarray(ids, np.int32).tobytes())
        except Exception as e:  # noqa: BLE001 - the parent raises it for this request only
            reply(out, ERROR, f"{type(e).__name__}: {e}".encode())


if __name__ == "__main__":
    serve(sys.argv[1])

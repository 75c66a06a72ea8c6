"""Prefix-cache keys: a cryptographic hash chain over the token ids of each block.

The cache is shared by every client of a server, so its keys must be collision-resistant:
a client that could make two different token chains hash alike could make another
client's prompt continue from KV computed for other tokens (vLLM moved to sha256 for
this, CVE-2025-25183). A block's digest is blake2b-256 over its parent's digest and its
token ids as little-endian int32, so equal digests mean equal tokens from position 0 on.
It is computed once per full block (registering it, or looking it up at admission),
never per token.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from panechat.backends.paged_kv import BLOCK_TOKENS

__all__ = ["DIGEST_BYTES", "ROOT", "block_digest"]

DIGEST_BYTES = 32
#: The parent digest of a sequence's first block.
ROOT = bytes(DIGEST_BYTES)

_FULL = struct.Struct(f"<{BLOCK_TOKENS}i")


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chain digest through a block holding `tokens` (at most BLOCK_TOKENS ids) after
    the chain `parent`. The encoding is fixed-width, so (parent, tokens) is recovered from
    the hashed bytes: only a blake2b collision could give two chains one digest."""
    ids = _FULL.pack(*tokens) if len(tokens) == BLOCK_TOKENS else struct.pack(f"<{len(tokens)}i", *tokens)
    return hashlib.blake2b(parent + ids, digest_size=DIGEST_BYTES).digest()

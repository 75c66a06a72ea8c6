"""Errors every layer shares: `BackendUnavailable` and `one_line`, the way an exception
becomes the one line a user sees.

Backends are the bottom layer (app -> engine -> backends), so this module imports nothing
of panechat's and anything may import it.
"""

from __future__ import annotations


class BackendUnavailable(Exception):
    """The requested backend cannot run here; the message names the fix."""


def one_line(e: BaseException, *, with_type: bool = False) -> str:
    """The first line of `e`'s message (its type name when the message is empty), for a
    one-line error. with_type: prefix the type name, as in "OSError: no such device"."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {lines[0]}" if with_type else lines[0]

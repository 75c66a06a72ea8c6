"""`UsageError`: a user mistake (a bad flag, a missing file), which the CLI prints as one
line on stderr with exit code 2, never as a traceback."""

from __future__ import annotations


class UsageError(Exception):
    """A user mistake; printed as one line naming the problem and the fix, exit code 2."""

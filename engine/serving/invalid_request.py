"""`InvalidRequest`: the client's own mistake, which the engine (and the server in front of
it) refuses in one line.

Only these are the client's to fix: every protocol answers them with a 4xx
(app/engine_errors.py). Any other exception from the engine, a plain ValueError included,
is a bug in panechat and is answered as an internal error. A subclass of ValueError, so
callers that caught ValueError before keep working.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request panechat refuses because of what it asks (a field out of range, an empty or
    malformed prompt); the message is one line naming the problem and the fix. `param`:
    the request field at fault, when one is (e.g. "temperature")."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

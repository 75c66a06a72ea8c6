"""Graceful shutdown: on SIGTERM or SIGINT, drain before uvicorn closes the connections.

uvicorn's own shutdown closes websockets at once (1012) and cuts HTTP responses still
streaming after `timeout_graceful_shutdown`, so a client sees its reply stop with no end.
`DrainingServer` takes the signal instead and runs `drain` first (docs/protocol.md,
"Shutdown"):

1. stop admitting: new generations get 503 `shutting_down` (ws: an `error` frame), and
   `/health` answers 503 `draining`, so a load balancer stops sending work;
2. let the generations in flight finish, for up to the grace (`--shutdown-grace`);
3. end the rest with reason `shutdown`: each handler sends its client a proper end (SSE:
   an error event and `data: [DONE]`; a non-streamed request: 503 `shutting_down`; ws:
   `finished` with reason `shutdown`);
4. close the websockets (1001, going away); then uvicorn stops as usual.

A second signal ends the grace at once; a third is uvicorn's forced exit.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import uvicorn

from .state import ServerState

__all__ = ["DrainingServer", "drain"]

#: Seconds the handlers get, once their generations are ended, to send their clients the end.
ENDING_S = 3.0
#: How often the drain looks at what is still running.
POLL_S = 0.02


async def _until(done: Callable[[], bool], timeout: float, hurry: asyncio.Event | None = None) -> None:
    """Return once `done()`, after `timeout` seconds, or once `hurry` is set."""
    t_end = time.monotonic() + timeout
    while not done() and time.monotonic() < t_end and not (hurry is not None and hurry.is_set()):
        await asyncio.sleep(POLL_S)


async def drain(state: ServerState, grace: float, hurry: asyncio.Event | None = None) -> None:
    """Steps 1 to 4 above, on the server's event loop; returns when every generation this
    app started has ended and its client has been told (or after ENDING_S more)."""
    state.begin_drain(grace)
    running = len(state.inflight)
    state.log.info("shutting down: %d generation(s) in flight get up to %g s to finish", running, grace)
    await _until(lambda: not state.inflight, grace, hurry)
    cut = list(state.inflight)
    for gen in cut:
        gen.cancel("shutdown")
    await _until(lambda: not state.inflight, ENDING_S)
    for conn in list(state.sockets):
        await conn.going_away()
    left = len(state.inflight)
    state.log.info("shutdown: %d generation(s) finished, %d ended with reason 'shutdown'%s",
                   running - len(cut), len(cut), f", {left} still unanswered" if left else "")


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose exit (a signal, or `request_drain()` from any thread) first
    drains the app: see the module docstring.

    The signal handler (main thread, between two bytecodes) only counts; the loop starts
    the drain at its next tick (uvicorn ticks every 0.1 s). A drained server exits
    normally: the signal is not raised again afterwards as uvicorn does, so `panechat
    serve` exits 0 after SIGTERM or Ctrl-C."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float):
        super().__init__(config)
        self.state = state
        self.grace = grace
        self.exit_requests = 0  # signals (or request_drain calls) so far
        self._drain: asyncio.Task | None = None
        self._hurry: asyncio.Event | None = None

    def handle_exit(self, sig: int, frame) -> None:
        self.request_drain()

    def request_drain(self, grace: float | None = None) -> None:
        """Drain (with `grace`, default the server's), then exit. Again: end the grace now.
        A third time: uvicorn's forced exit. Safe from any thread and from a signal handler."""
        if grace is not None and self.exit_requests == 0:
            self.grace = grace
        self.exit_requests += 1
        if self.exit_requests >= 3:
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.exit_requests and self._drain is None:
            self._hurry = asyncio.Event()
            self._drain = asyncio.create_task(self._drain_then_exit())
        if self.exit_requests >= 2 and self._hurry is not None:
            self._hurry.set()
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.state, self.grace, self._hurry)
        finally:
            self.should_exit = True

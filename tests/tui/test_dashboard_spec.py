"""The dashboard shows each speculating stream's draft acceptance (issue 27, "Visible"):
worded by `state_words`, and on screen under Pilot while the real local engine decodes
a repetitive reply with n-gram drafts."""

from __future__ import annotations

import asyncio
import time

from textual.app import App
from textual.widgets import DataTable

from panechat.app.clients.local import LocalBackend
from panechat.app.tui.widgets.dashboard import Dashboard, state_words
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.speculation import StepCost
from panechat.engine.serving.stats import StreamState, StreamStats


def test_a_decoding_stream_with_drafts_shows_their_acceptance():
    assert state_words(StreamStats("r", "c", StreamState.DECODING, spec_acceptance=0.716)) == "spec 71%"
    assert state_words(StreamStats("r", "c", StreamState.DECODING, spec_acceptance=1.0)) == "spec all"
    assert state_words(StreamStats("r", "c", StreamState.DECODING, spec_acceptance=0.996)) == "spec 99%"
    assert len(state_words(StreamStats("r", "c", StreamState.DECODING, spec_acceptance=0.99))) <= len("decoding")
    assert state_words(StreamStats("r", "c", StreamState.DECODING)) == "decoding"  # no draft tried yet
    assert state_words(StreamStats("r", "c", StreamState.QUEUED, spec_acceptance=0.5)) == "queued"


class _FreeRows(StepCost):
    """Extra rows cost nothing: every draft the n-grams offer is tried (this machine's load aside)."""

    def ratio(self, rows: int, extra: int) -> float:
        return 1.0


class _Host(App):
    def __init__(self, backend):
        super().__init__()
        self.backend = backend

    def compose(self):
        yield Dashboard(self.backend)


async def test_the_dashboard_shows_a_live_streams_acceptance(tui_engine):
    backend = LocalBackend(tui_engine)
    await backend.start()
    was = tui_engine.scheduler.step_cost
    tui_engine.scheduler.step_cost = _FreeRows()
    try:
        app = _Host(backend)
        async with app.run_test(size=(60, 30)) as pilot:
            ids = tui_engine.completion_ids("1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2")
            gen = tui_engine.submit(prompt_ids=ids, params=SamplingParams(max_tokens=120))
            table, seen, deadline = app.query_one(DataTable), set(), time.monotonic() + 60
            while time.monotonic() < deadline and not any(w.startswith("spec ") for w in seen):
                await pilot.pause(0.1)
                seen |= {str(table.get_row_at(i)[1]) for i in range(table.row_count)}
            gen.cancel()
            await asyncio.to_thread(gen.result)
        assert any(w.startswith("spec ") for w in seen), seen
    finally:
        tui_engine.scheduler.step_cost = was

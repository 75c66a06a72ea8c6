"""The dashboard shows each speculating stream's draft acceptance and the tokens a verify
step gives (issue 27, "Visible"): worded by `state_words` and `spec_words`, and on screen
under Pilot while the real local engine decodes a repetitive reply with n-gram drafts."""

from __future__ import annotations

import asyncio
import time

from textual.app import App
from textual.widgets import DataTable, Static

from panechat.app.clients.local import LocalBackend
from panechat.app.tui.widgets.dashboard import Dashboard, spec_words, state_words
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.speculation import StepCost
from panechat.engine.serving.stats import EngineStats, StreamState, StreamStats


def test_a_decoding_stream_with_drafts_shows_their_acceptance():
    assert state_words(StreamStats("r", "c", StreamState.DECODING, spec_acceptance=0.716)) == "spec 71%"
    assert state_words(StreamStats("r", "c", StreamState.DECODING, spec_acceptance=1.0)) == "spec all"
    assert state_words(StreamStats("r", "c", StreamState.DECODING, spec_acceptance=0.996)) == "spec 99%"
    assert len(state_words(StreamStats("r", "c", StreamState.DECODING, spec_acceptance=0.99))) <= len("decoding")
    assert state_words(StreamStats("r", "c", StreamState.DECODING)) == "decoding"  # no draft tried yet
    assert state_words(StreamStats("r", "c", StreamState.QUEUED, spec_acceptance=0.5)) == "queued"


def test_the_batch_line_words_tokens_per_verify_step():
    d = StreamState.DECODING
    streams = (StreamStats("a", "c", d, spec_tokens_per_step=2.5), StreamStats("b", "c", d, spec_tokens_per_step=1.5),
               StreamStats("q", "c", StreamState.QUEUED, spec_tokens_per_step=9.0), StreamStats("n", "c", d))
    assert spec_words(EngineStats(streams=streams)) == "spec 2.0 tok/step"  # the decoding ones that drafted
    assert spec_words(EngineStats(streams=streams[3:])) == ""


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
            # long enough to outlast a few of the dashboard's 4 Hz refreshes (120 tokens of this
            # repetitive reply ran out in under one, drafts standing); cancelled once seen
            gen = tui_engine.submit(prompt_ids=ids, params=SamplingParams(max_tokens=900))
            table, seen, deadline = app.query_one(DataTable), set(), time.monotonic() + 60
            batch, lines = app.query_one("#dash-batch", Static), set()
            while time.monotonic() < deadline and not (any(w.startswith("spec ") for w in seen)
                                                       and any("tok/step" in x for x in lines)):
                await pilot.pause(0.1)
                seen |= {str(table.get_row_at(i)[1]) for i in range(table.row_count)}
                lines.add(str(batch.render()))
            gen.cancel()
            await asyncio.to_thread(gen.result)
        assert any(w.startswith("spec ") for w in seen), seen
        steps = [float(x.split("spec ")[1].split(" tok/step")[0]) for x in lines if "tok/step" in x]
        assert steps and all(1.0 < v <= 1 + 16 for v in steps), lines  # drafts stood: more than 1 a step
    finally:
        tui_engine.scheduler.step_cost = was

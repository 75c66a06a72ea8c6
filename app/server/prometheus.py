"""`GET /metrics`: Prometheus text format, derived from each model's `engine.stats()` (an
`EngineStats`) at scrape time; every engine metric carries a `model` label. The
`panechat_client_*` families carry a `client` label: the --tokens name, or "-" for every
client of a server without named tokens (addresses would make the label unbounded).

A custom collector reads one engine snapshot per scrape, so serving costs nothing per
token. Each app gets its own registry (several servers may live in one process).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from panechat.engine.serving.stats import StreamState

if TYPE_CHECKING:
    from panechat.engine.serving.stats import EngineStats
    from .conversations import ConversationStore
    from .state import ServerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    """Turns one `EngineStats` snapshot into metric families."""

    def __init__(self, state: "ServerState"):
        self.state = state

    def collect(self):
        st = self.state
        engine = st.engine
        ready = GaugeMetricFamily("panechat_ready", "1 when the model is loaded and serving, 0 while loading")
        ready.add_metric([], 1.0 if engine is not None else 0.0)
        yield ready
        terms = GaugeMetricFamily("panechat_websocket_terminals", "Connected websocket terminals")
        terms.add_metric([], float(st.terminals))
        yield terms
        yield from _history(st.conversations)
        if engine is None:
            yield from _clients(st, {})
            return
        engines = st.models.engines()
        stats = {name: e.stats() for name, e in engines.items()}
        yield from _clients(st, stats)
        info = InfoMetricFamily("panechat_model", "The models being served", labels=["model"])
        for name, e in engines.items():
            info.add_metric([name], {"file": str(e.lm.name), "backend": e.lm.model.backend.describe(),
                                     "batching": str(bool(stats[name].batching)).lower(),
                                     "default": str(name == st.models.default).lower()})
        yield info
        yield from engine_families(stats)


def engine_families(stats: "dict[str, EngineStats]"):
    """The metric families of every model's EngineStats, each sample labelled `model`."""
    def family(kind, name: str, doc: str, value) -> None:
        f = kind(name, doc, labels=["model"])
        for model, s in stats.items():
            f.add_metric([model], float(value(s)))
        return f

    def gauge(name: str, doc: str, value):
        return family(GaugeMetricFamily, name, doc, value)

    def counter(name: str, doc: str, value):
        return family(CounterMetricFamily, name, doc, value)

    def kv_usage(s) -> float:
        return (s.kv_in_use or 0) / s.kv_total if s.kv_total else 0.0

    yield gauge("panechat_requests_running", "Generations admitted (prefilling or decoding)",
                lambda s: sum(1 for x in s.streams if x.state != StreamState.QUEUED))
    yield gauge("panechat_requests_waiting", "Generations waiting in the queue", lambda s: s.queue_depth or 0)
    yield gauge("panechat_max_concurrent", "Generations computed at once (--max-concurrent)",
                lambda s: s.batch_max or 0)
    yield gauge("panechat_kv_cache_usage_perc", "Fraction of the KV blocks held by running generations "
                "(1 = full)", kv_usage)
    yield gauge("panechat_kv_blocks_in_use", "KV blocks held by running generations", lambda s: s.kv_in_use or 0)
    yield gauge("panechat_kv_blocks_resident", "KV blocks holding KV: in use, or cached for reuse",
                lambda s: s.kv_resident or 0)
    yield gauge("panechat_kv_blocks_total", "KV blocks in the budget (--kv-memory)", lambda s: s.kv_total or 0)
    yield gauge("panechat_kv_blocks_shared", "KV blocks held by more than one generation", lambda s: s.kv_shared)
    yield gauge("panechat_kv_block_tokens", "Tokens per KV block", lambda s: s.kv_block_tokens or 0)
    yield gauge("panechat_kv_bytes_in_use", "Bytes of the KV blocks held by running generations",
                lambda s: (s.kv_in_use or 0) * (s.kv_bytes_per_block or 0))
    yield gauge("panechat_kv_bytes_total", "Bytes of the KV budget",
                lambda s: (s.kv_total or 0) * (s.kv_bytes_per_block or 0))
    yield counter("panechat_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                  lambda s: s.prefix_cache_queries)
    yield counter("panechat_prefix_cache_hits", "Prompt tokens found computed in the prefix cache",
                  lambda s: s.prefix_cache_hits)
    yield counter("panechat_kv_preemptions", "Generations sent back to the queue when KV blocks ran out",
                  lambda s: s.preemptions)
    yield counter("panechat_spec_draft_tokens", "Draft tokens checked by speculative decoding",
                  lambda s: s.spec_draft_tokens)
    yield counter("panechat_spec_accepted", "Draft tokens accepted (each a token without a step of its own)",
                  lambda s: s.spec_accepted)
    yield counter("panechat_spec_steps", "A sequence's steps that checked drafts (tokens per such step: "
                  "1 + accepted / steps)", lambda s: s.spec_steps)
    yield gauge("panechat_batch_size", "Sequences in the latest forward step", lambda s: s.batch_now or 0)
    yield gauge("panechat_generated_tokens_per_second", "Tokens generated over the last second", lambda s: s.tok_s)
    yield gauge("panechat_context_tokens", "Context per conversation (tokens)", lambda s: s.ctx or 0)
    yield counter("panechat_prompt_tokens", "Prompt tokens of admitted requests", lambda s: s.prompt_tokens)
    yield counter("panechat_generated_tokens", "Tokens generated", lambda s: s.generated_tokens)
    yield counter("panechat_reused_prefix_tokens",
                  "Prompt tokens whose KV was reused from the prefix cache or a snapshot (not recomputed)",
                  lambda s: s.reused_tokens)
    yield counter("panechat_steps", "Forward steps run", lambda s: s.steps)
    yield counter("panechat_kv_evictions", "Cached idle KV blocks evicted to make room", lambda s: s.evictions)
    yield counter("panechat_kv_snapshots_written", "KV snapshots written to disk (evicted or cached at stop)",
                  lambda s: s.kv_snapshots_written)
    yield counter("panechat_kv_snapshots_restored",
                  "Requests whose prompt prefix KV was read from a snapshot instead of prefilled",
                  lambda s: s.kv_snapshots_restored)
    yield counter("panechat_requests_refused", "Requests refused because the queue was full (HTTP 429)",
                  lambda s: s.refused)
    yield counter("panechat_requests_admitted", "Requests admitted (given KV blocks)", lambda s: s.requests_total)
    fin = CounterMetricFamily("panechat_requests_finished", "Finished generations by finish reason",
                              labels=["model", "reason"])
    for model, s in stats.items():
        for reason, n in sorted(s.requests_finished.items()):
            fin.add_metric([model, reason], float(n))
    yield fin

    # steps by number of sequences: step_hist[n] = steps that computed n sequences
    steps = HistogramMetricFamily("panechat_step_batch_size", "Sequences per forward step (1 = unbatched)",
                                  labels=["model"])
    ttft = HistogramMetricFamily("panechat_time_to_first_token_seconds",
                                 "Time from submission to the first generated token", labels=["model"])
    for model, s in stats.items():
        hist = s.step_hist
        if hist:
            buckets, acc, total = [], 0, 0.0
            for n, count in enumerate(hist):
                acc += count
                total += n * count
                if n >= 1:
                    buckets.append((str(float(n)), float(acc)))
            buckets.append(("+Inf", float(acc)))
            steps.add_metric([model], buckets, sum_value=total)
        th = s.ttft_hist
        if th.le:
            buckets, acc = [], 0
            for le, count in zip(th.le, th.counts):
                acc += count
                buckets.append((str(float(le)), float(acc)))
            acc += th.counts[-1] if len(th.counts) > len(th.le) else 0
            buckets.append(("+Inf", float(acc)))
            ttft.add_metric([model], buckets, sum_value=float(th.sum))
    yield steps
    yield ttft


def _clients(st: "ServerState", stats: "dict[str, EngineStats]"):
    """Per client: its open terminals, its generations running and waiting, and its counters."""
    usage, label = st.usage, st.usage.label
    labels = ["client"]
    sockets: Counter[str] = Counter(label(c.client) for c in list(st.sockets) if c.authed)
    running: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    for s in stats.values():
        for x in s.streams:
            (waiting if x.state == StreamState.QUEUED else running)[label(x.client)] += 1
    seen = sorted(set(usage.by_label) | set(sockets) | set(running) | set(waiting))
    for kind, name, doc, value in (
            (GaugeMetricFamily, "panechat_client_websockets", "Open websocket terminals of the client", sockets.get),
            (GaugeMetricFamily, "panechat_client_requests_running", "The client's generations admitted", running.get),
            (GaugeMetricFamily, "panechat_client_requests_waiting", "The client's generations in the queue",
             waiting.get),
            (CounterMetricFamily, "panechat_client_requests", "Generations the client submitted (queued)",
             lambda c: usage.of(c).requests if c in usage.by_label else 0),
            (CounterMetricFamily, "panechat_client_requests_refused",
             "The client's generations refused with 429 (queue or its part of it full)",
             lambda c: usage.of(c).refused if c in usage.by_label else 0),
            (CounterMetricFamily, "panechat_client_prompt_tokens", "Prompt tokens of the client's finished generations",
             lambda c: usage.of(c).prompt_tokens if c in usage.by_label else 0),
            (CounterMetricFamily, "panechat_client_generated_tokens", "Tokens generated for the client",
             lambda c: usage.of(c).completion_tokens if c in usage.by_label else 0)):
        f = kind(name, doc, labels=labels)
        for c in seen:
            f.add_metric([c], float(value(c) or 0))
        yield f


def _history(store: "ConversationStore"):
    """The websocket conversations kept in memory, against --history-memory."""
    for name, doc, value in (
            ("panechat_history_bytes", "Memory held by websocket conversation history (bytes)", store.nbytes),
            ("panechat_history_budget_bytes", "The history memory budget (--history-memory, bytes)",
             store.max_bytes),
            ("panechat_history_conversations", "Websocket conversations kept in memory", len(store))):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], float(value))
        yield g
    c = CounterMetricFamily("panechat_history_evictions",
                            "Idle conversations dropped to stay within --history-memory or the count cap")
    c.add_metric([], float(store.evictions))
    yield c


def make_registry(state: "ServerState") -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(state))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


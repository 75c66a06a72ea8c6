"""What a generation streams back: token deltas, prefill progress, and one finish."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenEvent:
    """A sampled token and the text it completes (may be empty mid UTF-8 character)."""

    request_id: str
    token_id: int
    text: str
    logprob: object = None  # its TokenLogprob (logprobs.py) when the request asked for logprobs


@dataclass(frozen=True)
class PrefillEvent:
    """Prompt tokens whose KV is computed so far (reused ones included) out of the total."""

    request_id: str
    done: int
    total: int


@dataclass(frozen=True)
class FinishEvent:
    """The last event of every generation. reason: stop, length, cancelled, error, or
    shutdown (ended by its server's shutdown, see `Generation.cancel`)."""

    request_id: str
    reason: str
    text: str
    token_ids: list[int]
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    error: str | None = None
    logprobs: list | None = None  # each generated token's TokenLogprob, when asked for
    prompt_logprobs: list | None = None  # each prompt token's after the first, when asked for


Event = TokenEvent | PrefillEvent | FinishEvent

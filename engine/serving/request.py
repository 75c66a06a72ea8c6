"""A generation request and its life cycle (vLLM v1 `request.py` style)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from panechat.engine.serving.sampling import Sampler, SamplingParams


class RequestState(enum.IntEnum):
    """Ordered: a request only moves forward, except that preemption (KV memory ran out)
    sends a running one back to WAITING."""

    WAITING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3


@dataclass
class Request:
    """One turn of one conversation: prompt tokens in, generated tokens out.

    `computed` counts prompt+output tokens whose KV is in its blocks (the KV manager holds
    its block table); scheduling is just letting `computed` catch up with `known` (no
    separate prefill and decode modes)."""

    id: str
    conversation: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    emit: Callable[[object], None]
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()  # the reply text is the output processor's (output.py)
    processors: tuple = ()  # LogitsProcessors on its logits before the sampler, in this order
    client: str = ""  # who sent it (a --tokens name, a terminal, an address): the queue is fair across clients
    state: RequestState = RequestState.WAITING
    preemptions: int = 0
    reused: int = 0  # prompt tokens found computed at (first) admission
    computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    cancel_reason: str = "cancelled"  # the finish reason a cancelled request ends with
    # with params.logprobs: each output token's TokenLogprob (logprobs.py); `next_logprob`
    # is the one of the token just picked, until the output processor takes it
    token_logprobs: list = field(default_factory=list)
    next_logprob: object = None
    # with params.prompt_logprobs: prompt token p's TokenLogprob at p - 1 (None until computed)
    prompt_lps: list | None = None
    forks: list = field(default_factory=list)  # samples of the same prompt, queued once its prefill is done
    spec: object = None  # its Speculation (speculation.py) when it decodes with drafts, else None
    drafts: list = field(default_factory=list)  # this step's draft tokens (rows after its decode row)
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    @property
    def known(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def known_slice(self, start: int, n: int) -> list[int]:
        """known[start:start+n] without building the whole list (called every step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:start - p + n]
        return (self.prompt_ids[start:start + n] + self.output_ids[: max(0, start + n - p)])

    @property
    def n_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

"""A generation request and its life cycle (vLLM v1 `request.py` style)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from panechat.engine.serving.sampling import Sampler, SamplingParams
from panechat.engine.text.tokenizer import StreamDecoder


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
    decoder: StreamDecoder
    emit: Callable[[object], None]
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    state: RequestState = RequestState.WAITING
    preemptions: int = 0
    reused: int = 0  # prompt tokens found computed at (first) admission
    computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    held: str = ""  # decoded text held back while it may be the start of a stop string
    cancelled: bool = False
    cancel_reason: str = "cancelled"  # the finish reason a cancelled request ends with
    finish_reason: str | None = None
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

    def take_text(self, piece: str) -> str:
        """Add decoded text; return what may be shown now (held back if it could begin a
        stop string). Sets finish_reason='stop' when a stop string completes."""
        if not self.stop_strings:
            self.text += piece
            return piece
        buf = self.held + piece
        for s in self.stop_strings:
            at = buf.find(s)
            if at >= 0:
                self.finish_reason = "stop"
                self.held = ""
                self.text += buf[:at]
                return buf[:at]
        keep = max((_overlap(buf, s) for s in self.stop_strings), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        out = buf[: len(buf) - keep]
        self.text += out
        return out

    def flush_text(self, piece: str) -> str:
        out = (self.held + piece) if self.finish_reason != "stop" else ""
        self.held = ""
        self.text += out
        return out


def _overlap(buf: str, stop: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of stop."""
    for n in range(min(len(buf), len(stop) - 1), 0, -1):
        if buf.endswith(stop[:n]):
            return n
    return 0

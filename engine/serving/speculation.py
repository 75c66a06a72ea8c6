"""Speculative decoding that keeps the answer: n-gram drafts from the conversation's own
tokens, checked exactly (issue 27).

A decoding sequence with k draft tokens is computed as k+1 rows of one forward pass, row j
the sequence's decode row at position L+j with input token draft[j-1] (row 0: its last
known token). Every row is row-invariant (docs/architecture.md, "Why batching cannot
change the answer"), so row j's logits are the bits a plain decode step at L+j would give
once the drafts before it are the tokens plain decoding would have picked. The sampler
then runs on the rows in order, as plain decoding would, one draw per token: the first
draft it disagrees with ends the run, and its own pick there is the next token. So the
reply is the same token sequence as without speculation, greedy or seeded.

`NgramDrafter` proposes drafts like llama.cpp's `lookup` and vLLM's `ngram`: the tokens
that followed the latest earlier occurrence of the sequence's last n tokens (n = 3, then 2).
Its index (n-gram -> where its continuation starts) grows by a few dict writes per token.
`AdaptiveK` picks k from the sequence's recent acceptance and pauses drafting, for longer
each time, while drafts keep failing, so prose without repeats costs nearly nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from panechat.engine.serving.logits_processors import LogitBias, RepeatPenalty

NGRAM_MAX, NGRAM_MIN = 3, 2  # n-gram lengths tried, longest first
K_START, K_MAX = 3, 8  # drafts per step: the first guess and the most
PAUSE_MAX = 32  # steps without drafting after repeated misses, at most

#: Processors that read only the history they are given (no state of their own), so each
#: verify row can get its own: a request with any other (a grammar's mask, count
#: penalties) decodes without speculation.
HISTORY_FREE = (LogitBias, RepeatPenalty)


class NgramDrafter:
    """One sequence's tokens (prompt, then accepted reply) and the index of its n-grams.

    `propose(k)` returns up to k tokens that followed the latest earlier occurrence of the
    last NGRAM_MAX..NGRAM_MIN tokens (the longest match wins); `extend` adds accepted
    tokens. Each token costs NGRAM_MAX - NGRAM_MIN + 1 dict writes, once."""

    __slots__ = ("tokens", "_index")

    def __init__(self, prompt: Sequence[int]):
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.extend(prompt)

    def extend(self, new: Sequence[int]) -> None:
        """Append accepted tokens; each n-gram ending just before a token maps to that
        token's position (its continuation), the latest occurrence winning."""
        toks, index = self.tokens, self._index
        for t in new:
            end = len(toks)
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    index[tuple(toks[end - n:end])] = end
            toks.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to `k` draft tokens continuing the sequence (empty: no n-gram matched)."""
        toks = self.tokens
        end = len(toks)
        if k <= 0:
            return []
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if end < n:
                continue
            at = self._index.get(tuple(toks[end - n:]))
            if at is not None:  # at < end: the index holds only n-grams with a continuation
                return toks[at:at + k]
        return []


class AdaptiveK:
    """How many drafts one sequence tries next, from how its last ones fared: one more
    after a fully accepted run (up to K_MAX), one more than the accepted ones after a
    partial one, half after none; at 0 it pauses drafting for 1, 2, 4 .. PAUSE_MAX steps
    (reset by the next accepted draft), then tries one draft again."""

    __slots__ = ("k", "_pause", "_wait")

    def __init__(self):
        self.k = K_START
        self._pause = 1  # the next pause's length
        self._wait = 0  # steps left in the current pause

    def next_k(self) -> int:
        """The drafts to try this step (0 while paused); counts one step of a pause."""
        if self._wait > 0:
            self._wait -= 1
            return 0
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        """The outcome of a step that tried `drafted` drafts."""
        if drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 1, K_MAX)
        elif accepted:
            self.k = accepted + 1
        else:
            self.k //= 2
        if accepted:
            self._pause = 1
        elif self.k == 0:
            self._wait, self._pause, self.k = self._pause, min(2 * self._pause, PAUSE_MAX), 1


class Speculation:
    """One request's speculation: its drafter, its k, and its counts (drafted, accepted).
    Drafts never reach past `max_len` positions (the context)."""

    __slots__ = ("drafter", "policy", "max_len", "drafted", "accepted", "steps")

    def __init__(self, prompt: Sequence[int], max_len: int):
        self.drafter = NgramDrafter(prompt)
        self.policy = AdaptiveK()
        self.max_len = max_len
        self.drafted = 0
        self.accepted = 0
        self.steps = 0  # verify steps (those that tried at least one draft)

    def propose(self, room: int) -> list[int]:
        """This step's drafts: at most `room` (the caller's bound: tokens left, KV slots)."""
        k = min(self.policy.next_k(), room, self.max_len - len(self.drafter.tokens) - 1)
        return self.drafter.propose(k) if k > 0 else []

    def accept(self, tokens: Sequence[int], drafted: int, accepted: int) -> None:
        """A step's outcome: `tokens` appended to the sequence; it tried `drafted` drafts,
        of which the first `accepted` stood."""
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.steps += 1
            self.policy.observe(drafted, accepted)
        self.drafter.extend(tokens)

    @property
    def acceptance(self) -> float | None:
        """Accepted drafts over drafted ones (None before any draft)."""
        return self.accepted / self.drafted if self.drafted else None


def can_speculate(processors: Sequence[object], wanted: bool) -> bool:
    """Whether a request may decode with drafts: it did not turn them off and every
    processor of its logits reads only the history it is given (HISTORY_FREE)."""
    return wanted and all(isinstance(p, HISTORY_FREE) for p in processors)


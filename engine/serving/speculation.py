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
that followed an earlier occurrence of the sequence's longest suffix seen before (8 tokens
down to 2), the latest one, or the place the last drafts came from while that copy still
matches (quoting, rewriting a file). Its index (n-gram -> where its continuation starts)
grows by a few dict writes per token.
`AdaptiveK` bounds k from the sequence's recent acceptance and pauses drafting, for longer
each time, while drafts keep failing; `StepCost` (the engine's measured step time by row
count) and the request's acceptance estimate then take the k that speeds the step up most,
or none, so prose without repeats, or a machine where extra rows are dear, costs nearly
nothing. Where no k up to the policy's pays for its rows, the policy allows one more draft
next time, so a machine where only long runs pay (a CPU's second row costs nearly a
step) still reaches them. A grammar's mask and count penalties keep state of their own
token by token, so a request with one decodes without drafts (`can_speculate`).

A `Drafter` proposes one sequence's drafts: `NgramDrafter`, or with `--spec draft` a draft
model's (draft_model.py), which computes them for all sequences before the step is planned
(`Speculation.wanted` says how many pay).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from panechat.engine.serving.logits_processors import LogitBias, RepeatPenalty

NGRAM_MAX, NGRAM_MIN = 8, 2  # n-gram lengths tried, longest first
K_START, K_MAX = 3, 8  # drafts per step: the first guess and the most
PAUSE_MAX = 32  # steps without drafting after repeated misses, at most

#: Processors that read only the history they are given (no state of their own), so each
#: verify row can get its own: a request with any other (a grammar's mask, count
#: penalties) decodes without speculation.
HISTORY_FREE = (LogitBias, RepeatPenalty)


class Drafter(Protocol):
    """What proposes one sequence's drafts: `NgramDrafter`, or a draft model's
    (draft_model.py). It holds the sequence's tokens (prompt, then accepted reply)."""

    tokens: list[int]

    def propose(self, k: int) -> list[int]:
        """Up to `k` draft tokens continuing `tokens`."""

    def extend(self, new: Sequence[int]) -> None:
        """Append the tokens a step accepted."""


class NgramDrafter:
    """One sequence's tokens (prompt, then accepted reply) and the index of its n-grams.

    `propose(k)` returns up to k tokens that followed an earlier occurrence of the
    sequence's longest suffix of NGRAM_MAX..NGRAM_MIN tokens seen before: the latest such
    occurrence, unless the place the last drafts were copied from still matches that
    suffix (a copy in progress: quoting, rewriting a file), which then goes on. `extend`
    adds accepted tokens; each costs NGRAM_MAX - NGRAM_MIN + 1 dict writes, once."""

    __slots__ = ("tokens", "_index", "_source")

    def __init__(self, prompt: Sequence[int]):
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self._source: int | None = None  # where the next token of the copy in progress sits
        self.extend(prompt)

    def extend(self, new: Sequence[int]) -> None:
        """Append accepted tokens; each n-gram ending just before a token maps to that
        token's position (its continuation), the latest occurrence winning. The n-grams are
        made by zip over shifted slices, in C: a 4k-token prompt costs 4.5 ms (7 ms a token
        at a time; the 3- and 2-grams alone took 1.8 ms), a 32k one 70 ms."""
        toks, index = self.tokens, self._index
        if self._source is not None:
            self._source += len(new)
        start = len(toks)
        toks.extend(new)
        end = len(toks)
        for n in range(NGRAM_MIN, NGRAM_MAX + 1):
            first = max(start, n)  # the first position whose n tokens before it exist
            if first < end:
                grams = zip(*(toks[first - n + i:end - n + i] for i in range(n)))
                index.update(zip(grams, range(first, end)))

    def propose(self, k: int) -> list[int]:
        """Up to `k` draft tokens continuing the sequence (empty: no n-gram matched)."""
        toks = self.tokens
        end = len(toks)
        if k <= 0:
            return []
        for n in range(min(NGRAM_MAX, end), NGRAM_MIN - 1, -1):
            suffix = tuple(toks[end - n:])
            at = self._index.get(suffix)  # at < end: the index holds only n-grams with a continuation
            if at is None:
                continue
            src = self._source
            if src is not None and n <= src < end and tuple(toks[src - n:src]) == suffix:
                at = src  # the copy in progress matches as long a suffix: it goes on
            self._source = at
            return toks[at:at + k]
        self._source = None
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

    def peek(self) -> int:
        """What `next_k` would return, without counting a step of a pause."""
        return 0 if self._wait > 0 else self.k

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


class StepCost:
    """This engine's seconds per forward step by its number of rows, as measured (a moving
    average each), so drafts are tried only where their rows cost less than the tokens
    they are expected to bring: on a GPU extra rows are nearly free, on a small CPU a
    second row may cost as much as the first. Steps with drafts (several rows of a sequence)
    are kept apart from those of one row per sequence, since a backend may run them another
    way; the engine records neither kind for steps with a prefill chunk. A draft step's
    row count never measured is read off a line fitted to the draft steps measured (their
    cost grows about linearly in rows), or, before two counts are known, assumed cheap (a
    tenth of a step per row), so it gets tried, and measured."""

    MAX_ROWS = 64
    FIT_DECAY = 0.95  # of the line's old points at each draft step

    def __init__(self):
        self._plain = [0.0] * (self.MAX_ROWS + 1)  # one row per sequence
        self._several = [0.0] * (self.MAX_ROWS + 1)  # some sequence with several rows
        self._fit = [0.0] * 5  # decayed sums of 1, rows, seconds, rows^2, rows*seconds (draft steps)

    def record(self, rows: int, seconds: float, several: bool = False) -> None:
        """One forward step of `rows` rows took `seconds` (steps past MAX_ROWS: ignored);
        `several`: some sequence had drafts (several rows) in it."""
        if 0 < rows <= self.MAX_ROWS:
            table = self._several if several else self._plain
            t = table[rows]
            table[rows] = seconds if t == 0.0 else 0.8 * t + 0.2 * seconds
            if several:
                d, f = self.FIT_DECAY, self._fit
                for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
                    f[i] = d * f[i] + v

    def _draft_step(self, rows: int) -> float:
        """Seconds of a draft step of `rows` rows: measured, else on the fitted line (0.0:
        no line yet)."""
        t = self._several[min(rows, self.MAX_ROWS)]
        if t > 0.0:
            return t
        n, x, y, xx, xy = self._fit
        det = n * xx - x * x
        if det <= 1e-9 * n * n:  # one row count so far: no slope
            return 0.0
        slope = max(0.0, (n * xy - x * y) / det)
        return max((y - slope * x) / n + slope * rows, 1e-9)

    def seconds(self, rows: int) -> float:
        """The measured time of a plain step of `rows` rows (0.0: not measured yet)."""
        return self._plain[min(rows, self.MAX_ROWS)]

    def ratio(self, rows: int, extra: int) -> float:
        """How much longer a step of rows + extra rows (drafts among them) takes than a
        plain one of `rows`."""
        base, more = self._plain[min(rows, self.MAX_ROWS)], self._draft_step(rows + extra)
        if base <= 0.0 or more <= 0.0:
            return 1.0 + 0.1 * extra
        return more / base

    def speedup(self, tokens: float, expected: float, plain: int, extra: int, planned: float = 1.0,
                draft_s: float = 0.0) -> float:
        """How many times the tokens per second of a step grow (> 1: the drafts pay) when
        drafts expected to give `expected` tokens (1 + the accepted ones) join it: a step of
        `plain` plain rows expected to give `tokens`, taking `planned` times a plain one so
        far, with `extra` draft rows then, and `draft_s` seconds of a draft model's passes."""
        base = self.seconds(plain)
        slower = self.ratio(plain, extra) / planned + (draft_s / base if base > 0 else 0.0)
        return (tokens + expected - 1) / tokens / slower


class Speculation:
    """One request's speculation: its drafter, its k, its acceptance estimate, and its
    counts (drafted, accepted). Drafts never reach past `max_len` positions (the context).

    The estimate is the chance that a draft stands given the ones before it did (hits over
    hits and misses, the older ones decayed), starting from an optimistic PRIOR and drawn
    back to it while the request does not draft, so a reply that turns repetitive later
    is tried again."""

    __slots__ = ("drafter", "policy", "max_len", "drafted", "accepted", "steps", "expected", "_hits", "_misses",
                 "_declined")

    PRIOR = (4.0, 1.0)  # (hits, misses): 0.8
    DECAY = 0.8  # of the old counts at each verify
    DRIFT = 0.03  # towards the prior at each step without drafts

    def __init__(self, prompt: Sequence[int], max_len: int, drafter: Drafter | None = None):
        self.drafter = drafter if drafter is not None else NgramDrafter(prompt)
        self.policy = AdaptiveK()
        self.max_len = max_len
        self.drafted = 0
        self.accepted = 0
        self.steps = 0  # verify steps (those that tried at least one draft)
        self.expected = 1.0  # tokens the last proposal is expected to give (1: no drafts)
        self._hits, self._misses = self.PRIOR
        self._declined = False  # the last proposal had drafts, none worth their rows

    @property
    def chance(self) -> float:
        """The estimated chance that a draft stands, given the ones before it did."""
        return self._hits / (self._hits + self._misses)

    def wanted(self, room: int, worth: Callable[[float, int], float] | None = None) -> int:
        """The most drafts the next `propose(room, ...)` may take, and with `worth` (as for
        `propose`) only as many as pay: a draft model computes them before the step is
        planned, so drafts that would not pay are not computed at all."""
        k = max(0, min(self.policy.peek(), room, self.max_len - len(self.drafter.tokens) - 1))
        return k if worth is None or k == 0 else self._best(k, worth)[0]

    def propose(self, room: int, worth: Callable[[float, int], float] | None = None) -> list[int]:
        """This step's drafts: at most `room` (the caller's bound: tokens left, KV slots).
        `worth(expected_tokens, k)`: how much k more rows that are expected to give that
        many tokens speed the step up (> 1: worth it); the k with the best worth is taken,
        none when no k is worth it. None: every candidate draft is taken."""
        self.expected, self._declined = 1.0, False
        k = min(self.policy.next_k(), room, self.max_len - len(self.drafter.tokens) - 1)
        drafts = self.drafter.propose(k) if k > 0 else []
        if not drafts or worth is None:
            return drafts
        best, self.expected = self._best(len(drafts), worth)
        self._declined = best == 0
        return drafts[:best]

    def _best(self, n: int, worth: Callable[[float, int], float]) -> tuple[int, float]:
        """The k <= n with the best worth (0: none is worth it) and the tokens it is expected to give."""
        a, best, best_worth, expected, e, p = self.chance, 0, 1.0, 1.0, 1.0, 1.0
        for k in range(1, n + 1):
            p *= a
            e += p  # expected tokens from k drafts: 1 + a + ... + a^k
            w = worth(e, k)
            if w > best_worth:
                best, best_worth, expected = k, w, e
        return best, expected

    def accept(self, tokens: Sequence[int], drafted: int, accepted: int) -> None:
        """A step's outcome: `tokens` appended to the sequence; it tried `drafted` drafts,
        of which the first `accepted` stood."""
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.steps += 1
            self.policy.observe(drafted, accepted)
            self._hits = self.DECAY * self._hits + accepted
            self._misses = self.DECAY * self._misses + (accepted < drafted)
        else:
            ph, pm = self.PRIOR
            self._hits += self.DRIFT * (ph - self._hits)
            self._misses += self.DRIFT * (pm - self._misses)
            if self._declined:  # too few drafts to pay for their rows (a CPU's 2nd row is dear): allow more
                self.policy.k = min(self.policy.k + 1, K_MAX)
        self.drafter.extend(tokens)

    @property
    def acceptance(self) -> float | None:
        """Accepted drafts over drafted ones (None before any draft)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens each verify step gave (its accepted drafts plus the target's own token;
        None before any): what one read of the weights yields for this sequence."""
        return (self.steps + self.accepted) / self.steps if self.steps else None


def can_speculate(processors: Sequence[object], wanted: bool) -> bool:
    """Whether a request may decode with drafts: it did not turn them off and every
    processor of its logits reads only the history it is given (HISTORY_FREE)."""
    return wanted and all(isinstance(p, HISTORY_FREE) for p in processors)


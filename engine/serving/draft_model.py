"""Drafts from a small model of the target's vocabulary (`--spec draft --draft-model X`).

The draft model runs on the target's backend with paged KV of its own, as many blocks as
the target's (the engine's KV budget holds both). Before each engine step `DraftModel.run` drafts for every speculating
sequence at once: one forward pass catches each sequence's draft KV up with the tokens
the target accepted (its prompt, the first time) and gives its first draft, then one pass
per further draft position, all sequences as rows of it, each pick the argmax. The drafts
are proposals only: the target checks them as it checks n-gram drafts (speculation.py),
so the reply is the one plain decoding gives whatever the draft model says.

After a verify `ModelDraft.extend` keeps the draft KV of the accepted drafts and drops
the rest (paged KV: a length change). A finished, cancelled or preempted sequence gives
its draft blocks back (`release`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from panechat.backends.paged_kv import bytes_per_block
from panechat.engine.default_model import resolve_model_path
from panechat.engine.gguf.file import ModelFileError
from panechat.engine.kv.blocks import BlockPool
from panechat.engine.kv.manager import KVManager
from panechat.engine.model.forward import Batch
from panechat.engine.model.loader import LoadedModel, load_model


class ModelDraft:
    """One sequence's side of the draft model (a `Drafter`): its tokens (prompt, then
    accepted reply), how many positions of its draft KV hold them (`computed`), and the
    drafts `DraftModel.run` made for this step (`proposal`)."""

    __slots__ = ("key", "tokens", "computed", "proposal", "admitted")

    def __init__(self, key: str, prompt: Sequence[int]):
        self.key = key  # its id in the draft KV manager
        self.tokens: list[int] = list(prompt)
        self.computed = 0
        self.proposal: list[int] = []
        self.admitted = False

    def propose(self, k: int) -> list[int]:
        """This step's drafts from the draft model, at most `k` (none when it made none)."""
        return self.proposal[:k] if k > 0 else []

    def extend(self, new: Sequence[int]) -> None:
        """Append accepted tokens; the draft KV past the last position whose token stands
        is dropped (the drafts after the first rejected one were computed on wrong input)."""
        end = len(self.tokens)
        ok = 0
        while ok < len(new) and ok < len(self.proposal) and new[ok] == self.proposal[ok]:
            ok += 1
        self.computed = min(self.computed, end + ok)
        self.tokens.extend(new)
        self.proposal = []

    def tokens_at(self, start: int, n: int) -> list[int]:
        """tokens[start:start+n] (the KV manager registers full blocks by their tokens)."""
        return self.tokens[start:start + n]


class DraftModel:
    """A draft model on the target's backend and its paged KV (`n_blocks`, as many as the
    target's), drafting greedily for many sequences per forward pass. Counts its passes
    and their seconds (`forwards`, `seconds`; `forward_s` weighs the drafts' cost)."""

    def __init__(self, lm: LoadedModel, n_blocks: int, kv_dtype: str, prefix_caching: bool, max_catch_up: int):
        self.lm = lm
        a = lm.model.args
        self.kv = lm.model.backend.new_paged_kv(n_blocks, a.n_layer, a.n_kv_head, a.head_dim, kv_dtype)
        self.pool = BlockPool(n_blocks, caching=prefix_caching)
        self.manager = KVManager(self.pool)
        self.max_catch_up = max_catch_up  # rows of the catch-up pass (all sequences), at most
        self._live: dict[str, ModelDraft] = {}  # the sequences holding draft blocks
        self.broken = False  # set by the engine when a run raised: no more drafts from it
        self.forwards = 0
        self.runs = 0
        self.seconds = 0.0
        self.forward_s = 0.0  # seconds per pass of one row a sequence, a moving average (0.0: not yet)

    def drafter(self, key: str, prompt: Sequence[int]) -> ModelDraft:
        """A new sequence's drafter (`key`: its request id); it takes draft KV when it first drafts."""
        return ModelDraft(key, prompt)

    @property
    def held(self) -> int:
        """Sequences holding draft KV blocks now."""
        return len(self._live)

    def run(self, wants: list[tuple[ModelDraft, int]], live: set[str]) -> None:
        """Draft for each (sequence, k) of `wants` up to k tokens into its `proposal`
        (fewer, or none, where draft blocks run short or its catch-up does not fit this
        step's `max_catch_up` rows); first gives back the blocks of the sequences not in
        `live` (preempted)."""
        for key in [k for k in self._live if k not in live]:
            self.release(self._live[key])
        t0 = time.perf_counter()
        ready = [(d, n) for d, n in ((d, self._reserve(d, k)) for d, k in wants if k > 0) if n > 0]
        if not ready:
            return
        # the catch-up pass holds max_catch_up rows at most, the shortest catch-ups first (they
        # draft now); a new sequence's prompt may take a few steps before it drafts
        parts, budget = [], self.max_catch_up  # (sequence, first position, tokens, whether it drafts)
        for d, _ in sorted(ready, key=lambda dk: len(dk[0].tokens) - dk[0].computed):
            n = min(len(d.tokens) - d.computed, budget)
            if n > 0:
                budget -= n
                parts.append((d, d.computed, d.tokens[d.computed:d.computed + n], d.computed + n == len(d.tokens)))
        while parts:
            t1 = time.perf_counter()
            for (d, _, toks, _), tok in zip([p for p in parts if p[3]], self._greedy(parts)):
                d.proposal.append(int(tok))
            if all(len(p[2]) == 1 for p in parts):  # a draft pass (a long catch-up would overstate the cost)
                per = time.perf_counter() - t1
                self.forward_s = per if self.forward_s == 0.0 else 0.8 * self.forward_s + 0.2 * per
            for d, _, toks, _ in parts:
                d.computed += len(toks)
            # the next position's pass: each sequence that wants more feeds its latest draft
            parts = [(d, d.computed, d.proposal[-1:], True) for d, k in ready if 0 < len(d.proposal) < k]
        self.runs += 1
        self.seconds += time.perf_counter() - t0

    def release(self, d: ModelDraft) -> None:
        """Give `d`'s draft blocks back (its computed full blocks stay cached for a later
        turn of the conversation); it is admitted again when it drafts next."""
        if self._live.pop(d.key, None) is not None:
            self.manager.free(d.key, min(d.computed, len(d.tokens)), d.tokens_at)
        d.admitted, d.computed, d.proposal = False, 0, []

    def close(self) -> None:
        """Give every sequence's draft blocks back."""
        for d in list(self._live.values()):
            self.release(d)

    # -- one run -----------------------------------------------------------------
    def _reserve(self, d: ModelDraft, k: int) -> int:
        """Admit `d` (its cached prefix shared) or register its newly full blocks, and hold
        blocks for its catch-up and up to k drafts; returns the drafts they hold (0: none
        now, too few blocks are free)."""
        d.proposal = []
        d.computed = min(d.computed, len(d.tokens) - 1)  # the last known token's row gives draft 1
        if not d.admitted:
            got = self.manager.admit(d.key, d.tokens)
            if got is None:
                return 0
            if got.copies:
                self.lm.model.backend.copy_blocks(self.kv, [c.src for c in got.copies], [c.dst for c in got.copies])
            self.manager.copies_done()
            d.admitted, d.computed = True, got.computed
            self._live[d.key] = d
        else:
            self.manager.commit(d.key, d.computed, d.tokens_at)
        need = len(d.tokens) + k - 1  # positions written: the known tokens, then drafts 1..k-1
        while self.manager.slots(d.key) < need and self.manager.grow(d.key):
            pass
        return max(0, min(k, self.manager.slots(d.key) - len(d.tokens) + 1))

    def _greedy(self, parts: list[tuple[ModelDraft, int, list[int], bool]]) -> np.ndarray:
        """One forward pass of each part's tokens at its positions into its draft KV; the
        argmax of the last row of each part that gives a draft."""
        tokens, seqs, positions, logit_rows = [], [], [], []
        tables = [self.manager.blocks(d.key) for d, _, _, _ in parts]
        table = np.zeros((len(parts), max(map(len, tables))), np.int32)
        for i, (d, start, toks, drafts) in enumerate(parts):
            tokens.extend(toks)
            seqs.extend([i] * len(toks))
            positions.extend(range(start, start + len(toks)))
            table[i, :len(tables[i])] = tables[i]
            if drafts:
                logit_rows.append(len(tokens) - 1)
        wanted = len(logit_rows)
        if not wanted:  # only catch-up this pass: one row's logits, unused (a pass wants some)
            logit_rows.append(len(tokens) - 1)
        batch = Batch(np.asarray(tokens, np.int32), np.asarray(seqs, np.int32), np.asarray(positions, np.int32),
                      np.asarray(logit_rows, np.int64), table)
        self.forwards += 1
        model = self.lm.model
        if model.samples_on_device:  # greedy picks where the logits are: only ids cross
            n = len(logit_rows)
            zeros = np.zeros(n, np.float32)
            picks = model.forward_tokens(self.kv, batch, zeros, np.ones(n, np.float32), zeros,
                                         np.zeros(n, np.int32), np.zeros(n, np.uint64), np.zeros(n, np.int64))
            return np.asarray(picks)[:wanted, 0]
        return np.argmax(model.forward(self.kv, batch), axis=1)[:wanted]


def load_draft_lm(spec: str, target: LoadedModel, ctx: int) -> LoadedModel:
    """The draft model `spec` names (a path or a catalog name) on the target's backend, for
    `ctx` positions; ModelFileError (one line naming both files) unless its vocabulary is
    the target's."""
    try:
        lm = load_model(resolve_model_path(spec), target.model.backend, max_positions=ctx)
    except ModelFileError as e:
        raise ModelFileError(f"--draft-model: {e}") from None
    problem = vocabulary_mismatch(lm, target)
    if problem:
        lm.tokenizer.close()
        raise ModelFileError(f"--draft-model {Path(lm.path).name} cannot draft for {Path(target.path).name}: "
                             f"{problem}; use a draft model of the same family (the same tokenizer)")
    return lm


def draft_bytes_per_block(lm: LoadedModel, kv_dtype: str) -> int:
    """Bytes of one KV block of the draft model (the engine's KV budget holds them too)."""
    a = lm.model.args
    return bytes_per_block(a.n_layer, a.n_kv_head, a.head_dim, kv_dtype)


def vocabulary_mismatch(draft: LoadedModel, target: LoadedModel) -> str | None:
    """Why `draft`'s token ids do not mean `target`'s (None: the same vocabulary): the
    embedding rows, the token list, or the first token that differs."""
    dv, tv = draft.model.args.vocab_size, target.model.args.vocab_size
    if dv != tv:
        return f"its vocabulary has {dv} tokens, the target's {tv}"
    dt, tt = draft.tokenizer, target.tokenizer
    if dt.vocab_size != tt.vocab_size:
        return f"its token list has {dt.vocab_size} tokens, the target's {tt.vocab_size}"
    for i in range(tt.vocab_size):
        if dt.token_bytes(i) != tt.token_bytes(i):
            return f"token {i} is {dt.token_bytes(i)!r} there but {tt.token_bytes(i)!r} in the target"
    return None



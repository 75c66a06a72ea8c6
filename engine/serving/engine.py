"""The engine: one compute thread owns the model and the KV block pool.

Requests come in from any thread (or asyncio task) through `submit`; each step the
scheduler picks the rows, the model computes them in one forward pass, and every
sequence's sampled token goes back on its own event stream (llama.cpp server's
one-thread task loop; mlx-lm's BatchGenerator insert/next/remove). The output processor
(output.py) turns the sampled tokens into events and says who ends.

Faults stay with their request: input is validated at submit, and an exception on a row's
behalf (its logits processors, sampler, stop strings, decoder or emit) fails that row alone
while the rest of the step carries on. Only a failure of the shared work (the KV copies, the
forward pass) fails the requests of the step; the engine thread itself never dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sized
from dataclasses import replace
from numbers import Integral
from pathlib import Path
from typing import AsyncIterator, Iterator

import numpy as np

from panechat.backends.paged_kv import BLOCK_TOKENS, bytes_per_block
from panechat.engine.serving.config import EngineConfig, format_size
from panechat.engine.serving.draft_model import DraftModel, draft_bytes_per_block, load_draft_lm
from panechat.engine.serving.events import Event, FinishEvent
from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.model.invariance import check_model_invariance, check_one_call_step, check_speculation
from panechat.engine.gguf.file import ModelFileError
from panechat.engine.kv.blocks import BlockKey, BlockPool, blocks_for
from panechat.engine.kv.manager import KVManager
from panechat.engine.kv.persistence import KVPersistence
from panechat.engine.kv.snapshot import KVShape
from panechat.engine.kv.snapshot_store import reason as snapshot_reason
from panechat.engine.model.loader import LoadedModel
from panechat.engine.serving.grammar import GrammarMask
from panechat.engine.serving.logits_processors import StepProcessors, make_processors, step_processors
from panechat.engine.serving.logprobs import HostRows, log_softmax, prompt_logprobs, token_logprob
from panechat.engine.serving.metrics import EngineMetrics, retry_after_estimate
from panechat.engine.serving.output import End, OutputProcessor
from panechat.engine.model.forward import Batch
from panechat.engine.serving.request import Request, RequestState
from panechat.engine.serving.sampling import SamplingError, SamplingParams, device_sampling_rows, make_sampler
from panechat.engine.serving.speculation import Speculation, can_speculate
from panechat.engine.serving.scheduler import ClientQueueFull, QueueFull, Scheduler, StepPlan
from panechat.engine.serving.stats import EngineStats, IdleConversation, StreamState, StreamStats
from panechat.engine.text.chat_template import ChatTemplateError
from panechat.engine.text.grammar_vocab import ll_tokenizer

#: The snapshot file's dtype name of each --kv-dtype (snapshots hold the cache's own bits).
SNAPSHOT_DTYPES = {"f16": "float16", "f32": "float32"}

__all__ = ["Engine", "EngineConfig", "Generation", "QueueFull", "ClientQueueFull", "InvalidRequest", "PromptTooLong",
           "KVBudgetTooSmall", "EngineStopped"]

log = logging.getLogger(__name__)


_STREAM_STATE = {RequestState.WAITING: StreamState.QUEUED, RequestState.PREFILLING: StreamState.PREFILLING,
                 RequestState.DECODING: StreamState.DECODING}


class PromptTooLong(InvalidRequest):
    """The prompt does not fit the per-conversation context (never truncated silently)."""


class KVBudgetTooSmall(PromptTooLong):
    """The prompt plus max_tokens needs more KV blocks than the whole budget holds: it could
    never run, so it is refused at once rather than left waiting."""


class EngineStopped(RuntimeError):
    """`submit` after `stop()`: the engine takes no more work."""


class Generation:
    """Handle for one submitted request: read its events, or cancel it.

    The engine thread puts events on a thread-safe queue; the consumer picks how to read
    them: `events()` blocks (any thread), `aevents()` awaits on the loop it is iterated
    from. Nothing is guessed at submit time, so a Generation may be created on one thread
    and read on another. Each event is delivered once; the last one is the FinishEvent."""

    def __init__(self, engine: "Engine", request_id: str, client: str = ""):
        self.engine = engine
        self.id = request_id
        self.client = client  # who it is attributed to (Engine.submit's `client`)
        self.finish: FinishEvent | None = None
        self._q: queue.SimpleQueue[Event] = queue.SimpleQueue()
        # set by aevents(): the reading loop and the asyncio.Event that wakes it
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def _emit(self, ev: Event) -> None:  # called on the engine thread
        self._q.put(ev)
        waker = self._waker
        if waker is not None:
            loop, ready = waker
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the reader's loop is closed: nobody listens any more
                self.cancel()

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop generating; a FinishEvent with `reason` follows (unless it finished first)."""
        self.engine.cancel(self.id, reason)

    def events(self) -> Iterator[Event]:
        """Block for each event in turn until the FinishEvent (which is yielded, then kept
        in `finish`)."""
        self._waker = None
        while self.finish is None:
            ev = self._q.get()
            if isinstance(ev, FinishEvent):
                self.finish = ev
            yield ev

    async def aevents(self) -> AsyncIterator[Event]:
        """`events()` for asyncio: awaits on the running loop, never blocks it."""
        ready = asyncio.Event()
        self._waker = (asyncio.get_running_loop(), ready)
        try:
            while self.finish is None:
                ready.clear()  # before looking: an event put after this look sets it again
                try:
                    ev = self._q.get_nowait()
                except queue.Empty:
                    await ready.wait()
                    continue
                if isinstance(ev, FinishEvent):
                    self.finish = ev
                yield ev
        finally:
            if self.finish is not None:
                self._waker = None
            # else the reader gave up early: once its loop closes, the next event cancels

    def result(self) -> FinishEvent:
        """Block until finished (not on an event loop); returns the FinishEvent."""
        for _ in self.events():
            pass
        assert self.finish is not None
        return self.finish


class Engine:
    """Batched, batch-invariant generation over one pool of paged KV blocks, with shared
    prefixes cached."""

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None):
        self.lm = lm
        self.cfg = cfg = config or EngineConfig()
        args = lm.model.args
        self.ctx = min(cfg.ctx_size, args.context_length)
        if self.ctx < cfg.MIN_CTX:  # the config is valid, so the model's own context is this short
            raise ModelFileError(f"the model's context ({args.context_length} tokens) is shorter than "
                                 f"the minimum of {cfg.MIN_CTX}; use a model with a longer context")
        per_block = bytes_per_block(args.n_layer, args.n_kv_head, args.head_dim, cfg.kv_dtype)
        # --spec draft: the draft model, on this backend; the KV budget holds its blocks too
        draft_lm = None if cfg.spec != "draft" else load_draft_lm(cfg.draft_model, lm, self.ctx)
        draft_block = 0 if draft_lm is None else draft_bytes_per_block(draft_lm, cfg.kv_dtype)
        self.kv_budget_note = self._kv_budget(cfg, per_block + draft_block)
        n_blocks = max(1, self.kv_budget // (per_block + draft_block))
        be = lm.model.backend
        self.kv = be.new_paged_kv(n_blocks, args.n_layer, args.n_kv_head, args.head_dim, cfg.kv_dtype)
        self.pool = BlockPool(n_blocks, caching=cfg.prefix_caching)
        self.metrics = EngineMetrics(cfg.max_concurrent)
        self.output = OutputProcessor(lm.tokenizer, self.ctx)  # tokens -> events, and who ends
        self.metrics.kv_total = n_blocks
        self.metrics.kv_bytes_per_block = per_block
        self.kv_manager = KVManager(self.pool, self._open_snapshots())
        # as many draft KV blocks as the target's: room for the same sequences
        self.draft: DraftModel | None = None if draft_lm is None else DraftModel(
            draft_lm, n_blocks, cfg.kv_dtype, cfg.prefix_caching, cfg.prefill_chunk)
        self.scheduler = Scheduler(self.kv_manager, cfg.max_concurrent, cfg.max_queue, cfg.prefill_chunk,
                                   max_queue_per_client=cfg.max_queue_per_client)
        # Set by the compute thread's start-up self-check (see start()).
        self.invariance_problem: str | None = None
        self.spec_problem: str | None = None  # why speculation is off after the self-check
        self.batching = True
        self._checked = threading.Event()
        self._check_in_background = False  # start(beside_others=True)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._by_id: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._published = 0.0  # when the stats state was last rebuilt
        self._members_changed = False  # a request came or went since then
        self._conversations: OrderedDict[str, list[tuple[int, BlockKey]]] = OrderedDict()  # see _remember

    def _kv_budget(self, cfg: EngineConfig, per_block: int) -> str:
        """Set `kv_budget` (bytes) from --kv-memory, else --kv-sessions whole contexts, else
        a share of the device's free memory; returns how it was chosen (start-up line)."""
        if cfg.kv_memory is not None:
            self.kv_budget = cfg.kv_memory
            return "--kv-memory"
        if cfg.kv_sessions is not None:
            self.kv_budget = cfg.kv_sessions * blocks_for(self.ctx) * per_block
            return f"--kv-sessions {cfg.kv_sessions} contexts"
        free = self.lm.model.backend.free_memory()
        if free is None:  # unknown: room for 2 x max-concurrent whole contexts
            self.kv_budget = 2 * cfg.max_concurrent * blocks_for(self.ctx) * per_block
            return "default: free memory unknown, 2 x max-concurrent contexts"
        self.kv_budget = max(int(free * cfg.KV_MEMORY_SHARE), blocks_for(self.ctx) * per_block)
        return f"default: {cfg.KV_MEMORY_SHARE:.0%} of {format_size(free)} free; set --kv-memory"

    # -- public API ------------------------------------------------------------------
    def startup_lines(self) -> list[str]:
        """Human-readable start-up report: backend, KV memory, concurrency mode."""
        be, m = self.lm.model.backend, self.lm.model
        kv = self.kv
        lines = [
            f"model: {self.lm.name} ({m.args.architecture}, {m.args.n_layer} layers, "
            f"loaded in {m.load_seconds:.1f} s, {m.weight_bytes / 2**20:.0f} MiB of weights)",
            f"backend: {be.describe()}",
            f"context: {self.ctx} tokens per conversation",
            f"KV cache: {format_size(kv.nbytes)} ({self.kv_budget_note}), {kv.dtype}, "
            f"{kv.n_blocks} blocks of {BLOCK_TOKENS} tokens = {kv.n_blocks * BLOCK_TOKENS} tokens "
            f"({kv.n_blocks * BLOCK_TOKENS / self.ctx:.1f} full contexts), shared prefixes cached",
        ]
        if m.decoder_off:
            lines.append(f"decode step: op by op, the one-call step turned off by the self-check: {m.decoder_off}")
        if self.cfg.spec == "off":
            lines.append("speculative decoding: off (--spec off)")
        elif self.spec_problem or not self.batching:
            lines.append(f"speculative decoding: off, the self-check failed: {self.spec_problem or 'no batching'}")
        elif self.draft is not None:
            d = self.draft
            lines.append(f"speculative decoding: draft model {d.lm.name} ({d.lm.model.args.n_layer} layers, "
                         f"{d.lm.model.weight_bytes / 2**20:.0f} MiB, KV {format_size(d.kv.nbytes)}), drafts "
                         "checked exactly (replies identical to plain decoding)")
        else:
            lines.append("speculative decoding: n-gram drafts, checked exactly (replies identical to plain decoding)")
        k = self.cfg.max_concurrent
        if self.batching:
            lines.append(f"concurrency: {k} generations at once, decode batched, answers identical to solo")
        else:
            lines.append(f"concurrency: {k} generations at once, decode NOT batched (one sequence "
                         f"per step) because the invariance self-check failed: {self.invariance_problem}")
        return lines

    def start(self, beside_others: bool = False) -> "Engine":
        """Start the compute thread; returns once its invariance self-check has run.
        `beside_others`: other engines of this process are serving, so the self-check runs
        in the backend's `background()` (on the CPU: one thread),
        giving way to their streams.

        Every kernel call, the self-check's too, happens on that one thread: numba's
        OpenMP kernels run about 2x slower when a second thread has used them."""
        if self._thread is None:
            self._check_in_background = beside_others
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="panechat-engine", daemon=True)
            self._thread.start()
            self._checked.wait()
        return self

    def stop(self, reason: str = "cancelled") -> None:
        """End everything (each generation gets its FinishEvent with `reason`) and join the
        thread. Later submits are refused. With KV snapshots on, the idle conversations'
        KV is written first (the compute thread does it on its way out)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        with self._lock:
            for r in list(self._by_id.values()):
                self._finish(r, reason)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Check `messages` and render them with the chat template into token ids, as
        `submit(messages)` does; raises InvalidRequest (the template's refusal of the
        conversation included). A long history takes milliseconds, so code on an event loop
        calls this in a worker thread, then `submit(prompt_ids=...)`."""
        _validate_messages(messages)
        try:
            return self.lm.prompt_ids(messages, tools)
        except ChatTemplateError as e:  # e.g. "roles must alternate": the conversation is the client's
            raise InvalidRequest(str(e), param="messages") from None

    def completion_ids(self, text: str) -> list[int]:
        """A raw prompt (no chat template) as token ids, BOS per the file's flags; raises
        InvalidRequest for a non-string, empty or invalid-Unicode `text`."""
        if not isinstance(text, str) or not text:
            raise InvalidRequest("empty prompt: give the text to complete", param="prompt")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("the prompt is not valid Unicode (lone surrogate)", param="prompt") from None
        return self.lm.completion_ids(text)

    @property
    def chat_stops(self) -> tuple[str, ...]:
        """Stop strings every chat reply gets from the template (the ChatML fallback's turn
        markers; none for a file's own template): a chat submit passes them with its own."""
        return self.lm.template.stop_strings

    def submit(self, messages: list[dict] | None = None, *, prompt_ids: list[int] | None = None,
               params: SamplingParams | None = None, conversation: str | None = None,
               stop: tuple[str, ...] | list[str] = (), client: str = "") -> Generation:
        """Queue one generation. Raises InvalidRequest (bad input; PromptTooLong among them),
        QueueFull (ClientQueueFull among them), EngineStopped. These checks protect the
        engine whoever calls it; the server's request schema (app/server/request_schema.py)
        has refused bad fields before. `client`: who sent it; the queue is fair across
        clients (engine/serving/fair_queue.py)."""
        return self.submit_n(1, messages, prompt_ids=prompt_ids, params=params, conversation=conversation,
                             stop=stop, client=client)[0]

    def submit_n(self, n: int, messages: list[dict] | None = None, *, prompt_ids: list[int] | None = None,
                 params: SamplingParams | None = None, conversation: str | None = None,
                 stop: tuple[str, ...] | list[str] = (), client: str = "") -> list[Generation]:
        """Queue `n` samples of one prompt (OpenAI's `n`), as `submit` does one: sample i
        has seed `params.seed + i` (mod 2^64; each a random one without a seed), so it is
        the generation `submit` gives with that seed. The first prefills the prompt; the
        others are queued once it has (at the head of their client's queue), sharing its KV
        blocks through the prefix cache, so n samples cost about one prefill. Prompt logprobs
        come with the first only."""
        if self._stop:
            raise EngineStopped("the engine is stopped")
        params = params or SamplingParams()
        params.validate()
        if prompt_ids is None:
            prompt_ids = self.prompt_ids(messages)
        else:
            if isinstance(prompt_ids, Sized):
                self._check_length(len(prompt_ids))  # too long: refused before its ids are read
            prompt_ids = _validated_ids(prompt_ids, self.lm.model.args.vocab_size)
        self._check_fits(prompt_ids, params)
        reqs, gens = [], []
        for i in range(n):
            p = params if i == 0 else replace(params, prompt_logprobs=None, seed=(
                None if params.seed is None else (params.seed + i) % 2**64))
            gen, req = self._new_request(prompt_ids, p, conversation if i == 0 else None, stop, client)
            reqs.append(req)
            gens.append(gen)
        reqs[0].forks = reqs[1:]
        with self._lock:
            try:
                self.scheduler.add(reqs[0])
            except QueueFull as e:
                self.metrics.refused += 1
                e.retry_after = self.retry_after(e)
                raise
            for req in reqs:
                self._by_id[req.id] = req
                self.output.add(req)
            self._members_changed = True
        self._wake.set()
        return gens

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """PromptTooLong / KVBudgetTooSmall unless the prompt and its reply can ever run."""
        self._check_length(len(prompt_ids))
        need = blocks_for(min(len(prompt_ids) + params.max_tokens, self.ctx))
        if need > self.pool.n_blocks:
            raise KVBudgetTooSmall(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{format_size(need * self.kv.bytes_per_block)} of KV but the budget is "
                f"{format_size(self.kv.nbytes)}; lower max_tokens or raise --kv-memory")

    def _check_length(self, n: int) -> None:
        """InvalidRequest for an empty prompt, PromptTooLong for one of `ctx` tokens or more."""
        if not n:
            raise InvalidRequest("empty prompt")
        if n >= self.ctx:
            raise PromptTooLong(f"prompt is {n} tokens but the context holds {self.ctx}; "
                                "shorten the conversation or raise --ctx-size")

    def _new_request(self, prompt_ids: list[int], params: SamplingParams, conversation: str | None,
                     stop, client: str) -> tuple[Generation, Request]:
        rid = f"req-{next(self._ids)}"
        gen = Generation(self, rid, client)
        processors = make_processors(params, self.lm.model.args.vocab_size) + self._grammar_mask(params)
        req = Request(
            id=rid, conversation=conversation or rid, prompt_ids=list(prompt_ids), params=params,
            sampler=make_sampler(params), emit=gen._emit,
            stop_ids=self.lm.tokenizer.stop_ids, stop_strings=tuple(s for s in stop if s),
            processors=processors, client=client,
            prompt_lps=None if params.prompt_logprobs is None else [None] * (len(prompt_ids) - 1),
        )
        if self.cfg.spec != "off" and can_speculate(processors, params.speculate):
            drafter = self.draft.drafter(rid, req.prompt_ids) if self.draft is not None else None
            req.spec = Speculation(req.prompt_ids, self.ctx, drafter)
        return gen, req

    def _grammar_mask(self, params: SamplingParams) -> tuple[GrammarMask, ...]:
        """The grammar's mask processor, when the request has one (its vocabulary built on
        the model's first grammar, then shared); InvalidRequest when it does not compile."""
        if params.grammar is None:
            return ()
        tok = self.lm.tokenizer
        return (GrammarMask(params.grammar, ll_tokenizer(tok), tok.stop_ids, self.lm.model.args.vocab_size),)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Ask for a request to end; its FinishEvent follows, with `reason` ('cancelled' by
        the client, 'shutdown' by a server going away; the first cancel's reason wins)."""
        req = self._by_id.get(request_id)
        if req is not None and not req.cancelled:
            req.cancel_reason = reason
            req.cancelled = True
            self._wake.set()

    def retry_after(self, refusal: QueueFull | None = None) -> int:
        """Seconds after which a request refused now (QueueFull) should come back: the
        time the queue ahead of it takes to clear at the recent pace (1..60). For a
        ClientQueueFull, its client's queue, served at its share of the places."""
        waiting, places = len(self.scheduler.waiting), self.cfg.max_concurrent
        if isinstance(refusal, ClientQueueFull):
            waiting = refusal.waiting
            places = max(1, places // max(1, self.scheduler.waiting.clients()))
        return retry_after_estimate(waiting, places, self.metrics.mean_request_s())

    def stats(self) -> EngineStats:
        """Snapshot of streams, batch occupancy, queue and KV slots (cheap)."""
        return self.metrics.snapshot(batching=self.batching, ctx=self.ctx)

    # -- the compute thread ------------------------------------------------------------
    def _self_check(self) -> None:
        if self.cfg.verify_invariance:
            try:
                self._check_one_call_step()
                self.invariance_problem = check_model_invariance(self.lm.model, self.kv)
            except Exception as e:  # a broken check must not pass for a proof
                self.invariance_problem = f"self-check failed to run: {type(e).__name__}: {e}"
            self.batching = self.invariance_problem is None
            self._check_speculation()
        # rows are only proven independent of each other when the check passed
        self.scheduler.max_seqs_per_step = None if self.batching else 1
        self.scheduler.speculate = self.batching and self.spec_problem is None
        self._checked.set()

    def _check_speculation(self) -> None:
        """Drafts are checked only where k+1 rows of one sequence are proven to give the
        bits of k+1 single steps; otherwise speculation is off (one log line)."""
        if self.cfg.spec == "off" or not self.batching:
            return
        try:
            self.spec_problem = check_speculation(self.lm.model, self.kv)
        except Exception as e:  # a broken check must not pass for a proof
            self.spec_problem = f"self-check failed to run: {type(e).__name__}: {e}"
        if self.spec_problem:
            log.warning("speculative decoding turned off: %s", self.spec_problem)

    def _check_one_call_step(self) -> None:
        """A one-call decode step unlike op by op is turned off (one log line): the model
        decodes op by op from then on, and the invariance check proves that path."""
        problem = check_one_call_step(self.lm.model, self.kv)
        if problem:
            self.lm.model.turn_off_decoder(problem)
            log.warning("one-call decode step turned off, decode runs op by op: %s", problem)

    def _run(self) -> None:
        with (self.lm.model.backend.background() if self._check_in_background else contextlib.nullcontext()):
            self._self_check()
        be = self.lm.model.backend
        while not self._stop:
            plan, copied = None, False
            try:
                with self._lock:
                    self._reap_cancelled()
                if self.draft is not None and not self.draft.broken:
                    self._draft_ahead()
                # not under the lock: an admission may read a KV snapshot from disk, and
                # submit (on an event loop) must not wait for that
                plan = self.scheduler.schedule()
                with self._lock:
                    self._publish_state(force=self._members_changed or not plan.requests)
                try:
                    if plan.kv_copies:  # before the forward pass
                        be.copy_blocks(self.kv, [c.src for c in plan.kv_copies], [c.dst for c in plan.kv_copies])
                finally:  # done or failed: the sources may be reused
                    self.kv_manager.copies_done()
                copied = True
                if not plan.requests:
                    self.metrics.mark_idle()
                    self._wake.wait(0.5)
                    if self._wake.is_set():
                        self._wake.clear()
                        time.sleep(self.cfg.straggler_ms / 1000.0)  # let near-simultaneous arrivals join
                    continue
                self._step(plan)
            except Exception as e:  # shared work failed: fail the requests it touched
                log.exception("engine step failed")
                with self._lock:
                    # a failed copy leaves a block whose KV its request relies on: fail them all
                    ok = plan is not None and plan.requests and copied
                    victims = plan.requests if ok else list(self._by_id.values())
                    for r in victims:
                        self._fail(r, f"internal error: {type(e).__name__}: {e}")
        self.kv_manager.close()  # with snapshots on: the idle conversations' KV is written
        if self.draft is not None:
            self.draft.close()

    def _draft_ahead(self) -> None:
        """The draft model's drafts for every decoding request that speculates, before the
        step is planned, as many as pay for the target's extra rows and the draft passes
        (the scheduler then takes those that still pay: `Speculation.propose`); preempted
        requests give their draft KV back."""
        decoding = [r for r in self.scheduler.running if r.state == RequestState.DECODING]
        running = [r for r in decoding if r.spec is not None]
        wants, n, cost, per = [], len(decoding), self.scheduler.step_cost, self.draft.forward_s

        def worth(expected: float, k: int) -> float:  # the step's tokens per second, relative
            return cost.speedup(n, expected, n, k, draft_s=k * per)

        if self.scheduler.speculate:
            for r in running:
                k = r.spec.wanted(r.params.max_tokens - len(r.output_ids) - 1, worth)  # room: the scheduler's
                if k > 0:
                    wants.append((r.spec.drafter, k))
        try:
            self.draft.run(wants, {r.id for r in running})
        except Exception:  # drafts are only proposals: a failing draft model fails no request
            log.exception("the draft model failed; decoding goes on without its drafts")
            self.draft.close()
            self.draft.broken = True

    def _open_snapshots(self) -> KVPersistence | None:
        """The snapshot folder of this model when --kv-snapshots is on; a folder that
        cannot be used turns them off with one log line (the engine serves without)."""
        cfg = self.cfg
        if not cfg.kv_snapshot_dir:
            return None
        args = self.lm.model.args
        shape = KVShape(SNAPSHOT_DTYPES[self.kv.dtype], args.n_layer, args.n_kv_head, args.head_dim)
        try:
            return KVPersistence.open(Path(cfg.kv_snapshot_dir), self.lm.path, shape, cfg.kv_snapshot_memory,
                                      self.lm.model.backend, self.kv, cfg.kv_snapshot_min_tokens,
                                      self.metrics.record_snapshots)
        except Exception as e:  # noqa: BLE001 - e.g. an unwritable cache folder
            log.warning("KV snapshots off: %s (folder %s)", snapshot_reason(e), cfg.kv_snapshot_dir)
            return None

    def _step(self, plan: StepPlan) -> None:
        tokens, seqs, positions, logit_rows = [], [], [], []
        sampled: list[Request] = []  # requests whose rows give tokens this step, in row order
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first position, rows) wanting prompt logprobs
        now = time.perf_counter()
        width = max(map(len, plan.block_tables))
        tables = np.zeros((len(plan.requests), width), np.int32)  # padding: never read
        for i, (r, n, table) in enumerate(zip(plan.requests, plan.n_tokens, plan.block_tables)):
            if r.t_start == 0.0:
                r.t_start = now
                self.metrics.record_admit(len(r.prompt_ids), r.reused)
            if r.prompt_lps is not None and r.computed < len(r.prompt_ids) - 1:
                prompt_rows.append((r, r.computed, min(n, len(r.prompt_ids) - 1 - r.computed)))
            k = len(r.drafts)  # draft rows after its known one (speculation.py); 0 but when decoding
            tokens.extend(r.known_slice(r.computed, n - k))
            tokens.extend(r.drafts)
            positions.extend(range(r.computed, r.computed + n))
            seqs.extend([i] * n)
            tables[i, :len(table)] = table
            r.computed += n - k  # the drafts' positions count once they are accepted (_pick)
            if r.computed == r.n_known:  # caught up: this row's logits (and its drafts') give tokens
                logit_rows.extend(range(len(tokens) - k - 1, len(tokens)))
                sampled.append(r)
        extra = _prompt_logit_rows(prompt_rows, plan.n_tokens, plan.requests) if prompt_rows else []
        batch = Batch(np.asarray(tokens, np.int32), np.asarray(seqs, np.int32),
                      np.asarray(positions, np.int32), np.asarray(logit_rows + extra, np.int64), tables)
        rows = [(r, j) for r in sampled for j in range(len(r.drafts) + 1)]
        drafting = len(rows) > len(sampled)
        prefill = any(n > len(r.drafts) + 1 for r, n in zip(plan.requests, plan.n_tokens))
        t0 = time.perf_counter()
        logits, picks, procs, lp, extra_logits = self._forward(batch, rows, len(extra))
        if not prefill:  # a prefill chunk's step may take another path (op by op): not a decode step's cost
            self.scheduler.step_cost.record(batch.tokens.size, time.perf_counter() - t0, drafting)
        if prompt_rows:
            _keep_prompt_logprobs(prompt_rows, extra_logits)
        now = time.perf_counter()
        with self._lock:
            prefilling = [r for r in plan.requests if r.state == RequestState.PREFILLING and r not in sampled]
            picked = self._pick(sampled, logits, picks, procs, lp)
            before = {r.id: len(r.output_ids) for r in sampled}
            for r, end in self.output.process(prefilling, picked, now):
                r.computed = min(r.computed, r.n_known)  # it ended before its last accepted token
                self._end(r, end)
            self._spec_outcomes(sampled, before)
        if procs is not None:  # the next step's masks, computed while its forward pass runs
            procs.prefetch()
        self.metrics.record_step(len(plan.requests), batch.tokens.size, len(picked), now)

    def _spec_outcomes(self, sampled: list[Request], before: dict[str, int]) -> None:
        """Give each speculating request's drafter the tokens it accepted this step, and
        count its drafts and the accepted ones."""
        drafted = accepted = steps = 0
        for r in sampled:
            if r.spec is None or r.state == RequestState.FINISHED:
                continue
            k = len(r.drafts)
            got = r.output_ids[before[r.id]:]
            n_ok = min(k, max(0, len(got) - 1))
            r.spec.accept(got, k, n_ok)
            drafted, accepted, steps = drafted + k, accepted + n_ok, steps + (k > 0)
            r.drafts = []
        if drafted:
            self.metrics.record_spec(drafted, accepted, steps)

    def _forward(self, batch: Batch, rows: list[tuple[Request, int]], n_extra: int):
        """The forward pass with each sampled row's processors applied: (host logits or None,
        device picks or None, the StepProcessors, the logit rows seen by the rows wanting
        logprobs as (rows, row of each sampled index) or None, the `n_extra` prompt logprob
        rows after the sampled ones on the host). `rows`: each sampled logit row's
        (request, j), j its draft rows before it (0: its decode row). Rows that ask for
        nothing cost nothing."""
        model, logits, picks = self.lm.model, None, None
        procs = step_processors([(r.processors, _history(r, j) if r.processors else ()) for r, j in rows])
        want = [i for i, (r, _) in enumerate(rows) if r.params.logprobs is not None]
        n = len(rows)
        if rows and model.samples_on_device:  # only token ids (and asked-for rows) cross to the host
            seen = HostRows(want + list(range(n, n + n_extra))) if want or n_extra else None
            picks = model.forward_tokens(self.kv, batch, *_padded(device_sampling_rows(
                [r.sampler for r, _ in rows], [len(r.output_ids) + j for r, j in rows]), n_extra),
                before_pick=_then(procs, seen))
            host = seen.host if seen is not None else None
            lp = (host, {i: j for j, i in enumerate(want)}) if want else None
            return None, picks, procs, lp, host[len(want):] if seen is not None else None
        logits = model.forward(self.kv, batch)
        if procs is not None:
            procs(logits, np)
        return logits, None, procs, (logits, {i: i for i in want}) if want else None, logits[n:]

    def _pick(self, sampled: list[Request], logits: np.ndarray | None, picks: np.ndarray | None,
              procs: StepProcessors | None, lp: tuple | None = None) -> list[tuple[Request, int, object]]:
        """Each sampled request's tokens, from its host logits or its device picks, with
        their logprobs; a request whose logits processor or sampler raised fails alone.
        A request with drafts takes its rows in order, one sampler call per token as plain
        decoding makes, up to the first pick unlike its row's draft (or a stop token); the
        accepted drafts' KV stands (`computed`). `lp`: (rows, row of each sampled logit
        row) of the logits seen by the rows wanting logprobs."""
        picked, at = [], 0
        for r in sampled:
            base, n = at, len(r.drafts) + 1
            at += n
            try:  # whatever goes wrong with this row is this row's alone
                got = []
                for j in range(n):
                    i = base + j
                    if procs is not None:
                        procs.check(i)
                    tok = r.sampler(logits[i]) if picks is None else r.sampler.device_pick(picks[i])
                    tlp = None
                    if lp is not None and r.params.logprobs is not None:
                        tlp = token_logprob(log_softmax(lp[0][lp[1][i]]), tok, r.params.logprobs)
                    got.append((r, tok, tlp))
                    if j == n - 1 or tok != r.drafts[j] or tok in r.stop_ids:
                        break
            except Exception as e:
                self._fail_row(r, e)
                continue
            r.computed += len(got) - 1  # the drafts whose picks matched: their positions hold true KV
            if r.state == RequestState.PREFILLING:
                r.state = RequestState.DECODING
                self._release_forks(r)
            picked.extend(got)
        return picked

    def _release_forks(self, r: Request) -> None:
        """Queue the other samples of `r`'s prompt (its prefill is done or it ended): they
        find its blocks in the prefix cache."""
        if r.forks:
            forks = [f for f in r.forks if f.state == RequestState.WAITING and not f.cancelled]
            r.forks = []
            self.scheduler.add_first(forks)

    def _end(self, r: Request, end: End) -> None:
        """Act on what the output processor said of `r`: finish it, or fail it alone."""
        if isinstance(end, Exception):
            self._fail_row(r, end)
            return
        try:
            self._finish(r, end)
        except Exception as e:  # its FinishEvent's emit
            self._fail_row(r, e)

    def _fail_row(self, r: Request, e: Exception) -> None:
        """Fail one request after an exception raised on its behalf (never its neighbours)."""
        if isinstance(e, SamplingError):
            self._fail(r, str(e))
        else:
            log.error("request %s failed alone", r.id, exc_info=e)
            self._fail(r, f"internal error in this request: {type(e).__name__}: {e}")

    def _fail(self, r: Request, error: str) -> None:
        """Finish `r` with reason 'error', dropping its KV (it may be incomplete or hold
        NaN); a FinishEvent its reader cannot take does not stop the engine."""
        try:
            self._finish(r, "error", error=error, keep_cache=False)
        except Exception:  # its emit raised: the request is already out of the scheduler
            pass

    def _reap_cancelled(self) -> None:
        for r in [r for r in self._by_id.values() if r.cancelled]:
            self._finish(r, r.cancel_reason)

    def _finish(self, r: Request, reason: str, error: str | None = None, keep_cache: bool = True) -> None:
        if r.state == RequestState.FINISHED:
            return
        held = self.scheduler.finish(r, keep_cache=keep_cache)
        self._release_forks(r)
        if held:
            self._remember(r.conversation, held)
        self._by_id.pop(r.id, None)
        if self.draft is not None and r.spec is not None:
            self.draft.release(r.spec.drafter)
        r.t_end = time.perf_counter()
        self._members_changed = True
        self.metrics.record_finish(reason, (r.t_first - r.t_submit) if r.t_first else None,
                                   (r.t_end - r.t_start) if r.t_start else None)
        self.output.finish(r, reason, error)

    def _publish_state(self, force: bool) -> None:
        """Rebuild the per-stream stats before the next step. While the same requests run,
        at most 20 times a second (readers poll about 10 times a second; steps run up to
        ~100 a second); when one came or went, always, so a request is in the stats before
        it emits anything and a running engine never reads as idle."""
        now = time.perf_counter()
        if not force and now - self._published < 0.05:
            return
        self._published, self._members_changed = now, False
        streams = []
        for r in itertools.chain(self.scheduler.running, self.scheduler.waiting):
            n = len(r.output_ids)
            dt = now - r.t_first if r.t_first else 0.0
            n_prompt = len(r.prompt_ids)
            streams.append(StreamStats(
                id=r.id, conversation=r.conversation, client=r.client, state=_STREAM_STATE[r.state], tokens=n,
                tok_s=(n - 1) / dt if n > 1 and dt > 0 else 0.0,
                ttft_ms=1000 * (r.t_first - r.t_submit) if r.t_first else None,
                prefill_done=min(r.computed, n_prompt), prefill_total=n_prompt,
                spec_acceptance=r.spec.acceptance if r.spec is not None else None,
                spec_tokens_per_step=r.spec.tokens_per_step if r.spec is not None else None,
            ))
        running = {r.conversation for r in self.scheduler.running}
        idle = tuple(IdleConversation(conv, block, n) for conv, block, n in self._idle_conversations()
                     if conv not in running)
        p = self.pool
        self.metrics.set_state(tuple(streams), idle, len(self.scheduler.waiting), p.in_use, p.resident,
                               p.n_blocks, p.evictions, kv_shared=p.shared, kv_peak_in_use=p.peak_in_use,
                               prefix_cache_queries=p.queries, prefix_cache_hits=p.hits,
                               preemptions=self.scheduler.preemptions)

    def _remember(self, conversation: str, held: list[tuple[int, BlockKey]]) -> None:
        """Note the cached blocks a finished turn leaves (its leading registered ones, with
        the key each is cached under), for the dashboard's idle conversations."""
        self._conversations.pop(conversation, None)
        self._conversations[conversation] = held
        while len(self._conversations) > 64:
            self._conversations.popitem(last=False)

    def _idle_conversations(self) -> list[tuple[str, int, int]]:
        """(conversation, first block, cached tokens) of remembered conversations whose
        first blocks are still cached, most recent first; forgets the evicted ones. A block
        still holds them while the pool keeps the same key object for it (no hashing)."""
        out, keys = [], self.pool.key
        for conv, held in reversed(list(self._conversations.items())):
            n = 0
            while n < len(held) and keys[held[n][0]] is held[n][1]:
                n += 1
            if n == 0:
                del self._conversations[conv]
            else:
                out.append((conv, held[0][0], n * BLOCK_TOKENS))
        return out


def _history(r: Request, j: int) -> list[int]:
    """The tokens generated before logit row j of `r` (its drafts before that row count as
    accepted: the row's pick stands only if they were)."""
    return r.output_ids if j == 0 else r.output_ids + r.drafts[:j]


def _prompt_logit_rows(prompt_rows: list[tuple[Request, int, int]], n_tokens: list[int],
                       requests: list[Request]) -> list[int]:
    """The batch rows whose logits give prompt logprobs: each such request's rows of this
    step before its prompt's last position, after all the sampled rows."""
    start, first_row = 0, {}
    for r, n in zip(requests, n_tokens):
        first_row[r.id] = start
        start += n
    return [first_row[r.id] + j for r, _, m in prompt_rows for j in range(m)]


def _keep_prompt_logprobs(prompt_rows: list[tuple[Request, int, int]], logits: np.ndarray) -> None:
    """Store each request's prompt logprobs from its rows of `logits` (in `prompt_rows`
    order); a recompute after a preemption writes the same values again."""
    at = 0
    for r, first, m in prompt_rows:
        got = prompt_logprobs(logits[at:at + m], r.prompt_ids, first, r.params.prompt_logprobs)
        r.prompt_lps[first:first + len(got)] = got
        at += m


def _padded(rows: tuple[np.ndarray, ...], extra: int) -> tuple[np.ndarray, ...]:
    """Device sampling arrays with `extra` greedy rows appended (the prompt logprob rows,
    whose picks are not used)."""
    if not extra:
        return rows
    fill = (0, 1, 0, 0, 0, 0)  # temperature 0 (greedy), top_p 1, min_p, top_k, seed, step
    return tuple(np.concatenate([a, np.full(extra, f, a.dtype)]) for a, f in zip(rows, fill))


def _then(*parts):
    """A `before_pick` calling each of `parts` that is not None, in order (None: none)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]

    def before_pick(logits, xp):
        for p in parts:
            p(logits, xp)
    return before_pick


def _validated_ids(prompt_ids, vocab_size: int) -> list[int]:
    """prompt_ids as a list of ints, or InvalidRequest (one line) unless each is a token id of
    the model (0 <= id < vocab_size): an id outside would index past the embedding table
    in the shared forward pass, or, negative, silently read another token's row. About
    0.2 ms for 4k ids (submit may run on an event loop)."""
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise InvalidRequest("prompt_ids must be a list of integer token ids") from None
    types = set(map(type, ids))
    if not types <= {int}:
        if not all(issubclass(t, Integral) and not issubclass(t, bool) for t in types):
            raise InvalidRequest("prompt_ids must be a list of integer token ids")
        ids = [int(t) for t in ids]  # numpy integers
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise InvalidRequest(f"prompt_ids must be token ids in [0, {vocab_size}); got {bad}")
    return ids


def _validate_messages(messages) -> None:
    """Raise InvalidRequest (one line) unless messages is a non-empty list of {role, content}
    strings that are valid Unicode (a lone surrogate cannot be tokenized)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("empty prompt: give at least one message", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"message {i} must be an object with string 'role' and 'content'",
                                 param="messages")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"message {i} content is not valid Unicode (lone surrogate)",
                                 param="messages") from None

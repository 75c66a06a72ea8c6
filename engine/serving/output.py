"""The output processor: each step's sampled token ids -> each request's events (vLLM v1
`OutputProcessor`, with the stop checks of its scheduler's `check_stop`).

It knows tokens and text, not the model or the KV cache: incremental detokenizing
(`StreamDecoder`), stop tokens, stop strings (text held back while it may be the start of
one), max_tokens and the context limit, and the FinishEvent's usage and timings. The engine
calls `process` once per step and acts on the requests it says end; every event a request
streams is emitted here.
"""

from __future__ import annotations

from panechat.engine.serving.events import FinishEvent, PrefillEvent, TokenEvent
from panechat.engine.serving.request import Request
from panechat.engine.text.tokenizer import StreamDecoder, Tokenizer

#: What `process` says of a request that ends this step: its finish reason ('stop',
#: 'length'), or the exception raised on its behalf (its emit, its decoder), which fails it alone.
End = str | Exception


class ReplyText:
    """One request's reply text as its tokens arrive: decoded incrementally, with text held
    back while it may be the start of a stop string; `stopped` once one completes."""

    __slots__ = ("decoder", "stops", "held", "text", "stopped")

    def __init__(self, decoder: StreamDecoder, stops: tuple[str, ...]):
        self.decoder = decoder
        self.stops = stops
        self.held = ""  # decoded, not yet shown: it may begin a stop string
        self.text = ""  # everything shown so far
        self.stopped = False

    def push(self, token: int) -> str:
        """The text `token` lets through now. When it completes a stop string, the text up
        to that string's start, and `stopped` is set (nothing after it is ever shown)."""
        piece = self.decoder.push(token)
        if not self.stops:
            self.text += piece
            return piece
        buf = self.held + piece
        for s in self.stops:
            at = buf.find(s)
            if at >= 0:
                self.stopped = True
                self.held = ""
                self.text += buf[:at]
                return buf[:at]
        keep = max(_overlap(buf, s) for s in self.stops)
        self.held = buf[len(buf) - keep:] if keep else ""
        out = buf[:len(buf) - keep]
        self.text += out
        return out

    def flush(self) -> str:
        """The text still held (a partial character, a partial stop string) when the reply
        ends without a stop string; "" after one."""
        tail = self.decoder.flush()
        out = "" if self.stopped else self.held + tail
        self.held = ""
        self.text += out
        return out


def _overlap(buf: str, stop: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of stop."""
    for n in range(min(len(buf), len(stop) - 1), 0, -1):
        if buf.endswith(stop[:n]):
            return n
    return 0


class OutputProcessor:
    """Turns each step's sampled tokens into each request's events and says which requests
    end (stop token, stop string, max_tokens, the context). Holds each request's reply
    text from `add` (at submit) to `finish`."""

    def __init__(self, tokenizer: Tokenizer, ctx: int):
        self.tokenizer = tokenizer
        self.ctx = ctx  # a reply ends ('length') when prompt + reply fill the context
        self._texts: dict[str, ReplyText] = {}

    def add(self, r: Request) -> None:
        """Start `r`'s reply text (its own decoder and stop strings)."""
        self._texts[r.id] = ReplyText(StreamDecoder(self.tokenizer), r.stop_strings)

    def process(self, prefilling: list[Request], sampled: list[tuple],
                now: float) -> list[tuple[Request, End]]:
        """One step's output: a PrefillEvent for each request in `prefilling` (still
        reading its prompt), then each (request, token) or (request, token, logprob) of
        `sampled` taken in turn (a request may have several: accepted drafts; those after
        it ends are dropped). Returns the requests that end now, each with its End; one
        request's exception never reaches another."""
        ends: list[tuple[Request, End]] = []
        for r in prefilling:
            try:
                r.emit(PrefillEvent(r.id, r.computed, len(r.prompt_ids)))
            except Exception as e:
                ends.append((r, e))
        ended: set[str] = set()
        for r, tok, *lp in sampled:
            if r.id in ended:
                continue
            try:
                reason = self._accept(r, tok, now, lp[0] if lp else r.next_logprob)
            except Exception as e:
                reason = e
            if reason is not None:
                ends.append((r, reason))
                ended.add(r.id)
        return ends

    def _accept(self, r: Request, tok: int, now: float, logprob: object = None) -> str | None:
        if not r.t_first:  # its first token (not again after a preemption's recompute)
            r.t_first = now
            r.emit(PrefillEvent(r.id, len(r.prompt_ids), len(r.prompt_ids)))
        text = self._texts[r.id]
        if tok in r.stop_ids:
            self._flush(r, text)
            return "stop"
        r.output_ids.append(tok)
        lp = None
        if r.params.logprobs is not None:
            lp = logprob
            r.token_logprobs.append(lp)
        r.emit(TokenEvent(r.id, tok, text.push(tok), lp))
        if text.stopped:
            return "stop"
        if len(r.output_ids) >= r.params.max_tokens or r.n_known >= self.ctx:
            self._flush(r, text)
            return "length"
        return None

    @staticmethod
    def _flush(r: Request, text: ReplyText) -> None:
        """Emit text still held back (a partial character or a partial stop string)."""
        tail = text.flush()
        if tail:
            r.emit(TokenEvent(r.id, -1, tail))

    def finish(self, r: Request, reason: str, error: str | None = None) -> None:
        """Emit `r`'s FinishEvent (its text so far, token ids, usage, timings; `r.t_end`
        set) and forget its text. Held-back text is not shown: an error or a cancel
        ends the reply where it stood."""
        text = self._texts.pop(r.id, None)
        r.emit(FinishEvent(r.id, reason, text.text if text is not None else "", list(r.output_ids),
                           usage(r), timings(r), error,
                           list(r.token_logprobs) if r.params.logprobs is not None else None,
                           list(r.prompt_lps) if r.prompt_lps is not None else None))


def usage(r: Request) -> dict:
    """The FinishEvent's token counts."""
    return {"prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.output_ids),
            "reused_tokens": r.reused}


def timings(r: Request) -> dict:
    """The FinishEvent's timings, in ms (decode_tok_s: tokens per second after the first;
    ttft_ms and decode_tok_s None when they never happened)."""
    n_out = len(r.output_ids)
    ttft = (r.t_first - r.t_submit) if r.t_first else None
    decode_s = r.t_end - r.t_first if r.t_first else 0.0
    return {
        "queue_ms": 1000 * ((r.t_start or r.t_end) - r.t_submit),
        "prompt_ms": 1000 * ((r.t_first - r.t_start) if r.t_first else 0.0),
        "ttft_ms": 1000 * ttft if ttft is not None else None,
        "decode_tok_s": (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else None,
        "total_ms": 1000 * (r.t_end - r.t_submit),
    }

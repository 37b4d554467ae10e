"""Request output on the loop thread: each request's stream, its new tokens and text
(stop strings applied), the token-time metrics, and the hand-over of deltas to the
consumers' event loops, batched to one wake-up per loop per engine loop pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

from specd.workers.engine.detokenizer import IncrementalDetokenizer
from specd.workers.engine.metrics import EngineMetrics
from specd.workers.requests.faults import record_fault, replica_fault
from specd.workers.requests.request import Req
from specd.workers.types import FinishReason, GenerateDelta, Usage


@dataclasses.dataclass(slots=True)
class RequestStream:
    """Where a request's deltas go: an asyncio queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    req: Req
    session_id: str | None = None  # a turn of this session (history joined on the loop)
    detok: IncrementalDetokenizer | None = None  # made on the loop, once the prompt is known
    sent_tokens: int = 0
    sent_prompt_logprobs: bool = False


Deliveries = list[tuple[asyncio.Queue, GenerateDelta]]  # (a stream's queue, its delta)


def _deliver(items: Deliveries) -> None:
    """On a consumer's event loop: put each delta on its stream's queue."""
    for queue_, delta in items:
        queue_.put_nowait(delta)


def error_delta(rid: str, message: str, code: int) -> GenerateDelta:
    """The one delta of a request refused or failed with HTTP status ``code``."""
    return GenerateDelta(
        rid=rid, finished=True, finish_reason=FinishReason.ERROR, error=message, error_code=code
    )


class OutputProcessor:
    """The streams of the requests in the scheduler, keyed by request id.

    ``finish`` ends a request in the scheduler; it is called when the text reaches a
    stop string (a stop the scheduler cannot see: it works on token ids).
    """

    def __init__(
        self,
        metrics: EngineMetrics,
        tokenizer: object,
        finish: Callable[[Req, FinishReason], None],
        stream_interval: int = 1,
    ):
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.finish = finish
        self.stream_interval = stream_interval  # spec.scheduler.streamInterval
        self.streams: dict[str, RequestStream] = {}
        # deltas of this loop pass, per consumer loop (``send``, ``flush``)
        self._outbox: dict[asyncio.AbstractEventLoop, Deliveries] = {}

    def open(self, stream: RequestStream) -> None:
        """Start streaming ``stream.req`` (its prompt is final: a session turn's history
        is joined)."""
        req = stream.req
        stream.detok = IncrementalDetokenizer(
            self.tokenizer, len(req.prompt_ids), req.params.stop, req.params.min_tokens
        )
        self.streams[req.rid] = stream

    def live_requests(self) -> list[Req]:
        return [stream.req for stream in self.streams.values()]

    def emit(self, req: Req) -> None:
        """Send ``req``'s new tokens and text; finish it on a stop string."""
        stream = self.streams.get(req.rid)
        if stream is None or not self._due(req, stream):
            return
        now = time.monotonic()
        try:
            text = self._new_text(req, stream)
            if stream.detok.stopped and not req.finished:
                self.finish(req, FinishReason.STOP)
                text += stream.detok.feed(req.fill_ids, final=True)
            elif stream.detok.stopped and req.finish_reason is FinishReason.LENGTH:
                req.finish_reason = FinishReason.STOP  # the stop string came first (vLLM's order)
        except Exception as err:  # this request's text, not the replica
            if replica_fault(err):
                raise
            record_fault(req, f"detokenizing failed for this request: {type(err).__name__}: {err}")
            if not req.finished:
                self.finish(req, FinishReason.ERROR)
            req.error, req.error_code, text = req.fault, 500, ""
        new_tokens = req.output_ids[stream.sent_tokens :]
        if new_tokens:
            self._observe_token_times(req, now, len(new_tokens))
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = tuple(req.output_logprobs[stream.sent_tokens :])
        stream.sent_tokens = len(req.output_ids)
        delta = GenerateDelta(
            rid=req.rid,
            token_ids=tuple(new_tokens),
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(req, stream),
            text=text,
            finished=req.finished,
        )
        if req.finished:
            delta = self._finish_delta(req, delta, now)
            del self.streams[req.rid]
        self.send(stream, delta)

    def _due(self, req: Req, stream: RequestStream) -> bool:
        """Whether ``req`` sends a delta now: its first (time to first token), its last,
        and between them once ``stream_interval`` tokens are waiting.  A request with
        stop strings sends every step: its text is what ends it, so it is read as it
        comes (held back, a stop would be found steps late, after the request went on)."""
        waiting = len(req.output_ids) - stream.sent_tokens
        return (
            req.finished
            or stream.sent_tokens == 0
            or waiting >= self.stream_interval
            or bool(req.params.stop)
        )

    def send(self, stream: RequestStream, delta: GenerateDelta) -> None:
        """Queue ``delta`` for the stream's consumer (``flush`` hands it over)."""
        self._outbox.setdefault(stream.loop, []).append((stream.queue, delta))

    def flush(self) -> None:
        """Hand this loop pass's deltas to their consumers: one wake-up per event loop,
        not one per request and step."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            with contextlib.suppress(RuntimeError):  # the consumer's loop is gone: nobody listens
                loop.call_soon_threadsafe(_deliver, items)

    @staticmethod
    def _prompt_logprobs(req: Req, stream: RequestStream) -> tuple | None:
        """The prompt's log-probs, on a scoring request's first delta (the prompt is
        scored by then: its first output token is sampled after the last chunk)."""
        if req.params.prompt_logprobs is None or stream.sent_prompt_logprobs:
            return None
        stream.sent_prompt_logprobs = True
        return (None, *req.prompt_logprobs)

    @staticmethod
    def _new_text(req: Req, stream: RequestStream) -> str:
        """New text of ``req``.  With stop strings and several new tokens (a verify step
        adds up to S + 1), tokens are fed one at a time and those after the token that
        completes a stop string are dropped, as if they had come one step at a time."""
        new = len(req.output_ids) - stream.sent_tokens
        if not stream.detok.stop or new <= 1:
            return stream.detok.feed(req.fill_ids, final=req.finished)
        base = len(req.prompt_ids) + stream.sent_tokens
        text = ""
        for i in range(1, new + 1):
            text += stream.detok.feed(req.fill_ids[: base + i], final=req.finished and i == new)
            if stream.detok.stopped:
                req.truncate_output(stream.sent_tokens + i)
                break
        return text

    def _observe_token_times(self, req: Req, now: float, count: int) -> None:
        self.metrics.generation_tokens.inc(count)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now

    def _finish_delta(self, req: Req, delta: GenerateDelta, now: float) -> GenerateDelta:
        """The last delta: finish reason and usage; counts the finish."""
        self.metrics.e2e.observe(now - req.arrival_time)
        self.metrics.finished.labels(self.metrics.replica, req.finish_reason.value).inc()
        usage = Usage(
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            spec_verify_steps=req.spec_verify_steps,
            spec_accepted_tokens=req.spec_accepted_tokens,
        )
        return dataclasses.replace(
            delta,
            finished=True,
            finish_reason=req.finish_reason,
            usage=usage,
            error=req.error,
            error_code=req.error_code,
        )

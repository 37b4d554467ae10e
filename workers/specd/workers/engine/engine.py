"""One model replica: the loop thread that runs scheduler steps, and its async front.

Requests enter through ``generate`` (an async generator of ``GenerateDelta``) and
``abort``; both only post to the inbox (``inbox.py``).  The loop thread is the single
owner of the scheduler, the KV memory and the model: it drains the inbox between steps,
runs one step (``pipeline.py``, through the plain or speculative executor the factory
chose: ``executors.py``, ``factory.py``), and posts deltas back to each request's asyncio
queue (``output.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

import torch

from specd.workers.bench_knobs import BenchKnobs
from specd.workers.config import DeploymentSpec
from specd.workers.contracts import EngineStatus, PrefixCacheShape
from specd.workers.engine.calibration import calibrate_at_load
from specd.workers.engine.compute import (
    Compute,
    call_into,
    single_threaded_torch_in_this_thread,
)
from specd.workers.engine.factory import build_engine_parts, pick_device
from specd.workers.engine.inbox import Abort, CallOnLoop, CloseSession, Inbox, Message, Submit
from specd.workers.engine.leak_checks import LeakChecks
from specd.workers.engine.metrics import EngineMetrics
from specd.workers.engine.output import OutputProcessor, RequestStream, error_delta
from specd.workers.engine.pipeline import StepPipeline
from specd.workers.engine.rank_group import RankRendezvous
from specd.workers.engine.validation import validate_request
from specd.workers.requests.request import Req, RequestStatus
from specd.workers.runner.structured_output import Grammars
from specd.workers.scheduler.session_store import TurnSettling
from specd.workers.speculative.decoder import KVWriteOutOfBounds
from specd.workers.types import (
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    InvalidRequest,
    SessionSnapshot,
)

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_SESSION_EXPIRY_EVERY_S = 1.0
_SETTLE_POLL_S = 0.002


class Engine:
    def __init__(
        self,
        spec: DeploymentSpec,
        *,
        replica: str = "0",
        device: str | None = None,
        knobs: BenchKnobs = BenchKnobs(),
        rendezvous: RankRendezvous | None = None,
    ):
        self.spec = spec
        self.rendezvous = rendezvous  # rank 0 of a tensor-parallel replica: where ranks meet
        self.knobs = knobs  # benchmark-only, never from the spec
        self.replica = replica
        self.device = torch.device(device or pick_device(spec))
        self.metrics = EngineMetrics(replica)
        self.config_hash = spec.config_hash()
        self.healthy = True
        self.last_error: str | None = None
        self._inbox = Inbox()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status: dict[str, Any] | None = None  # `EngineStatus` fields, once loaded
        self.step_seconds = {"host": 0.0, "model": 0.0}  # loop time outside / inside the model
        self.overlap = spec.scheduler.overlap
        self._compute = Compute(self.overlap, f"specd-compute-{replica}")
        self.strict_mem_check = spec.debug.strict_mem_check >= 1 or bool(
            int(os.environ.get("SPECD_STRICT_MEM_CHECK", "0") or 0)
        )
        self._idle_checked = False  # the idle leak check ran since the last work
        self._parked: list[RequestStream] = []  # turns waiting for their session's last turn
        self._next_expiry = 0.0

    def start(self) -> None:
        """Load tokenizer and model, size the KV memory and start the loop thread.

        All torch work, loading included, happens on the loop thread: CPU torch runs
        its OpenMP thread team per calling thread, and a second team (e.g. one left by
        loading on the caller's thread) halves matmul speed on small machines
        (measured: 5.2 ms vs 11 ms per demo-model decode step on 2 cores).
        """
        ready: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"specd-engine-{self.replica}", daemon=True
        )
        self._thread.start()
        error = ready.get()
        if error is not None:
            self._thread.join()
            raise error

    def _run(self, ready: queue.SimpleQueue) -> None:
        try:
            self._compute.run(self._load)
            if self._compute.threaded:
                single_threaded_torch_in_this_thread()
            calibrate_at_load(self)
            self._refresh_status()
        except BaseException as err:  # handed to start()'s caller
            self._compute.shutdown()
            ready.put(err)
            return
        ready.put(None)
        self._loop()

    def _load(self) -> None:
        """Build the parts (``factory.py``) on the compute thread and wire them."""
        parts = build_engine_parts(
            self.spec,
            device=self.device,
            knobs=self.knobs,
            metrics=self.metrics,
            compute=self._compute,
            rendezvous=self.rendezvous,
        )
        models, memory = parts.models, parts.memory
        self.tokenizer, self.model = models.tokenizer, models.model
        self.model_config, self.draft_head = models.config, models.draft_head
        self.context_length = models.context_length
        self.eos_token_ids = models.eos_token_ids
        self.sampling_defaults = models.sampling_defaults
        self.spec_shape, self.spec_policy = models.spec_shape, models.spec_policy
        self.req_pool, self.allocator, self.kv = memory.req_pool, memory.allocator, memory.kv
        self.kv_pool, self.evicted_blocks = memory.kv_pool, memory.evicted_blocks
        self.backend_name = memory.backend_name
        self.runner, self.spec_decoder = parts.runner, parts.spec_decoder
        self.executor, self.graphs_off = parts.executor, parts.graphs_off
        self.graphs = self.executor.graphs  # None when off (``graphs_off`` says why)
        self.fit, self.sessions, self.scheduler = parts.fit, parts.sessions, parts.scheduler
        self.session_transfer, self.ranks = parts.session_transfer, parts.ranks
        self.metrics.kv_tokens_total.set(self.allocator.total_tokens)
        self.outputs = OutputProcessor(
            self.metrics,
            self.tokenizer,
            self.scheduler.finish,
            stream_interval=self.spec.scheduler.stream_interval,
        )
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.pipeline = StepPipeline(self.executor, self.scheduler, self.outputs, self.metrics)
        self.leak_checks = LeakChecks(
            self.scheduler, self.sessions, self.kv, self.metrics, strict=self.strict_mem_check
        )

    def _graph_status(self) -> dict:
        if self.graphs is None:
            return {"mode": "off", "reason": self.graphs_off}
        return self.graphs.status()

    # -- public API (any thread / event loop) --------------------------------
    def validate(self, req: GenerateRequest) -> None:
        """Raise ``InvalidRequest`` naming the field if ``req`` cannot be served."""
        validate_request(
            req,
            vocab_size=self.model_config.vocab_size,
            policy=self.scheduler.config.policy,
            fit=self.fit,
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream deltas until one is finished; leaving early aborts the request."""
        if not self.healthy:
            yield error_delta(request.rid, f"engine unhealthy: {self.last_error}", 503)
            return
        try:
            self.validate(request)
            grammar = None
            if (asked := request.params.grammar) is not None:  # compiled off the event loop
                started = time.perf_counter()
                grammar = await asyncio.to_thread(self.grammars.state_for, request.params)
                self.metrics.grammar_compile.observe(time.perf_counter() - started)
                self.metrics.structured_requests.labels(self.metrics.replica, asked.kind).inc()
        except InvalidRequest as err:
            yield error_delta(request.rid, str(err), getattr(err, "code", 400))
            return
        req = Req(
            rid=request.rid or uuid.uuid4().hex,
            prompt_ids=list(request.prompt_ids),
            params=request.params,
            grammar=grammar,
            priority=request.priority,
            owner=request.owner,
        )
        stream = RequestStream(asyncio.get_running_loop(), asyncio.Queue(), req, request.session_id)
        self._post(Submit(stream))
        finished = False
        try:
            while not finished:
                delta = await stream.queue.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        self._post(Abort(rid))

    def open_session(self) -> str:
        """A new streaming session's id (``SessionError`` 400 when sessions are off, 429
        when ``spec.sessions.maxSessions`` are open)."""
        return self.sessions.open()

    def close_session(self, session_id: str) -> None:
        """Close a session (``SessionError`` 404 unknown, 410 already closed or expired);
        its KV is freed on the loop, after the turn in flight if any (that is aborted)."""
        self.sessions.mark_closing(session_id)
        self._post(CloseSession(session_id))

    async def idle_session_ids(self) -> list[str]:
        """Sessions with no turn in flight: those a draining replica can move."""
        return await self._on_loop(self.sessions.idle_ids)

    async def export_session(self, session_id: str) -> SessionSnapshot:
        """Take an idle session out of this replica, its KV copied to the host
        (`SessionTransfer.leave`); ``SessionError`` as a turn would get, or 409 mid-turn."""
        while True:
            try:
                return await self._on_loop(self.session_transfer.leave, session_id)
            except TurnSettling:
                await asyncio.sleep(_SETTLE_POLL_S)  # the step in flight ends first

    async def import_session(self, snapshot: SessionSnapshot) -> bool:
        """Hold a session that left another replica; True when its KV came along."""
        arrived = await self._on_loop(self.session_transfer.arrive, snapshot)
        self.metrics.session_arrivals.labels(self.replica, "kv" if arrived else "history").inc()
        return arrived

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` on the loop thread, between steps, awaited by the caller."""
        done: Future = Future()
        self._post(CallOnLoop(done, fn, args))
        return asyncio.wrap_future(done)

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def prefix_cache_shape(self) -> PrefixCacheShape | None:
        """The prefix cache's page size and capacity (None when off), for the router."""
        if self.kv.cache is None:
            return None
        return PrefixCacheShape(
            page_size=self.allocator.page_size, capacity_tokens=self.allocator.total_tokens
        )

    def status(self) -> EngineStatus:
        """The loop's latest status snapshot, with the health as it is now.  Validated
        here, not in the loop: the loop refreshes the snapshot after every step (a plain
        dict costs ~3 us; the model ~40 us), the actor reads it about once a second."""
        if self._status is None:
            raise RuntimeError(f"engine {self.replica}: no status before its model loaded")
        return EngineStatus.model_validate(
            {**self._status, "healthy": self.healthy, "last_error": self.last_error}
        )

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _post(self, message: Message) -> None:
        self._inbox.post(message)

    # -- loop thread ---------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.ranks is not None:
                    self.ranks.check()  # a broken rank group ends the loop
                self._drain_inbox()
                self._expire_sessions()
                if not self.scheduler.has_work() and not self.pipeline.in_flight:
                    self.outputs.flush()
                    self._refresh_status()
                    self._on_idle()
                    self._inbox.wait(_IDLE_WAIT_S)
                    continue
                self.step()
                self.outputs.flush()
        except Exception as err:  # the loop must never die silently
            log.exception("engine %s loop failed", self.replica)
            self.healthy = False
            self.last_error = f"{type(err).__name__}: {err}"
            self.metrics.engine_healthy.set(0)
        finally:
            self.pipeline.settle(self.replica)
            self._abort_all()
            self.outputs.flush()
            self._compute.shutdown()
            if self.ranks is not None:
                self.ranks.close()

    def step(self) -> None:
        """Schedule, run and account one batch (``StepPipeline.run_step``), then add the
        scheduler's statistics of the step to the metrics."""
        t0 = time.perf_counter()
        self._idle_checked = False
        try:
            model_s = self.pipeline.run_step()
        except KVWriteOutOfBounds:
            self.metrics.leak_check("req_to_token", "busy", ok=False)
            raise
        self.metrics.observe_scheduler(self.scheduler.take_step_stats())
        if self.strict_mem_check:
            self.leak_checks.run("busy")
        self._refresh_status()
        host_s = time.perf_counter() - t0 - model_s
        for phase, seconds in (("host", host_s), ("model", model_s)):
            self.step_seconds[phase] += seconds
            self.metrics.step_seconds.labels(self.replica, phase).inc(seconds)

    def _drain_inbox(self) -> None:
        parked, self._parked = self._parked, []
        for stream in parked:
            self._add(stream)
        for message in self._inbox.drain():
            self._idle_checked = False
            match message:
                case Submit(stream=stream):
                    self._add(stream)
                case Abort(rid=rid):
                    self._abort(rid)
                case CloseSession(session_id=sid):
                    if (turn := self.sessions.close_now(sid)) is not None:
                        self._abort(turn.rid)
                case CallOnLoop(done=done, fn=fn, args=args):
                    call_into(done, fn, args)

    def _abort(self, rid: str) -> None:
        """Abort ``rid`` wherever it is: parked (never queued; its caller has left) or
        in the scheduler."""
        if self._unpark(rid):
            return
        if (req := self.scheduler.abort(rid)) is not None:
            self.metrics.aborts.inc()
            self.outputs.emit(req)

    def _add(self, stream: RequestStream) -> None:
        """Queue a request; a session turn first joins its session's history and KV (the
        session store's fit policy may refuse it)."""
        req = stream.req
        if stream.session_id is not None:
            try:
                self.sessions.begin_turn(stream.session_id, req)
            except TurnSettling:
                self._parked.append(stream)
                return
            except InvalidRequest as err:
                self.outputs.send(stream, error_delta(req.rid, str(err), getattr(err, "code", 400)))
                return
        self.outputs.open(stream)
        self.scheduler.add(req)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids) - req.cached_tokens)

    def _unpark(self, rid: str) -> bool:
        for stream in self._parked:
            if stream.req.rid == rid:
                self._parked.remove(stream)
                return True
        return False

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + _SESSION_EXPIRY_EVERY_S
            if self.sessions.expire(now):
                self._idle_checked = False

    def _on_idle(self) -> None:
        """Idle leak check, once per idle period: only sessions may hold KV."""
        if not self._idle_checked:
            self._idle_checked = True
            self.leak_checks.run("idle")

    def _abort_all(self) -> None:
        """Finish every live request and tell its client.  After an engine failure,
        freeing a request's KV may fail again (the bookkeeping may be what broke): that
        is logged, and the client still gets its last delta."""
        for req in self.outputs.live_requests():
            reason = FinishReason.ABORT if self.healthy else FinishReason.ERROR
            try:
                self.scheduler.finish(req, reason)
            except Exception:
                log.exception("engine %s: freeing %s at shutdown failed", self.replica, req.rid)
                req.status, req.finish_reason = RequestStatus.FINISHED, reason
            if not self.healthy:
                req.error = self.last_error
            self.outputs.emit(req)

    def _refresh_status(self) -> None:
        s, a, cache = self.scheduler, self.allocator, self.kv.cache
        queued_tokens = sum(r.tokens_to_compute for r in s.waiting)
        self.metrics.requests_running.set(len(s.running))
        self.metrics.requests_queued.set(len(s.waiting))
        evictable = cache.evictable_tokens if cache is not None else 0
        cached = cache.num_pages * a.page_size if cache is not None else 0
        used = a.used_tokens - evictable  # what requests and sessions hold
        self.metrics.kv_tokens_used.set(used)
        self.metrics.kv_tokens_cached.set(cached)
        reserved = self.kv.reserved_tokens
        self.metrics.kv_tokens_reserved.set(reserved)
        self.metrics.kv_reserve_ratio.set(reserved / max(used, 1))
        session_tokens = self.sessions.held_tokens()
        self.metrics.sessions_open.set(self.sessions.num_open)
        self.metrics.session_kv_tokens.set(session_tokens)
        self._status = {  # `EngineStatus`, validated by `status`
            "replica": self.replica,
            "config_hash": self.config_hash,
            "device": self.device.type,
            "attention_backend": self.backend_name,
            "kernel_ops": self.kv.ops.name,
            "cuda_graphs": self._graph_status(),
            "running": len(s.running),
            "queued": len(s.waiting),
            "queued_tokens": queued_tokens,
            "kv_used_tokens": used,
            "kv_cached_tokens": cached,
            "kv_total_tokens": a.total_tokens,
            "kv_usage": used / a.total_tokens,
            "prefix_cache": {
                "queried_tokens": s.prefix_queried_tokens,
                "hit_tokens": s.prefix_hit_tokens,
                "evicted_blocks": self.evicted_blocks.snapshot(),
            },
            "retractions": s.num_retractions,
            "preemptions": s.num_preemptions,
            "kv_reserved_tokens": reserved,
            "leak_check_failures": self.metrics.leak_failures,
            "sessions_open": self.sessions.num_open,
            "session_kv_tokens": session_tokens,
            # cumulative; mean accept length = 1 + accepted_tokens / verify_steps
            "speculation": dict(self.metrics.spec_totals) if self.spec_shape is not None else None,
            "adaptive": self._adaptive_status(),
        }

    def _adaptive_status(self) -> dict | None:
        """The active rung, the controller's estimate and the plain-step counts."""
        if self.spec_policy is None:
            return None
        return {**self.spec_policy.status(), "plain_steps": dict(self.metrics.spec_plain)}

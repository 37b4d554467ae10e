"""One engine step through the executor: schedule, run, resolve, emit.

Synchronously a batch runs start to finish.  Under overlap scheduling a pipelined batch
(`StepExecutor.pipelined`) is only launched and stays in flight: the next step launches
the batch after it (committed lengths lag by the one in flight), then resolves it.
Prefill chunks, admissions and retractions need the pipeline drained; the executor then
schedules nothing ahead and the next batch waits for the next step::

    step N:    schedule B1, launch B1
    step N+1:  schedule B2 ahead of B1, launch B2 | wait for B1, resolve B1, emit
    step N+2:  schedule B3 ahead of B2, launch B3 | wait for B2, resolve B2, emit
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from specd.workers.engine.executors import StepExecutor
from specd.workers.engine.metrics import EngineMetrics
from specd.workers.engine.output import OutputProcessor
from specd.workers.requests.batch import ScheduledBatch
from specd.workers.requests.faults import unusable_row_message
from specd.workers.runner.model_runner import LaunchedStep
from specd.workers.scheduler.scheduler import Scheduler
from specd.workers.types import FinishReason

log = logging.getLogger(__name__)


def wait_for(future: Future):
    """The result of a submitted batch (a launched one's ids on the host)."""
    out = future.result()
    return out.wait() if isinstance(out, LaunchedStep) else out


class StepPipeline:
    def __init__(
        self,
        executor: StepExecutor,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        metrics: EngineMetrics,
    ):
        self.executor = executor
        self.scheduler = scheduler
        self.outputs = outputs
        self.metrics = metrics
        self.pending: tuple[ScheduledBatch, Future] | None = None  # step in flight (overlap)

    @property
    def in_flight(self) -> bool:
        return self.pending is not None

    def run_step(self) -> float:
        """Schedule, run and resolve one batch (under overlap: launch the next one before
        resolving the one in flight).  Returns the seconds spent waiting for the model."""
        if self.pending is not None:
            return self._overlapped_step()
        return self._synchronous_step()

    def _synchronous_step(self) -> float:
        """One batch start to finish; under overlap a pipelined batch is only launched."""
        batch = self.executor.schedule()
        self._emit_failed()
        if batch is None:
            return 0.0
        self._count_step(batch)
        t1 = time.perf_counter()
        future = self.executor.submit(batch)
        if self.executor.pipelined(batch):
            self.pending = (batch, future)
            return time.perf_counter() - t1
        out = wait_for(future)
        model_s = time.perf_counter() - t1
        self._process(batch, out)
        return model_s

    def _overlapped_step(self) -> float:
        """Launch step N+1 (committed lengths lag by step N), then process N.  Prefill
        chunks, admissions and retractions need the pipeline drained: then N+1 waits."""
        batch, future = self.pending
        nxt = self.executor.schedule_ahead(batch)
        self._emit_failed()
        self.pending = None
        if nxt is not None:
            self._count_step(nxt)
            self.metrics.steps_launched_ahead.inc()
            self.pending = (nxt, self.executor.submit(nxt))
        t1 = time.perf_counter()
        out = wait_for(future)
        model_s = time.perf_counter() - t1
        self._process(batch, out)
        return model_s

    def settle(self, replica: str) -> None:
        """Shutdown or failure: let the step in flight finish and account it, so its
        requests' KV can be freed."""
        if self.pending is None:
            return
        batch, future = self.pending
        self.pending = None
        try:
            self._process(batch, wait_for(future))
        except Exception:  # the loop is ending anyway; the KV is still freed below
            log.exception("engine %s: step in flight failed at shutdown", replica)
            for req in batch.reqs:
                req.inflight_steps = 0
                req.release_deferred = False

    def _process(self, batch: ScheduledBatch, out) -> None:
        """Host side of a computed batch: fail the requests that failed alone, then
        resolve, stop rules, metrics, emit."""
        self._fail_faulted(batch, out)
        for req in self.executor.process(batch, out):
            self.outputs.emit(req)

    def _fail_faulted(self, batch: ScheduledBatch, out) -> None:
        """Finish with an error each request of ``batch`` that failed alone
        (``requests/faults.py``): its KV is freed as on an abort, its result dropped, and
        the batch's other requests go on."""
        flagged = batch.reqs if batch.verify else batch.sampled_reqs
        for i in out.unusable if batch.verify else out.unusable_rows:
            req = flagged[i]
            req.fault = unusable_row_message(req)  # the clearer cause wins
            req.error_code = 400 if req.params.grammar is not None else 500  # its own grammar
        for req in batch.reqs:
            if req.fault is None or req.finished:
                continue
            self.scheduler.finish(req, FinishReason.ERROR)
            req.error, req.error_code = req.fault, req.error_code or 500
            self.outputs.emit(req)

    def _count_step(self, batch: ScheduledBatch) -> None:
        kind = "verify" if batch.verify else "decode"
        if not batch.verify and any(n != 1 for n in batch.extend_lens):
            kind = "extend"
        self.metrics.steps.labels(self.metrics.replica, kind).inc()
        self.metrics.step_requests.labels(self.metrics.replica, kind).inc(len(batch.reqs))

    def _emit_failed(self) -> None:
        for req in self.scheduler.failed:
            self.outputs.emit(req)
        self.scheduler.failed.clear()

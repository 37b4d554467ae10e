"""How an engine's batches run: plain decode or speculative decode, behind one interface.

The factory picks one executor per engine (`factory.build_engine_parts`); the step
pipeline and the engine never ask which.  An executor decides

* what a step schedules: the scheduler's batch, for a verify with the rung the adaptive
  controller or the load policy picks, and under overlap the batch launched ahead of
  the one in flight (`schedule`, `schedule_ahead`);
* which batches overlap only launches, resolving them while the next one is scheduled
  (`pipelined`);
* how a batch runs on the compute thread (`submit`) and how its output is resolved
  (`process`: a runner output, or a speculative step's);
* which CUDA graphs it captures (`capture_graphs`), and the draft's metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

import torch

from specd.workers.engine.compute import Compute
from specd.workers.engine.metrics import EngineMetrics
from specd.workers.requests.batch import RunnerOutput, ScheduledBatch
from specd.workers.requests.request import Req
from specd.workers.rung import PLAIN, PlainReason, Rung
from specd.workers.runner.graph_runner import GraphRunner
from specd.workers.runner.model_runner import ModelRunner
from specd.workers.scheduler.scheduler import Scheduler
from specd.workers.speculative.adaptive import SpecPolicy
from specd.workers.speculative.cost_model import batch_bucket
from specd.workers.speculative.decoder import SpecDecoder, SpecStepOut
from specd.workers.speculative.deferred_extend import CATCH_UP_AT
from specd.workers.speculative.step_graphs import SpecGraphs

if TYPE_CHECKING:
    from specd.workers.config import SpeculativeSpec


class FilledSpan(NamedTuple):
    """One request's positions in a prefill step, as the draft reads them afterwards."""

    req: Req
    start: int  # the first position filled
    length: int  # positions filled
    row: int  # its first row in the batch's hidden states
    sampled: int | None  # the token sampled after it, if its chunk reached the end
    plain_decode: bool  # a drafting request's plain decode (``ScheduledBatch.plain_decodes``)

    @classmethod
    def of(cls, batch: ScheduledBatch, result: RunnerOutput) -> list[FilledSpan]:
        sampled = iter(result.next_token_ids)
        rows = itertools.accumulate(batch.extend_lens[:-1], initial=0)
        return [
            cls(req, start, n, row, next(sampled) if done else None, decoded)
            for req, start, n, done, decoded, row in zip(
                batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample,
                batch.decodes_plainly, rows, strict=True,
            )
        ]  # fmt: skip

    def tokens_ahead(self) -> list[int]:
        """Token ``p + 1`` for each position ``p`` filled: the prompt's, then the sampled."""
        ahead = self.req.fill_ids[self.start + 1 : self.start + self.length + 1]
        return ahead if self.sampled is None else [*ahead, self.sampled]


class PlainBatchOut(NamedTuple):
    """A batch of plain decodes the policy chose (load, cost), computed: the runner's
    output, and what its deferred draft extends cost (a catch-up once a backlog was
    full) and measured (NGRAM's shadow walks)."""

    result: RunnerOutput
    catch_up_seconds: float
    catch_up_tokens: int
    shadow_accepted: tuple[tuple[str, int], ...]  # (rid, accepted drafts) per shadow walk

    @property
    def unusable_rows(self) -> tuple[int, ...]:
        """The runner's (the pipeline fails those requests alone)."""
        return self.result.unusable_rows


class StepExecutor(ABC):
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, compute: Compute, overlap: bool):
        self.scheduler = scheduler
        self.runner = runner
        self.compute = compute  # where torch work runs (the compute thread under overlap)
        self.overlap = overlap
        self.graphs: GraphRunner | SpecGraphs | None = None  # once captured

    @abstractmethod
    def schedule(self) -> ScheduledBatch | None:
        """This step's batch (its KV allocated), or None."""

    @abstractmethod
    def schedule_ahead(self, in_flight: ScheduledBatch) -> ScheduledBatch | None:
        """Overlap: the batch to launch behind ``in_flight`` before it is resolved, if any."""

    @abstractmethod
    def pipelined(self, batch: ScheduledBatch) -> bool:
        """Under overlap, ``batch`` is only launched and stays in flight while the next
        one is scheduled."""

    @abstractmethod
    def submit(self, batch: ScheduledBatch) -> Future:
        """Queue ``batch`` on the compute thread (its result, or a ``LaunchedStep``)."""

    @abstractmethod
    def process(self, batch: ScheduledBatch, out) -> list[Req]:
        """Resolve a computed batch (stop rules, metrics) -> the requests with new tokens."""

    @abstractmethod
    def capture_graphs(self, sizes: list[int]) -> None:
        """Capture this executor's CUDA graphs for batches of ``sizes`` requests."""

    @abstractmethod
    def publish_info(self) -> None:
        """Set the gauges that describe this executor (not its steps)."""


class PlainExecutor(StepExecutor):
    """Plain decode: prefill chunks and decodes in one batch; under overlap every batch is
    launched, and the decode after it scheduled while it computes."""

    def schedule(self) -> ScheduledBatch | None:
        return self.scheduler.schedule()

    def schedule_ahead(self, in_flight: ScheduledBatch) -> ScheduledBatch | None:
        return self.scheduler.schedule_decode_ahead(in_flight)

    def pipelined(self, batch: ScheduledBatch) -> bool:
        return self.overlap

    def submit(self, batch: ScheduledBatch) -> Future:
        if self.pipelined(batch):
            return self.compute.submit(self.runner.launch, batch)
        return self.compute.submit(self.runner.run, batch, None)

    def process(self, batch: ScheduledBatch, out: RunnerOutput) -> list[Req]:
        return self.scheduler.process_result(batch, out)

    def capture_graphs(self, sizes: list[int]) -> None:
        self.graphs = self.runner.enable_decode_graphs(sizes, self.runner.req_pool.width)
        self.graphs.capture()

    def publish_info(self) -> None:
        """Nothing: plain decode has no drafter."""


# plain batches leave the draft's extend for later (deferred_extend.py), whoever chose
# them (load, cost model, a request's end or its opt-out), but the active rung 0's: its
# steps probe the draft, which is how the adaptive controller climbs back.  A switch back
# to speculation catches up first (a transition, not charged to plain)
DEFERRING = frozenset(PlainReason) - {PlainReason.RUNG}


def prefill_catch_up_seconds(seconds: float, tokens: int, prefill_tokens: int) -> float:
    """The part of a verify's draft catch-up (``seconds`` for ``tokens``) that read tokens
    decoded in prefill steps: speculating pays it, plain decoding would not (it is the
    verify's cost), unlike the tokens plain batches deferred (plain's cost).  Shared by
    tokens read."""
    if tokens <= 0 or seconds <= 0 or prefill_tokens <= 0:
        return 0.0
    return seconds * min(prefill_tokens, tokens) / tokens


def spec_graph_rungs(
    speculative: SpeculativeSpec, spec_policy: SpecPolicy | None = None
) -> list[Rung]:
    """The rungs a speculative engine may run, so captures graphs for: its ladder, the
    shorter chains its cost model may choose (``spec_policy``'s,
    ``CostModel.chain_candidates``), and the plain rung when the policy may run a batch
    plain (cost model or threshold)."""
    rungs = list(speculative.ladder)
    model = None if spec_policy is None else spec_policy.cost_model
    if model is not None:
        for rung in speculative.ladder:
            rungs += [c for c in model.chain_candidates(rung) if c not in rungs]
    policy = speculative.policy
    if PLAIN not in rungs and (policy.uses_cost_model or policy.max_batch_for_spec is not None):
        rungs.append(PLAIN)
    return rungs


class SpeculativeExecutor(StepExecutor):
    """Speculative decode: prefill chunks run in a step of their own, where drafting
    requests decode a token plainly beside them, and the draft then extends over the
    chunks' positions (the plain decodes join its backlog); every request with a draft
    state then verifies, on the rung the adaptive controller (or the load policy)
    picks.  Under overlap only verifies are pipelined."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        compute: Compute,
        overlap: bool,
        *,
        decoder: SpecDecoder,
        policy: SpecPolicy,
        graph_rungs: Sequence[Rung],
        metrics: EngineMetrics,
    ):
        super().__init__(scheduler, runner, compute, overlap)
        self.decoder = decoder
        self.policy = policy
        self.graph_rungs = list(graph_rungs)
        self.metrics = metrics
        self.publish_info()
        scheduler.on_release = self._forget_draft_state
        self._backlogs: dict[str, int] = {}  # rid -> deferred tokens the draft has not read
        self._prefill_backlogs: dict[str, int] = {}  # rid -> those of them decoded in prefill steps

    def publish_info(self) -> None:
        """The drafter and the active rung's steps."""
        self.metrics.spec_adaptive_steps.set(self.policy.active.steps)
        self.metrics.spec_draft_info.labels(self.metrics.replica, self.decoder.algorithm).set(1)

    def schedule(self) -> ScheduledBatch | None:
        start = time.perf_counter()
        if self.scheduler.wants_extend() or not self._decodes_plain_batches():
            return self._with_rung(self.scheduler.schedule(), start)
        drafting = [r for r in self.scheduler.running if r.spec_ready]
        if not drafting:
            return None
        rung, plain_reason = self._choose(drafting)
        if plain_reason in DEFERRING:
            batch = self.scheduler.schedule_plain_decodes(drafting)
            if batch is not None:
                return dataclasses.replace(
                    batch, rung=PLAIN, plain_reason=plain_reason, scheduled_at=start
                )
        return self._with_rung(self.scheduler.schedule_verify(), start, (rung, plain_reason))

    def _decodes_plain_batches(self) -> bool:
        """Whether a batch the policy runs plain (load, cost) is a batch of plain decodes
        through the model runner, the plain engine's own step, rather than a root-only
        verify: without overlap (which pipelines verifies only) and CUDA graphs (which
        hold the root-only verify's replay)."""
        return not self.overlap and self.graphs is None

    def schedule_ahead(self, in_flight: ScheduledBatch) -> ScheduledBatch | None:
        if self.scheduler.wants_extend():
            return None
        start = time.perf_counter()
        return self._with_rung(self.scheduler.schedule_verify(allow_retract=False), start)

    def pipelined(self, batch: ScheduledBatch) -> bool:
        return self.overlap and batch.verify

    def submit(self, batch: ScheduledBatch) -> Future:
        if batch.verify:
            return self.compute.submit(self._timed_step, batch)
        return self.compute.submit(self._extend_compute, batch)

    def _timed_step(self, batch: ScheduledBatch) -> SpecStepOut:
        """Compute side of a verify, with its seconds for the cost model (a catch-up of
        deferred draft extends left out: the cost model charges it to plain steps).
        A batch the policy ran plain leaves the draft's extend for later."""
        start = time.perf_counter()
        defer = batch.plain_reason in DEFERRING
        out = self.decoder.step(list(batch.reqs), list(batch.granted_lens), batch.rung, defer)
        seconds = time.perf_counter() - start - out.catch_up_seconds
        return dataclasses.replace(out, seconds=seconds)

    def process(self, batch: ScheduledBatch, out) -> list[Req]:
        if batch.verify:
            return self._process_verify(batch, out)
        chosen = out if isinstance(out, PlainBatchOut) else None  # the policy's plain batch
        updated = self.scheduler.process_result(batch, out if chosen is None else chosen.result)
        decoded = []  # plain decodes: one more token each that its draft has not read
        for req, sampled, decodes in zip(
            batch.reqs, batch.sample, batch.decodes_plainly, strict=True
        ):
            if decodes:
                decoded.append(req)
                continue
            req.spec_ready = req.spec_ready or (sampled and not req.finished)
            if sampled:  # a prefill (or a retracted request's redo) leaves the draft current
                self._drop_backlogs(req.rid)
        self._count_backlogs(decoded, deferred=True, in_prefill=chosen is None)
        if any(self._backlogs.get(r.rid, 0) >= CATCH_UP_AT for r in decoded):
            self._count_backlogs(decoded, deferred=False)  # SpecDecoder.defer read them all
        if chosen is None:
            self.metrics.observe_plain_decodes(len(decoded))
        else:
            self._observe_plain_batch(batch, chosen)
        return updated

    def capture_graphs(self, sizes: list[int]) -> None:
        self.graphs = SpecGraphs(self.decoder, self.graph_rungs, sizes)
        self.decoder.graphs = self.graphs
        self.graphs.capture()

    def _with_rung(
        self,
        batch: ScheduledBatch | None,
        start: float,
        chosen: tuple[Rung, PlainReason | None] | None = None,
    ) -> ScheduledBatch | None:
        """Fix a verify batch's rung when it is scheduled: the adaptive controller's
        active rung, or plain when the policy says so (allocation stays widest), unless
        already ``chosen``."""
        if batch is None or not batch.verify:
            return batch
        if chosen is None:
            chosen = self._choose(batch.reqs)
        rung, plain_reason = chosen
        return dataclasses.replace(
            batch,
            rung=rung,
            plain_reason=plain_reason,
            scheduled_at=start,
            extend_lens=tuple(rung.draft_tokens for _ in batch.reqs),
        )

    def _choose(self, reqs: Sequence[Req]) -> tuple[Rung, PlainReason | None]:
        """The policy's rung for a verify of ``reqs``: their mean backlog and the tokens
        each may still produce weigh in (``SpecPolicy.choose``); plain while one of them
        opted out of speculation (``speculative: false``)."""
        if not all(r.params.speculative for r in reqs):
            return PLAIN, PlainReason.REQUEST
        backlog = sum(self._backlogs.get(r.rid, 0) for r in reqs) / len(reqs)
        tokens_left = [r.params.max_tokens - len(r.output_ids) for r in reqs]
        return self.policy.choose(len(reqs), backlog, tokens_left, [r.rid for r in reqs])

    def _extend_compute(self, batch: ScheduledBatch) -> RunnerOutput | PlainBatchOut:
        """Compute side of a prefill/decode batch, then the draft over the same positions."""
        result = self.runner.run(batch, self.decoder.capture_layers)
        caught_up = self._draft_after_extend(batch, result)
        if batch.plain_reason is None:
            return result
        return PlainBatchOut(result, *caught_up, self.decoder.shadow_samples())

    def _draft_after_extend(self, batch: ScheduledBatch, result: RunnerOutput) -> tuple[float, int]:
        """Draft rows for the positions the target just filled (token ``p + 1`` with the
        target's hidden at ``p``; the last one of a finished prompt is the sampled token).
        A plain decode leaves its token to the draft's backlog -> the (seconds, tokens)
        of the catch-up that a full backlog started, zeros if none."""
        features = self.decoder.features(result.hidden, result.aux)
        spans = FilledSpan.of(batch, result)
        extends = [s for s in spans if not s.plain_decode]
        self.decoder.after_extend(
            [s.req for s in extends],
            [s.start for s in extends],
            [s.tokens_ahead() for s in extends],
            [features[s.row : s.row + s.length] for s in extends],
            [s.sampled is not None for s in extends],
        )
        decodes = [s for s in spans if s.plain_decode]
        if decodes:  # their feature rows copied: a backlog outlives this batch's tensors
            rows = torch.tensor([s.row for s in decodes], device=features.device)
            return self.decoder.defer(
                [s.req for s in decodes],
                [s.start for s in decodes],
                [s.sampled for s in decodes],
                features.index_select(0, rows),
            )
        return 0.0, 0

    def _process_verify(self, batch: ScheduledBatch, out) -> list[Req]:
        """Host side of a verify: resolve, stop rules, metrics."""
        updated = self.scheduler.process_verify(batch, out.new_tokens, out.logprobs)
        live = {id(r) for r in updated}
        counted = [i for i, r in enumerate(batch.reqs) if id(r) in live]
        nodes = out.node_counts or (batch.rung.draft_tokens,) * len(batch.reqs)
        self.metrics.observe_verify(
            tuple(out.accept_lens[i] for i in counted), sum(nodes[i] - 1 for i in counted)
        )
        self._observe_rung(batch, out)
        return updated

    def _observe_rung(self, batch: ScheduledBatch, out) -> None:
        """Feed the batch's acceptance (probe hits on the plain rung) to the adaptive
        controller; every request the verify ran on counts, finished ones too."""
        rung = batch.rung
        self.metrics.observe_rung(batch.plain_reason)
        accepted = out.accept_lens if rung.speculates else out.probes
        deferred = batch.plain_reason in DEFERRING
        prefill_catch_up = 0.0
        if not deferred:
            prefill_tokens = sum(self._prefill_backlogs.get(r.rid, 0) for r in batch.reqs)
            prefill_catch_up = prefill_catch_up_seconds(
                out.catch_up_seconds, out.catch_up_tokens, prefill_tokens
            )
            self.metrics.observe_prefill_catch_up(prefill_catch_up)
        self.policy.observe(
            rung,
            batch.plain_reason,
            accepted,
            self._step_seconds(batch, out) + prefill_catch_up,
            len(batch.reqs),
            self._held_rids(r.rid for r in batch.reqs),
        )
        if out.suffix_trees:
            self.metrics.spec_hybrid_suffix_trees.inc(out.suffix_trees)
        if batch.rung.speculates and out.node_counts:
            self.metrics.spec_root_only_requests.inc(out.node_counts.count(1))
        if deferred:  # a full backlog: what staying plain costs
            self.policy.observe_catch_up(out.catch_up_seconds, out.catch_up_tokens)
        self._count_backlogs(batch.reqs, deferred and not out.catch_up_tokens)
        self._observe_shadows_and_cost(rung, len(batch.reqs), out.shadow_accepted)

    def _observe_plain_batch(self, batch: ScheduledBatch, out: PlainBatchOut) -> None:
        """Feed a batch of plain decodes the policy chose to the cost model, as the
        plain rung: its whole step's seconds, less a catch-up (charged apart)."""
        self.metrics.observe_rung(batch.plain_reason)
        seconds = self._step_seconds(batch, out)
        self.policy.observe(PLAIN, batch.plain_reason, (), seconds, len(batch.reqs))
        self.policy.observe_catch_up(out.catch_up_seconds, out.catch_up_tokens)
        self._observe_shadows_and_cost(PLAIN, len(batch.reqs), out.shadow_accepted)

    def _observe_shadows_and_cost(
        self, rung: Rung, batch_size: int, shadow_accepted: tuple[tuple[str, int], ...]
    ) -> None:
        """Shadow walks' acceptance (rid, accepted drafts) to the cost model, and its
        gauges for ``rung``."""
        if shadow_accepted:
            rids = self._held_rids(rid for rid, _ in shadow_accepted)
            accepted = [n for _, n in shadow_accepted]
            self.policy.observe_shadow(self.decoder.shadow_rung, accepted, rids)
            self.metrics.observe_shadow(tuple(accepted))
        model = self.policy.cost_model
        if model is not None:
            bucket = batch_bucket(batch_size)
            self.metrics.observe_cost(
                bucket,
                rung.steps,
                model.seconds_per_request(bucket, rung),
                model.predicted_tokens_per_second(bucket, rung),
            )
        self.metrics.spec_adaptive_steps.set(self.policy.active.steps)

    def _step_seconds(self, batch: ScheduledBatch, out: SpecStepOut | PlainBatchOut) -> float:
        """What the step cost the engine, for the cost model: without overlap, the
        whole step (scheduling, compute and processing: host work grows with the tokens
        a step appends); under overlap (verifies only: ``_decodes_plain_batches``) the
        host hides behind compute, so compute alone.  A catch-up of deferred draft
        extends is left out (charged to plain steps)."""
        if self.overlap:
            return out.seconds
        return time.perf_counter() - batch.scheduled_at - out.catch_up_seconds

    def _held_rids(self, rids: Iterable[str]) -> list[str | None]:
        """``rids``, None for each request the scheduler no longer runs: finished,
        aborted or retracted, its KV is gone and so is its own acceptance
        (``_forget_draft_state``); an observation of it (its last verify, a shadow walk
        that ended beside a prefill step) must not bring that back."""
        running = {r.rid for r in self.scheduler.running}
        return [rid if rid in running else None for rid in rids]

    def _count_backlogs(
        self, reqs: Sequence[Req], deferred: bool, in_prefill: bool = False
    ) -> None:
        """Host-side mirror of the decoder's backlogs, for the cost model: a deferred
        step adds a token to each (a prefill step's decode also to its prefill part);
        any other step (or a catch-up) empties them."""
        for req in reqs:
            if req.finished:  # released already: nothing left to count
                continue
            if not deferred:
                self._backlogs[req.rid] = self._prefill_backlogs[req.rid] = 0
                continue
            self._backlogs[req.rid] = self._backlogs.get(req.rid, 0) + 1
            self._prefill_backlogs[req.rid] = self._prefill_backlogs.get(req.rid, 0) + in_prefill

    def _drop_backlogs(self, rid: str) -> None:
        """Forget ``rid``'s mirrored backlog, its prefill part included."""
        self._backlogs.pop(rid, None)
        self._prefill_backlogs.pop(rid, None)

    def _forget_draft_state(self, req: Req) -> None:
        """The scheduler freed ``req``'s KV: drop its draft state (after steps in flight)."""
        self._drop_backlogs(req.rid)
        self.policy.forget(req.rid)
        finished = req.finished and req.error is None
        self.compute.submit(self.decoder.drop, [req.rid], finished)

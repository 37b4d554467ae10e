"""Continuous batching with chunked prefill, admission limits and retraction.

Each step has a token budget (``chunked_prefill_size``, never below the number of
running requests).  Running requests are served first, oldest first: a decoding
request needs one token, a request mid-prefill gets the next chunk.  Waiting
requests are then admitted in queue order (`policy`: arrival, or priority then
arrival) while the budget, the row pool, ``max_running_requests`` and the KV pool
allow.  When a running request cannot get KV for its next token, the newest running
request (`policy`: or the lowest-priority one) is retracted: its KV is freed and it
goes back to the queue, keeping its output so far (it is re-prefilled later and
continues exactly where it stopped).  Under the priority policy a waiting request
that cannot start preempts running requests of lower priority the same way.  A
waiting request whose prompt opens like the prompt of a request still prefilling is
passed over until that prefill has computed the shared pages (`prefix_sharing.py`),
so it borrows them from the prefix cache instead of computing them a second time.

The scheduler only does bookkeeping; it never builds tensors for the model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specd.workers.mem_cache.kv_manager import KVManager, RowWidthExceeded
from specd.workers.mem_cache.sizing import SpecShape, admission_headroom, decode_alloc_target
from specd.workers.requests.batch import RunnerOutput, ScheduledBatch
from specd.workers.requests.request import Req, RequestStatus
from specd.workers.requests.stop import check_stop, reaches_length_limit
from specd.workers.scheduler.accounting import (
    preclaim_bonus_slot,
    resolve_committed,
    return_preclaimed_slot,
)
from specd.workers.scheduler.policy import (
    Policy,
    enqueue,
    preemption_victims,
    retraction_victim,
)
from specd.workers.scheduler.prefix_sharing import awaits_shared_prefill, start_on_cached_prefix
from specd.workers.scheduler.session_store import SessionStore
from specd.workers.scheduler.step_stats import StepStats
from specd.workers.types import FinishReason


def launched(spans: list[tuple[Req, int, int, bool]], **fields) -> ScheduledBatch | None:
    """The batch of ``spans`` (request, first position, tokens, whether it samples),
    each request now counted as having a step in flight; None if empty."""
    if not spans:
        return None
    for req, *_ in spans:
        req.inflight_steps += 1
    reqs, starts, lens, sample = zip(*spans, strict=True)
    return ScheduledBatch(reqs, starts, lens, sample, **fields)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    spec: SpecShape | None = None  # speculative decoding layout, None for plain decode
    policy: Policy = "fcfs"  # the waiting queue's order and who gives way (policy.py)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retractions = 0  # to let a running request grow (KV ran out)
        self.num_preemptions = 0  # to let a waiting request of higher priority start
        self.failed: list[Req] = []  # finished with an error while scheduling; engine reports
        self.on_release: Callable[[Req], None] | None = None  # KV of ``req`` was freed
        self.sessions: SessionStore | None = None  # turns of sessions keep their KV there
        self.num_row_width_errors = 0
        self.num_session_evictions = 0  # session KV freed under pressure (tokens kept)
        self.prefix_queried_tokens = 0  # tokens new requests looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens found (their prefill skipped)
        self.deferred: list[Req] = []  # finished, KV freed once their step in flight ends
        self._reported = StepStats()  # the totals at the last `take_step_stats`

    # -- queue -------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = RequestStatus.WAITING
        enqueue(self.waiting, req, self.config.policy)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: str) -> Req | None:
        """Finish ``rid`` with ABORT wherever it is; returns it, or None if unknown."""
        for req in list(self.waiting) + self.running:
            if req.rid == rid:
                self.finish(req, FinishReason.ABORT)
                return req
        return None

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Retire ``req``: free its KV and drop it from the queues."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.inflight_steps:  # a launched step still writes its KV: free after it
            req.release_deferred = True
            self.deferred.append(req)
        else:
            self._release(req)

    def _release(self, req: Req) -> None:
        """``req`` is finished and no step is in flight: free its KV (a session turn hands
        it back to its session instead)."""
        if req.release_deferred:
            self.deferred.remove(req)
        if req.session is not None:
            self.sessions.end_turn(req, self.config.context_length)
        else:
            self.kv.release(req.kv, req.final_kv_tokens)
        self._forget(req)

    def kv_holders(self) -> list[Req]:
        """Every request that holds KV right now (the leak checks' ``requests``)."""
        return self.running + self._waiting_with_kv() + self.deferred

    def _waiting_with_kv(self) -> list[Req]:
        """Waiting requests that hold KV: session turns, whose history is their KV."""
        return [r for r in self.waiting if r.kv.row is not None]

    def _forget(self, req: Req) -> None:
        req.spec_ready = False
        req.release_deferred = False
        if self.on_release is not None:
            self.on_release(req)

    def totals(self) -> StepStats:
        """The counters since this scheduler started."""
        return StepStats(
            retractions=self.num_retractions,
            preemptions=self.num_preemptions,
            session_evictions=self.num_session_evictions,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            row_width_errors=self.num_row_width_errors,
        )

    def take_step_stats(self) -> StepStats:
        """What the counters added since the last call (the engine's one step: they
        change only while a batch is scheduled)."""
        totals = self.totals()
        step, self._reported = totals.since(self._reported), totals
        return step

    # -- one step ----------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's requests and token counts, allocating their KV (the batch's
        ``req_to_token`` writes go out together).  Plain decode mixes prefill chunks and
        decodes in one batch.  A speculative engine runs prefill chunks when one is due,
        with each drafting request decoding a token beside them (`_plain_decodes`), else
        a verify of every request with a draft state (prompt cached, first token out)."""
        with self.kv.batched_writes():
            if self.config.spec is None:
                return launched(self._pick_extend(self.running))
            drafting = [r for r in self.running if r.spec_ready]
            prefill = self._pick_extend(
                [r for r in self.running if not r.spec_ready], len(drafting)
            )
            if not prefill:
                return self.schedule_verify()
            decodes = self._plain_decodes(drafting)
            flags = (False,) * len(prefill) + (True,) * len(decodes)
            return launched(prefill + decodes, plain_decodes=flags)

    def wants_extend(self) -> bool:
        """A prefill chunk is due (a speculative engine runs those before verifies)."""
        return bool(self.waiting) or any(not r.spec_ready for r in self.running)

    def _pick_extend(self, candidates: list[Req], reserved: int = 0) -> list[tuple]:
        """Spans (request, start, tokens, samples) of ``candidates``' next tokens, then of
        waiting requests admitted, in the token budget less ``reserved`` (KV allocated)."""
        budget = max(self.config.chunked_prefill_size, len(candidates) + reserved) - reserved
        picked: list[tuple[Req, int]] = []
        for req in list(candidates):
            if req not in self.running:  # retracted while serving an older request
                continue
            take = min(req.tokens_to_compute, budget)
            if take == 0 or not self._grow_or_retract(req, req.kv.committed + take):
                continue
            picked.append((req, take))
            budget -= take
        picked += self._admit(budget)
        return [
            (r, r.kv.committed, n, r.kv.committed + n == r.num_fill)
            for r, n in picked
            if r.status is RequestStatus.RUNNING
        ]

    def _plain_decodes(self, drafting: list[Req]) -> list[tuple]:
        """Prefill step: each drafting request decodes its root plainly instead of waiting
        for the next verify (its draft reads it later, deferred_extend.py); one whose KV
        cannot grow without a retraction sits the step out."""
        return [
            (r, r.kv.committed, 1, True)
            for r in drafting
            if r.status is RequestStatus.RUNNING and self.kv.grow(r.kv, r.kv.committed + 1)
        ]

    def schedule_plain_decodes(self, drafting: list[Req]) -> ScheduledBatch | None:
        """A batch the policy runs plain: each ``drafting`` request decodes its root."""
        with self.kv.batched_writes():
            decodes = self._plain_decodes(drafting)
        full = decodes and len(decodes) == len(drafting)  # else a verify, which may retract
        return launched(decodes, plain_decodes=(True,) * len(decodes)) if full else None

    def schedule_decode_ahead(self, in_flight: ScheduledBatch) -> ScheduledBatch | None:
        """Overlap scheduling, plain decode: the decode step after ``in_flight``, picked
        while that batch computes.  Each request reads the token ``in_flight`` samples for
        it (on the device) at the position after that batch's tokens; one whose pending
        token ends it by length sits out.  None, and the pipeline drains, when a request
        is waiting or mid-prefill, or the pool would need a retraction: admission and
        retraction happen between resolved batches."""
        if self.waiting:
            return None
        next_position = {
            id(r): start + n
            for r, start, n, sampled in zip(
                in_flight.reqs, in_flight.prefix_lens, in_flight.extend_lens, in_flight.sample,
                strict=True,
            )
            if sampled
        }  # fmt: skip
        if any(id(r) not in next_position for r in self.running):
            return None
        spans = []
        with self.kv.batched_writes():
            for req in self.running:
                if reaches_length_limit(req, self.config.context_length, pending=1):
                    continue
                position = next_position[id(req)]
                if not self.kv.grow(req.kv, position + 1):
                    return None
                spans.append((req, position, 1, True))
        return launched(spans, decode_ahead=True)

    def schedule_verify(self, allow_retract: bool = True) -> ScheduledBatch | None:
        """Grow every drafting request to ``committed + reserve`` and pre-claim its root.

        Under overlap this runs before the previous verify's results are in, so committed
        lags by up to one verify; the 2x reserve covers that.  ``allow_retract=False``
        (overlap) gives up, returning None, instead of retracting a request in flight.
        """
        with self.kv.batched_writes():
            return self._schedule_verify(allow_retract)

    def _schedule_verify(self, allow_retract: bool) -> ScheduledBatch | None:
        spec, page = self.config.spec, self.kv.page_size
        picked = []
        for req in list(self.running):
            if req not in self.running or not req.spec_ready:
                continue
            target = decode_alloc_target(req.kv.committed, req.kv.allocated, spec, page)
            try:
                if not allow_retract:
                    if not self.kv.grow(req.kv, target):
                        return None
                elif not self._grow_or_retract(req, target):
                    continue
            except RowWidthExceeded as err:
                self.num_row_width_errors += 1
                req.error = str(err)
                self.finish(req, FinishReason.ERROR)
                self.failed.append(req)
                continue
            picked.append(req)
        picked = [r for r in picked if r.status is RequestStatus.RUNNING]
        for req in picked:
            preclaim_bonus_slot(req.kv)
        return launched(
            [(r, r.num_fill - 1, spec.max_draft_tokens, True) for r in picked],
            verify=True,
            granted_lens=tuple(r.kv.allocated for r in picked),
        )

    def _admit(self, budget: int) -> list[tuple[Req, int]]:
        admitted, passed_over = [], []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) >= self.config.max_running_requests:
                if self._preempt_for(req):
                    continue
                break
            if awaits_shared_prefill(self.kv, self.running, req):
                passed_over.append(self.waiting.popleft())
                continue
            borrowed = start_on_cached_prefix(self.kv, req)
            take = min(req.tokens_to_compute, budget)
            # room for its whole remaining prefill (a chunked prefill admitted without it
            # retracts itself, is readmitted, and starves the decodes), keeping each
            # running request's next decode growth free
            headroom = len(self.running) * admission_headroom(self.config.spec, self.kv.page_size)
            room = self.kv.available_tokens - headroom
            if room < req.tokens_to_compute or not self.kv.grow(req.kv, req.kv.committed + take):
                if borrowed:  # hold nothing while waiting; the next try matches again
                    self.kv.release(req.kv)
                if self._reclaim_session_kv(req.tokens_to_compute + headroom):
                    continue  # ``take`` may have grown: the turn prefills its history again
                short = req.tokens_to_compute + headroom - self.kv.available_tokens
                if self._preempt_for(req, max(short, 1)):
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._count_cache_lookup(req, borrowed)
            admitted.append((req, take))
            budget -= take
        self.waiting.extendleft(reversed(passed_over))  # their place in the queue kept
        return admitted

    def _count_cache_lookup(self, req: Req, borrowed: int | None) -> None:
        """A request admitted for the first time: its lookup in the usage and metrics."""
        if borrowed is None or req.num_retractions:
            return
        self.prefix_queried_tokens += req.cacheable_len
        self.prefix_hit_tokens += borrowed
        req.cached_tokens = min(borrowed, len(req.prompt_ids))

    def _grow_or_retract(self, req: Req, new_allocated: int) -> bool:
        """Allocate up to ``new_allocated`` for ``req``, retracting newer requests if the
        pool is full.  False if ``req`` itself had to be retracted."""
        while not self.kv.grow(req.kv, new_allocated):
            if self._reclaim_session_kv(
                self.kv.pages_needed(req.kv, new_allocated) * self.kv.page_size
            ):
                continue
            victim = retraction_victim(self.running, self.config.policy)
            self.retract(victim)
            if victim is req:
                return False
        return True

    def _preempt_for(self, req: Req, tokens_short: int = 0) -> bool:
        """Retract the running requests waiting ``req`` preempts to start (the batch is
        full, or ``tokens_short`` KV slots are missing; see `preemption_victims`).
        False if it preempts none."""
        victims = preemption_victims(
            self.running, req, self.config.policy, tokens_short, self.kv.page_size
        )
        for victim in victims:
            self.retract(victim, preempted=True)
        return bool(victims)

    def _reclaim_session_kv(self, tokens: int) -> bool:
        """Free session KV that no step is using until ``tokens`` slots are free: waiting
        turns' history first (newest first), then idle sessions (least recently used).
        Their tokens are kept; the next turn prefills the history again.  False if
        there was nothing to free."""
        freed = False
        for req in reversed(self._waiting_with_kv()):
            if self.kv.available_tokens >= tokens:
                return freed
            self.kv.release(req.kv, req.final_kv_tokens)
            self.num_session_evictions += 1
            freed = True
        while self.kv.available_tokens < tokens and self.sessions is not None:
            if not self.sessions.evict_lru():
                break
            self.num_session_evictions += 1
            freed = True
        return freed

    def retract(self, req: Req, *, preempted: bool = False) -> None:
        """Free ``req``'s KV and requeue it (first, or at its priority's place); its
        output so far is kept.  ``preempted``: for a waiting request of higher priority,
        not because KV ran out."""
        if req.inflight_steps:
            raise RuntimeError(f"request {req.rid} retracted while a step is in flight")
        self.running.remove(req)
        # a session turn's history KV too; the final pages stay cached, so the
        # re-prefill may find them unless evicted
        self.kv.release(req.kv, req.final_kv_tokens)
        self._forget(req)  # and the draft state
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        if preempted:
            self.num_preemptions += 1
        else:
            self.num_retractions += 1
        enqueue(self.waiting, req, self.config.policy, front=True)

    def process_result(self, batch: ScheduledBatch, result: RunnerOutput) -> list[Req]:
        """Commit the computed KV, append sampled tokens, finish stopped requests.

        Returns the requests that received a new token (finished ones included; not
        those that finished while this step was in flight, whose result is dropped)."""
        dropped = set()
        scored = result.prompt_logprobs or ((),) * len(batch.reqs)
        for req, extend, prompt_logprobs in zip(batch.reqs, batch.extend_lens, scored, strict=True):
            if not self._step_landed(req):
                dropped.add(id(req))
                continue
            req.kv.committed += extend
            req.kv.assert_lengths(self.kv.row_width)
            req.prompt_logprobs.extend(prompt_logprobs)
            if extend > 1:  # a prefill chunk: share its pages now
                self.kv.share_computed(req.kv, req.final_kv_tokens[: req.cacheable_len])
        updated = []
        reqs = batch.sampled_reqs
        logprobs = result.logprobs or (None,) * len(reqs)
        for req, token, logprob in zip(reqs, result.next_token_ids, logprobs, strict=True):
            if id(req) in dropped:
                continue
            updated.append(req)
            req.append_output(token, logprob)
            reason = check_stop(req, self.config.eos_token_ids, self.config.context_length)
            if reason is not None:
                self.finish(req, reason)
        return updated

    def process_verify(
        self,
        batch: ScheduledBatch,
        new_tokens: tuple[tuple[int, ...], ...],
        new_logprobs: tuple = (),
    ) -> list[Req]:
        """Resolve a verify step: commit the root and accepted drafts, append the new
        tokens one by one under the stop rules (tokens past a stop are dropped; their KV
        stays over-allocated until the request is freed).  ``new_logprobs``: per request,
        its tokens' log-probs or None (``()``: nobody asked)."""
        updated = []
        new_logprobs = new_logprobs or (None,) * len(batch.reqs)
        for req, tokens, logprobs in zip(batch.reqs, new_tokens, new_logprobs, strict=True):
            if req.finished:  # finished while this step was in flight: drop its result
                return_preclaimed_slot(req.kv)
            if not self._step_landed(req):
                continue
            updated.append(req)
            resolve_committed(req.kv, len(tokens))
            req.spec_verify_steps += 1
            req.spec_accepted_tokens += len(tokens) - 1
            for i, token in enumerate(tokens):
                req.append_output(token, logprobs[i] if logprobs is not None else None)
                reason = check_stop(req, self.config.eos_token_ids, self.config.context_length)
                if reason is not None:  # tokens past the stop are dropped, so is their KV
                    pending_preclaims = req.inflight_steps
                    req.kv.committed = min(req.kv.committed, req.num_fill - 1 + pending_preclaims)
                    self.finish(req, reason)
                    break
            req.kv.assert_lengths(self.kv.row_width)
        return updated

    def _step_landed(self, req: Req) -> bool:
        """A step of ``req`` in flight is done: False if ``req`` finished meanwhile (the
        result is dropped; its KV is freed once no step of it is in flight)."""
        req.inflight_steps -= 1
        if not req.finished:
            return True
        if req.release_deferred and not req.inflight_steps:
            self._release(req)
        return False

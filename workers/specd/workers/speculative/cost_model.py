"""The cost model: whether a verify batch of this size speculates or runs plain (DESIGN §5).

Plain Python, no torch.  The engine feeds it the compute seconds of every verify step
(``SpecPolicy.observe``).  It keeps:

* per batch-size bucket (``batch_bucket``) and rung, the cost of a step per request
  from its newest ``COST_WINDOW`` times (``StepCost``): their median less the slowed
  ones (``typical``): steps that met a page fault, a GC pause or a busy neighbour must
  not decide for long, but what the engine pays for a rung is what its steps typically
  take, not their fastest (a verify's many short kernels meet the neighbours' noise
  more often than a plain step does);
* per speculating rung, an EMA of the accepted drafts per request, bonus excluded
  (acceptance does not depend on the batch size), moved by ``emaAlpha`` per verify batch
  of ``ACCEPTANCE_BATCH`` requests or more and by less for smaller ones; it starts as
  the plain mean of its first samples; a draft-free drafter also
  measures it on plain steps (``observe_accepted``), so a rung that lost on acceptance
  wins back as soon as its drafts would be accepted again;
* for a draft-free drafter (NGRAM, SUFFIX), also each request's own EMA of its
  accepted drafts (``own_accepted``, ``OWN_ALPHA``), from its verifies and shadow walks:
  such a drafter's acceptance is a property of each request's text, and a batch is
  weighed with its requests' own estimates (the rung's for a request that has none);
* an EMA of the seconds per token the draft took to catch up on deferred plain steps
  (``deferred_extend.py``): a cost of plain steps that they do not pay themselves.

A candidate's predicted throughput is::

    tokens/s per request = min(1 + accepted drafts, tokens left) / seconds per request
    plain:                 1 / (seconds per request + catch-up seconds per token)

where a request's tokens left are its ``max_tokens`` less its output so far: a verify's
tokens past them are dropped, so a request one or two tokens from its end gains nothing
from a deep tree (``tokens_per_verify``, averaged over the batch).  The bucket decides
on the uncapped predictions (its winner, margin and reruns are about the rungs' costs);
a batch whose capped gain then falls below plain's runs plain alone (``near_their_ends``),
and so does a batch in lockstep whose lead is under ``LOCKSTEP_MARGIN`` (``lockstep.py``).

and a batch runs the candidate with the higher prediction.  The candidates are the rung
the ladder offers (the adaptive controller's active rung, or the one configured) and the
plain rung.  Worked example (illustrative numbers), batch 8: a chain of 3 steps costs
9.1 ms per request and accepts 1.2 drafts -> 242 tokens/s; plain costs 3.5 ms -> 286
tokens/s: plain wins.  At batch 1 the chain costs 30 ms and plain 15 ms: 73 against 67.

A candidate the bucket has not measured runs first (an exploration): the speculating
rung, then plain, until each has ``MIN_SAMPLES`` step times, and the speculating rung
until its acceptance has the weight of ``ACCEPTANCE_BATCH`` requests (at batch 1, eight
verifies: ``acceptance_known``).  A rung's first step in a
bucket is dropped: it may pay one-time costs (a kernel compile, a first plan).  The loser
runs once more now and then (``rerun_loser``: after ``reexploreEvery`` decisions, backing
off while it keeps losing), so a cost or an acceptance that changed (another workload, a
warmer cache) can win back.

Buckets are narrow (the sizes in one are within a quarter of each other) because a
step's cost per request falls with the batch while its fixed part is shared: costs of
the two candidates measured at sizes far apart would compare badly.

A chain drafted by a model may also weigh each shorter chain (``chooseSteps``:
``chain_length.py``).

Costs measured far apart in time compare badly too: a step gets slower as its requests'
contexts grow (attention reads more KV), and the loser is measured only now and then.
So the model also keeps, per bucket and speculating rung, the ratio of its step cost to
plain's, from samples of the two taken within ``PAIRED_STEPS`` steps of each other
(``Bucket.ratios``), and compares the rungs at the newest measurement: the rung measured
last keeps its own cost, the other's is that scaled by the ratio.  A drift both rungs
share (all 32 requests of a batch at twice the context) then cannot flip the decision.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from specd.workers.contracts import CostCalibration
from specd.workers.rung import PLAIN, PlainReason, Rung
from specd.workers.speculative.acceptance import (
    ACCEPTANCE_BATCH,
    ChainAcceptance,
    Ema,
    acceptance_known,
)
from specd.workers.speculative.chain_length import fastest_chain, shorter_chains
from specd.workers.speculative.lockstep import LOCKSTEP_MARGIN, in_lockstep

FIRST_SAMPLES_DROPPED = 1  # step times per (bucket, rung) dropped as warm-up
MIN_SAMPLES = 2  # step times per (bucket, rung) before its cost counts
COST_WINDOW = 3  # the newest step times whose median is the cost
SHORT_BACKLOG = 8  # mean unread tokens per request at which a speculating rerun is cheap
MAX_BACKOFF = 16  # reruns of a loser that keeps losing come at most this x reexploreEvery apart
SWITCH_MARGIN = 0.05  # the lead that turns a bucket's decision from its last winner
PAIRED_STEPS = COST_WINDOW  # a bucket's steps within which two rungs' samples form a ratio
RATIO_WINDOW = 5  # the newest cost ratios whose median is a rung's ratio to plain
OWN_ALPHA = 0.5  # the weight of a request's newest sample in its own acceptance
OUTLIER_FACTOR = 1.5  # a step time this many times the window's fastest is noise (typical)


def typical(seconds: Sequence[float]) -> float:
    """The cost that step times say: their median once the slowed ones are dropped (over
    ``OUTLIER_FACTOR`` times the fastest).  Noise only ever adds time: a step that met a
    neighbour's burst, a page fault or a GC pause took 2-7x as long as its neighbours on
    the 2-core VM, while steps of one shape vary by a few percent.  A plain median of
    three is two such steps away from deciding: two slow verifies at the end of batch 1's
    exploration sent a 1.6x speculation to plain until its next rerun.  Nor is the
    fastest the cost: at a held 32 on the demo pair a verify's 85 ms and more are many
    short kernels that the neighbours' noise meets, and the fastest of three sat 9-12%
    below the mean of its steps (plain's 9% below to 1% above), so a chain no faster
    than plain per token kept winning."""
    fastest = min(seconds)
    return statistics.median([s for s in seconds if s <= OUTLIER_FACTOR * fastest])


@dataclass(slots=True)
class StepCost:
    """One (bucket, rung)'s step times per request and its cost from the newest ones
    (``typical``), once there are ``MIN_SAMPLES`` past the dropped warm-up (kept as
    ``value``)."""

    seen: int = 0
    window: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    at: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW))  # their bucket steps
    value: float | None = None

    def add(self, seconds_per_request: float, step: int = 0) -> bool:
        """Count a step's seconds per request (the bucket's ``step``-th); False for a
        dropped warm-up step."""
        self.seen += 1
        if self.seen <= FIRST_SAMPLES_DROPPED:
            return False
        self.window.append(seconds_per_request)
        self.at.append(step)
        if len(self.window) >= MIN_SAMPLES:
            self.value = typical(self.window)
        return True

    @property
    def step(self) -> int:
        """The bucket's step count at the newest counted sample (``window[-1]``)."""
        return self.at[-1] if self.at else 0

    def recent(self) -> float | None:
        """The cost (``typical``) of the samples taken within ``PAIRED_STEPS`` bucket
        steps of the newest, less the slowed ones (over ``OUTLIER_FACTOR`` times the window's fastest):
        the cost now; None when every recent sample was slowed (a page fault, a
        neighbour's burst), so that no ratio is formed from noise alone."""
        newest, ceiling = self.step - PAIRED_STEPS, OUTLIER_FACTOR * min(self.window)
        recent = [
            s for s, at in zip(self.window, self.at, strict=True) if at >= newest and s <= ceiling
        ]
        return typical(recent) if recent else None


@dataclass(slots=True)
class Bucket:
    """One batch-size bucket: its rungs' costs and its decisions so far."""

    costs: dict[Rung, StepCost] = field(default_factory=dict)
    decisions: int = 0  # made on measurements (explorations not counted)
    best: Rung | None = None  # the last decision's winner
    last_rerun: int = 0  # decisions made at the loser's last rerun
    interval: int = 0  # decisions between the loser's reruns (0: reexploreEvery)
    steps: int = 0  # observed so far
    rival: Rung | None = None  # the speculating rung the last decision weighed plain against
    chain: Rung | None = None  # the chain length the last decision chose (``choose_chain``)
    # speculating rung -> its step cost / plain's, from samples taken close together
    ratios: dict[Rung, deque] = field(default_factory=dict)

    def pair(self, measured: Rung) -> None:
        """``measured`` just counted a sample: with each other side (plain, or the
        speculating rungs) whose newest sample is within ``PAIRED_STEPS`` steps, it forms
        a cost ratio of their recent costs (``StepCost.recent``), unless one side's
        recent samples were all slowed."""
        plain = self.costs.get(PLAIN)
        if plain is None or not plain.window:
            return
        spec_rungs = [measured] if measured.speculates else [r for r in self.costs if r.speculates]
        for rung in spec_rungs:
            spec = self.costs[rung]
            if not spec.window or abs(spec.step - plain.step) > PAIRED_STEPS:
                continue
            spec_now, plain_now = spec.recent(), plain.recent()
            if spec_now is not None and plain_now is not None:
                self.ratios.setdefault(rung, deque(maxlen=RATIO_WINDOW)).append(
                    spec_now / plain_now
                )

    def current_costs(self, rung: Rung) -> tuple[float | None, float | None]:
        """(``rung``'s, plain's) seconds per request as of the newest measurement: the
        one measured last as measured, the other scaled from it by their cost ratio
        (their own medians until a ratio exists)."""
        spec, plain = self.costs.get(rung), self.costs.get(PLAIN)
        spec_value = None if spec is None else spec.value
        plain_value = None if plain is None else plain.value
        ratios = self.ratios.get(rung)
        if spec_value is None or plain_value is None or not ratios:
            return spec_value, plain_value
        ratio = statistics.median(ratios)
        if plain.step >= spec.step:
            return ratio * plain_value, plain_value
        return spec_value, spec_value / ratio


def winner_and_loser(
    rung: Rung, speculated: float, plain: float, last: Rung | None
) -> tuple[Rung, Rung]:
    """The decision between ``rung`` and plain from their predicted tokens per second:
    the faster, except that after plain (``last``, the last decision's winner) the rung
    needs a lead of ``SWITCH_MARGIN``.  A switch is not free (speculating again makes the
    draft read the plain steps' backlog first), and near a tie the band keeps the last
    winner.  The band lies on speculation's side: once it predicts no more than plain,
    it stops.  Speculating costs what a verify's step time does not show (its requests
    end at different steps, so more prefill steps read one or two prompts each), and a
    band on both sides let a rung slower by up to the margin keep the batch."""
    if last == PLAIN:
        speculates = speculated >= plain * (1.0 + SWITCH_MARGIN)
    else:
        speculates = speculated >= plain
    return (rung, PLAIN) if speculates else (PLAIN, rung)


def tokens_per_verify(
    accepted: float, tokens_left: Sequence[int] = (), own: Sequence[float | None] = ()
) -> float:
    """The tokens a step adds per request, averaged over the batch: its accepted drafts
    (its ``own`` estimate where it has one, else ``accepted``, the rung's; plain: 0) and
    the bonus, but no more than it may still produce (``tokens_left``: its
    ``max_tokens`` less its output; a verify's tokens past that are dropped).  Neither
    given: ``1 + accepted``."""
    size = max(len(tokens_left), len(own))
    if not size:
        return 1.0 + accepted
    gains = [1.0 + (accepted if mine is None else mine) for mine in own or [None] * size]
    if tokens_left:
        gains = [min(g, max(left, 1)) for g, left in zip(gains, tokens_left, strict=True)]
    return sum(gains) / size


def with_reason(rung: Rung) -> tuple[Rung, PlainReason | None]:
    """A cost model's choice of ``rung`` with its reason: ``COST`` for plain (the bucket's
    winner or an exploration of it), None for a speculating rung."""
    return rung, None if rung.speculates else PlainReason.COST


def batch_bucket(batch_size: int) -> int:
    """The largest batch size of ``batch_size``'s bucket: each size up to 8, then four
    buckets per doubling (10, 12, 14, 16, 20, 24, 28, 32, 40, ...), so the sizes sharing a
    bucket are within a quarter of its largest."""
    quantum = 1 << max((batch_size - 1).bit_length() - 3, 0)
    return -(-batch_size // quantum) * quantum


class CostModel:
    """Measured step costs and acceptance -> speculate or not, per batch-size bucket.

    ``params`` is ``speculative.policy.costModel`` (``CostModelSpec``)."""

    def __init__(
        self,
        params,
        per_request: bool = False,
        fixed_width: bool = False,
        chain_steps: bool = False,
    ):
        """``per_request``: also keep each request's own acceptance (``own_accepted``).
        ``fixed_width``: every verify of a rung has one width (a draft model's trees;
        draft-free drafters verify ragged batches), so made-up batches measure it at
        load (``SpecPolicy.calibrates``).  ``chain_steps``: a chain also weighs its
        shorter chains (``choose_chain``; a draft model's chains, not hybrid ones)."""
        self.params = params
        self.fixed_width = fixed_width
        self._chain = ChainAcceptance(params.ema_alpha) if chain_steps else None
        self._buckets: dict[int, Bucket] = {}  # by largest batch size
        self._accepted: dict[Rung, Ema] = {}  # speculating rung -> accepted drafts
        # rid -> (the rung, the request's own accepted drafts at it)
        self._own: dict[str, tuple[Rung, Ema]] | None = {} if per_request else None
        self._catch_up = Ema(params.ema_alpha)  # draft seconds per deferred token
        self.explorations = 0
        self.calibration: CostCalibration | None = None  # the load's, once run

    def seconds_per_request(
        self, bucket: int, rung: Rung, against: Rung | None = None
    ) -> float | None:
        """A verify step's seconds per request, as of the bucket's newest measurement
        (``costs``; plain's as weighed against the speculating rung ``against``, by
        default the last decision's); plain's includes the draft's catch-up on the
        tokens it deferred."""
        state = self._buckets.get(bucket)
        if rung.speculates:
            return self.costs(bucket, rung)[0]
        against = against or (state.rival if state is not None else None)
        if against is not None:
            seconds = self.costs(bucket, against)[1]
        else:
            cost = None if state is None else state.costs.get(PLAIN)
            seconds = None if cost is None else cost.value
        return None if seconds is None else seconds + (self._catch_up.value or 0.0)

    def costs(self, bucket: int, rung: Rung) -> tuple[float | None, float | None]:
        """(``rung``'s, plain's) seconds per request in ``bucket``: its own measurements
        (``Bucket.current_costs``), with what it lacks filled in from the measured
        buckets around it (``interpolated``): a side it measured keeps its cost and the
        other follows by their interpolated ratio."""
        state = self._buckets.get(bucket)
        spec, plain = (None, None) if state is None else state.current_costs(rung)
        if spec is not None and plain is not None:
            return spec, plain
        guess = self.interpolated(bucket, rung)
        if guess is None:
            return spec, plain
        ratio = guess[0] / guess[1]
        if spec is not None:
            return spec, spec / ratio
        if plain is not None:
            return plain * ratio, plain
        return guess

    def interpolated(self, bucket: int, rung: Rung) -> tuple[float, float] | None:
        """(``rung``'s, plain's) seconds per request in ``bucket`` from the nearest
        buckets below and above it where both are measured: a step's time is a fixed
        part plus a part per request, so each rung's step time lies on the line between
        theirs.  None unless ``bucket`` lies between two such buckets: a calibration at
        1, 8 and 32 (``engine/calibration.py``) so spares the sizes between them their
        explorations (a ragged tail meets one new bucket after another)."""
        below = above = None
        for size, state in self._buckets.items():
            measured = state.current_costs(rung)
            if size == bucket or None in measured:
                continue
            if size < bucket and (below is None or size > below[0]):
                below = (size, *measured)
            elif size > bucket and (above is None or size < above[0]):
                above = (size, *measured)
        if below is None or above is None:
            return None
        (low, *low_costs), (high, *high_costs) = below, above
        share = (bucket - low) / (high - low)
        return tuple(
            ((1 - share) * low * a + share * high * b) / bucket
            for a, b in zip(low_costs, high_costs, strict=True)
        )

    def accepted_drafts(self, rung: Rung) -> float | None:
        """The rung's accepted drafts per request; None until ``ACCEPTANCE_BATCH``
        requests' worth of verifies measured it (``acceptance_known``)."""
        if not rung.speculates:
            return 0.0
        if self._chain is not None and rung.topk == 1:
            return self._chain.accepted(rung.steps)
        ema = self._accepted.get(rung)
        return ema.value if acceptance_known(ema) else None

    def own_accepted(self, rids: Sequence[str], rung: Rung) -> list[float | None]:
        """Each request's own accepted drafts at ``rung`` (None: none measured, or not
        kept).  A draft-free drafter's acceptance is a property of each request's text
        and moves within it (NGRAM: a request starts repeating itself, or copying its
        context, then stops); the rung's one estimate carries the end of some requests
        into the start of others."""
        if self._own is None or not rung.speculates:
            return []
        held = [self._own.get(rid) for rid in rids]
        return [None if h is None or h[0] != rung else h[1].value for h in held]

    @property
    def requests_tracked(self) -> int:
        """Requests whose own acceptance is kept now."""
        return 0 if self._own is None else len(self._own)

    def forget(self, rid: str) -> None:
        """``rid`` is done: drop its own acceptance."""
        if self._own is not None:
            self._own.pop(rid, None)

    def predicted_tokens_per_second(
        self,
        bucket: int,
        rung: Rung,
        against: Rung | None = None,
        tokens_left: Sequence[int] = (),
        own: Sequence[float | None] = (),
    ) -> float | None:
        """Tokens per second per request if a batch of ``bucket`` ran ``rung`` (plain:
        as weighed against ``against``, see ``seconds_per_request``), for requests with
        ``tokens_left`` and ``own`` acceptance (``tokens_per_verify``; none given: the
        rung's, uncapped); None until both the step's cost and the rung's acceptance
        are measured."""
        seconds = self.seconds_per_request(bucket, rung, against)
        accepted = self.accepted_drafts(rung)
        if seconds is None or accepted is None:
            return None
        return tokens_per_verify(accepted, tokens_left, own if rung.speculates else ()) / seconds

    def choose(
        self,
        batch_size: int,
        rung: Rung,
        backlog: float = 0.0,
        tokens_left: Sequence[int] = (),
        rids: Sequence[str] = (),
    ) -> tuple[Rung, PlainReason | None]:
        """-> (``rung`` (a speculating one) or ``PLAIN``, why plain; None when it
        speculates) for a verify batch of ``batch_size`` whose requests have a mean of
        ``backlog`` tokens the draft has not read and may each produce ``tokens_left``
        more (empty: not known); ``rids``: theirs, for their own acceptance where it is
        kept (``own_accepted``).  Plain is ``END`` when the batch runs plain only because
        its requests are near their ends, ``LOCKSTEP`` when only because they decode in
        lockstep (`in_lockstep`) and speculation leads by less than ``LOCKSTEP_MARGIN``,
        else ``COST``."""
        bucket = batch_bucket(batch_size)
        rung = self.choose_chain(bucket, rung)
        own = self.own_accepted(rids, rung)
        speculated = self.predicted_tokens_per_second(bucket, rung, own=own)
        plain = self.predicted_tokens_per_second(bucket, PLAIN, against=rung)
        if speculated is None:
            return self._explore(rung)
        if plain is None:
            return self._explore(PLAIN)
        state = self._buckets.setdefault(bucket, Bucket())  # new: its costs interpolated
        best, loser = winner_and_loser(rung, speculated, plain, state.best)
        state.rival = rung
        every = self.params.reexplore_every
        if state.best not in (None, best):  # the winner changed: rerun soon again
            state.interval = every
        state.best = best
        state.decisions += 1
        lockstep = in_lockstep(tokens_left)
        if self.rerun_loser(state, loser, backlog, lockstep):
            state.last_rerun = state.decisions
            state.interval = min(2 * (state.interval or every), MAX_BACKOFF * every)
            return self._explore(loser)
        if best.speculates and self.near_their_ends(bucket, rung, plain, tokens_left, own):
            return PLAIN, PlainReason.END  # this batch only: its requests end first
        if best.speculates and lockstep and speculated < plain * (1.0 + LOCKSTEP_MARGIN):
            return PLAIN, PlainReason.LOCKSTEP  # this batch only: kept in lockstep
        return with_reason(best)

    def chain_candidates(self, rung: Rung) -> list[Rung]:
        """The speculating rungs a batch offered ``rung`` may run: every chain of 1 to
        its steps where ``chain_steps`` holds and it is a chain, else ``rung`` alone."""
        return [rung] if self._chain is None else shorter_chains(rung)

    def choose_chain(self, bucket: int, rung: Rung) -> Rung:
        """The chain length (``chain_candidates``) that ``bucket`` predicts the most
        tokens per second from, to weigh against plain: accepted drafts from
        ``ChainAcceptance``, cost ratios to plain measured (``costs``) or on the line
        through the measured ones (``ratio_on_line``).  ``rung`` itself until some chain
        is measured here or around and every depth's acceptance is known, and once in
        ``reexploreEvery`` verifies (``ChainAcceptance.stale``); the last choice stays
        unless another is ``SWITCH_MARGIN`` ahead."""
        candidates = self.chain_candidates(rung)
        if len(candidates) == 1 or self._chain.stale(rung.steps, self.params.reexplore_every):
            return rung  # a stale chain: this batch refreshes every depth
        accepted = {c: self.accepted_drafts(c) for c in candidates}
        if None in accepted.values():
            return rung
        measured = {}
        for c in candidates:
            spec, plain = self.costs(bucket, c)
            if spec is not None and plain is not None:
                measured[c.steps] = spec / plain
        if not measured:
            return rung
        state = self._buckets.setdefault(bucket, Bucket())
        state.chain = fastest_chain(accepted, measured, state.chain, SWITCH_MARGIN)
        return state.chain

    def near_their_ends(
        self,
        bucket: int,
        rung: Rung,
        plain: float,
        tokens_left: Sequence[int],
        own: Sequence[float | None] = (),
    ) -> bool:
        """Whether the batch's requests are so near their ``max_tokens`` that ``rung``
        (the bucket's winner), its gain per request capped by the tokens each may still
        produce (``tokens_per_verify``), makes fewer tokens per second than plain's
        ``plain``."""
        if not tokens_left:
            return False
        capped = self.predicted_tokens_per_second(bucket, rung, tokens_left=tokens_left, own=own)
        return capped is not None and capped < plain

    def rerun_loser(self, state: Bucket, loser: Rung, backlog: float, lockstep: bool) -> bool:
        """Whether the loser runs once more: ``reexploreEvery`` decisions after the
        winner last changed, then twice as long after each rerun it lost (up to
        ``MAX_BACKOFF`` times), since a rerun of a speculating loser at a large batch
        can cost several plain steps.  A speculating loser also waits for a batch whose
        backlog is short (up to as long again): speculating makes the draft read every
        request's backlog first; and for one not in ``lockstep`` (`in_lockstep`),
        which one verify would spread."""
        since = state.decisions - state.last_rerun
        interval = state.interval or self.params.reexplore_every
        if not loser.speculates:
            return since >= interval
        if lockstep:
            return False
        return since >= 2 * interval or (since >= interval and backlog <= SHORT_BACKLOG)

    def _explore(self, rung: Rung) -> tuple[Rung, PlainReason | None]:
        self.explorations += 1
        return with_reason(rung)

    def observe(
        self,
        batch_size: int,
        rung: Rung,
        seconds: float,
        accepted: Sequence[int],
        rids: Sequence[str | None] = (),
    ) -> None:
        """One verify step of ``batch_size`` requests at ``rung`` took ``seconds`` of
        compute; ``accepted``: its accepted drafts per request, of ``rids`` (ignored on
        the plain rung)."""
        if batch_size <= 0 or not seconds > 0:
            return
        state = self._buckets.setdefault(batch_bucket(batch_size), Bucket())
        state.steps += 1
        cost = state.costs.get(rung)
        if cost is None:
            cost = state.costs[rung] = StepCost()
        if cost.add(seconds / batch_size, state.steps):
            state.pair(rung)
        self.observe_accepted(rung, accepted, rids)

    def samples(self, batch_size: int, rung: Rung) -> int:
        """Step times seen so far for ``batch_size``'s bucket at ``rung`` (warm-up
        included)."""
        state = self._buckets.get(batch_bucket(batch_size))
        cost = None if state is None else state.costs.get(rung)
        return 0 if cost is None else cost.seen

    def observe_accepted(
        self, rung: Rung, accepted: Sequence[int], rids: Sequence[str | None] = ()
    ) -> None:
        """Accepted drafts per request (of ``rids``, where given; None: a request that
        is done) at a speculating ``rung``: a verify's, or walks of its draft measured
        on plain steps (``ngram_decoder.py``)."""
        if not (rung.speculates and accepted):
            return
        ema = self._accepted.setdefault(rung, Ema(self.params.ema_alpha))
        ema.add(sum(accepted) / len(accepted), min(len(accepted) / ACCEPTANCE_BATCH, 1.0))
        if self._chain is not None and rung.topk == 1:
            self._chain.add(accepted, rung.steps)
        if self._own is None or not rids:
            return
        for rid, n in zip(rids, accepted, strict=True):
            if rid is None:  # a request that is done
                continue
            held = self._own.get(rid)
            if held is None or held[0] != rung:
                held = self._own[rid] = (rung, Ema(OWN_ALPHA))
            held[1].add(n)

    def observe_catch_up(self, seconds: float, tokens: int) -> None:
        """The draft read ``tokens`` deferred tokens in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self._catch_up.add(seconds / tokens)

    def status(self) -> dict:
        """Per bucket measured so far: each rung's cost and prediction, and the winner."""
        return {
            "calibration": None if self.calibration is None else self.calibration.model_dump(),
            "explorations": self.explorations,
            "catch_up_seconds_per_token": _rounded(self._catch_up.value, 7),
            "accepted_drafts": [
                {**_rung_fields(r), "accepted_drafts": _rounded(e.value)}
                for r, e in sorted(self._accepted.items(), key=lambda item: item[0].steps)
            ],
            "buckets": [self._bucket_status(b) for b in sorted(self._buckets)],
            "chain_acceptance": self._chain_shares(),
        }

    def _chain_shares(self) -> list[float | None]:
        return [] if self._chain is None else [_rounded(p) for p in self._chain.shares()]

    def _bucket_status(self, bucket: int) -> dict:
        state = self._buckets[bucket]
        return {
            "max_batch": bucket,
            "decisions": state.decisions,
            "best_steps": None if state.best is None else state.best.steps,
            "chain_steps": None if state.chain is None else state.chain.steps,
            "rungs": [
                {
                    **_rung_fields(r),
                    "seconds_per_request": _rounded(self.seconds_per_request(bucket, r), 7),
                    "tokens_per_second": _rounded(self.predicted_tokens_per_second(bucket, r), 2),
                }
                for r in sorted(state.costs, key=lambda r: r.steps)
            ],
        }


def _rung_fields(rung: Rung) -> dict:
    return {"steps": rung.steps, "topk": rung.topk, "draft_tokens": rung.draft_tokens}


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)

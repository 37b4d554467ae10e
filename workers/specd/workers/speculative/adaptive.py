"""Adaptive and load-aware speculation: which rung a verify batch drafts with (DESIGN §5).

Plain Python, no torch.  The engine asks ``SpecPolicy.choose`` when it schedules a
verify batch (the rung is then fixed on the batch, so overlap scheduling is unaffected)
and feeds the batch's acceptance back with ``SpecPolicy.observe`` when it processes it.
KV sizing never looks at the active rung: it is always the widest (seed 003).

The rule (``AdaptiveController``; field names are ``speculative.adaptive``'s):

* One observation per verify batch: the mean over its requests of accepted drafts
  (bonus excluded) divided by the batch's steps.  A plain (steps 0) batch drafts
  nothing; its observation is the probe: whether the draft's top-1 guess from its stored
  state equalled the token the target produced (one step, accepted or not).
* ``rate = (1 - emaAlpha) * rate + emaAlpha * observation``; the first observation seeds
  it.  ``ema = rate * max(steps, 1)`` is the same estimate in accepted drafts per verify
  at the active rung.  Keeping it as a rate lets a batch scheduled at another rung (under
  overlap, one scheduled before a move) and the move itself carry over unconverted.
* No decision during the first ``warmupBatches`` batches; after that, one decision every
  ``updateInterval`` batches: an up vote if ``rate >= upThreshold``, a down vote if
  ``rate < downThreshold``, else no vote.  ``upHysteresis`` consecutive up votes move one
  rung up, ``downHysteresis`` consecutive down votes one rung down; any other decision
  breaks the streak, and a move clears both.  The ladder clamps: up votes at the top
  rung (down votes at the bottom) move nothing.

When a speculating rung is active, ``speculative.policy`` may still run a batch plain:
the cost model (``cost_model.py``, the default) where it predicts more tokens per second
from plain decode at the batch's size, or, when set, ``maxBatchForSpec``: a fixed
threshold on the batch's requests that overrides it.  Such batches do not feed the
controller: they measure the load, not the draft.
"""

from __future__ import annotations

from collections.abc import Sequence

from specd.workers.rung import PLAIN, PlainReason, Rung
from specd.workers.speculative.acceptance import Ema
from specd.workers.speculative.cost_model import CostModel, with_reason


def chooses_chain_steps(speculative, draft_free: bool) -> bool:
    """Whether the cost model weighs shorter chains (``costModel.chooseSteps``): a
    draft model's chains, not a draft-free drafter's (ragged proposals) or a hybrid's
    (suffix trees beside the chain)."""
    return (
        speculative.policy.cost_model.choose_steps and not draft_free and speculative.suffix is None
    )


class AdaptiveController:
    """Moves the active rung along ``ladder`` (narrowest first) by measured acceptance.

    ``params`` is ``speculative.adaptive`` (``AdaptiveSpec``)."""

    def __init__(self, ladder: Sequence[Rung], initial: Rung, params):
        if not ladder or list(ladder) != sorted(ladder, key=lambda r: r.steps):
            raise ValueError(f"the ladder must be non-empty, narrowest first: {ladder}")
        self.ladder = tuple(ladder)
        self.index = self.ladder.index(initial)
        self.params = params
        self._rate = Ema(params.ema_alpha)  # of accepted drafts / steps
        self.batches = 0  # verify batches observed
        self.changes = 0  # rung moves so far
        self._up_votes = 0
        self._down_votes = 0

    @property
    def rung(self) -> Rung:
        return self.ladder[self.index]

    @property
    def rate(self) -> float | None:
        """The acceptance rate: an EMA of accepted drafts / steps (None before any)."""
        return self._rate.value

    @property
    def ema(self) -> float | None:
        """Accepted drafts per verify at the active rung (the probe hit rate at steps 0)."""
        return None if self.rate is None else self.rate * max(self.rung.steps, 1)

    def observe(self, rung: Rung, accepted: Sequence[int]) -> bool:
        """One verify batch run at ``rung``: accepted drafts per request (probe hits, 0
        or 1, on the plain rung).  Returns True when the active rung moved."""
        if not accepted:
            return False
        self._rate.add(sum(accepted) / len(accepted) / max(rung.steps, 1))
        self.batches += 1
        after_warmup = self.batches - self.params.warmup_batches
        if after_warmup <= 0 or after_warmup % self.params.update_interval:
            return False
        return self._decide()

    def _decide(self) -> bool:
        up = self.rate >= self.params.up_threshold
        down = self.rate < self.params.down_threshold
        self._up_votes = self._up_votes + 1 if up else 0
        self._down_votes = self._down_votes + 1 if down else 0
        step = 0
        if self._up_votes >= self.params.up_hysteresis and self.index + 1 < len(self.ladder):
            step = 1
        elif self._down_votes >= self.params.down_hysteresis and self.index > 0:
            step = -1
        if not step:
            return False
        self.index += step
        self.changes += 1
        self._up_votes = self._down_votes = 0
        return True


class SpecPolicy:
    """The engine's one place that picks a verify batch's rung: the adaptive controller's
    active rung (or the one configured rung), or the plain rung where the cost model or
    the load threshold says so.

    ``speculative`` is ``DeploymentSpec.speculative`` (``SpeculativeSpec``)."""

    def __init__(self, speculative, draft_free: bool = False):
        """``draft_free``: NGRAM or SUFFIX drafts, so the cost model keeps each request's
        own acceptance (``CostModel.own_accepted``) and weighs ragged verifies."""
        self.fixed = speculative.initial_rung
        self.controller = (
            AdaptiveController(speculative.ladder, speculative.initial_rung, speculative.adaptive)
            if speculative.adaptive.enabled
            else None
        )
        policy = speculative.policy
        self.max_batch_for_spec = policy.max_batch_for_spec
        self.cost_model = (
            CostModel(
                policy.cost_model,
                per_request=draft_free,
                fixed_width=not draft_free,
                chain_steps=chooses_chain_steps(speculative, draft_free),
            )
            if policy.uses_cost_model
            else None
        )
        # while set, the load's calibration (``engine/calibration.py``): every verify batch
        # runs this rung and only its step cost is measured
        self.calibrating: Rung | None = None

    @property
    def calibrates(self) -> bool:
        """Whether the cost model's step costs can be measured at load: it decides, and
        a draft model drafts (a verify's width does not depend on the text; a draft-free
        drafter's made-up prompts would match nothing and verify root-only)."""
        return self.cost_model is not None and self.cost_model.fixed_width

    @property
    def active(self) -> Rung:
        return self.controller.rung if self.controller is not None else self.fixed

    def choose(
        self,
        batch_size: int,
        backlog: float = 0.0,
        tokens_left: Sequence[int] = (),
        rids: Sequence[str] = (),
    ) -> tuple[Rung, PlainReason | None]:
        """-> (the rung a verify batch of ``batch_size`` requests runs, why it is plain;
        None when it speculates).  ``backlog``: the mean tokens per request the draft has
        not read (``deferred_extend.py``); ``tokens_left``: per request, the tokens it
        may still produce (``cost_model.tokens_per_verify``); ``rids``: theirs."""
        if self.calibrating is not None:
            return with_reason(self.calibrating)
        rung = self.active
        if not rung.speculates:
            return rung, PlainReason.RUNG
        limit = self.max_batch_for_spec
        if limit is not None and batch_size > limit:
            return PLAIN, PlainReason.LOAD
        if self.cost_model is not None:
            return self.cost_model.choose(batch_size, rung, backlog, tokens_left, rids)
        return rung, None

    def observe(
        self,
        rung: Rung,
        plain_reason: PlainReason | None,
        accepted: Sequence[int],
        seconds: float,
        batch_size: int,
        rids: Sequence[str | None] = (),
    ) -> None:
        """Feed a processed batch of ``batch_size`` requests (``rids``): its accepted
        drafts per request (probe hits on the plain rung, none when it skipped the
        probe) and its compute seconds.  While calibrating only the seconds count: a
        made-up prompt's acceptance says nothing of real text."""
        if self.calibrating is not None:
            self.cost_model.observe(batch_size, rung, seconds, ())
            return
        if self.cost_model is not None:
            self.cost_model.observe(batch_size, rung, seconds, accepted, rids)
        for_ladder = plain_reason in (None, PlainReason.RUNG) and not self.shortened(rung)
        if self.controller is not None and for_ladder:
            self.controller.observe(rung, accepted)

    def shortened(self, rung: Rung) -> bool:
        """Whether ``rung`` is a shorter chain the cost model chose in place of the
        active one (``CostModel.choose_chain``): its acceptance per step is higher than
        the active rung's, so the adaptive controller must not read it as the ladder's."""
        active = self.active
        return (
            self.cost_model is not None
            and rung != active
            and rung in self.cost_model.chain_candidates(active)
        )

    def observe_shadow(
        self, rung: Rung, accepted: Sequence[int], rids: Sequence[str | None]
    ) -> None:
        """Drafts ``rung`` would have accepted in requests ``rids``, measured on plain
        steps."""
        if self.cost_model is not None:
            self.cost_model.observe_accepted(rung, accepted, rids)

    def forget(self, rid: str) -> None:
        """``rid`` is done (its own acceptance goes)."""
        if self.cost_model is not None:
            self.cost_model.forget(rid)

    def observe_catch_up(self, seconds: float, tokens: int) -> None:
        """The draft caught up on ``tokens`` deferred by plain steps in ``seconds``."""
        if self.cost_model is not None:
            self.cost_model.observe_catch_up(seconds, tokens)

    def status(self) -> dict:
        rung, c = self.active, self.controller
        return {
            "enabled": c is not None,
            "steps": rung.steps,
            "topk": rung.topk,
            "draft_tokens": rung.draft_tokens,
            "ema": None if c is None or c.ema is None else round(c.ema, 4),
            "acceptance_rate": None if c is None or c.rate is None else round(c.rate, 4),
            "batches": 0 if c is None else c.batches,
            "rung_changes": 0 if c is None else c.changes,
            "max_batch_for_spec": self.max_batch_for_spec,
            "cost_model": None if self.cost_model is None else self.cost_model.status(),
        }

"""`spec.draft` and `spec.speculative`: the drafter, draft steps, tree shape, adaptive
steps, the load policy and NGRAM's match lengths, with the rules that tie numSteps, topk
and numDraftTokens together."""

from __future__ import annotations

from enum import Enum
from functools import cached_property
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema, model_validator

from specd.workers.rung import Rung
from specd.workers.spec_model import DType, SpecModel, SubfieldError


class DraftAlgorithm(str, Enum):
    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"
    NGRAM = "NGRAM"  # prompt lookup over the request's own tokens: no draft model
    SUFFIX = "SUFFIX"  # suffix decoding: the request's tokens and the replica's outputs

    @property
    def has_model(self) -> bool:
        """Whether this algorithm drafts with a model loaded from ``spec.draft.path``."""
        return self not in (DraftAlgorithm.NGRAM, DraftAlgorithm.SUFFIX)


# drafters with no draft model: they propose from tokens
DRAFT_FREE = (DraftAlgorithm.NGRAM, DraftAlgorithm.SUFFIX)
# drafters that take spec.speculative.suffix: SUFFIX itself, and a draft model (hybrid)
SUFFIXED = (DraftAlgorithm.SUFFIX, DraftAlgorithm.EAGLE, DraftAlgorithm.EAGLE3)


class DraftSpec(SpecModel):
    path: str | None = Field(
        None,
        min_length=1,
        description="Local folder of the draft head (EAGLE, EAGLE3); NGRAM and SUFFIX take none",
    )
    algorithm: DraftAlgorithm = DraftAlgorithm.EAGLE
    token_map: str | None = Field(
        None,
        min_length=1,
        description="EAGLE: a file of the target token ids the draft may propose (a JSON "
        "list, or a torch-saved 1-D tensor as SGLang's --speculative-token-map); the draft's "
        "lm_head keeps only their rows. Outputs are unchanged",
    )
    dtype: DType = Field(
        DType.auto,
        description="The draft's weights and activations. auto: bfloat16 beside a float32 "
        "target on a CPU with AVX512-BF16 or AMX (2-4x faster draft steps, outputs "
        "unchanged; under tensor parallelism, on every rank's CPU), the target's dtype "
        "everywhere else. On CUDA, the target's only",
    )

    @model_validator(mode="after")
    def _path_matches_algorithm(self) -> DraftSpec:
        name = self.algorithm.value
        if self.algorithm.has_model and self.path is None:
            raise SubfieldError("path", f"{name} drafts with a model: give its local folder")
        if not self.algorithm.has_model and self.path is not None:
            raise SubfieldError("path", f"{name} drafts from tokens, not a model: leave path out")
        if self.token_map is not None and self.algorithm is not DraftAlgorithm.EAGLE:
            raise SubfieldError(
                "tokenMap",
                f"a token map restricts an EAGLE draft's lm_head; {name} has "
                + ("its own vocabulary map (d2t)" if self.algorithm.has_model else "no draft model")
                + ": leave tokenMap out",
            )
        return self


class CandidateRung(SpecModel):
    """One adaptive rung written out; topk / numDraftTokens left out come from the spec."""

    steps: int = Field(ge=0, le=16, description="Draft steps (0 = plain decode)")
    topk: int | None = Field(None, ge=1, le=16)
    num_draft_tokens: int | None = Field(None, ge=2, le=256)


def _steps_as_rung(value: Any) -> Any:
    return {"steps": value} if isinstance(value, int) and not isinstance(value, bool) else value


# An entry is either an int (steps) or {steps, topk, numDraftTokens}.  Kubernetes
# schemas have no int-or-object type, so the CRD keeps the item free-form and the
# operator (pydantic) validates it.
CandidateStep = Annotated[
    CandidateRung,
    BeforeValidator(_steps_as_rung),
    WithJsonSchema(
        {
            "description": "steps (an integer), or {steps, topk, numDraftTokens}",
            "x-kubernetes-preserve-unknown-fields": True,
        }
    ),
]


class AdaptiveSpec(SpecModel):
    """Adaptive speculation: the draft steps follow the acceptance rate along candidateSteps."""

    enabled: bool = False
    candidate_steps: list[CandidateStep] = Field(
        default_factory=list, description="The ladder, narrowest first (steps ascending)"
    )
    ema_alpha: float = Field(0.2, gt=0, le=1, description="Weight of the newest verify batch")
    warmup_batches: int = Field(8, ge=0, description="Verify batches before any decision")
    update_interval: int = Field(4, ge=1, description="Verify batches between decisions")
    up_threshold: float = Field(
        0.8, gt=0, le=1, description="Vote up at an acceptance rate (accepted/steps) >= this"
    )
    down_threshold: float = Field(
        0.3, ge=0, le=1, description="Vote down at an acceptance rate below this"
    )
    up_hysteresis: int = Field(2, ge=1, description="Consecutive up votes to move up")
    down_hysteresis: int = Field(1, ge=1, description="Consecutive down votes to move down")

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> AdaptiveSpec:
        if self.down_threshold > self.up_threshold:
            raise ValueError(
                f"downThreshold ({self.down_threshold}) must not exceed upThreshold "
                f"({self.up_threshold})"
            )
        return self


class CostModelSpec(SpecModel):
    """The measured cost model: per batch, speculate only where it predicts more tokens
    per second than plain decode (``speculative/cost_model.py``)."""

    enabled: bool = Field(
        True, description="Pick speculation or plain decode per verify batch by measured cost"
    )
    ema_alpha: float = Field(
        0.2,
        gt=0,
        le=1,
        description="Weight of the newest verify batch in the acceptance estimate",
    )
    reexplore_every: int = Field(
        64,
        ge=2,
        le=100_000,
        description="Decisions per batch-size bucket between re-runs of the losing choice",
    )
    choose_steps: bool = Field(
        False,
        description="A chain (topk 1) drafted by a model: also weigh each shorter chain "
        "(1 to numSteps draft steps) per batch-size bucket and run the fastest; a "
        "shorter chain's acceptance follows from the chain's own (its first drafts)",
    )
    calibration_batch_sizes: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        [1, 8, 32],
        max_length=8,
        description="Batch sizes whose speculating and plain step costs are measured at "
        "load, on made-up prompts, before the replica serves (a draft model's drafters; "
        "sizes above maxRunningRequests run at that size); [] learns them online "
        "only",
    )


class SpeculationPolicySpec(SpecModel):
    """When a verify batch speculates: the cost model decides, unless maxBatchForSpec
    sets a fixed threshold."""

    max_batch_for_spec: int | None = Field(
        None,
        ge=1,
        description="A verify batch with more requests runs plain decode (steps 0); "
        "overrides the cost model",
    )
    cost_model: CostModelSpec = Field(default_factory=CostModelSpec)

    @property
    def uses_cost_model(self) -> bool:
        """The cost model decides (maxBatchForSpec, when set, overrides it)."""
        return self.cost_model.enabled and self.max_batch_for_spec is None


class NgramSpec(SpecModel):
    """NGRAM drafting (prompt lookup): the request's last n tokens, for the longest n in
    [minMatch, maxMatch] that occurred before in its own tokens, propose what followed."""

    min_match: int = Field(1, ge=1, le=64, description="Shortest suffix that may match (tokens)")
    max_match: int = Field(8, ge=1, le=64, description="Longest suffix tried first (tokens)")

    @model_validator(mode="after")
    def _ordered(self) -> NgramSpec:
        if self.min_match > self.max_match:
            raise SubfieldError(
                "minMatch",
                f"{self.min_match} exceeds maxMatch ({self.max_match}): lower minMatch "
                f"or raise maxMatch",
            )
        return self


class SuffixSpec(SpecModel):
    """SUFFIX drafting (suffix decoding): the replica's recent outputs, counted as a
    suffix tree, propose beside the request's own tokens (``speculative/suffix.py``)."""

    max_depth: int = Field(
        8, ge=1, le=64, description="Longest context matched in the outputs (tokens)"
    )
    max_cached_tokens: int = Field(
        16384,
        ge=64,
        le=4_194_304,
        description="Output tokens kept per replica, all API keys together; the oldest "
        "outputs are evicted past it (memory grows with this times maxDepth)",
    )
    min_token_prob: float = Field(
        0.1, gt=0, le=1, description="A draft token's least estimated probability"
    )
    max_spec_factor: float = Field(
        1.0,
        gt=0,
        le=16,
        description="Drafts at most this times the matched context's length deep",
    )
    share_across_keys: bool = Field(
        False,
        description="Propose one API key's outputs to another's requests (off: each key "
        "drafts only from its own; without API keys all requests share)",
    )
    hybrid_threshold: float = Field(
        2.0,
        ge=0,
        le=256,
        description="With an EAGLE or EAGLE3 draft (hybrid): a request verifies the "
        "SUFFIX tree instead of the draft model's when it expects at least this many "
        "accepted drafts",
    )


class SpeculativeSpec(SpecModel):
    num_steps: int = Field(3, ge=1, le=16, description="Draft steps per verify (S)")
    topk: int = Field(1, ge=1, le=16, description="Branching per draft step (k); 1 = chain")
    num_draft_tokens: int = Field(
        4, ge=2, le=256, description="Tokens per verify incl. the root (T)"
    )
    adaptive: AdaptiveSpec = Field(default_factory=AdaptiveSpec)
    policy: SpeculationPolicySpec = Field(default_factory=SpeculationPolicySpec)
    ngram: NgramSpec | None = Field(
        None,
        description="Match lengths in the request's own tokens (spec.draft.algorithm NGRAM, "
        "or SUFFIX's own-token part)",
    )
    suffix: SuffixSpec | None = Field(
        None,
        description="SUFFIX drafting's output cache (spec.draft.algorithm SUFFIX); with "
        "an EAGLE or EAGLE3 draft, hybrid drafting",
    )
    # Operator-only (the SpeculationEffective condition): excluded from dumps, so changing
    # it neither reaches the engine config nor changes the config hash (no needless roll).
    min_accept_length: float = Field(
        1.5,
        ge=1,
        exclude=True,
        description="SpeculationEffective is False while the mean accept length is below this",
    )

    @model_validator(mode="after")
    def _consistent_tree(self) -> SpeculativeSpec:
        for rule in speculative_rules(self.num_steps, self.topk, self.num_draft_tokens):
            raise ValueError(rule)
        _ = self.max_draft_tokens  # resolves and checks the ladder, caches T (once)
        return self

    # The cached values below are computed once per validated spec (seed 003).  The spec
    # is frozen; a ``model_copy(update=...)`` of it would keep them stale, so rebuild a
    # changed spec with ``model_validate`` instead.
    @cached_property
    def ladder(self) -> tuple[Rung, ...]:
        """The rungs a verify may run, narrowest first: the adaptive candidates when
        enabled, else the one configured (numSteps, topk, numDraftTokens)."""
        candidates = self._candidate_rungs()
        if self.adaptive.enabled:
            return candidates
        return (Rung(self.num_steps, self.topk, self.num_draft_tokens),)

    @cached_property
    def initial_rung(self) -> Rung:
        """The rung whose steps equal numSteps, else the widest below it, else the first."""
        below = [r for r in self.ladder if r.steps <= self.num_steps]
        return below[-1] if below else self.ladder[0]

    @cached_property
    def max_draft_tokens(self) -> int:
        """T that KV is sized for: the widest rung's, whichever rung is active."""
        return max(r.draft_tokens for r in self.ladder)

    def _candidate_rungs(self) -> tuple[Rung, ...]:
        """``adaptive.candidateSteps`` resolved and checked (errors name the entry)."""
        field = "adaptive.candidateSteps"
        entries = self.adaptive.candidate_steps
        if self.adaptive.enabled and not entries:
            raise SubfieldError(field, "list at least one step count when adaptive is enabled")
        rungs: list[Rung] = []
        for i, entry in enumerate(entries):
            if rungs and entry.steps <= rungs[-1].steps:
                problem = "a duplicate" if entry.steps == rungs[-1].steps else "out of order"
                raise SubfieldError(
                    f"{field}[{i}]",
                    f"steps {entry.steps} is {problem}: list each step count once, ascending",
                )
            rungs.append(self._resolve_rung(entry, f"{field}[{i}]"))
        return tuple(rungs)

    def _resolve_rung(self, entry: CandidateRung, path: str) -> Rung:
        """topk defaults to the spec's; T to steps + 1 for a chain, else
        min(numDraftTokens, topk * steps + 1).  Steps 0 is plain decode (T = 1)."""
        if entry.steps == 0:
            if entry.topk is not None or entry.num_draft_tokens is not None:
                raise SubfieldError(
                    path, "steps 0 is plain decode: leave out topk and numDraftTokens"
                )
            return Rung(0, 1, 1)
        topk = entry.topk if entry.topk is not None else self.topk
        tokens = entry.num_draft_tokens
        if tokens is None:
            tokens = default_num_draft_tokens(entry.steps, topk, cap=self.num_draft_tokens)
        for rule in speculative_rules(entry.steps, topk, tokens):
            raise SubfieldError(path, rule)
        return Rung(entry.steps, topk, tokens)


def default_num_draft_tokens(steps: int, topk: int, cap: int) -> int:
    """T for ``steps`` draft steps of ``topk``: a chain verifies the root and one token per
    step; a tree at most its ``topk * steps + 1`` nodes, and no more than ``cap``."""
    return steps + 1 if topk == 1 else min(cap, topk * steps + 1)


def speculative_rules(num_steps: int, topk: int, num_draft_tokens: int) -> list[str]:
    """The cross-field rules on (S, k, T), as messages for the ones broken."""
    broken = []
    if topk == 1 and num_draft_tokens != num_steps + 1:
        broken.append(
            f"numDraftTokens must be numSteps + 1 = {num_steps + 1} when topk is 1 "
            f"(a chain verifies the root and one token per step); got {num_draft_tokens}"
        )
    if topk > 1 and num_draft_tokens > topk * num_steps + 1:
        broken.append(
            f"numDraftTokens must be at most topk * numSteps + 1 = {topk * num_steps + 1} "
            f"(the tree has no more nodes); got {num_draft_tokens}"
        )
    return broken


def check_drafter_settings(draft: DraftSpec, speculative: SpeculativeSpec) -> None:
    """``speculative.ngram`` only for NGRAM or SUFFIX, ``speculative.suffix`` only for
    SUFFIX or a draft model (hybrid): `SubfieldError` naming the field otherwise."""
    for field, algorithms in (("ngram", DRAFT_FREE), ("suffix", SUFFIXED)):
        if getattr(speculative, field) is not None and draft.algorithm not in algorithms:
            names = " or ".join(a.value for a in algorithms)
            raise SubfieldError(
                f"speculative.{field}",
                f"set for spec.draft.algorithm {draft.algorithm.value}: it configures "
                f"{names} drafting only; drop it or change the algorithm",
            )

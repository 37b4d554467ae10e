"""What crosses a process boundary, typed: one frozen pydantic model per value.

    engine ──EngineStatus──▶ actor ──ReplicaInfo, ReplicaStatus──▶ pool
    pool ──AdminStatus──▶ gateway ``GET /admin/status`` (JSON) ──▶ operator
    pool ──GatewayHealth──▶ gateway ``GET /health``

The engine builds its `EngineStatus`; the actor adds its own fields (`ReplicaStatus`)
and Ray pickles the model to the pool, which keeps it on the replica and builds the
`AdminStatus` document from it; the gateway serves ``model_dump(mode="json")``; the
operator parses the JSON with ``AdminStatus.model_validate`` and reads attributes.
Every field is required and unknown keys are refused, so a renamed or missing field
fails validation, naming it (`field_errors`), instead of reading as zero.

Torch-free on purpose (pydantic and the standard library only): the operator imports it.
JSON keys are the field names (snake_case), as the gateway has always served them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Contract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- engine: static facts (EngineActor.info) ----------------------------------------------
class PrefixCacheShape(_Contract):
    """The engine's prefix cache as the gateway's cache-aware router mirrors it."""

    page_size: int
    capacity_tokens: int  # its KV pool: the most it can keep


# How an engine actor and its gateway talk (`pool.delta_socket`): an actor of a specd
# that speaks another wire does not validate, so a new gateway replaces it instead of
# adopting it.  socket/2: the requests and cancels travel on the socket too (socket/1
# actors took them as Ray calls).
DELTA_WIRE = "socket/2"
DeltaWire = Literal[DELTA_WIRE]  # pydantic refuses any other value


class ReplicaInfo(_Contract):
    """A loaded replica's static facts (``EngineActor.info``: the readiness signal)."""

    replica: str
    delta_wire: DeltaWire
    config_hash: str
    model: str  # the served model name
    context_length: int
    vocab_size: int  # the gateway's token id checks
    sampling_defaults: dict[str, int | float]  # what a request leaving a field out gets
    device: str  # e.g. "cuda:0"
    prefix_cache: PrefixCacheShape | None  # None: no prefix cache


# -- engine: status (Engine.status, EngineActor.status) ----------------------------------
class EvictedBlockKeys(_Contract):
    """Blocks the prefix cache evicted: the newest keys, and how many ever."""

    total: int
    keys: tuple[int, ...]


class PrefixCacheStats(_Contract):
    queried_tokens: int
    hit_tokens: int
    evicted_blocks: EvictedBlockKeys


class SpeculationTotals(_Contract):
    """Cumulative verify counters; mean accept length = 1 + accepted / verify steps."""

    verify_steps: int
    draft_tokens: int
    accepted_tokens: int


class PlainSteps(_Contract):
    """Verify batches run as plain decode, by reason (``specd_spec_plain_steps``)."""

    rung: int  # the active rung has no draft
    load: int  # policy.maxBatchForSpec
    cost: int  # the cost model (its explorations of plain included)
    end: int  # the cost model: the batch's requests end before a verify pays
    lockstep: int  # the cost model: they decode in lockstep, speculation leads by little
    request: int  # a request of the batch opted out (``speculative: false``)


class RungCost(_Contract):
    """One rung's measured cost in a batch-size bucket, and its predicted throughput."""

    steps: int  # 0 = plain decode
    topk: int
    draft_tokens: int
    seconds_per_request: float | None  # median of the newest; None until measured
    tokens_per_second: float | None  # per request; None until cost and acceptance are known


class CostBucket(_Contract):
    """Verify batches of up to ``max_batch`` requests (and over half of it)."""

    max_batch: int
    decisions: int  # made on measurements (explorations not counted)
    best_steps: int | None  # the last decision's winner (0 = plain)
    rungs: tuple[RungCost, ...]
    # the chain length weighed against plain (costModel.chooseSteps); None: the rung's own
    chain_steps: int | None = None


class RungAcceptance(_Contract):
    steps: int
    topk: int
    draft_tokens: int
    accepted_drafts: float | None  # EMA of accepted drafts per request (bonus excluded)


class CostCalibration(_Contract):
    """The step costs measured at load on made-up batches (``engine/calibration.py``)."""

    batch_sizes: tuple[int, ...]  # as run (``costModel.calibrationBatchSizes``, clipped)
    steps: int
    seconds: float


class CostModelStatus(_Contract):
    """The cost model's inputs and decisions (``speculative/cost_model.py``)."""

    calibration: CostCalibration | None  # None: none ran (off, or a draft-free drafter)
    explorations: int
    catch_up_seconds_per_token: float | None  # the draft reading deferred tokens
    accepted_drafts: tuple[RungAcceptance, ...]
    buckets: tuple[CostBucket, ...]
    # a chain's P(accepted >= j), j = 1, 2, ... (costModel.chooseSteps; None: not known)
    chain_acceptance: tuple[float | None, ...] = ()


class AdaptiveStatus(_Contract):
    """The active rung, the controller's estimate and the plain-step counts."""

    enabled: bool
    steps: int
    topk: int
    draft_tokens: int
    ema: float | None
    acceptance_rate: float | None
    batches: int
    rung_changes: int
    max_batch_for_spec: int | None
    cost_model: CostModelStatus | None  # None: off, or maxBatchForSpec overrides it
    plain_steps: PlainSteps


class GraphsOff(_Contract):
    mode: Literal["off"]
    reason: str  # why not (a spec setting, the backend, the kernel ops)


class SpecGraphReplays(_Contract):
    draft: int
    verify: int
    extend: int


class GraphsOn(_Contract):
    mode: Literal["captured", "emulated"]  # CUDA graphs, or their CPU emulation
    sizes: tuple[int, ...]  # batch sizes with a graph
    graphs: int
    buffer_bytes: int
    capture_seconds: float
    replays: int | SpecGraphReplays  # per step kind under speculative decoding


CudaGraphStatus = Annotated[GraphsOff | GraphsOn, Field(discriminator="mode")]


class EngineStatus(_Contract):
    """One engine's status, refreshed by its loop after every step and when idle."""

    replica: str
    config_hash: str
    device: str  # "cpu" or "cuda"
    attention_backend: str
    kernel_ops: str
    cuda_graphs: CudaGraphStatus
    running: int
    queued: int
    queued_tokens: int
    kv_used_tokens: int  # held by requests and sessions (not the evictable cache)
    kv_cached_tokens: int
    kv_total_tokens: int
    kv_usage: float  # kv_used_tokens / kv_total_tokens
    prefix_cache: PrefixCacheStats
    retractions: int
    preemptions: int
    kv_reserved_tokens: int
    leak_check_failures: int
    sessions_open: int
    session_kv_tokens: int
    speculation: SpeculationTotals | None  # None: plain decode
    adaptive: AdaptiveStatus | None  # None: plain decode
    healthy: bool  # False once the loop died
    last_error: str | None


class ReplicaStatus(EngineStatus):
    """`EngineStatus` as the actor reports it: its leak-check failures counted now (the
    engine's snapshot stops refreshing when its loop dies), and the actor's own state."""

    draining: bool
    inflight: int  # streams open on the actor

    @classmethod
    def of_engine(
        cls, status: EngineStatus, *, leak_check_failures: int, draining: bool, inflight: int
    ) -> ReplicaStatus:
        fields = {**dict(status), "leak_check_failures": leak_check_failures}
        return cls(**fields, draining=draining, inflight=inflight)


# -- pool: /admin/status ------------------------------------------------------------------
ReplicaStateName = Literal["starting", "ready", "draining", "dead"]


class ReplicaSummary(_Contract):
    """The pool's line for one replica."""

    name: str
    actor_name: str
    state: ReplicaStateName
    config_hash: str
    inflight: int  # streams the gateway has open on it
    context_length: int | None  # None until ready
    sampling_defaults: dict[str, int | float] | None  # None until ready
    load: ReplicaStatus | None  # the latest probe's answer; None until the first
    error: str | None
    restarts: int  # failures of its predecessors


class RoutingStatus(_Contract):
    policy: str  # spec.routing.policy
    routed: dict[str, int]  # prompts routed, by reason (prefix, load, balance)
    predicted_hit_tokens: int


class AutoscalePending(_Contract):
    direction: Literal["up", "down"]
    for_s: float


class AutoscalingStatus(_Contract):
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float
    mean_ongoing_requests: float
    wanted: int  # what the load asks for, bounds aside
    proposal: int  # ``wanted`` within the bounds
    pending: AutoscalePending | None  # a proposal waiting out its delay
    held_requests: int  # waiting for a replica to start


class ReplicaFailureSummary(_Contract):
    """The same load error twice for ``config_hash``: no replica of it is started again."""

    config_hash: str
    replica: str
    message: str
    time: float


class ReplicaDeaths(_Contract):
    """Replicas that died, by reason (``specd_replica_deaths_total{reason}``)."""

    engine_error: int
    load_error: int
    probe_timeout: int
    actor_died: int
    killed: int


class PoolEvent(_Contract):
    time: float  # unix seconds
    replica: str  # "-" for the pool itself
    event: str  # starting, ready, dead, draining, retired, autoscaled, ...
    detail: str


class AdminStatus(_Contract):
    """The ``GET /admin/status`` document: the operator builds the CR status from it."""

    deployment: str
    model: str
    config_hash: str
    desired_replicas: int
    ready_replicas: int
    converged: bool
    released: bool
    kv_usage: float  # highest over ready replicas
    actors: tuple[ReplicaSummary, ...]
    routing: RoutingStatus
    autoscaling: AutoscalingStatus | None  # None: a fixed replica count
    failure: ReplicaFailureSummary | None  # for the current config only
    replica_deaths: ReplicaDeaths
    retired_leak_check_failures: int  # of replicas gone
    events: tuple[PoolEvent, ...]  # the newest, oldest first


class GatewayHealth(_Contract):
    """The ``GET /health`` body (200 when ``status`` is not "unavailable", else 503)."""

    status: Literal["ok", "unavailable", "scaled_to_zero"]
    ready_replicas: int
    desired_replicas: int
    unhealthy_replicas: tuple[str, ...]
    reason: str | None = None  # why not ok (absent from the JSON when ok)

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def field_errors(err: ValidationError, limit: int = 5) -> str:
    """The problems, each naming its field (``actors[0].load.kv_usage: Field required``);
    the first ``limit`` of them, then how many more."""
    lines = []
    for e in err.errors():
        path = ""
        for item in e["loc"]:
            path += f"[{item}]" if isinstance(item, int) else (f".{item}" if path else str(item))
        lines.append(f"{path or '<root>'}: {e['msg']}")
    more = f"; and {len(lines) - limit} more" if len(lines) > limit else ""
    return "; ".join(lines[:limit]) + more

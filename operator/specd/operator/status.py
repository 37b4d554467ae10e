"""CR status from the gateway's ``/admin/status`` document (pure; no kopf, no client).

The operator's timer is the only status writer.  Each poll it calls `compute_status`
with what it observed (`Observation`: the parsed spec or why it is invalid, whether
KubeRay is missing, the gateway document or ``None`` when unreachable) and the status
already on the CR, and patches the result only when it differs (`status_changed`).

Speculation is judged over a *window*: the cumulative counters of the actors present
now, minus the counters the previous poll stored in ``status.speculation`` (for the
same actors).  So ``acceptLength`` says how drafts did since the last poll, not since
the deployment began.

    Ready                True  <=> the gateway runs the current config hash, and exactly
                               the desired actors are ready on it (the router only
                               routes to ready actors: ready means routable); reason
                               ScaledToZero when that is none (minReplicas 0, idle)
    Progressing          True  while the gateway or any actor is not on the current hash,
                               or the ready count differs from the desired one

The desired count is ``spec.replicas``; with ``spec.autoscaling`` it is the gateway's
autoscaler's (``desired_replicas`` of its document), or ``spec.replicas`` within the
bounds while the gateway cannot be read.
    Degraded             True  with a reason: InvalidSpec, KubeRayMissing, ReplicaFailed
                               (the gateway gave up loading the current config: the
                               same load error twice), ReplicaFailing, LeakCheckFailed,
                               GatewayStatusInvalid (its document breaks the contract)
    SpeculationEffective True  <=> mean accept length over the window >= minAcceptLength
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from specd.workers.config import SpecDecodeDeployment
from specd.workers.contracts import AdminStatus, PoolEvent, ReplicaSummary

KUBERAY_INSTALL_HINT = (
    "install the KubeRay operator (helm install kuberay-operator "
    "kuberay/kuberay-operator), or set spec.ray.address to an existing Ray cluster"
)


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Condition(_Status):
    type: str
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class SpeculationStatus(_Status):
    algorithm: str | None = Field(
        None, description="spec.draft.algorithm: what the acceptance below is of"
    )
    accept_length: float | None = Field(
        None, description="Mean tokens per verify (accepted drafts + bonus), last window"
    )
    accept_rate: float | None = Field(None, description="Accepted / proposed drafts, last window")
    window_verifies: int = Field(0, description="Verify steps in the last window")
    # cumulative per-actor counters as last seen: the next window starts here
    counters: dict[str, list[int]] = Field(
        default_factory=dict, description="actor -> [verifySteps, draftTokens, acceptedTokens]"
    )


class KVStatus(_Status):
    usage: float = Field(0.0, description="Highest used/total KV tokens over ready actors")
    reserve_usage: float = Field(
        0.0, description="Highest speculative reserve (allocated beyond committed) / total"
    )


class ActorStatus(_Status):
    name: str
    state: str
    config_hash: str
    restarts: int = Field(
        0, description="Failures of this replica's predecessors (each replacement adds one)"
    )
    spec_steps: int | None = Field(
        None, description="Speculation steps of the adaptive rung now active (adaptive only)"
    )
    error: str | None = None


class SddStatus(_Status):
    """The ``status`` of a SpecDecodeDeployment (also the CRD's status schema)."""

    replicas: int = Field(0, description="Live engine actors (starting or ready)")
    ready_replicas: int = 0
    updated_replicas: int = Field(0, description="Ready actors on the current config hash")
    desired_replicas: int = Field(
        0, description="Replicas the gateway keeps: spec.replicas, or the autoscaler's count"
    )
    ready: str = Field("0/0", description="readyReplicas/desiredReplicas, for kubectl")
    observed_generation: int | None = None
    selector: str = Field("", description="Label selector of the engine pods (scale)")
    endpoint: str | None = None
    config_hash: str | None = None
    conditions: list[Condition] = Field(default_factory=list)
    speculation: SpeculationStatus | None = None
    kv: KVStatus = Field(default_factory=KVStatus)
    leak_check_failures: int = 0
    replacements: int = Field(0, description="Actors the gateway replaced after a failure")
    last_event_time: float | None = Field(None, description="Newest gateway event counted")
    actors: list[ActorStatus] = Field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Observation:
    """What one reconcile saw; ``sdd`` is None exactly when ``invalid`` says why."""

    generation: int
    sdd: SpecDecodeDeployment | None
    invalid: str | None = None
    kuberay_missing: bool = False
    gateway: AdminStatus | None = None  # /admin/status, None when it could not be read
    gateway_error: str | None = None  # why not: unreachable, an HTTP error, invalid
    gateway_invalid: bool = False  # it answered a document that breaks the contract
    endpoint: str | None = None
    selector: str = ""


def _condition(type_: str, status: bool | None, reason: str, message: str = "") -> Condition:
    text = "Unknown" if status is None else ("True" if status else "False")
    return Condition(type=type_, status=text, reason=reason, message=message)


def _counters(actor: ReplicaSummary) -> list[int] | None:
    spec = actor.load.speculation if actor.load is not None else None
    if spec is None:
        return None
    return [spec.verify_steps, spec.draft_tokens, spec.accepted_tokens]


def speculation_window(
    actors: Sequence[ReplicaSummary], previous: SpeculationStatus | None
) -> SpeculationStatus:
    """Accept length/rate over the counters gained since ``previous`` (per actor).

    An actor first seen (or whose counters went down: replaced engine) contributes
    its whole counters.  With no verify in the window the previous values stay.
    """
    before = previous.counters if previous is not None else {}
    now: dict[str, list[int]] = {}
    verifies = drafts = accepted = 0
    for actor in actors:
        c = _counters(actor)
        if c is None:
            continue
        now[actor.name] = c
        base = before.get(actor.name, [0, 0, 0])
        delta = [x - y for x, y in zip(c, base, strict=True)]
        if min(delta) < 0:
            delta = c
        verifies, drafts, accepted = verifies + delta[0], drafts + delta[1], accepted + delta[2]
    if verifies == 0:
        keep = previous or SpeculationStatus()
        return SpeculationStatus(
            accept_length=keep.accept_length, accept_rate=keep.accept_rate, counters=now
        )
    return SpeculationStatus(
        accept_length=round(1 + accepted / verifies, 3),
        accept_rate=round(accepted / drafts, 3) if drafts else None,
        window_verifies=verifies,
        counters=now,
    )


def failing_replicas(events: Sequence[PoolEvent]) -> list[PoolEvent]:
    """'dead' events after the last 'ready' one: failures nothing has recovered from."""
    failing: list[PoolEvent] = []
    for event in events:
        if event.event == "ready":
            failing = []
        elif event.event == "dead":
            failing.append(event)
    return failing


def _kv(actors: Sequence[ReplicaSummary]) -> KVStatus:
    usage = reserve = 0.0
    for actor in actors:
        load = actor.load
        if actor.state != "ready" or load is None:
            continue
        usage = max(usage, load.kv_usage)
        if load.kv_total_tokens:
            reserve = max(reserve, load.kv_reserved_tokens / load.kv_total_tokens)
    return KVStatus(usage=round(usage, 4), reserve_usage=round(reserve, 4))


def _leak_check_failures(actors: Sequence[ReplicaSummary]) -> int:
    return sum(a.load.leak_check_failures for a in actors if a.load is not None)


def _rollout(obs: Observation, desired_hash: str, desired: int) -> tuple[Condition, Condition]:
    """(Ready, Progressing) from the gateway's view of the actors."""
    doc = obs.gateway
    if doc is None:
        reason, why = _unread_gateway(obs)
        return (
            _condition("Ready", False, reason, why),
            _condition("Progressing", True, "WaitingForGateway", why),
        )
    if doc.config_hash != desired_hash:
        why = f"gateway runs config {doc.config_hash}, waiting for {desired_hash}"
        return (
            _condition("Ready", False, "ConfigPending", why),
            _condition("Progressing", True, "ConfigPending", why),
        )
    live = [a for a in doc.actors if a.state in ("starting", "ready")]
    current_ready = [a for a in live if a.state == "ready" and a.config_hash == desired_hash]
    outdated = [a for a in live if a.config_hash != desired_hash]
    if len(current_ready) == desired and len(live) == desired:
        msg = f"{desired}/{desired} actors ready on config {desired_hash}"
        reason = "AllReplicasReady"
        if desired == 0:  # autoscaling.minReplicas 0, idle: a request starts a replica
            msg, reason = "scaled to zero: the next request starts a replica", "ScaledToZero"
        return (
            _condition("Ready", True, reason, msg),
            _condition("Progressing", False, "RolloutComplete", msg),
        )
    msg = (
        f"{len(current_ready)}/{desired} actors ready on config {desired_hash}"
        + (f", {len(outdated)} on an older config" if outdated else "")
        + (f", {len(live)} live" if len(live) != desired else "")
    )
    reason = "RollingUpdate" if outdated else "ReplicasNotReady"
    return _condition("Ready", False, reason, msg), _condition("Progressing", True, reason, msg)


def _unread_gateway(obs: Observation) -> tuple[str, str]:
    """(reason, message) when the poll got no valid document."""
    if obs.gateway_invalid:
        return "GatewayStatusInvalid", f"gateway /admin/status invalid: {obs.gateway_error}"
    return (
        "GatewayUnavailable",
        f"gateway /admin/status unreachable: {obs.gateway_error or 'no answer'}",
    )


def _degraded(obs: Observation) -> Condition:
    if obs.invalid is not None:
        return _condition("Degraded", True, "InvalidSpec", obs.invalid)
    if obs.kuberay_missing:
        return _condition(
            "Degraded",
            True,
            "KubeRayMissing",
            f"spec.ray: no RayCluster API (ray.io/v1) is served; {KUBERAY_INSTALL_HINT}",
        )
    if obs.gateway_invalid:  # a version skew or a bug: loud, never read as zeros
        return _condition("Degraded", True, *_unread_gateway(obs))
    doc = obs.gateway
    if doc is None:
        return _condition("Degraded", False, "AsExpected")
    failure = doc.failure
    if failure and obs.sdd is not None and failure.config_hash == obs.sdd.spec.config_hash():
        return _condition(
            "Degraded",
            True,
            "ReplicaFailed",
            f"replica {failure.replica} failed to load twice alike, so none is started "
            f"until the spec changes: {failure.message}",
        )
    failing = failing_replicas(doc.events)
    if failing:
        last = failing[-1]
        return _condition(
            "Degraded",
            True,
            "ReplicaFailing",
            f"replica {last.replica}: {last.detail}"
            + (
                f" ({len(failing)} failures since the last ready replica)"
                if len(failing) > 1
                else ""
            ),
        )
    leaks = _leak_check_failures(doc.actors)
    if leaks:
        return _condition(
            "Degraded",
            True,
            "LeakCheckFailed",
            f"{leaks} KV leak-check failures reported by the actors (see the engine logs)",
        )
    return _condition("Degraded", False, "AsExpected")


def _speculation_effective(
    sdd: SpecDecodeDeployment | None, spec_status: SpeculationStatus | None
) -> Condition:
    if sdd is None:
        return _condition("SpeculationEffective", None, "InvalidSpec")
    if sdd.spec.speculative is None:
        return _condition("SpeculationEffective", False, "SpeculationOff", "no spec.draft")
    floor = sdd.spec.speculative.min_accept_length
    if spec_status is None or spec_status.accept_length is None:
        return _condition("SpeculationEffective", None, "NoVerifies", "no verify step observed yet")
    ok = spec_status.accept_length >= floor
    return _condition(
        "SpeculationEffective",
        ok,
        "AcceptLengthOK" if ok else "AcceptLengthLow",
        f"mean accept length {spec_status.accept_length:g} "
        f"{'>=' if ok else '<'} spec.speculative.minAcceptLength {floor:g}",
    )


def _stamp(new: list[Condition], old: list[Condition], now: str, generation: int) -> None:
    """Keep ``lastTransitionTime`` of conditions whose status did not change."""
    before = {c.type: c for c in old}
    for c in new:
        prev = before.get(c.type)
        c.last_transition_time = (
            prev.last_transition_time if prev and prev.status == c.status else now
        )
        c.observed_generation = generation


def desired_replicas(obs: Observation) -> int:
    """The actors the gateway should keep (see the module docstring)."""
    if obs.sdd is None:
        return 0
    spec = obs.sdd.spec
    if spec.autoscaling is None:
        return spec.replicas
    if obs.gateway is not None:
        return obs.gateway.desired_replicas
    return spec.autoscaling.clamp(spec.replicas)


def compute_status(obs: Observation, previous: SddStatus, now: str) -> SddStatus:
    """The CR status for one observation (``now``: RFC 3339 time for transitions)."""
    sdd = obs.sdd
    desired = desired_replicas(obs)
    desired_hash = sdd.spec.config_hash() if sdd is not None else None
    doc = obs.gateway
    actors = doc.actors if doc is not None else ()
    if sdd is None or obs.kuberay_missing:
        ready_c = _condition("Ready", False, _degraded(obs).reason, _degraded(obs).message)
        progressing = _condition("Progressing", False, ready_c.reason, ready_c.message)
    else:
        ready_c, progressing = _rollout(obs, desired_hash, desired)
    spec_status = None
    if sdd is not None and sdd.spec.speculative is not None:
        spec_status = speculation_window(actors, previous.speculation).model_copy(
            update={"algorithm": sdd.spec.draft.algorithm.value}
        )
    conditions = [ready_c, progressing, _degraded(obs), _speculation_effective(sdd, spec_status)]
    _stamp(conditions, previous.conditions, now, obs.generation)
    live = [a for a in actors if a.state in ("starting", "ready")]
    ready = [a for a in live if a.state == "ready"]
    seen_until = previous.last_event_time or 0.0
    events = doc.events if doc is not None else ()
    new_deaths = [e for e in events if e.event == "dead" and e.time > seen_until]
    return SddStatus(
        replicas=len(live),
        ready_replicas=len(ready),
        desired_replicas=desired,
        updated_replicas=len([a for a in ready if a.config_hash == desired_hash]),
        ready=f"{len(ready)}/{desired}",
        observed_generation=obs.generation,
        selector=obs.selector,
        endpoint=obs.endpoint,
        config_hash=desired_hash,
        conditions=conditions,
        speculation=spec_status,
        kv=_kv(actors),
        leak_check_failures=(doc.retired_leak_check_failures if doc is not None else 0)
        + _leak_check_failures(actors),  # replicas gone, and those here
        replacements=previous.replacements + len(new_deaths),
        last_event_time=max([seen_until, *(e.time for e in events)]) or None,
        actors=[
            ActorStatus(
                name=a.name,
                state=a.state,
                config_hash=a.config_hash,
                restarts=a.restarts,
                spec_steps=_spec_steps(a),
                error=a.error,
            )
            for a in actors
        ],
    )


def _spec_steps(actor: ReplicaSummary) -> int | None:
    """The steps of the adaptive rung active on ``actor`` (None: not adaptive, no load)."""
    adaptive = actor.load.adaptive if actor.load is not None else None
    return adaptive.steps if adaptive is not None else None


def status_document(status: SddStatus) -> dict[str, Any]:
    """The JSON written to ``.status`` (camelCase, no nulls)."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def parse_status(raw: dict[str, Any] | None) -> SddStatus:
    """The status on the CR, or an empty one when absent or foreign (never raises)."""
    try:
        return SddStatus.model_validate(raw or {})
    except ValueError:
        return SddStatus()


def status_changed(new: SddStatus, old_raw: dict[str, Any] | None) -> bool:
    return status_document(new) != (old_raw or {})


def transitions(new: SddStatus, old: SddStatus) -> list[Condition]:
    """Conditions whose status or reason changed (for Events)."""
    before = {c.type: (c.status, c.reason) for c in old.conditions}
    return [c for c in new.conditions if before.get(c.type) != (c.status, c.reason)]


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif value != before or key not in old:
            patch[key] = value
    return patch

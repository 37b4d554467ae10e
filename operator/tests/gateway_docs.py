"""``/admin/status`` documents as `PoolController.status()` builds them: `AdminStatus`
values (`specd.workers.contracts`), so a document the tests make is one the real
gateway could serve (test_contracts checks the real pool's against the model)."""

from __future__ import annotations

import time
from typing import Any

from specd.devtools.status_docs import replica_status
from specd.workers.config import DeploymentSpec
from specd.workers.contracts import AdminStatus, PoolEvent, ReplicaSummary


def actor(
    name: str,
    config_hash: str,
    state: str = "ready",
    *,
    verifies: int = 0,
    drafts: int = 0,
    accepted: int = 0,
    kv_used: int = 0,
    kv_reserved: int = 0,
    kv_total: int = 1000,
    leaks: int = 0,
    speculating: bool = True,
    restarts: int = 0,
    adaptive_steps: int | None = None,
) -> ReplicaSummary:
    """A replica's line; its ``load`` (a probe's answer) only once it is ready."""
    adaptive = None
    if adaptive_steps is not None:
        adaptive = {
            "enabled": True,
            "steps": adaptive_steps,
            "topk": 1,
            "draft_tokens": adaptive_steps,
            "ema": None,
            "acceptance_rate": None,
            "batches": 0,
            "rung_changes": 0,
            "max_batch_for_spec": None,
            "cost_model": None,
            "plain_steps": {"rung": 0, "load": 0, "cost": 0, "end": 0, "lockstep": 0, "request": 0},
        }
    load = replica_status(
        name,
        config_hash,
        kv_used_tokens=kv_used,
        kv_total_tokens=kv_total,
        kv_reserved_tokens=kv_reserved,
        leak_check_failures=leaks,
        speculation=(
            {"verify_steps": verifies, "draft_tokens": drafts, "accepted_tokens": accepted}
            if speculating
            else None
        ),
        adaptive=adaptive,
    )
    return ReplicaSummary(
        name=name,
        actor_name=f"specd-test-abc123-{name}",
        state=state,
        config_hash=config_hash,
        inflight=0,
        context_length=4096 if state == "ready" else None,
        sampling_defaults={} if state == "ready" else None,
        load=load if state == "ready" else None,
        error=None,
        restarts=restarts,
    )


def event(replica: str, what: str, detail: str = "", at: float | None = None) -> PoolEvent:
    return PoolEvent(time=at or time.time(), replica=replica, event=what, detail=detail)


def gateway_doc(
    spec: DeploymentSpec,
    actors: list[ReplicaSummary],
    *,
    name: str = "x",
    config_hash: str | None = None,
    events: list[PoolEvent] | None = None,
    desired: int | None = None,
    failure: str | None = None,
    retired_leaks: int = 0,
) -> AdminStatus:
    """``desired``: the autoscaler's count (default ``spec.replicas``); ``failure``: the
    load error the pool gave up on (for the current config)."""
    want = config_hash or spec.config_hash()
    ready = [a for a in actors if a.state == "ready"]
    desired = spec.replicas if desired is None else desired
    return AdminStatus(
        deployment=name,
        model=spec.served_model_name,
        config_hash=want,
        desired_replicas=desired,
        ready_replicas=len(ready),
        converged=len(actors) == desired
        and all(a.state == "ready" and a.config_hash == want for a in actors),
        kv_usage=max((a.load.kv_usage for a in ready if a.load is not None), default=0.0),
        released=False,
        actors=tuple(actors),
        routing={"policy": spec.routing.policy, "routed": {}, "predicted_hit_tokens": 0},
        autoscaling=None,
        failure=None
        if failure is None
        else {"config_hash": want, "replica": "r1", "message": failure, "time": time.time()},
        replica_deaths={
            r: 0 for r in ("engine_error", "load_error", "probe_timeout", "actor_died", "killed")
        },
        retired_leak_check_failures=retired_leaks,
        events=tuple(events or ()),
    )


def without_field(doc: AdminStatus, path: str) -> dict[str, Any]:
    """``doc``'s JSON with the field at ``path`` (``actors.0.load.kv_usage``) removed."""
    raw, parent, last = _at(doc, path)
    del parent[last]
    return raw


def renamed_field(doc: AdminStatus, path: str, new_name: str) -> dict[str, Any]:
    """``doc``'s JSON with the field at ``path`` renamed to ``new_name`` (its value kept)."""
    raw, parent, last = _at(doc, path)
    parent[new_name] = parent.pop(last)
    return raw


def _at(doc: AdminStatus, path: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(``doc``'s JSON, the mapping holding the field at ``path``, the field's name)."""
    raw = doc.model_dump(mode="json")
    *parents, last = path.split(".")
    node: Any = raw
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    return raw, node, last

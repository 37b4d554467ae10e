"""``/admin/status`` documents in the shape `PoolController.status()` returns
(test_gateway_contract checks the keys against the real pool)."""

from __future__ import annotations

import time
from typing import Any

from specd.workers.config import DeploymentSpec


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
) -> dict[str, Any]:
    load = {
        "replica": name,
        "config_hash": config_hash,
        "running": 0,
        "queued": 0,
        "queued_tokens": 0,
        "kv_used_tokens": kv_used,
        "kv_total_tokens": kv_total,
        "kv_usage": kv_used / kv_total,
        "retractions": 0,
        "kv_reserved_tokens": kv_reserved,
        "leak_check_failures": leaks,
        "speculation": (
            {"verify_steps": verifies, "draft_tokens": drafts, "accepted_tokens": accepted}
            if speculating
            else None
        ),
        "adaptive": None if adaptive_steps is None else {"steps": adaptive_steps, "topk": 1},
        "healthy": True,
        "last_error": None,
        "draining": False,
        "inflight": 0,
    }
    return {
        "name": name,
        "actor_name": f"specd-test-abc123-{name}",
        "state": state,
        "config_hash": config_hash,
        "inflight": 0,
        "context_length": 4096,
        "sampling_defaults": {},
        "load": load if state == "ready" else {},
        "error": None,
        "restarts": restarts,
    }


def event(replica: str, what: str, detail: str = "", at: float | None = None) -> dict[str, Any]:
    return {"time": at or time.time(), "replica": replica, "event": what, "detail": detail}


def gateway_doc(
    spec: DeploymentSpec,
    actors: list[dict[str, Any]],
    *,
    name: str = "x",
    config_hash: str | None = None,
    events: list[dict[str, Any]] | None = None,
    desired: int | None = None,
    failure: str | None = None,
    retired_leaks: int = 0,
) -> dict[str, Any]:
    """``desired``: the autoscaler's count (default ``spec.replicas``); ``failure``: the
    load error the pool gave up on (for the current config)."""
    want = config_hash or spec.config_hash()
    ready = [a for a in actors if a["state"] == "ready"]
    desired = spec.replicas if desired is None else desired
    return {
        "deployment": name,
        "model": spec.served_model_name,
        "config_hash": want,
        "desired_replicas": desired,
        "ready_replicas": len(ready),
        "converged": len(actors) == desired
        and all(a["state"] == "ready" and a["config_hash"] == want for a in actors),
        "kv_usage": max((a["load"]["kv_usage"] for a in ready), default=0.0),
        "released": False,
        "actors": actors,
        "routing": {"policy": spec.routing.policy, "routed": {}, "predicted_hit_tokens": 0},
        "autoscaling": None,
        "failure": None
        if failure is None
        else {"config_hash": want, "replica": "r1", "message": failure, "time": time.time()},
        "replica_deaths": {
            r: 0 for r in ("engine_error", "load_error", "probe_timeout", "actor_died", "killed")
        },
        "retired_leak_check_failures": retired_leaks,
        "events": events or [],
    }

"""Valid contract values for tests that play an engine or an actor without one: every
field of `specd.workers.contracts.ReplicaInfo` / `ReplicaStatus` set to what an idle
replica reports, any of them overridden by keyword (torch-free: the operator's tests
use it too)."""

from __future__ import annotations

from typing import Any

from specd.workers.contracts import DELTA_WIRE, EngineStatus, ReplicaInfo, ReplicaStatus


def engine_status_fields(replica: str = "r0", config_hash: str = "h", **fields: Any) -> dict:
    """The fields of an idle engine's `EngineStatus`, updated with ``fields``;
    ``kv_usage`` follows ``kv_used_tokens`` / ``kv_total_tokens`` unless given."""
    out: dict[str, Any] = {
        "replica": replica,
        "config_hash": config_hash,
        "device": "cpu",
        "attention_backend": "torch",
        "kernel_ops": "torch",
        "cuda_graphs": {"mode": "off", "reason": "spec.cudaGraph.enabled is false"},
        "running": 0,
        "queued": 0,
        "queued_tokens": 0,
        "kv_used_tokens": 0,
        "kv_cached_tokens": 0,
        "kv_total_tokens": 1000,
        "prefix_cache": {
            "queried_tokens": 0,
            "hit_tokens": 0,
            "evicted_blocks": {"total": 0, "keys": []},
        },
        "retractions": 0,
        "preemptions": 0,
        "kv_reserved_tokens": 0,
        "leak_check_failures": 0,
        "sessions_open": 0,
        "session_kv_tokens": 0,
        "speculation": None,
        "adaptive": None,
        "healthy": True,
        "last_error": None,
    }
    out.update(fields)
    out.setdefault("kv_usage", out["kv_used_tokens"] / out["kv_total_tokens"])
    return out


def engine_status(replica: str = "r0", config_hash: str = "h", **fields: Any) -> EngineStatus:
    return EngineStatus.model_validate(engine_status_fields(replica, config_hash, **fields))


def replica_status(
    replica: str = "r0",
    config_hash: str = "h",
    *,
    draining: bool = False,
    inflight: int = 0,
    **fields: Any,
) -> ReplicaStatus:
    """What an idle actor's ``status()`` answers (see `engine_status_fields`)."""
    engine = engine_status_fields(replica, config_hash, **fields)
    return ReplicaStatus.model_validate({**engine, "draining": draining, "inflight": inflight})


def replica_info(replica: str = "r0", config_hash: str = "h", **fields: Any) -> ReplicaInfo:
    """What a loaded actor's ``info()`` answers (a prefix cache of page 1 unless given)."""
    out: dict[str, Any] = {
        "replica": replica,
        "delta_wire": DELTA_WIRE,
        "config_hash": config_hash,
        "model": "demo",
        "context_length": 4096,
        "vocab_size": 512,
        "sampling_defaults": {},
        "device": "cpu",
        "prefix_cache": {"page_size": 1, "capacity_tokens": 4096},
    }
    return ReplicaInfo.model_validate({**out, **fields})

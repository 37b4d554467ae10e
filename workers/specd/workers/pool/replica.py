"""The replica handle: one engine actor as the pool sees it.

A `Replica` is the actor's Ray handle plus what the pool knows of it: its state
(`ReplicaState`: starting -> ready -> draining -> dead), its info and latest status,
the streams the gateway has open on it.  Also here: why a replica died (`DeathReason`),
a model that will not load (`ReplicaFailure`), the error a request gets when its
replica fails (`ReplicaError`), and the Ray names of engine actors (`actor_name`).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from specd.workers.contracts import (
    ReplicaFailureSummary,
    ReplicaInfo,
    ReplicaStatus,
    ReplicaSummary,
)
from specd.workers.pool.rank_actor import release_ranks
from specd.workers.pool.router import ReplicaLoad


class ReplicaState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class DeathReason(str, Enum):
    """Why a replica died (``specd_replica_deaths_total{reason}``)."""

    ENGINE_ERROR = "engine_error"  # its engine loop died (or a probe's call raised)
    LOAD_ERROR = "load_error"  # it did not start: its model did not load, or not in time
    PROBE_TIMEOUT = "probe_timeout"  # no answer to a health probe in time
    ACTOR_DIED = "actor_died"  # its actor process is gone (a crash, a lost node)
    KILLED = "killed"  # its actor was killed from outside (``ray.kill``)


def death_reason(err: RayError) -> DeathReason:
    """The `DeathReason` of a Ray failure: an actor gone (killed, which only Ray's
    message tells, or died), else a call that raised in the engine."""
    if not isinstance(err, RayActorError):
        return DeathReason.ENGINE_ERROR
    return DeathReason.KILLED if "killed by `ray.kill`" in str(err) else DeathReason.ACTOR_DIED


@dataclass(frozen=True, slots=True)
class ReplicaFailure:
    """The same `ReplicaLoadError` twice in a row for ``config_hash``: no replica of
    it is started again (a new config hash clears it)."""

    config_hash: str
    replica: str  # the replica that failed second
    message: str
    time: float

    def summary(self) -> ReplicaFailureSummary:
        return ReplicaFailureSummary(**asdict(self))


class ReplicaError(RuntimeError):
    """A replica failed while serving a request; ``lost`` when its actor is gone."""

    def __init__(self, replica: str, message: str, *, lost: bool):
        super().__init__(message)
        self.replica = replica
        self.lost = lost


@dataclass(slots=True, eq=False)
class Replica:
    name: str  # the engine's `replica` label
    actor_name: str
    handle: Any  # ray ActorHandle of an EngineActor
    config_hash: str
    state: ReplicaState = ReplicaState.STARTING
    info: ReplicaInfo | None = None  # EngineActor.info(), once ready
    load: ReplicaStatus | None = None  # latest EngineActor.status(), once ready
    inflight: int = 0  # streams the gateway has open on it
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    restarts: int = 0  # failures of this replica's predecessors (a replacement inherits +1)
    evictions_seen: int = 0  # prefix-cache block evictions already taken off its record

    def router_load(self) -> ReplicaLoad:
        load = self.load
        if load is None:  # not probed yet: only its streams count
            return ReplicaLoad(name=self.name, inflight=self.inflight)
        return ReplicaLoad(
            name=self.name,
            queued_tokens=load.queued_tokens,
            inflight=self.inflight,
            kv_usage=load.kv_usage,
            sessions_open=load.sessions_open,
        )

    def note_session_opened(self) -> None:
        """Count a session opening here until the next probe reports the real number
        (so a burst of opens spreads over the replicas; a refused open is forgotten at
        that probe too)."""
        if self.load is not None:
            opened = self.load.sessions_open + 1
            self.load = self.load.model_copy(update={"sessions_open": opened})

    @property
    def healthy(self) -> bool:
        return self.load is None or self.load.healthy

    def summary(self) -> ReplicaSummary:
        return ReplicaSummary(
            name=self.name,
            actor_name=self.actor_name,
            state=self.state.value,
            config_hash=self.config_hash,
            inflight=self.inflight,
            context_length=self.info.context_length if self.info is not None else None,
            sampling_defaults=self.info.sampling_defaults if self.info is not None else None,
            load=self.load,
            error=self.error,
            restarts=self.restarts,
        )

    def kill(self) -> None:
        """End this replica's actor for good (one already gone is fine), and its
        placement group at tensor > 1 (which ends any rank still in it)."""
        with contextlib.suppress(Exception):
            ray.kill(self.handle, no_restart=True)
        with contextlib.suppress(Exception):
            release_ranks(self.actor_name)


def actor_name(deployment: str, token: str, replica: str) -> str:
    """Ray name of an engine actor; ``token`` (6 hex digits) tells gateways apart, and a
    new gateway adopts every actor whose name matches its deployment (see
    `PoolController.start`)."""
    return f"specd-{deployment}-{token}-{replica}"


def replica_of_actor(ray_name: str) -> str:
    """The replica name an `actor_name` ends with (the whole name if it is not one)."""
    head, _, replica = ray_name.rpartition("-")
    return replica if head.startswith("specd-") and re.fullmatch(r"r[0-9]+", replica) else ray_name


def describe_error(err: BaseException) -> str:
    """One line for logs and status: Ray errors carry whole tracebacks."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:500]

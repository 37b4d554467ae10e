"""Routing policy: which ready replica gets the next request.  Pure: no Ray, no HTTP.

Load of a replica, compared in this order (lowest wins):
1. ``queued_tokens + inflight``: prompt tokens waiting in the engine (from the last
   status poll, so up to one health interval old) plus the requests the gateway has
   open on it right now (fresh, counted as one unit each).  Under light load the
   queue is empty and requests spread by count; under pressure the token backlog
   dominates.
2. ``kv_usage``: share of the replica's KV pool in use.
3. ``name``: a deterministic tie-break.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    name: str
    queued_tokens: int = 0
    inflight: int = 0
    kv_usage: float = 0.0

    def key(self) -> tuple[int, float, str]:
        return (self.queued_tokens + self.inflight, self.kv_usage, self.name)


def pick_replica(replicas: Iterable[ReplicaLoad]) -> str | None:
    """Name of the least-loaded replica, or ``None`` when there is none."""
    best = min(replicas, key=ReplicaLoad.key, default=None)
    return None if best is None else best.name

"""Routing policy: which ready replica gets the next request.  Pure: no Ray, no HTTP.

Load of a replica, compared in this order (lowest wins):
1. ``queued_tokens + inflight``: prompt tokens waiting in the engine (from the last
   status poll, so up to one health interval old) plus the requests the gateway has
   open on it right now (fresh, counted as one unit each).  Under light load the
   queue is empty and requests spread by count; under pressure the token backlog
   dominates.
2. ``kv_usage``: share of the replica's KV pool in use.
3. ``name``: a deterministic tie-break.

A new streaming session goes to the replica with the fewest open sessions first (an
idle session holds KV but shows no queue), then by the load above.  Every later turn
goes to that replica only (affinity): the session id carries the actor's name (see
`session_token`), so any gateway can route it without shared state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# ``<actor name>.<engine session id>``: both parts URL-safe, the engine id without dots
_SESSION_TOKEN = re.compile(r"([A-Za-z0-9._-]{1,200})\.([A-Za-z0-9_-]{1,100})")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    name: str
    queued_tokens: int = 0
    inflight: int = 0
    kv_usage: float = 0.0
    sessions_open: int = 0

    def key(self) -> tuple[int, float, str]:
        return (self.queued_tokens + self.inflight, self.kv_usage, self.name)

    def session_key(self) -> tuple[int, int, float, str]:
        return (self.sessions_open, *self.key())


def pick_replica(replicas: Iterable[ReplicaLoad], *, for_session: bool = False) -> str | None:
    """Name of the least-loaded replica (``for_session``: where a new session goes, the
    fewest open sessions first), or ``None`` when there is none."""
    key = ReplicaLoad.session_key if for_session else ReplicaLoad.key
    best = min(replicas, key=key, default=None)
    return None if best is None else best.name


def session_token(actor_name: str, engine_sid: str) -> str:
    """The session id clients see: the engine's id, prefixed by its actor's Ray name."""
    return f"{actor_name}.{engine_sid}"


def parse_session_token(token: str) -> tuple[str, str] | None:
    """``(actor name, engine session id)`` of a `session_token`, or ``None`` if malformed."""
    match = _SESSION_TOKEN.fullmatch(token)
    return None if match is None else (match[1], match[2])

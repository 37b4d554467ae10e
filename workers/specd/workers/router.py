"""Routing policy: which ready replica gets the next request.  Pure: no Ray, no HTTP.

Load of a replica, compared in this order (lowest wins):
1. ``queued_tokens + inflight``: prompt tokens waiting in the engine (from the last
   status poll, so up to one health interval old) plus the requests the gateway has
   open on it right now (fresh, counted as one unit each).  Under light load the
   queue is empty and requests spread by count; under pressure the token backlog
   dominates.
2. ``kv_usage``: share of the replica's KV pool in use.
3. ``name``: a deterministic tie-break.

Cache-aware routing (``spec.routing.policy: cacheAware``, the default) first asks the
gateway's `prefix_affinity` index how much of the prompt each replica likely holds in
its prefix cache (`pick_for_prompt`), as SGLang's router and llm-d's prefix scorer do:
1. the replica with the longest predicted hit gets the prompt when the hit covers at
   least ``cacheThreshold`` of it, unless that replica is too busy: more than
   ``balanceAbsThreshold`` more open requests than the least-loaded one and more than
   ``balanceRelThreshold`` times as many;
2. otherwise the least-loaded replica does, ties going to the one the index credits
   with the least cache (distinct prefixes spread over the replicas).

A new streaming session goes to the replica with the fewest open sessions first (an
idle session holds KV but shows no queue), then by the load above.  Before its first
turn it moves where cache-aware routing would send that turn's prompt for its cached
prefix (`PoolController.first_turn_home`); every later turn goes to its replica only
(affinity).  The session id carries the opening actor's name (see `session_token`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from specd.workers.config import RoutingSpec

# ``<actor name>.<engine session id>``: both parts URL-safe, the engine id without dots
_SESSION_TOKEN = re.compile(r"([A-Za-z0-9._-]{1,200})\.([A-Za-z0-9_-]{1,100})")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    name: str
    queued_tokens: int = 0
    inflight: int = 0
    kv_usage: float = 0.0
    sessions_open: int = 0
    predicted_hit: int = 0  # tokens of this prompt the replica likely has cached
    tracked_tokens: int = 0  # tokens of cache the prefix index credits it with

    def key(self) -> tuple[int, float, str]:
        return (self.queued_tokens + self.inflight, self.kv_usage, self.name)

    def spread_key(self) -> tuple[int, float, int, str]:
        load, kv_usage, name = self.key()
        return (load, kv_usage, self.tracked_tokens, name)

    def session_key(self) -> tuple[int, int, float, str]:
        return (self.sessions_open, *self.key())


def pick_replica(replicas: Iterable[ReplicaLoad], *, for_session: bool = False) -> str | None:
    """Name of the least-loaded replica (``for_session``: where a new session goes, the
    fewest open sessions first), or ``None`` when there is none."""
    key = ReplicaLoad.session_key if for_session else ReplicaLoad.key
    best = min(replicas, key=key, default=None)
    return None if best is None else best.name


RouteReason = Literal["prefix", "load", "balance"]


def pick_for_prompt(
    replicas: Iterable[ReplicaLoad], prompt_tokens: int, rule: RoutingSpec
) -> tuple[str, RouteReason] | None:
    """Cache-aware choice for a ``prompt_tokens``-long prompt: ``(name, reason)``.

    ``reason``: ``prefix`` (the longest predicted hit won), ``load`` (no hit worth
    following: the least-loaded replica), ``balance`` (a hit was there, but its replica
    was too busy), or ``None`` when there is no replica.
    """
    replicas = list(replicas)
    if not replicas:
        return None
    least = min(replicas, key=ReplicaLoad.spread_key)
    cached = min(replicas, key=lambda r: (-r.predicted_hit, *r.key()))
    if cached.predicted_hit == 0 or cached.predicted_hit < rule.cache_threshold * prompt_tokens:
        return least.name, "load"
    if _too_busy(cached.inflight, least.inflight, rule):
        return least.name, "balance"
    return cached.name, "prefix"


def _too_busy(inflight: int, least_inflight: int, rule: RoutingSpec) -> bool:
    """Whether a replica with ``inflight`` open requests is too far above the least
    loaded one for its cache to count (both of the rule's thresholds exceeded)."""
    return (
        inflight - least_inflight > rule.balance_abs_threshold
        and inflight > rule.balance_rel_threshold * least_inflight
    )


def session_token(actor_name: str, engine_sid: str) -> str:
    """The session id clients see: the engine's id, prefixed by its actor's Ray name."""
    return f"{actor_name}.{engine_sid}"


def parse_session_token(token: str) -> tuple[str, str] | None:
    """``(actor name, engine session id)`` of a `session_token`, or ``None`` if malformed."""
    match = _SESSION_TOKEN.fullmatch(token)
    return None if match is None else (match[1], match[2])

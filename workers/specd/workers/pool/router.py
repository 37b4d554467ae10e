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

`RoutingState` is the pool's memory for this: the prefix index and the prompts routed,
by replica and `RouteReason`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

from specd.workers.config import RoutingSpec
from specd.workers.pool.prefix_affinity import CacheShape, PrefixAffinity, PromptBlocks

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


class Routable(Protocol):
    """A replica as routing sees it (`pool.replica.Replica`)."""

    @property
    def name(self) -> str: ...

    @property
    def info(self) -> dict[str, Any]: ...

    def router_load(self) -> ReplicaLoad: ...


R = TypeVar("R", bound=Routable)


class RoutingState:
    """What cache-aware routing remembers: which replica likely caches which prompt
    prefix (`PrefixAffinity`), and the prompts routed to each replica, by `RouteReason`,
    with the prompt tokens predicted cached there."""

    def __init__(self) -> None:
        self.affinity = PrefixAffinity()
        self.routed: Counter[tuple[str, str]] = Counter()
        self.routed_hit_tokens: Counter[str] = Counter()

    def route(
        self, candidates: Mapping[str, R], prompt: Sequence[int], rule: RoutingSpec
    ) -> R | None:
        """The replica of ``candidates`` (by name) that gets ``prompt`` under ``rule``;
        the prompt goes on its prefix record."""
        if rule.policy == "leastLoad":
            name = pick_replica(r.router_load() for r in candidates.values())
            return None if name is None else candidates[name]
        blocks = PromptBlocks(prompt)
        choice = self._cache_aware_choice(candidates, blocks, rule)
        if choice is None:
            return None
        replica, reason, hit = choice
        self._record(replica, blocks)
        self.routed[replica.name, reason] += 1
        self.routed_hit_tokens[replica.name] += hit
        return replica

    def first_turn_home(
        self, candidates: Mapping[str, R], prompt: Sequence[int], current: R, rule: RoutingSpec
    ) -> R | None:
        """Where a new session on ``current`` should move for its first turn ``prompt``:
        the replica of ``candidates`` cache-aware routing would send the prompt to for
        its cached prefix (not too busy), or None to stay (no such replica, it is
        ``current``, or routing is ``leastLoad``)."""
        if rule.policy == "leastLoad":
            return None
        choice = self._cache_aware_choice(candidates, PromptBlocks(prompt), rule)
        if choice is None or choice[1] != "prefix" or choice[0] is current:
            return None
        return choice[0]

    def _cache_aware_choice(
        self, candidates: Mapping[str, R], blocks: PromptBlocks, rule: RoutingSpec
    ) -> tuple[R, RouteReason, int] | None:
        """Cache-aware routing's choice for a prompt among ``candidates``:
        ``(replica, reason, predicted hit tokens)``, None if there is none."""
        shapes = {name: CacheShape.from_info(r.info) for name, r in candidates.items()}
        hits = self.affinity.predicted_hits(blocks, shapes)
        loads = [
            replace(
                r.router_load(),
                predicted_hit=hits[name],
                tracked_tokens=self.affinity.tracked_tokens(name, shapes[name]),
            )
            for name, r in candidates.items()
        ]
        choice = pick_for_prompt(loads, len(blocks.prompt), rule)
        if choice is None:
            return None
        name, reason = choice
        return candidates[name], reason, hits[name]

    def record(self, replica: Routable, prompt: Sequence[int]) -> None:
        """``prompt`` goes to ``replica`` (a session's first turn) outside `route`."""
        self._record(replica, PromptBlocks(prompt))

    def _record(self, replica: Routable, blocks: PromptBlocks) -> None:
        """The prompt's pages will be cached on ``replica``: its prefix record."""
        self.affinity.record(replica.name, blocks, CacheShape.from_info(replica.info))

    def routed_by_reason(self) -> dict[str, int]:
        """Prompts routed by the replicas in the pool, by `RouteReason`."""
        totals: Counter[str] = Counter()
        for (_, reason), count in self.routed.items():
            totals[reason] += count
        return dict(totals)

    def forget(self, name: str) -> None:
        """Replica ``name`` left the pool: its prefix record and routing counts go."""
        self.affinity.forget(name)
        self.routed_hit_tokens.pop(name, None)
        for key in [k for k in self.routed if k[0] == name]:
            del self.routed[key]

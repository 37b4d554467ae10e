"""The gateway's own metrics and the merge of every engine's exposition into one
``/metrics`` page (families merged by name so HELP/TYPE appear once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from specd.workers.pool.controller import PoolController
from specd.workers.pool.replica import DeathReason, ReplicaState

log = logging.getLogger(__name__)


class GatewayMetrics:
    """The gateway's own series, next to the merged engine series on ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "specd_gateway_requests",
            "HTTP requests answered, by route and status code",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "specd_gateway_requests_in_flight",
            "HTTP requests being answered",
            registry=self.registry,
        )
        self.replicas = Gauge(
            "specd_gateway_replicas", "Engine actors by state", ["state"], registry=self.registry
        )
        self.desired_replicas = Gauge(
            "specd_gateway_desired_replicas",
            "Replicas the pool keeps: spec.replicas, or the autoscaler's count (ready below "
            "it: a replica is missing or starting)",
            registry=self.registry,
        )
        self.wanted_replicas = Gauge(
            "specd_gateway_autoscaler_wanted_replicas",
            "Replicas the load asks for before spec.autoscaling's bounds (the desired "
            "count without autoscaling): above the desired count for long, the deployment "
            "is pinned at maxReplicas",
            registry=self.registry,
        )
        self.ongoing_requests = Gauge(
            "specd_gateway_ongoing_requests",
            "Streams the gateway has open on its replicas (running or queued in their "
            "engines) and requests held for a replica to start: the autoscaler's load",
            registry=self.registry,
        )
        self.held_requests = Gauge(
            "specd_gateway_held_requests",
            "Requests waiting for a replica to start (autoscaling.minReplicas 0, scaled to zero)",
            registry=self.registry,
        )
        self._routing = _RoutingCounts()
        self.registry.register(self._routing)

    def observe_pool(self, pool: PoolController) -> None:
        self._routing.pool = pool
        self.desired_replicas.set(pool.desired_replicas)
        self.wanted_replicas.set(pool.wanted_replicas)
        self.ongoing_requests.set(pool.ongoing_requests())
        self.held_requests.set(pool.held_requests)
        states = [a.state for a in pool.status().actors]
        for state in ReplicaState:
            self.replicas.labels(state.value).set(states.count(state.value))


def merge_expositions(texts: Iterable[str], *registries: CollectorRegistry) -> bytes:
    """One exposition from several: families merged by name, so HELP/TYPE appear once.

    Engine samples already carry distinct ``replica`` labels, so samples never collide.
    A family whose type differs from the first one seen (a mixed-version rollout) is
    dropped rather than emitted invalid.
    """
    families: dict[str, Metric] = {}

    def add(family: Metric) -> None:
        have = families.setdefault(family.name, family)
        if have is family:
            return
        if have.type == family.type:
            have.samples.extend(family.samples)
        else:
            log.warning(
                "metric %s: type %s conflicts with %s; dropped", family.name, family.type, have.type
            )

    for text in texts:
        for family in text_string_to_metric_families(text):
            add(family)
    for registry in registries:
        for family in registry.collect():
            add(family)

    merged = CollectorRegistry(auto_describe=False)
    merged.register(_Families(list(families.values())))
    return generate_latest(merged)


class _Families:
    """A collector that returns fixed families (what `generate_latest` renders)."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class _RoutingCounts:
    """The pool's counts as counters, read at scrape: routing (`PoolController.route`),
    session moves (`SessionDirectory.outcomes`), placements (`SessionDirectory.placements`),
    replica deaths (`DeathReason`), streams cut off for a stalled client and the
    leak-check failures of replicas gone."""

    def __init__(self) -> None:
        self.pool: PoolController | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        if self.pool is None:
            return []
        routed = CounterMetricFamily(
            "specd_gateway_routed_requests",
            "Prompts routed to each replica, by why it was chosen: prefix (the longest "
            "predicted cache hit), load (least loaded), balance (a hit's replica was too busy)",
            labels=["replica", "reason"],
        )
        for (replica, reason), count in sorted(self.pool.routed.items()):
            routed.add_metric([replica, reason], count)
        hits = CounterMetricFamily(
            "specd_gateway_routed_predicted_hit_tokens",
            "Prompt tokens predicted cached on the replica each prompt was routed to",
            labels=["replica"],
        )
        for replica, count in sorted(self.pool.routed_hit_tokens.items()):
            hits.add_metric([replica], count)
        moves = CounterMetricFamily(
            "specd_gateway_session_moves",
            "Idle sessions of retired replicas, by outcome: kv (moved with their KV), "
            "history (moved; the next turn re-prefills), ended (no replica could take them)",
            labels=["outcome"],
        )
        for outcome in ("kv", "history", "ended"):
            moves.add_metric([outcome], self.pool.session_directory.outcomes[outcome])
        placements = CounterMetricFamily(
            "specd_gateway_session_placements",
            "New sessions whose first turn's prompt prefix is cached on another replica, by "
            "outcome: moved (there), refused (that replica was full: they stayed), stayed "
            "(closed or busy meanwhile), ended (no replica took them back)",
            labels=["outcome"],
        )
        for outcome in ("moved", "refused", "stayed", "ended"):
            placements.add_metric([outcome], self.pool.session_directory.placements[outcome])
        return [routed, hits, moves, placements, *self._replica_losses()]

    def _replica_losses(self) -> list[Metric]:
        deaths = CounterMetricFamily(
            "specd_replica_deaths",
            "Replicas that died, by reason: engine_error (its engine loop died), load_error "
            "(it did not start), probe_timeout (no answer to a health probe), actor_died "
            "(its process is gone), killed (ray.kill); each is replaced",
            labels=["reason"],
        )
        for reason in DeathReason:
            deaths.add_metric([reason.value], self.pool.deaths[reason])
        cut_off = CounterMetricFamily(
            "specd_gateway_streams_cut_off",
            "Streamed responses cut off because their client stopped reading while "
            "spec.gateway.maxStreamBacklog deltas waited (each request aborted, its KV freed)",
            value=self.pool.supervisor.streams_cut_off,
        )
        retired = CounterMetricFamily(
            "specd_retired_leak_check_failures",
            "KV leak-check failures of replicas no longer in the pool (dead or retired), as "
            "last reported: their specd_leak_checks_total series end with them",
            value=self.pool.retired_leak_check_failures,
        )
        return [deaths, cut_off, retired]


CLIENT_GONE = 499  # nginx's code for a request whose client left before it was answered


class CountRequests:
    """ASGI middleware: counts every response by route template and status code; a
    request whose client left before any answer (mid-body, or cut off by
    ``requestReadTimeoutSeconds``) counts as `CLIENT_GONE`, not as a 500."""

    def __init__(self, app: Any, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def receive_and_note() -> dict:
            nonlocal status
            message = await receive()
            if message["type"] == "http.disconnect" and status == 500:
                status = CLIENT_GONE
            return message

        async def send_and_note(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive_and_note, send_and_note)
        finally:
            self.metrics.in_flight.dec()
            endpoint = getattr(scope.get("route"), "path", "other")  # never raw paths: cardinality
            self.metrics.requests.labels(endpoint, str(status)).inc()

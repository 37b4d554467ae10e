"""Pool controller: keeps ``spec.replicas`` ready engine actors and streams requests to them.

A background task probes every actor (``status()`` with a timeout) each health
interval and then runs one level-based reconcile: `plan_reconcile` (pure, `plan`)
compares the live replicas with the desired spec and says how many to start and which
to retire.  Starting and retiring run as tasks, so a slow model load never stalls
health probes.  The Ray calls themselves are the `ReplicaSupervisor`'s (`supervisor`).

    state:  starting --info() answers--> ready --retired--> draining --drained--> (killed)
                 \\______________ probe fails / actor dies ______________/--> dead

A dead actor is killed and replaced under a new replica name (``r0, r1, ...`` never
reused), so metrics of a replacement never mix with its predecessor's.  A config-hash
change rolls one replica at a time with one surge replica: start new -> ready ->
drain old -> kill old.  A drained replica's idle sessions move to the others before it is
killed, with their KV (`SessionDirectory`), so no conversation is lost to a roll or a
scale-down.  With ``spec.autoscaling`` the count to keep is the `Autoscaler`'s, fed
the streams open on the replicas at every probe.

A ready replica is also watched (`EngineActor.wait_unhealthy`): an engine loop that
dies, or an actor that goes, marks it dead at once, not at the next probe.  Every death
is counted by `DeathReason`, and a replica that leaves the pool leaves its last
leak-check failure count in ``retired_leak_check_failures`` (its own series leave
``/metrics`` with it).  A model that fails to load with the same `ReplicaLoadError` twice
in a row (an unsupported architecture, a missing tensor) is a `ReplicaFailure`: no
replica of that config hash is started again until the spec changes.

Requests go to the replica `RoutingState` picks (`router`); a session's turns to the
replica the `SessionDirectory` knows holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from ray.exceptions import RayError

from specd.workers.config import DeploymentSpec
from specd.workers.contracts import (
    AdminStatus,
    AutoscalingStatus,
    ReplicaDeaths,
    ReplicaStatus,
    RoutingStatus,
)
from specd.workers.pool.actor import create_engine_actor
from specd.workers.pool.autoscaler import Autoscaler
from specd.workers.pool.plan import plan_reconcile
from specd.workers.pool.replica import (
    DeathReason,
    Replica,
    ReplicaFailure,
    ReplicaState,
    death_reason,
    describe_error,
)
from specd.workers.pool.router import RoutingState, pick_replica
from specd.workers.pool.session_directory import SessionDirectory
from specd.workers.pool.supervisor import ActorFactory, ReplicaSupervisor
from specd.workers.types import GenerateDelta, GenerateRequest

log = logging.getLogger(__name__)

_HELD_POLL_S = 0.05  # how often a request held for a replica looks for one


class PoolController:
    def __init__(
        self,
        spec: DeploymentSpec,
        *,
        name: str = "specd",
        health_interval_s: float = 2.0,
        probe_timeout_s: float = 10.0,
        start_timeout_s: float = 900.0,
        drain_timeout_s: float = 60.0,
        actor_factory: ActorFactory = create_engine_actor,
    ):
        self.spec = spec
        self.name = name
        self.health_interval_s = health_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.start_timeout_s = start_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._replicas: dict[str, Replica] = {}
        self.supervisor = ReplicaSupervisor(
            name,
            self._replicas,
            actor_factory=actor_factory,
            start_timeout_s=start_timeout_s,
            probe_timeout_s=probe_timeout_s,
            on_status=self.note_status,
            on_change=self._kick,
        )
        # restart counts owed to the next replacements (a scale-down forgets the surplus)
        self._replaced_restarts: deque[int] = deque()
        self._wake = asyncio.Event()
        self._monitor: asyncio.Task | None = None
        self.deaths = self.supervisor.deaths  # by `DeathReason`
        self.events = self.supervisor.events
        self.retired_leak_check_failures = 0  # last known counts of replicas now gone
        self.routing = RoutingState()
        # what each replica likely has cached; prompts routed, by (replica, `RouteReason`);
        # prompt tokens predicted cached there
        self.affinity = self.routing.affinity
        self.routed = self.routing.routed
        self.routed_hit_tokens = self.routing.routed_hit_tokens
        self.released = False  # `stop` ran: the actors are gone and stay gone
        self.session_directory = SessionDirectory()  # where sessions are, and their moves
        self.autoscaler: Autoscaler | None = None  # with spec.autoscaling, from `start`
        self.held_requests = 0  # requests waiting for a replica to start (scaled to zero)

    @property
    def desired_replicas(self) -> int:
        """The replicas to keep: ``spec.replicas``, or the autoscaler's count."""
        return self.spec.replicas if self.autoscaler is None else self.autoscaler.replicas

    @property
    def wanted_replicas(self) -> int:
        """The replicas the load asks for before the autoscaler's bounds (without
        autoscaling: the desired count)."""
        return self.desired_replicas if self.autoscaler is None else self.autoscaler.wanted

    async def start(self) -> None:
        """Adopt this deployment's running actors, then begin reconciling (returns once
        adoption is done; see `wait_converged`).  A released pool stays released."""
        if self._monitor is None and not self.released:
            await self.supervisor.adopt_running_actors()
            if self.spec.autoscaling is not None:  # a restarted gateway keeps what runs
                adopted = len(self._replicas)
                self.autoscaler = Autoscaler(self.spec.autoscaling, adopted or self.spec.replicas)
            self._monitor = asyncio.create_task(self._monitor_loop(), name="specd-pool-monitor")

    async def detach(self) -> None:
        """Stop reconciling and forget every actor without draining or killing it, so a
        new controller (a replacement gateway) adopts them; their requests keep running."""
        await self._stop_reconciling()
        self._replicas.clear()

    async def _stop_reconciling(self) -> None:
        """Cancel the monitor loop and every start/retire task."""
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.wait({self._monitor})  # a cancel of this caller still propagates
            self._monitor = None
        self.supervisor.cancel_tasks()

    async def stop(self, drain_timeout_s: float | None = None) -> list[str]:
        """Drain every replica (in parallel), kill them, stop reconciling for good;
        returns the replicas released."""
        self.released = True
        await self._stop_reconciling()
        timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        await asyncio.gather(
            *(
                self._retire(r, timeout)
                for r in list(self._replicas.values())
                if r.state is not ReplicaState.DEAD
            )
        )
        released = list(self._replicas)
        for name in released:
            self._forget(name)
        self.supervisor.stop_listening()
        return released

    def update_spec(self, spec: DeploymentSpec) -> None:
        """Adopt ``spec``: a new config hash rolls replicas, a new count scales (with
        autoscaling: the count set by hand is taken, and the autoscaler goes on from it)."""
        if spec.config_hash() != self.spec.config_hash():
            self._event("-", "rolling update", f"{self.spec.config_hash()} -> {spec.config_hash()}")
            self.supervisor.backoff.new_config()
        by_hand = spec.replicas if spec.replicas != self.spec.replicas else None
        if spec.autoscaling is None:
            self.autoscaler = None
        elif self.autoscaler is None:
            start_at = self.desired_replicas if by_hand is None else by_hand
            self.autoscaler = Autoscaler(spec.autoscaling, start_at)
        else:
            self.autoscaler.retune(spec.autoscaling, by_hand)
        self.spec = spec
        self._kick()

    async def wait_converged(self, timeout_s: float) -> bool:
        """Wait until exactly the desired replicas are ready and none is in transit."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.converged():
                return True
            await asyncio.sleep(0.05)
        return self.converged()

    def converged(self) -> bool:
        want = self.spec.config_hash()
        states = [(r.state, r.config_hash) for r in self._replicas.values()]
        return len(states) == self.desired_replicas and all(
            s is ReplicaState.READY and h == want for s, h in states
        )

    def ready(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.state is ReplicaState.READY]

    def pick(
        self, exclude: frozenset[str] | set[str] = frozenset(), *, for_session: bool = False
    ) -> Replica | None:
        """The least-loaded ready replica not in ``exclude``; ``for_session``: the one a
        new session should go to (see `router`)."""
        candidates = self._ready_except(exclude)
        name = pick_replica((r.router_load() for r in candidates.values()), for_session=for_session)
        return None if name is None else candidates[name]

    def route(
        self, prompt: Sequence[int], exclude: frozenset[str] | set[str] = frozenset()
    ) -> Replica | None:
        """The ready replica not in ``exclude`` that gets ``prompt`` under
        ``spec.routing`` (see `router`); the prompt goes on its prefix record."""
        return self.routing.route(self._ready_except(exclude), prompt, self.spec.routing)

    def first_turn_home(self, prompt: Sequence[int], current: Replica) -> Replica | None:
        """Where a new session on ``current`` should move for its first turn ``prompt``
        (`RoutingState.first_turn_home`): a current-config replica, or None to stay."""
        candidates = self._ready_except(self._outdated_ready())
        return self.routing.first_turn_home(candidates, prompt, current, self.spec.routing)

    def _outdated_ready(self) -> set[str]:
        """Ready replicas on an older config (leaving in a rolling update)."""
        want = self.spec.config_hash()
        return {r.name for r in self.ready() if r.config_hash != want}

    def _ready_except(self, exclude: frozenset[str] | set[str]) -> dict[str, Replica]:
        return {r.name: r for r in self.ready() if r.name not in exclude}

    def routed_by_reason(self) -> dict[str, int]:
        """Prompts routed by the replicas in the pool, by `RouteReason`."""
        return self.routing.routed_by_reason()

    def _forget(self, name: str) -> Replica:
        """Replica ``name`` left the pool: its last leak-check failure count stays in
        the pool's; its routing records go."""
        replica = self._replicas.pop(name)
        if replica.load is not None:
            self.retired_leak_check_failures += replica.load.leak_check_failures
        self.routing.forget(name)
        return replica

    def serving_actor(self, ray_name: str) -> Replica | None:
        """The ready replica whose actor is named ``ray_name`` (session affinity)."""
        return next((r for r in self.ready() if r.actor_name == ray_name), None)

    async def call(self, replica: Replica, method: str, *args: Any) -> Any:
        """``replica``'s actor ``method(*args)`` (`ReplicaSupervisor.call`)."""
        return await self.supervisor.call(replica, method, *args)

    def stream(self, replica: Replica, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        """``req``'s deltas from ``replica`` (`ReplicaSupervisor.stream`)."""
        return self.supervisor.stream(replica, req, self.spec.gateway.max_stream_backlog)

    def mark_dead(self, replica: Replica, reason: str, cause: DeathReason) -> None:
        """Stop routing to ``replica``, kill its actor, and let reconcile replace it."""
        self.supervisor.mark_dead(replica, reason, cause)

    def status(self) -> AdminStatus:
        """The `/admin/status` document (the operator builds the CR status from it)."""
        replicas = list(self._replicas.values())
        ready = [r for r in replicas if r.state is ReplicaState.READY]
        autoscaling = None
        if self.autoscaler is not None:
            autoscaling = AutoscalingStatus(
                **self.autoscaler.status(time.monotonic()), held_requests=self.held_requests
            )
        failure = self.current_failure()
        return AdminStatus(
            deployment=self.name,
            model=self.spec.served_model_name,
            config_hash=self.spec.config_hash(),
            desired_replicas=self.desired_replicas,
            ready_replicas=len(ready),
            converged=self.converged(),
            released=self.released,
            kv_usage=max((r.load.kv_usage for r in ready if r.load is not None), default=0.0),
            actors=tuple(r.summary() for r in replicas),
            routing=RoutingStatus(
                policy=self.spec.routing.policy,
                routed=self.routed_by_reason(),
                predicted_hit_tokens=self.routed_hit_tokens.total(),
            ),
            autoscaling=autoscaling,
            failure=None if failure is None else failure.summary(),
            replica_deaths=ReplicaDeaths(**{r.value: self.deaths[r] for r in DeathReason}),
            retired_leak_check_failures=self.retired_leak_check_failures,
            events=tuple(self.events),
        )

    def current_failure(self) -> ReplicaFailure | None:
        """The `ReplicaFailure` that holds back starts of the current config, if any."""
        return self.supervisor.backoff.failure_of(self.spec.config_hash())

    async def _monitor_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._probe_all()
                self._autoscale(time.monotonic())
                self._reconcile()
            except Exception:  # the loop must outlive any single failure
                log.exception("pool %s: reconcile failed", self.name)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.health_interval_s):
                    await self._wake.wait()

    async def _probe_all(self) -> None:
        live = [
            r
            for r in self._replicas.values()
            if r.state in (ReplicaState.READY, ReplicaState.DRAINING)
        ]
        await asyncio.gather(*(self._probe(r) for r in live))

    async def _probe(self, replica: Replica) -> None:
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                status = await replica.handle.status.remote()
        except TimeoutError:
            self.mark_dead(
                replica,
                f"no answer to a health probe within {self.probe_timeout_s:g}s",
                DeathReason.PROBE_TIMEOUT,
            )
        except RayError as err:
            self.mark_dead(replica, describe_error(err), death_reason(err))
        else:
            self.note_status(replica, status)
            if not replica.healthy:
                self._engine_failed(replica)

    def _engine_failed(self, replica: Replica) -> None:
        self.supervisor.engine_failed(replica)

    def note_status(self, replica: Replica, status: ReplicaStatus) -> None:
        """A probe's answer: the replica's load, and the blocks its prefix cache evicted
        since the last one leave its prefix record."""
        replica.load = status
        evicted = status.prefix_cache.evicted_blocks
        if evicted.total <= replica.evictions_seen:
            return
        new = evicted.total - replica.evictions_seen
        self.affinity.discard(replica.name, evicted.keys[-new:])
        replica.evictions_seen = evicted.total

    def ongoing_requests(self) -> int:
        """Streams open on the replicas (a retiring one's too: load until they end) and
        requests held for a replica to start."""
        return sum(r.inflight for r in self._replicas.values()) + self.held_requests

    def _autoscale(self, now: float) -> None:
        """Give the autoscaler the load (`ongoing_requests`, and the sessions open on
        ready replicas); an event when it takes a new count."""
        if self.autoscaler is None:
            return
        sessions = sum(r.load.sessions_open for r in self.ready() if r.load is not None)
        change = self.autoscaler.observe(now, self.ongoing_requests(), sessions)
        if change is not None:
            self._event("-", "autoscaled", change.describe())

    @property
    def scales_to_zero(self) -> bool:
        """``spec.autoscaling.minReplicas`` is 0: requests wait for a replica to start."""
        return self.autoscaler is not None and self.autoscaler.policy.min_replicas == 0

    async def wait_for_replica(self, gone: Callable[[], Awaitable[bool]]) -> bool:
        """Hold a request while no replica is ready, in a pool that scales to zero: it
        counts as load, so the autoscaler starts one at once.  True once one is ready;
        False at ``coldStartTimeoutSeconds``, when ``gone()`` (the client left), or at
        once in a pool that does not scale to zero."""
        if self.ready() or not self.scales_to_zero or self.released:
            return bool(self.ready())
        deadline = time.monotonic() + self.autoscaler.policy.cold_start_timeout_seconds
        self.held_requests += 1
        try:
            self._autoscale(time.monotonic())
            self._kick()
            while not self.ready():
                if time.monotonic() >= deadline or await gone():
                    return False
                await asyncio.sleep(_HELD_POLL_S)
            return True
        finally:
            self.held_requests -= 1

    def _reconcile(self) -> None:
        """One synchronous pass: forget the dead, then launch starts and retirements."""
        for name in [n for n, r in self._replicas.items() if r.state is ReplicaState.DEAD]:
            self._replaced_restarts.append(self._forget(name).restarts + 1)
        plan = plan_reconcile(
            list(self._replicas.values()),
            self.desired_replicas,
            self.spec.config_hash(),
            can_start=self.supervisor.backoff.may_start(self.spec.config_hash()),
        )
        for _ in range(plan.start):
            restarts = self._replaced_restarts.popleft() if self._replaced_restarts else 0
            replica = self.supervisor.launch(self.spec, restarts)
            self.supervisor.spawn(self.supervisor.wait_started(replica))
        while len(self._replaced_restarts) > self.desired_replicas:
            self._replaced_restarts.popleft()
        for name in plan.retire:
            self.supervisor.spawn(self._retire(self._replicas[name], self.drain_timeout_s))

    async def _retire(self, replica: Replica, timeout_s: float) -> None:
        """Drain (a ready replica) then kill; in-flight requests get ``timeout_s`` to finish."""
        was_ready = replica.state is ReplicaState.READY
        replica.state = ReplicaState.DRAINING
        self._event(replica.name, "draining", "")
        if was_ready:
            self.session_directory.begin_leaving(replica.actor_name)
            try:
                await self.supervisor.drain(replica, timeout_s)
                await self.supervisor.last_status(replica)
                if not self.released:
                    await self._move_sessions(replica)
            finally:
                self.session_directory.end_leaving(replica.actor_name)
        replica.kill()
        replica.state = ReplicaState.DEAD
        self._event(replica.name, "retired", "")
        self._kick()

    async def _move_sessions(self, replica: Replica) -> None:
        """Move drained ``replica``'s idle sessions to the replicas new sessions would
        go to (`SessionDirectory.move_sessions`), current ones first (in a rolling update,
        not to a replica that leaves next)."""
        outdated = self._outdated_ready()

        def pick(tried: set[str]) -> Replica | None:
            current = self.pick(tried | outdated, for_session=True)
            return current or self.pick(tried, for_session=True)

        moved = await self.session_directory.move_sessions(replica, pick, self.probe_timeout_s)
        if moved:
            detail = ", ".join(f"{moved[k]} {k}" for k in ("kv", "history", "ended") if moved[k])
            self._event(replica.name, "sessions moved", f"{detail} (kv: with their KV)")

    async def find_session(self, ray_name: str, engine_sid: str) -> Replica | None:
        """The ready replica holding session ``engine_sid``, opened on actor ``ray_name``
        (`SessionDirectory.find_session`)."""
        settle_s = self.drain_timeout_s + 2 * self.probe_timeout_s
        return await self.session_directory.find_session(
            ray_name, engine_sid, self, settle_s, self.probe_timeout_s
        )

    def _kick(self) -> None:
        self._wake.set()

    def _event(self, replica: str, event: str, detail: str) -> None:
        self.supervisor.event(replica, event, detail)

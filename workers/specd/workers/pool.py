"""Pool controller: keeps ``spec.replicas`` ready engine actors and streams requests to them.

A background task probes every actor (``status()`` with a timeout) each health
interval and then runs one level-based reconcile: `plan_reconcile` (pure) compares the
live replicas with the desired spec and says how many to start and which to retire.
Starting and retiring run as tasks, so a slow model load never stalls health probes.

    state:  starting --info() answers--> ready --retired--> draining --drained--> (killed)
                 \\______________ probe fails / actor dies ______________/--> dead

A dead actor is killed and replaced under a new replica name (``r0, r1, ...`` never
reused), so metrics of a replacement never mix with its predecessor's.  A config-hash
change rolls one replica at a time with one surge replica: start new -> ready ->
drain old -> kill old.  A drained replica's idle sessions move to the others before it is
killed, with their KV (`session_homes`), so no conversation is lost to a roll or a
scale-down.  With ``spec.autoscaling`` the count to keep is the `Autoscaler`'s, fed
the streams open on the replicas at every probe.

A ready replica is also watched (`EngineActor.wait_unhealthy`): an engine loop that
dies, or an actor that goes, marks it dead at once, not at the next probe.  Every death
is counted by `DeathReason`, and a replica that leaves the pool leaves its last
leak-check failure count in ``retired_leak_check_failures`` (its own series leave
``/metrics`` with it).  A model that fails to load with the same `ReplicaLoadError` twice
in a row (an unsupported architecture, a missing tensor) is a `ReplicaFailure`: no
replica of that config hash is started again until the spec changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError, RayError

from specd.workers.actor import ReplicaLoadError, create_engine_actor
from specd.workers.autoscaler import Autoscaler
from specd.workers.config import DeploymentSpec
from specd.workers.engine.types import FinishReason, GenerateDelta, GenerateRequest
from specd.workers.prefix_affinity import CacheShape, PrefixAffinity, PromptBlocks
from specd.workers.router import ReplicaLoad, RouteReason, pick_for_prompt, pick_replica
from specd.workers.session_homes import SessionHomes

log = logging.getLogger(__name__)

MAX_START_BACKOFF_S = 60.0
_HELD_POLL_S = 0.05  # how often a request held for a replica looks for one
_MAX_SESSION_HOPS = 8  # replicas a session may have moved through (then: ask around)


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

    def summary(self) -> dict[str, Any]:
        return asdict(self)


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
    info: dict[str, Any] = field(default_factory=dict)  # EngineActor.info(), once ready
    load: dict[str, Any] = field(default_factory=dict)  # latest EngineActor.status()
    inflight: int = 0  # streams the gateway has open on it
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    restarts: int = 0  # failures of this replica's predecessors (a replacement inherits +1)
    evictions_seen: int = 0  # prefix-cache block evictions already taken off its record

    def router_load(self) -> ReplicaLoad:
        return ReplicaLoad(
            name=self.name,
            queued_tokens=int(self.load.get("queued_tokens", 0)),
            inflight=self.inflight,
            kv_usage=float(self.load.get("kv_usage", 0.0)),
            sessions_open=int(self.load.get("sessions_open", 0)),
        )

    def note_session_opened(self) -> None:
        """Count a session opening here until the next probe reports the real number
        (so a burst of opens spreads over the replicas; a refused open is forgotten at
        that probe too)."""
        self.load["sessions_open"] = int(self.load.get("sessions_open", 0)) + 1

    @property
    def healthy(self) -> bool:
        return bool(self.load.get("healthy", True))

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "actor_name": self.actor_name,
            "state": self.state.value,
            "config_hash": self.config_hash,
            "inflight": self.inflight,
            "context_length": self.info.get("context_length"),
            "sampling_defaults": self.info.get("sampling_defaults"),
            "load": self.load,
            "error": self.error,
            "restarts": self.restarts,
        }


class _ReplicaView(Protocol):
    name: str
    state: ReplicaState
    config_hash: str


@dataclass(frozen=True, slots=True)
class Plan:
    start: int = 0
    retire: tuple[str, ...] = ()


def plan_reconcile(
    replicas: Sequence[_ReplicaView], desired: int, config_hash: str, *, can_start: bool = True
) -> Plan:
    """What to start and retire so that ``desired`` ready replicas run ``config_hash``.

    ``replicas`` is in creation order.  Outdated replicas still starting are retired at
    once; outdated ready ones go one at a time as current ones become ready, with one
    surge replica started while any remains (so capacity never dips during a roll).
    Scale-down retires starting replicas first, then the newest.
    """
    live = [r for r in replicas if r.state in (ReplicaState.STARTING, ReplicaState.READY)]
    current = [r for r in live if r.config_hash == config_hash]
    outdated = [r for r in live if r.config_hash != config_hash]
    current_starting = [r for r in current if r.state is ReplicaState.STARTING]
    current_ready = [r for r in current if r.state is ReplicaState.READY]
    old_ready = [r for r in outdated if r.state is ReplicaState.READY]
    retire = [r for r in outdated if r.state is ReplicaState.STARTING]

    if len(current) > desired:
        extra = current_starting[::-1] + current_ready[::-1]
        retire += extra[: len(current) - desired] + old_ready
        return Plan(0, tuple(r.name for r in retire))

    surplus = max(0, len(current_ready) + len(old_ready) - desired)
    retire += old_ready[:surplus]
    old_kept = len(old_ready) - surplus
    start = max(0, desired - len(current) - old_kept)
    if start == 0 and old_kept and not current_starting:
        start = 1  # the rolling update's surge replica
    return Plan(start if can_start else 0, tuple(r.name for r in retire))


ActorFactory = Callable[..., Any]


def actor_name(deployment: str, token: str, replica: str) -> str:
    """Ray name of an engine actor; ``token`` (6 hex digits) tells gateways apart, and a
    new gateway adopts every actor whose name matches its deployment (see `start`)."""
    return f"specd-{deployment}-{token}-{replica}"


def replica_of_actor(ray_name: str) -> str:
    """The replica name an `actor_name` ends with (the whole name if it is not one)."""
    head, _, replica = ray_name.rpartition("-")
    return replica if head.startswith("specd-") and re.fullmatch(r"r[0-9]+", replica) else ray_name


def _describe(err: BaseException) -> str:
    """One line for logs and status: Ray errors carry whole tracebacks."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:500]


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
        self._actor_factory = actor_factory
        self._replicas: dict[str, Replica] = {}
        self._seq = itertools.count()
        # restart counts owed to the next replacements (a scale-down forgets the surplus)
        self._replaced_restarts: deque[int] = deque()
        self._token = uuid.uuid4().hex[:6]  # keeps actor names unique across gateways
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._monitor: asyncio.Task | None = None
        self._start_failures = 0
        self._next_start_at = 0.0
        self._last_load_error: tuple[str, str] | None = None  # (config hash, message)
        self.failure: ReplicaFailure | None = None  # see `current_failure`
        self.deaths: Counter[DeathReason] = Counter()
        self.retired_leak_check_failures = 0  # last known counts of replicas now gone
        self.events: deque[dict[str, Any]] = deque(maxlen=50)
        self.affinity = PrefixAffinity()  # what each replica likely has cached
        # prompts routed, by (replica, `RouteReason`); prompt tokens predicted cached there
        self.routed: Counter[tuple[str, str]] = Counter()
        self.routed_hit_tokens: Counter[str] = Counter()
        self.released = False  # `stop` ran: the actors are gone and stay gone
        self.session_homes = SessionHomes()  # where the sessions of retired replicas went
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

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        """Adopt this deployment's running actors, then begin reconciling (returns once
        adoption is done; see `wait_converged`).  A released pool stays released."""
        if self._monitor is None and not self.released:
            await self._adopt_running_actors()
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
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        for task in list(self._tasks):
            task.cancel()

    async def _adopt_running_actors(self) -> None:
        """A gateway restart must not drop running replicas: engine actors are detached
        and named ``specd-<deployment>-...``; ready ones found in the Ray namespace are
        taken over as they are (a different config hash is rolled as usual), anything
        that does not answer or is draining is killed."""
        if not ray.is_initialized():
            return
        mine = re.compile(actor_name(re.escape(self.name), "[0-9a-f]{6}", "r[0-9]+"))
        for ray_name in sorted(n for n in ray.util.list_named_actors() if mine.fullmatch(n)):
            try:
                handle = ray.get_actor(ray_name)
                info = await asyncio.wait_for(handle.info.remote(), self.probe_timeout_s)
                load = await asyncio.wait_for(handle.status.remote(), self.probe_timeout_s)
            except (TimeoutError, RayError, ValueError) as err:
                self._event("-", "not adopted", f"actor {ray_name}: {_describe(err)}")
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(ray_name), no_restart=True)
                continue
            replica = Replica(
                info["replica"], ray_name, handle, info["config_hash"], ReplicaState.READY
            )
            replica.info, replica.load = info, load
            if load.get("draining") or replica.name in self._replicas:
                self._kill(replica)
                continue
            self._replicas[replica.name] = replica
            self._spawn(self._watch(replica))
            self._event(replica.name, "adopted", f"actor {ray_name}, config {replica.config_hash}")
        numbers = [int(n[1:]) for n in self._replicas if n[1:].isdigit()]
        self._seq = itertools.count(max(numbers, default=-1) + 1)

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
        return released

    def update_spec(self, spec: DeploymentSpec) -> None:
        """Adopt ``spec``: a new config hash rolls replicas, a new count scales (with
        autoscaling: the count set by hand is taken, and the autoscaler goes on from it)."""
        if spec.config_hash() != self.spec.config_hash():
            self._event("-", "rolling update", f"{self.spec.config_hash()} -> {spec.config_hash()}")
            # a new config may load: start it at once, and give up only on its own errors
            self.failure, self._last_load_error = None, None
            self._start_failures, self._next_start_at = 0, 0.0
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

    # -- routing and streaming ----------------------------------------------
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
        if self.spec.routing.policy == "leastLoad":
            return self.pick(exclude)
        blocks = PromptBlocks(prompt)
        choice = self._cache_aware_choice(blocks, exclude)
        if choice is None:
            return None
        replica, reason, hit = choice
        self._record(replica, blocks)
        self.routed[replica.name, reason] += 1
        self.routed_hit_tokens[replica.name] += hit
        return replica

    def _cache_aware_choice(
        self, blocks: PromptBlocks, exclude: frozenset[str] | set[str]
    ) -> tuple[Replica, RouteReason, int] | None:
        """Cache-aware routing's choice for a prompt among the ready replicas not in
        ``exclude``: ``(replica, reason, predicted hit tokens)``, None if there is none."""
        candidates = self._ready_except(exclude)
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
        choice = pick_for_prompt(loads, len(blocks.prompt), self.spec.routing)
        if choice is None:
            return None
        name, reason = choice
        return candidates[name], reason, hits[name]

    def note_prompt_served(self, replica: Replica, prompt: Sequence[int]) -> None:
        """``prompt`` goes to ``replica`` (a session's first turn) outside `route`."""
        self._record(replica, PromptBlocks(prompt))

    def _record(self, replica: Replica, blocks: PromptBlocks) -> None:
        """The prompt's pages will be cached on ``replica``: its prefix record."""
        self.affinity.record(replica.name, blocks, CacheShape.from_info(replica.info))

    def first_turn_home(self, prompt: Sequence[int], current: Replica) -> Replica | None:
        """Where a new session on ``current`` should move for its first turn ``prompt``:
        the replica cache-aware routing would send the prompt to for its cached prefix
        (a current-config one, not too busy), or None to stay (no such replica, it is
        ``current``, or routing is ``leastLoad``)."""
        if self.spec.routing.policy == "leastLoad":
            return None
        choice = self._cache_aware_choice(PromptBlocks(prompt), self._outdated_ready())
        if choice is None or choice[1] != "prefix" or choice[0] is current:
            return None
        return choice[0]

    def _outdated_ready(self) -> set[str]:
        """Ready replicas on an older config (leaving in a rolling update)."""
        want = self.spec.config_hash()
        return {r.name for r in self.ready() if r.config_hash != want}

    def _ready_except(self, exclude: frozenset[str] | set[str]) -> dict[str, Replica]:
        return {r.name: r for r in self.ready() if r.name not in exclude}

    def routed_by_reason(self) -> dict[str, int]:
        """Prompts routed by the replicas in the pool, by `RouteReason`."""
        totals: Counter[str] = Counter()
        for (_, reason), count in self.routed.items():
            totals[reason] += count
        return dict(totals)

    def _forget(self, name: str) -> Replica:
        """Replica ``name`` left the pool: its last leak-check failure count stays in
        the pool's; its routing records go."""
        replica = self._replicas.pop(name)
        self.retired_leak_check_failures += int(replica.load.get("leak_check_failures", 0))
        self._forget_routing(name)
        return replica

    def _forget_routing(self, name: str) -> None:
        """Replica ``name`` left the pool: its prefix record and routing counts go."""
        self.affinity.forget(name)
        self.routed_hit_tokens.pop(name, None)
        for key in [k for k in self.routed if k[0] == name]:
            del self.routed[key]

    def serving_actor(self, ray_name: str) -> Replica | None:
        """The ready replica whose actor is named ``ray_name`` (session affinity)."""
        return next((r for r in self.ready() if r.actor_name == ray_name), None)

    async def call(self, replica: Replica, method: str, *args: Any) -> Any:
        """``replica``'s actor ``method(*args)``; raises `ReplicaError` if it fails or
        does not answer within the probe timeout."""
        try:
            ref = getattr(replica.handle, method).remote(*args)
            return await asyncio.wait_for(ref, self.probe_timeout_s)
        except TimeoutError as err:
            raise ReplicaError(
                replica.name, f"replica {replica.name} did not answer {method}", lost=False
            ) from err
        except RayError as err:
            raise self._replica_error(replica, err, method) from err

    async def stream(
        self, replica: Replica, req: GenerateRequest
    ) -> AsyncGenerator[GenerateDelta, None]:
        """``req``'s deltas from ``replica``; leaving early cancels it in the engine.

        Raises `ReplicaError` (never hangs) if the actor dies or fails mid-stream.
        """
        gen = replica.handle.generate.options(num_returns="streaming").remote(req)
        replica.inflight += 1
        finished = False
        try:
            async for ref in gen:
                delta: GenerateDelta = await ref
                finished = delta.finished
                if delta.finish_reason is FinishReason.ERROR and (delta.error_code or 500) >= 500:
                    self._kick()  # the engine may have failed: probe now
                yield delta
        except RayError as err:
            raise self._replica_error(replica, err, "the request") from err
        finally:
            replica.inflight -= 1
            if not finished and replica.state is not ReplicaState.DEAD:
                ray.cancel(gen)  # cancels the actor task -> the engine aborts the request

    def _replica_error(self, replica: Replica, err: RayError, doing: str) -> ReplicaError:
        """The `ReplicaError` for a Ray failure; a dead actor is marked dead (``lost``)."""
        if isinstance(err, RayActorError):
            self.mark_dead(replica, f"died while serving: {_describe(err)}", death_reason(err))
            return ReplicaError(
                replica.name, f"replica {replica.name} died while serving {doing}", lost=True
            )
        return ReplicaError(
            replica.name, f"replica {replica.name} failed: {_describe(err)}", lost=False
        )

    def mark_dead(self, replica: Replica, reason: str, cause: DeathReason) -> None:
        """Stop routing to ``replica``, kill its actor, and let reconcile replace it."""
        if replica.state is ReplicaState.DEAD:
            return
        replica.state = ReplicaState.DEAD
        replica.error = reason
        self.deaths[cause] += 1
        self._event(replica.name, "dead", reason)
        self._kill(replica)
        self._kick()

    # -- observation ----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The `/admin/status` document (the operator builds the CR status from it)."""
        replicas = list(self._replicas.values())
        ready = [r for r in replicas if r.state is ReplicaState.READY]
        return {
            "deployment": self.name,
            "model": self.spec.served_model_name,
            "config_hash": self.spec.config_hash(),
            "desired_replicas": self.desired_replicas,
            "ready_replicas": len(ready),
            "converged": self.converged(),
            "released": self.released,
            "kv_usage": max((float(r.load.get("kv_usage", 0.0)) for r in ready), default=0.0),
            "actors": [r.summary() for r in replicas],
            "routing": {
                "policy": self.spec.routing.policy,
                "routed": self.routed_by_reason(),
                "predicted_hit_tokens": self.routed_hit_tokens.total(),
            },
            "autoscaling": (
                None
                if self.autoscaler is None
                else {
                    **self.autoscaler.status(time.monotonic()),
                    "held_requests": self.held_requests,
                }
            ),
            "failure": None if (failure := self.current_failure()) is None else failure.summary(),
            "replica_deaths": {reason.value: self.deaths[reason] for reason in DeathReason},
            "retired_leak_check_failures": self.retired_leak_check_failures,
            "events": list(self.events),
        }

    def current_failure(self) -> ReplicaFailure | None:
        """The `ReplicaFailure` that holds back starts of the current config, if any."""
        failure = self.failure
        return failure if failure and failure.config_hash == self.spec.config_hash() else None

    async def metrics_texts(self, timeout_s: float = 5.0) -> list[str]:
        """Every live actor's Prometheus exposition (actors that do not answer are skipped)."""
        live = [
            r
            for r in self._replicas.values()
            if r.state in (ReplicaState.READY, ReplicaState.DRAINING)
        ]

        async def one(r: Replica) -> str | None:
            try:
                return (await asyncio.wait_for(r.handle.metrics_text.remote(), timeout_s)).decode()
            except (TimeoutError, RayError):
                return None

        return [t for t in await asyncio.gather(*(one(r) for r in live)) if t is not None]

    # -- reconcile loop -------------------------------------------------------
    async def _monitor_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._probe_all()
                self._autoscale(time.monotonic())
                self._reconcile()
            except Exception:  # the loop must outlive any single failure
                log.exception("pool %s: reconcile failed", self.name)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.health_interval_s)

    async def _probe_all(self) -> None:
        live = [
            r
            for r in self._replicas.values()
            if r.state in (ReplicaState.READY, ReplicaState.DRAINING)
        ]
        await asyncio.gather(*(self._probe(r) for r in live))

    async def _probe(self, replica: Replica) -> None:
        try:
            status = await asyncio.wait_for(replica.handle.status.remote(), self.probe_timeout_s)
        except TimeoutError:
            self.mark_dead(
                replica,
                f"no answer to a health probe within {self.probe_timeout_s:g}s",
                DeathReason.PROBE_TIMEOUT,
            )
        except RayError as err:
            self.mark_dead(replica, _describe(err), death_reason(err))
        else:
            self.note_status(replica, status)
            if not replica.healthy:
                self._engine_failed(replica)

    async def _watch(self, replica: Replica) -> None:
        """Mark ``replica`` dead the moment its engine loop dies or its actor goes
        (`EngineActor.wait_unhealthy`), not at the next probe.  An adopted actor of
        an older version, without that method, is left to the probes."""
        try:
            ref = replica.handle.wait_unhealthy.remote()
        except AttributeError:
            return
        try:
            status = await ref
        except asyncio.CancelledError:  # detached or stopped: end the wait in the actor
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            raise
        except RayActorError as err:  # killed, retired or crashed (a no-op once marked dead)
            self.mark_dead(replica, _describe(err), death_reason(err))
            return
        except RayError:
            return  # the call failed, not the actor: the probes go on
        self.note_status(replica, status)
        self._engine_failed(replica)

    def _engine_failed(self, replica: Replica) -> None:
        self.mark_dead(
            replica, f"engine unhealthy: {replica.load.get('last_error')}", DeathReason.ENGINE_ERROR
        )

    def note_status(self, replica: Replica, status: dict[str, Any]) -> None:
        """A probe's answer: the replica's load, and the blocks its prefix cache evicted
        since the last one leave its prefix record."""
        replica.load = status
        evicted = (status.get("prefix_cache") or {}).get("evicted_blocks")
        if not evicted or evicted["total"] <= replica.evictions_seen:
            return
        new = evicted["total"] - replica.evictions_seen
        self.affinity.discard(replica.name, evicted["keys"][-new:])
        replica.evictions_seen = evicted["total"]

    def ongoing_requests(self) -> int:
        """Streams open on the replicas (a retiring one's too: load until they end) and
        requests held for a replica to start."""
        return sum(r.inflight for r in self._replicas.values()) + self.held_requests

    def _autoscale(self, now: float) -> None:
        """Give the autoscaler the load (`ongoing_requests`, and the sessions open on
        ready replicas); an event when it takes a new count."""
        if self.autoscaler is None:
            return
        sessions = sum(int(r.load.get("sessions_open", 0)) for r in self.ready())
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
            can_start=time.monotonic() >= self._next_start_at and self.current_failure() is None,
        )
        for _ in range(plan.start):
            restarts = self._replaced_restarts.popleft() if self._replaced_restarts else 0
            self._spawn(self._wait_started(self._launch(restarts)))
        while len(self._replaced_restarts) > self.desired_replicas:
            self._replaced_restarts.popleft()
        for name in plan.retire:
            self._spawn(self._retire(self._replicas[name], self.drain_timeout_s))

    def _launch(self, restarts: int = 0) -> Replica:
        """Create an actor for the current spec (synchronously, so the next plan counts it);
        ``restarts`` > 0 when it replaces dead ones."""
        name = f"r{next(self._seq)}"
        ray_name = actor_name(self.name, self._token, name)
        handle = self._actor_factory(self.spec, replica=name, actor_name=ray_name)
        replica = Replica(name, ray_name, handle, self.spec.config_hash(), restarts=restarts)
        self._replicas[name] = replica
        self._event(name, "starting", f"actor {ray_name}, config {replica.config_hash}")
        return replica

    async def _wait_started(self, replica: Replica) -> None:
        try:
            replica.info = await asyncio.wait_for(
                replica.handle.info.remote(), self.start_timeout_s
            )
            replica.load = await asyncio.wait_for(
                replica.handle.status.remote(), self.probe_timeout_s
            )
        except ReplicaLoadError as err:
            self._start_failed(replica, err.message, load_error=True)
            return
        except (TimeoutError, RayError) as err:
            reason = "timed out" if isinstance(err, asyncio.TimeoutError) else _describe(err)
            self._start_failed(replica, reason, load_error=False)
            return
        if replica.state is ReplicaState.STARTING:
            replica.state = ReplicaState.READY
            self._start_failures, self._last_load_error = 0, None
            self._spawn(self._watch(replica))
            self._event(
                replica.name, "ready", f"context length {replica.info.get('context_length')}"
            )
        self._kick()

    def _start_failed(self, replica: Replica, reason: str, *, load_error: bool) -> None:
        """Back off before the next start; the same ``load_error`` twice in a row for
        the current config is a `ReplicaFailure` (no next start).  Anything else (a
        timeout, a lost node) may pass: it is retried."""
        if replica.state is not ReplicaState.STARTING:
            return  # retired while starting: not a start failure
        self._start_failures += 1
        backoff = min(MAX_START_BACKOFF_S, 2.0**self._start_failures)
        self._next_start_at = time.monotonic() + backoff
        seen = (replica.config_hash, reason)
        if load_error and seen == self._last_load_error:
            self.failure = ReplicaFailure(replica.config_hash, replica.name, reason, time.time())
            then = "not restarted until the spec changes"
        else:
            self._last_load_error = seen if load_error else None
            then = f"next try in {backoff:g}s"
        self.mark_dead(replica, f"failed to start ({reason}); {then}", DeathReason.LOAD_ERROR)

    async def _retire(self, replica: Replica, timeout_s: float) -> None:
        """Drain (a ready replica) then kill; in-flight requests get ``timeout_s`` to finish."""
        was_ready = replica.state is ReplicaState.READY
        replica.state = ReplicaState.DRAINING
        self._event(replica.name, "draining", "")
        if was_ready:
            self.session_homes.begin_leaving(replica.actor_name)
            try:
                await self._drain(replica, timeout_s)
                await self._last_status(replica)
                if not self.released:
                    await self._move_sessions(replica)
            finally:
                self.session_homes.end_leaving(replica.actor_name)
        self._kill(replica)
        replica.state = ReplicaState.DEAD
        self._event(replica.name, "retired", "")
        self._kick()

    async def _drain(self, replica: Replica, timeout_s: float) -> None:
        """Let ``replica``'s requests in flight finish (``timeout_s`` at most)."""
        try:
            left = await asyncio.wait_for(
                replica.handle.drain.remote(timeout_s), timeout_s + self.probe_timeout_s
            )
        except (TimeoutError, RayError) as err:
            left = f"unknown ({_describe(err)})"
        if left:
            self._event(replica.name, "drain timeout", f"{left} requests still running are cut off")

    async def _last_status(self, replica: Replica) -> None:
        """A drained replica's final status (its leak checks counted to the end)."""
        with contextlib.suppress(TimeoutError, RayError):
            status = await asyncio.wait_for(replica.handle.status.remote(), self.probe_timeout_s)
            self.note_status(replica, status)

    async def _move_sessions(self, replica: Replica) -> None:
        """Move drained ``replica``'s idle sessions to the replicas new sessions would
        go to (`SessionHomes.move_sessions`), current ones first (in a rolling update,
        not to a replica that leaves next)."""
        outdated = self._outdated_ready()

        def pick(tried: set[str]) -> Replica | None:
            current = self.pick(tried | outdated, for_session=True)
            return current or self.pick(tried, for_session=True)

        moved = await self.session_homes.move_sessions(replica, pick, self.probe_timeout_s)
        if moved:
            detail = ", ".join(f"{moved[k]} {k}" for k in ("kv", "history", "ended") if moved[k])
            self._event(replica.name, "sessions moved", f"{detail} (kv: with their KV)")

    async def find_session(self, ray_name: str, engine_sid: str) -> Replica | None:
        """The ready replica holding session ``engine_sid``, opened on actor ``ray_name``:
        where this gateway last placed it (opened, moved for its first turn, or moved
        off a retired replica, once that one has drained), else whichever holds it."""
        actor = self.session_homes.home_of(engine_sid)
        if actor is None:  # opened before this gateway started
            return await self._locate_session(ray_name, engine_sid)
        for _ in range(_MAX_SESSION_HOPS):
            if (replica := self.serving_actor(actor)) is not None:
                return replica
            await self.session_homes.settled(actor, self.drain_timeout_s + 2 * self.probe_timeout_s)
            home = self.session_homes.home_of(engine_sid)
            if home is None or home == actor:
                break
            actor = home  # it moved; that replica may be leaving too
        return await self._locate_session(ray_name, engine_sid)

    async def _locate_session(self, ray_name: str, engine_sid: str) -> Replica | None:
        """Ask the ready replicas who holds ``engine_sid``; if none does, its opener
        ``ray_name`` (still serving) answers why (closed, expired, unknown)."""
        home = await self.session_homes.find(engine_sid, self.ready(), self.probe_timeout_s)
        return self.serving_actor(ray_name if home is None else home)

    # -- helpers ----------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _kick(self) -> None:
        self._wake.set()

    @staticmethod
    def _kill(replica: Replica) -> None:
        with contextlib.suppress(Exception):  # already gone is fine
            ray.kill(replica.handle, no_restart=True)

    def _event(self, replica: str, event: str, detail: str) -> None:
        log.info("pool %s: %s %s %s", self.name, replica, event, detail)
        self.events.append(
            {"time": time.time(), "replica": replica, "event": event, "detail": detail}
        )

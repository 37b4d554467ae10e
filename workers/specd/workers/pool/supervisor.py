"""The replicas' actors: the one place the pool talks to them through Ray.

`ReplicaSupervisor` carries out what the controller decides, one actor at a time:
- start: `launch` an actor for a spec, `wait_started` until it answers (a failure backs
  the next start off, `StartBackoff`; the same load error twice is a `ReplicaFailure`),
  then `watch` it;
- adopt the actors a previous gateway of the deployment left running
  (`adopt_running_actors`);
- serve: `call` an actor method, `stream` a request's deltas;
- retire: `drain`, then a `last_status`; the controller hands the sessions on and kills it;
- `mark_dead` a replica whose engine or actor failed (the controller's reconcile
  replaces it), counting its `DeathReason`; the pool's event log.

A ready replica is watched (`EngineActor.wait_unhealthy`): an engine loop that dies, or
an actor that goes, marks it dead at once, not at the next probe.
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
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from specd.workers.config import DeploymentSpec
from specd.workers.contracts import PoolEvent, ReplicaInfo, ReplicaStatus
from specd.workers.pool.actor import ReplicaLoadError
from specd.workers.pool.delta_channel import DeltaChannel
from specd.workers.pool.delta_socket import DeltaListener
from specd.workers.pool.plan import StartBackoff
from specd.workers.pool.rank_actor import release_ranks
from specd.workers.pool.replica import (
    DeathReason,
    Replica,
    ReplicaError,
    ReplicaState,
    actor_name,
    death_reason,
    describe_error,
)
from specd.workers.types import FinishReason, GenerateDelta, GenerateRequest

log = logging.getLogger(__name__)

ActorFactory = Callable[..., Any]
StatusSink = Callable[[Replica, ReplicaStatus], None]


class ReplicaSupervisor:
    """Starts, adopts, watches, calls, drains and marks dead the actors in
    ``replicas`` (the controller's, by replica name) of deployment ``deployment``.

    ``on_status(replica, status)`` takes each status an actor reports outside the
    controller's probes (its watch ended, its last status); ``on_change()`` asks the
    controller to reconcile now (a replica became ready, died or left).
    """

    def __init__(
        self,
        deployment: str,
        replicas: dict[str, Replica],
        *,
        actor_factory: ActorFactory,
        start_timeout_s: float,
        probe_timeout_s: float,
        on_status: StatusSink,
        on_change: Callable[[], None],
    ):
        self.deployment = deployment
        self._replicas = replicas
        self._actor_factory = actor_factory
        self.start_timeout_s = start_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self._on_status = on_status
        self._on_change = on_change
        self._seq = itertools.count()
        self._token = uuid.uuid4().hex[:6]  # keeps actor names unique across gateways
        self._tasks: set[asyncio.Task] = set()
        self._channels: dict[str, DeltaChannel] = {}  # by replica name
        self._listener = DeltaListener()  # where the actors connect their channels
        self.streams_cut_off = 0  # streams whose client stopped reading (`DeltaChannel`)
        self.backoff = StartBackoff()
        self.deaths: Counter[DeathReason] = Counter()
        self.events: deque[PoolEvent] = deque(maxlen=50)

    async def adopt_running_actors(self) -> None:
        """A gateway restart must not drop running replicas: engine actors are detached
        and named ``specd-<deployment>-...``; ready ones found in the Ray namespace are
        taken over as they are (a different config hash is rolled as usual), anything
        that does not answer or is draining is killed."""
        if not ray.is_initialized():
            return
        mine = re.compile(actor_name(re.escape(self.deployment), "[0-9a-f]{6}", "r[0-9]+"))
        for ray_name in sorted(n for n in ray.util.list_named_actors() if mine.fullmatch(n)):
            try:
                handle = ray.get_actor(ray_name)
                # validated: an actor of another specd version may answer other fields
                async with asyncio.timeout(self.probe_timeout_s):
                    info = ReplicaInfo.model_validate(await handle.info.remote())
                async with asyncio.timeout(self.probe_timeout_s):
                    load = ReplicaStatus.model_validate(await handle.status.remote())
            except (TimeoutError, RayError, ValueError) as err:  # ValidationError too
                self.event("-", "not adopted", f"actor {ray_name}: {describe_error(err)}")
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(ray_name), no_restart=True)
                with contextlib.suppress(Exception):
                    release_ranks(ray_name)
                continue
            replica = Replica(info.replica, ray_name, handle, info.config_hash, ReplicaState.READY)
            replica.info, replica.load = info, load
            if load.draining or replica.name in self._replicas:
                replica.kill()
                continue
            self._replicas[replica.name] = replica
            self.spawn(self.watch(replica))
            self.event(replica.name, "adopted", f"actor {ray_name}, config {replica.config_hash}")
        numbers = [int(n[1:]) for n in self._replicas if n[1:].isdigit()]
        self._seq = itertools.count(max(numbers, default=-1) + 1)

    def launch(self, spec: DeploymentSpec, restarts: int = 0) -> Replica:
        """Create an actor for ``spec`` (synchronously, so the next plan counts it);
        ``restarts`` > 0 when it replaces dead ones."""
        name = f"r{next(self._seq)}"
        ray_name = actor_name(self.deployment, self._token, name)
        handle = self._actor_factory(spec, replica=name, actor_name=ray_name)
        replica = Replica(name, ray_name, handle, spec.config_hash(), restarts=restarts)
        self._replicas[name] = replica
        self.event(name, "starting", f"actor {ray_name}, config {replica.config_hash}")
        return replica

    async def wait_started(self, replica: Replica) -> None:
        try:
            async with asyncio.timeout(self.start_timeout_s):
                replica.info = await replica.handle.info.remote()
            async with asyncio.timeout(self.probe_timeout_s):
                replica.load = await replica.handle.status.remote()
        except ReplicaLoadError as err:
            self._start_failed(replica, err.message, load_error=True)
            return
        except (TimeoutError, RayError) as err:
            reason = "timed out" if isinstance(err, asyncio.TimeoutError) else describe_error(err)
            self._start_failed(replica, reason, load_error=False)
            return
        if replica.state is ReplicaState.STARTING:
            replica.state = ReplicaState.READY
            self.backoff.started()
            self.spawn(self.watch(replica))
            self.event(replica.name, "ready", f"context length {replica.info.context_length}")
        self._on_change()

    def _start_failed(self, replica: Replica, reason: str, *, load_error: bool) -> None:
        """Back off before the next start (`StartBackoff.failed`)."""
        if replica.state is not ReplicaState.STARTING:
            return  # retired while starting: not a start failure
        then = self.backoff.failed(replica.config_hash, replica.name, reason, load_error=load_error)
        self.mark_dead(replica, f"failed to start ({reason}); {then}", DeathReason.LOAD_ERROR)

    async def watch(self, replica: Replica) -> None:
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
            self.mark_dead(replica, describe_error(err), death_reason(err))
            return
        except RayError:
            return  # the call failed, not the actor: the probes go on
        self._on_status(replica, status)
        self.engine_failed(replica)

    def engine_failed(self, replica: Replica) -> None:
        error = replica.load.last_error if replica.load is not None else None
        self.mark_dead(replica, f"engine unhealthy: {error}", DeathReason.ENGINE_ERROR)

    def mark_dead(self, replica: Replica, reason: str, cause: DeathReason) -> None:
        """Stop routing to ``replica``, kill its actor, and let reconcile replace it."""
        if replica.state is ReplicaState.DEAD:
            return
        replica.state = ReplicaState.DEAD
        replica.error = reason
        self.deaths[cause] += 1
        self.event(replica.name, "dead", reason)
        replica.kill()
        self._on_change()

    async def call(self, replica: Replica, method: str, *args: Any) -> Any:
        """``replica``'s actor ``method(*args)``; raises `ReplicaError` if it fails or
        does not answer within the probe timeout."""
        try:
            ref = getattr(replica.handle, method).remote(*args)
            async with asyncio.timeout(self.probe_timeout_s):
                return await ref
        except TimeoutError as err:
            raise ReplicaError(
                replica.name, f"replica {replica.name} did not answer {method}", lost=False
            ) from err
        except RayError as err:
            raise self._replica_error(replica, err, method) from err

    async def stream(
        self, replica: Replica, req: GenerateRequest, max_backlog: int
    ) -> AsyncGenerator[GenerateDelta, None]:
        """``req``'s deltas from ``replica`` (through its `DeltaChannel`); leaving early
        cancels it in the engine, and so does a client that lets ``max_backlog`` deltas
        wait (the stream then ends with an error delta).

        Raises `ReplicaError` (never hangs) if the actor dies or fails mid-stream.
        """
        channel = self._channel(replica)
        pending = channel.register(req.rid, max_backlog)
        replica.inflight += 1
        finished = False
        try:
            channel.submit(req)
            while not finished:
                delta = await pending.next()
                finished = delta.finished
                if delta.finish_reason is FinishReason.ERROR and (delta.error_code or 500) >= 500:
                    self._on_change()  # the engine may have failed: probe now
                yield delta
        finally:
            replica.inflight -= 1
            channel.unregister(req.rid)
            if not finished and not pending.cut_off and replica.state is not ReplicaState.DEAD:
                channel.cancel(req.rid)  # the engine aborts the request

    def _channel(self, replica: Replica) -> DeltaChannel:
        """``replica``'s open channel, or a new one."""
        if (channel := self._channels.get(replica.name)) is None:
            channel = DeltaChannel(
                replica.name,
                replica.handle,
                f"{self._token}-{uuid.uuid4().hex[:8]}",
                self._listener,
                on_error=lambda err: self._replica_error(replica, err, "the request"),
                on_closed=self._forget_channel,
                on_cut_off=self._count_cut_off,
                settle_timeout_s=self.probe_timeout_s,
            )
            self._channels[replica.name] = channel
        return channel

    def _count_cut_off(self) -> None:
        self.streams_cut_off += 1

    def _forget_channel(self, channel: DeltaChannel) -> None:
        if self._channels.get(channel.replica) is channel:
            del self._channels[channel.replica]

    def _replica_error(self, replica: Replica, err: RayError, doing: str) -> ReplicaError:
        """The `ReplicaError` for a Ray failure; a dead actor is marked dead (``lost``)."""
        if isinstance(err, RayActorError):
            self.mark_dead(replica, f"died while serving: {describe_error(err)}", death_reason(err))
            return ReplicaError(
                replica.name, f"replica {replica.name} died while serving {doing}", lost=True
            )
        return ReplicaError(
            replica.name, f"replica {replica.name} failed: {describe_error(err)}", lost=False
        )

    async def metrics_texts(self, timeout_s: float = 5.0) -> list[str]:
        """Every live actor's Prometheus exposition (actors that do not answer are skipped)."""
        live = [
            r
            for r in self._replicas.values()
            if r.state in (ReplicaState.READY, ReplicaState.DRAINING)
        ]

        async def one(r: Replica) -> str | None:
            try:
                async with asyncio.timeout(timeout_s):
                    return (await r.handle.metrics_text.remote()).decode()
            except (TimeoutError, RayError):
                return None

        return [t for t in await asyncio.gather(*(one(r) for r in live)) if t is not None]

    async def drain(self, replica: Replica, timeout_s: float) -> None:
        """Let ``replica``'s requests in flight finish (``timeout_s`` at most)."""
        try:
            async with asyncio.timeout(timeout_s + self.probe_timeout_s):
                left = await replica.handle.drain.remote(timeout_s)
        except (TimeoutError, RayError) as err:
            left = f"unknown ({describe_error(err)})"
        if left:
            self.event(replica.name, "drain timeout", f"{left} requests still running are cut off")

    async def last_status(self, replica: Replica) -> None:
        """A drained replica's final status (its leak checks counted to the end)."""
        with contextlib.suppress(TimeoutError, RayError):
            async with asyncio.timeout(self.probe_timeout_s):
                status = await replica.handle.status.remote()
            self._on_status(replica, status)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background until it ends or `cancel_tasks`."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop_listening(self) -> None:
        """Accept no more delta connections (channels open go on)."""
        self._listener.close()

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def event(self, replica: str, event: str, detail: str) -> None:
        log.info("pool %s: %s %s %s", self.deployment, replica, event, detail)
        self.events.append(PoolEvent(time=time.time(), replica=replica, event=event, detail=detail))

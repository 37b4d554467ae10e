"""The engine actor: one `Engine` in a Ray actor process, plus draining.

The pool controller creates these with `create_engine_actor`.  Each gateway opens one
channel per replica (``deltas(channel, address)``, which connects to the gateway:
`delta_channel`, `delta_socket`) and sends its requests on that connection, and the
cancels of those it leaves early; a cancel closes the engine's generator and so aborts
the request inside the engine.  The requests' deltas come back on it.

Session calls answer a `SessionReply` instead of raising: Ray wraps an actor's
exceptions, and the gateway needs the engine's status code as is.

A model that cannot load for a reason in its files or the spec (`ConfigError`,
`ModelLoadError`: an unsupported architecture, a missing tensor) does not fail the
actor's creation, which Ray would report as an untyped actor death: the actor stays up
and ``info()`` raises `ReplicaLoadError`, which the pool catches by type and does not
retry forever.  ``wait_unhealthy()`` returns as soon as the engine loop has died, so the
pool learns of it at once rather than at its next probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import ray

from specd.workers.bench_knobs import BenchKnobs, BenchKnobsError
from specd.workers.config import ConfigError, DeploymentSpec
from specd.workers.contracts import DELTA_WIRE, ReplicaInfo, ReplicaStatus
from specd.workers.engine.engine import Engine
from specd.workers.model.config import ModelLoadError
from specd.workers.pool.delta_outbox import DeltaOutbox
from specd.workers.pool.delta_socket import ChannelCommands, DeltaAddress, send_batches
from specd.workers.pool.rank_actor import (
    in_bundle,
    rank_gpus,
    reserve_ranks,
    start_ranks,
)
from specd.workers.types import (
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    SessionError,
    SessionSnapshot,
)

# Every in-flight stream holds one concurrency slot, and status/ping/abort calls must
# never wait behind them.
MAX_CONCURRENCY = 10_000
_DRAIN_POLL_S = 0.05
_HEALTH_POLL_S = 0.05  # how often `wait_unhealthy` looks at the engine


class ReplicaLoadError(Exception):
    """The replica's model cannot load for a reason in its files or the spec (the same
    on every try); raised by ``info()``, caught by type in the pool."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class SessionReply:
    """What a session call returned: ``session_id`` (open), or ``error`` and its HTTP
    ``code`` (400 disabled, 404 unknown, 410 closed or expired, 429 full, 503 draining)."""

    session_id: str | None = None
    error: str | None = None
    code: int = 200
    kv_moved: bool = False  # import_session: the session's KV came along
    from_source: bool = False  # import_session: the source's export refused

    @property
    def ok(self) -> bool:
        return self.error is None


def _refusal(err: SessionError, **extra: Any) -> SessionReply:
    return SessionReply(error=str(err), code=err.code, **extra)


def _session_call(fn: Callable[..., str | None], *args: Any) -> SessionReply:
    try:
        return SessionReply(session_id=fn(*args))
    except SessionError as err:
        return _refusal(err)


class EngineActor:
    """Ray actor body; every method is async so the actor runs on one event loop."""

    def __init__(self, spec: DeploymentSpec, replica: str):
        self._spec = spec
        self._draining = False
        self._inflight = 0
        self._load_error: str | None = None
        rendezvous, self._ranks = None, None
        if spec.parallelism.tensor > 1:  # this actor is rank 0; the others are its children
            self._ranks = start_ranks(spec, ray.get_runtime_context().get_actor_name())
            rendezvous = self._ranks.rendezvous
        try:
            self._engine = Engine(
                spec, replica=replica, knobs=BenchKnobs.from_env(), rendezvous=rendezvous
            )
            self._engine.start()
        except (ConfigError, ModelLoadError, BenchKnobsError) as err:  # reported by `info`, typed
            self._load_error = str(err)
        except BaseException:
            if self._ranks is not None:
                self._ranks.kill()
            raise
        if self._ranks is not None:
            if self._load_error is None:
                self._ranks.watch(self._engine.ranks.rank_ended)
            else:
                self._ranks.kill()

    async def deltas(self, channel: str, address: DeltaAddress) -> None:
        """Serve channel ``channel`` of the gateway at ``address``: its requests in, their
        deltas out, batched, for as long as the gateway keeps the connection (this call
        stays open meanwhile, so the gateway learns from Ray if this actor dies); when
        it closes, the channel's requests are cancelled."""
        outbox = DeltaOutbox()
        try:
            await send_batches(address, outbox, lambda commands: self._apply(outbox, commands))
        finally:
            outbox.close()

    def _apply(self, outbox: DeltaOutbox, commands: ChannelCommands) -> None:
        """The gateway's frame: start its requests (their deltas go to ``outbox``), then
        end those it cancels (the engine aborts them; unknown or finished: nothing)."""
        for req in commands.submits:
            outbox.forward(req.rid, self._generate(req))
        for rid in commands.cancels:
            outbox.cancel(rid)

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """``req``'s deltas; while draining, refuse it with a 503 delta."""
        if self._draining:
            yield GenerateDelta(
                rid=req.rid,
                finished=True,
                finish_reason=FinishReason.ERROR,
                error=f"replica {self._engine.replica} is draining; retry on another replica",
                error_code=503,
            )
            return
        self._inflight += 1
        try:
            async with contextlib.aclosing(self._engine.generate(req)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self._inflight -= 1

    async def abort(self, rid: str) -> None:
        self._engine.abort(rid)

    async def open_session(self) -> SessionReply:
        """A new streaming session on this replica (refused while draining)."""
        if self._draining:
            return self._draining_reply()
        return _session_call(self._engine.open_session)

    async def close_session(self, session_id: str) -> SessionReply:
        """Close a session; a turn in flight on it is aborted."""
        return _session_call(self._engine.close_session, session_id)

    async def has_session(self, session_id: str) -> bool:
        return self._engine.sessions.holds(session_id)

    async def idle_session_ids(self) -> list[str]:
        return await self._engine.idle_session_ids()

    async def export_session(self, session_id: str) -> SessionSnapshot | SessionReply:
        """Take an idle session out for a move (the pool passes the result, unawaited,
        to another replica's `import_session`)."""
        try:
            return await self._engine.export_session(session_id)
        except SessionError as err:
            return _refusal(err, from_source=True)

    async def import_session(self, snapshot: SessionSnapshot | SessionReply) -> SessionReply:
        """Hold a session exported by another replica (refused while draining)."""
        if isinstance(snapshot, SessionReply):
            return snapshot
        if self._draining:
            return self._draining_reply()
        try:
            kv_moved = await self._engine.import_session(snapshot)
        except SessionError as err:
            return _refusal(err)
        return SessionReply(session_id=snapshot.session_id, kv_moved=kv_moved)

    def _draining_reply(self) -> SessionReply:
        """A session call refused because this replica is leaving the pool."""
        return SessionReply(error=f"replica {self._engine.replica} is draining", code=503)

    async def info(self) -> ReplicaInfo:
        """Static facts: answered once the model is loaded (the readiness signal);
        `ReplicaLoadError` if it could not load."""
        if self._load_error is not None:
            raise ReplicaLoadError(self._load_error)
        return ReplicaInfo(
            replica=self._engine.replica,
            delta_wire=DELTA_WIRE,
            config_hash=self._spec.config_hash(),
            model=self._spec.served_model_name,
            context_length=self._engine.context_length,
            vocab_size=self._engine.model_config.vocab_size,  # the gateway's id checks
            sampling_defaults=self._engine.sampling_defaults,
            device=str(self._engine.device),
            prefix_cache=self._engine.prefix_cache_shape(),
        )

    async def status(self) -> ReplicaStatus:
        """The engine's status, with its leak-check failures as counted now (the
        engine's status snapshot stops refreshing when its loop dies)."""
        return ReplicaStatus.of_engine(
            self._engine.status(),
            leak_check_failures=self._engine.metrics.leak_failures,
            draining=self._draining,
            inflight=self._inflight,
        )

    async def wait_unhealthy(self) -> ReplicaStatus:
        """Return `status` once the engine loop has died (the pool waits on this)."""
        while self._engine.healthy:
            await asyncio.sleep(_HEALTH_POLL_S)
        return await self.status()

    async def metrics_text(self) -> bytes:
        return self._engine.metrics_text()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait for in-flight ones; returns how many remain."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        return self._inflight

    async def ping(self) -> bool:
        return True


_RemoteEngineActor = ray.remote(EngineActor)


def create_engine_actor(
    spec: DeploymentSpec, *, replica: str, actor_name: str
) -> ray.actor.ActorHandle:
    """Start an actor serving ``spec``; it is ready once ``info()`` answers.

    ``max_restarts=0``: the pool controller replaces a dead actor itself (under a new
    replica name) so that the dead one's in-flight requests fail cleanly.  Detached, so
    the actor outlives a gateway that dies: the next gateway adopts it by name.  At
    tensor > 1 it is rank 0, in bundle 0 of the replica's placement group.
    """
    placement = {}
    if spec.parallelism.tensor > 1:  # rank 0 in bundle 0 of the replica's ranks
        placement["scheduling_strategy"] = in_bundle(reserve_ranks(spec, actor_name), 0)
    return _RemoteEngineActor.options(
        name=actor_name,
        lifetime="detached",
        **placement,
        num_gpus=rank_gpus(spec),  # rank 0's; `start_ranks` asks for the others'
        num_cpus=spec.resources.cpu,
        max_restarts=0,
        max_concurrency=MAX_CONCURRENCY,
    ).remote(spec, replica)

"""The delta channel: one Ray stream per gateway and replica carrying every request's
deltas, instead of one Ray stream (and one Ray object per delta) per request.

Profiled at 64 concurrent streams (docs/benchmarks.md, "Where served time goes"), a Ray
object per request per step cost the gateway more than all its HTTP work: each one is
put, announced, fetched and deserialized on its own.  Here the actor's end
(`DeltaOutbox`) gathers what the engine produced for every request of a channel and
yields it as one `DeltaBatch` whenever the channel's reader has taken the last one, so a
batch carries at least an engine step's deltas and more when the gateway lags.  The
gateway's end (`DeltaChannel`) reads that stream and hands each delta to its request's
`PendingStream` by request id.

A request is ``submit``-ted to the actor as its own call after its `PendingStream` is
registered here; leaving early ``cancel``-s it (the actor cancels its task, which
aborts the request in the engine).  A client that stops reading stops taking deltas
off its `PendingStream`: once ``max_backlog`` deltas wait there, the stream is cut off
with an error and its request cancelled, so a stalled reader holds neither gateway
memory nor KV.  If the channel's stream fails (the actor died), every request on it gets
the `ReplicaError` and the next request opens a new channel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayError

from specd.workers.pool.replica import ReplicaError
from specd.workers.types import FinishReason, GenerateDelta

# Batches the actor may yield ahead of the gateway's reader; while that many wait, the
# outbox keeps gathering, so a lagging gateway gets fewer, bigger batches.
BATCHES_IN_FLIGHT = 2
SLOW_READER_CODE = 408  # the request's error status when its client stopped reading
_KEPT_APART = (FinishReason.ERROR, FinishReason.ABORT)  # never merged into text before them


@dataclass(frozen=True, slots=True)
class DeltaBatch:
    """What one message of a channel carries: deltas of any of its requests, each
    request's in order."""

    deltas: tuple[GenerateDelta, ...]


class DeltaOutbox:
    """The actor's end of one channel: deltas wait here until the stream yields them."""

    def __init__(self) -> None:
        self._waiting: list[GenerateDelta] = []
        self._ready = asyncio.Event()
        self.tasks: dict[str, asyncio.Task] = {}  # rid -> the task forwarding its deltas

    def put(self, delta: GenerateDelta) -> None:
        self._waiting.append(delta)
        self._ready.set()

    async def batches(self) -> AsyncIterator[DeltaBatch]:
        """Everything put since the last batch, as soon as there is something."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            waiting, self._waiting = self._waiting, []
            yield DeltaBatch(tuple(waiting))

    def forward(self, rid: str, deltas: AsyncIterator[GenerateDelta]) -> None:
        """Put each of ``deltas`` here, in a task of its own that ``cancel`` ends."""

        async def run() -> None:
            try:
                async with contextlib.aclosing(deltas):
                    async for delta in deltas:
                        self.put(delta)
            finally:
                if self.tasks.get(rid) is task:
                    del self.tasks[rid]

        task = asyncio.ensure_future(run())
        self.tasks[rid] = task

    def cancel(self, rid: str) -> None:
        if (task := self.tasks.get(rid)) is not None:
            task.cancel()

    def close(self) -> None:
        """The gateway left: cancel every request it had here."""
        for task in list(self.tasks.values()):
            task.cancel()


def cut_off_delta(rid: str, backlog: int) -> GenerateDelta:
    """The final delta of a stream whose client stopped reading."""
    return GenerateDelta(
        rid=rid,
        finished=True,
        finish_reason=FinishReason.ERROR,
        error=(
            f"the stream was cut off: its client stopped reading and {backlog} deltas "
            "were waiting (spec.gateway.maxStreamBacklog)"
        ),
        error_code=SLOW_READER_CODE,
    )


class PendingStream:
    """One request's deltas between the channel's reader and its consumer."""

    def __init__(self, rid: str, max_backlog: int):
        self.rid = rid
        self.max_backlog = max_backlog
        self._items: deque[GenerateDelta | ReplicaError] = deque()
        self._arrived = asyncio.Event()
        self.cut_off = False

    @property
    def backlog(self) -> int:
        return len(self._items)

    async def next(self) -> GenerateDelta:
        """The next delta, with the deltas that waited behind it merged in (so a consumer
        that fell behind sends one chunk, not one per step); an error or abort delta
        stays apart, after the text before it.  Raises the channel's `ReplicaError`."""
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        delta = self._items.popleft()
        if isinstance(delta, ReplicaError):
            raise delta
        while not delta.finished and self._items:
            later = self._items[0]
            if isinstance(later, ReplicaError) or later.finish_reason in _KEPT_APART:
                break
            delta = delta.then(self._items.popleft())
        return delta

    def put(self, item: GenerateDelta | ReplicaError) -> bool:
        """Queue ``item``; False once the backlog is full (the stream is then cut off:
        its last item says why, and nothing more is queued)."""
        if self.cut_off:
            return True
        if len(self._items) >= self.max_backlog:
            self.cut_off = True
            item, full = cut_off_delta(self.rid, len(self._items)), True
        else:
            full = False
        self._items.append(item)
        self._arrived.set()
        return not full

    def fail(self, error: ReplicaError) -> None:
        """The channel ended: the consumer gets ``error`` after what is queued."""
        self._items.append(error)
        self._arrived.set()


class DeltaChannel:
    """The gateway's end of one replica's channel.

    ``handle`` is replica ``replica``'s actor; ``channel_id`` names this gateway's channel
    there; ``on_error(err)`` turns the Ray failure that ended the stream into the
    `ReplicaError` its requests get (and marks the replica dead when its actor is
    gone); ``on_closed()`` forgets this channel so the next request opens another;
    ``on_cut_off()`` counts a stream cut off for a stalled client.
    """

    def __init__(
        self,
        replica: str,
        handle: Any,
        channel_id: str,
        on_error: Callable[[RayError], ReplicaError],
        on_closed: Callable[[DeltaChannel], None],
        on_cut_off: Callable[[], None],
    ):
        self.replica = replica
        self.handle = handle
        self.channel_id = channel_id
        self._on_error = on_error
        self._on_closed = on_closed
        self._on_cut_off = on_cut_off
        self.pending: dict[str, PendingStream] = {}
        stream = handle.deltas.options(
            num_returns="streaming", _generator_backpressure_num_objects=BATCHES_IN_FLIGHT
        ).remote(channel_id)
        self._reader = asyncio.ensure_future(self._read(stream))  # held: a task is weak-referenced

    def register(self, rid: str, max_backlog: int) -> PendingStream:
        pending = PendingStream(rid, max_backlog)
        self.pending[rid] = pending
        return pending

    def unregister(self, rid: str) -> None:
        self.pending.pop(rid, None)

    def cancel(self, rid: str) -> None:
        """End ``rid`` in the actor (fire and forget: a gone actor ends it anyway)."""
        with contextlib.suppress(RayError):
            self.handle.cancel.remote(rid, self.channel_id)

    async def _read(self, stream: Any) -> None:
        failure: ReplicaError | None = None
        try:
            async for ref in stream:
                batch: DeltaBatch = await ref
                for delta in batch.deltas:
                    pending = self.pending.get(delta.rid)
                    if pending is not None and not pending.put(delta):
                        self._on_cut_off()
                        self.cancel(delta.rid)
        except RayError as err:
            failure = self._on_error(err)
        finally:
            self._on_closed(self)
            failure = failure or ReplicaError(
                self.replica, f"replica {self.replica}'s delta stream ended", lost=False
            )
            for pending in self.pending.values():
                pending.fail(failure)

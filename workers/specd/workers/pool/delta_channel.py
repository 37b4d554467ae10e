"""The delta channel: one connection per gateway and replica carrying every request's
deltas, instead of one Ray stream (and one Ray object per delta) per request.

Profiled at 64 concurrent streams (docs/benchmarks.md, "Where served time goes"), a Ray
object per request per step cost the gateway more than all its HTTP work, and even one
Ray streaming item per engine step costs each side about 1 ms of CPU
(docs/serving-path.md).  Here the actor's end (`delta_outbox.DeltaOutbox`) gathers what
the engine produced for every request of a channel into one `DeltaBatch` whenever the
socket has taken the last one (`delta_socket`), so a batch carries at least an engine
step's deltas and more when the gateway lags.  The gateway's end (`DeltaChannel`) reads
the batches and hands each delta to its request's `PendingStream` by request id.  Ray
carries one call per channel, ``deltas``, open for the channel's life (if it fails, Ray
says why, e.g. that the actor died).

A request is ``submit``-ted on the same connection once its `PendingStream` is
registered here, and leaving early ``cancel``-s it (the actor cancels its task, which
aborts the request in the engine): the requests and cancels of one event-loop pass go
in one `ChannelCommands` frame, so a burst of requests reaches the engine together
instead of one Ray call (about 1 ms of CPU on each side) at a time.

A client that stops reading stops taking deltas off its `PendingStream`: once
``max_backlog`` deltas wait there, the stream is cut off with an error and its request
cancelled, so a stalled reader holds neither gateway memory nor KV.  If the channel ends
(the actor died), every request on it gets the `ReplicaError` and the next request opens
a new channel.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayError

from specd.workers.pool.delta_outbox import DeltaBatch
from specd.workers.pool.delta_socket import (
    ChannelCommands,
    Connection,
    DeltaListener,
    DeltaWireError,
    read_batches,
    write_frame,
)
from specd.workers.pool.replica import ReplicaError
from specd.workers.types import FinishReason, GenerateDelta, GenerateRequest

SLOW_READER_CODE = 408  # the request's error status when its client stopped reading
_KEPT_APART = (FinishReason.ERROR, FinishReason.ABORT)  # never merged into text before them


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
    there; its actor connects to ``listener``.  ``on_error(err)`` turns the Ray failure
    that ended the channel into the `ReplicaError` its requests get (and marks the
    replica dead when its actor is gone); ``on_closed()`` forgets this channel so the
    next request opens another; ``on_cut_off()`` counts a stream cut off for a stalled
    client.  Once the connection closes, Ray has ``settle_timeout_s`` to say why.
    """

    def __init__(
        self,
        replica: str,
        handle: Any,
        channel_id: str,
        listener: DeltaListener,
        on_error: Callable[[RayError], ReplicaError],
        on_closed: Callable[[DeltaChannel], None],
        on_cut_off: Callable[[], None],
        settle_timeout_s: float,
    ):
        self.replica = replica
        self.handle = handle
        self.channel_id = channel_id
        self._on_error = on_error
        self._on_closed = on_closed
        self._on_cut_off = on_cut_off
        self._settle_timeout_s = settle_timeout_s
        self.pending: dict[str, PendingStream] = {}
        # what goes to the actor in the next frame: sent once it has connected
        self._writer: asyncio.StreamWriter | None = None
        self._submits: list[GenerateRequest] = []
        self._cancels: list[str] = []
        self._flush_due = False
        self._reader = asyncio.ensure_future(self._run(listener))  # held: tasks are weak

    def register(self, rid: str, max_backlog: int) -> PendingStream:
        pending = PendingStream(rid, max_backlog)
        self.pending[rid] = pending
        return pending

    def unregister(self, rid: str) -> None:
        self.pending.pop(rid, None)

    def submit(self, req: GenerateRequest) -> None:
        """Start ``req`` in the actor (register its stream first); it goes with this loop
        pass's other requests in one frame, once the actor has connected."""
        self._submits.append(req)
        self._flush_soon()

    def cancel(self, rid: str) -> None:
        """End ``rid`` in the actor (fire and forget: a gone actor ends it anyway)."""
        self._cancels.append(rid)
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Write what waits as one frame, if the actor is connected (else it waits)."""
        self._flush_due = False
        if self._writer is None or not (self._submits or self._cancels):
            return
        if not self._writer.is_closing():  # closing: the channel fails its requests
            write_frame(self._writer, ChannelCommands(tuple(self._submits), tuple(self._cancels)))
        self._submits, self._cancels = [], []

    async def _run(self, listener: DeltaListener) -> None:
        """Open the channel, read it to its end, then fail whatever still waits."""
        failure: ReplicaError | None = None
        connected: asyncio.Future[Connection] | None = None
        call: asyncio.Future | None = None
        try:
            address, connected = await listener.expect()
            call = asyncio.ensure_future(self.handle.deltas.remote(self.channel_id, address))
            await asyncio.wait({connected, call}, return_when=asyncio.FIRST_COMPLETED)
            if connected.done():
                reader, self._writer = connected.result()
                self._flush()  # what was submitted while the actor connected
                async for batch in read_batches(reader):
                    self._dispatch(batch)
            failure = await self._why_ended(call)
        except DeltaWireError as err:
            failure = ReplicaError(self.replica, f"replica {self.replica}: {err}", lost=False)
        finally:
            if connected is not None and connected.done():
                connected.result()[1].close()
            elif connected is not None:
                connected.cancel()  # the actor never connected
            if call is not None:
                call.cancel()
            self._on_closed(self)
            failure = failure or ReplicaError(
                self.replica, f"replica {self.replica}'s delta channel ended", lost=False
            )
            for pending in self.pending.values():
                pending.fail(failure)

    def _dispatch(self, batch: DeltaBatch) -> None:
        for delta in batch.deltas:
            pending = self.pending.get(delta.rid)
            if pending is not None and not pending.put(delta):
                self._on_cut_off()
                self.cancel(delta.rid)

    async def _why_ended(self, call: asyncio.Future) -> ReplicaError | None:
        """The channel's call's failure (e.g. its actor died), if Ray reports one in time."""
        try:
            async with asyncio.timeout(self._settle_timeout_s):
                await call
        except RayError as err:
            return self._on_error(err)
        except TimeoutError:
            pass
        return None

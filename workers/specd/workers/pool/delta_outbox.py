"""The actor's end of a delta channel: every request's deltas for one gateway, gathered
into batches (`DeltaBatch`) that `delta_socket.send_batches` writes as they are ready.

A request's deltas are forwarded here by a task of its own (``forward``); ``cancel``
ends that task, which closes the engine's generator and so aborts the request in the
engine; ``close`` (the gateway left) cancels them all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specd.workers.types import GenerateDelta


@dataclass(frozen=True, slots=True)
class DeltaBatch:
    """What one message of a channel carries: deltas of any of its requests, each
    request's in order."""

    deltas: tuple[GenerateDelta, ...]


class DeltaOutbox:
    """One channel's deltas in the actor: they wait here until the next batch takes them."""

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

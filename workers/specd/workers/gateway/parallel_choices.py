"""``n`` choices of one API request: their engine requests, and their streams merged.

Each choice is an engine request of its own (its prompt prefilled again: there is no
prefix sharing between requests yet), so the choices spread over replicas like any
requests.  A request's ``seed`` gives choice i the seed ``seed + i``: the choices differ
and the whole response reproduces.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

from specd.workers.types import GenerateRequest

T = TypeVar("T")


def choice_requests(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """``req`` as ``n`` engine requests (ids ``<rid>-<i>`` when n > 1)."""
    if n == 1:
        return [req]
    seed = req.params.seed
    return [
        dataclasses.replace(
            req,
            rid=f"{req.rid}-{i}",
            params=dataclasses.replace(req.params, seed=None if seed is None else seed + i),
        )
        for i in range(n)
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class _Ended:
    error: BaseException | None = None


async def merge_streams(
    streams: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """``(i, item)`` from every stream as items arrive, each stream in its own order;
    closing this (a client gone) cancels and closes every stream.  One stream is read
    directly (no task and queue per item); several are pumped through a bounded queue,
    so a client that stops reading stops the pumps too (and its streams' backlogs grow
    where they are bounded, `delta_channel.PendingStream`)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | _Ended]] = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as err:  # handed to the consumer, which raises it
            await queue.put((i, _Ended(err)))
            return
        await queue.put((i, _Ended()))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if isinstance(item, _Ended):
                if item.error is not None:
                    raise item.error
                open_streams -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # already closed
                await stream.aclose()

"""A request's deltas on their way to the client.

Errors travel as final deltas (`error_delta`); `refused` tells a replica's refusal
before any token (the request may go elsewhere) and `failure_of` the `ApiError` a final
delta stands for.  The response starts only once the first delta is in, which is then
put back in front of the rest (`prepend`); a client that leaves while the gateway waits
cancels the wait (`unless_disconnected`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from specd.workers.gateway.errors import ApiError, param_of_message
from specd.workers.types import FinishReason, GenerateDelta

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's convention; only ever seen in metrics


class ClientGone(Exception):
    pass


def error_delta(rid: str, status: int, message: str) -> GenerateDelta:
    return GenerateDelta(
        rid=rid, finished=True, finish_reason=FinishReason.ERROR, error=message, error_code=status
    )


def refused(delta: GenerateDelta) -> bool:
    """A replica's refusal before any token (draining, or unhealthy): the request may
    go elsewhere."""
    return delta.finished and delta.error_code == 503 and not delta.token_ids


def failure_of(delta: GenerateDelta) -> ApiError | None:
    """The error a final delta stands for, if it is not a normal finish."""
    if delta.finish_reason is FinishReason.ERROR:
        status = delta.error_code or 500
        message = delta.error or "the engine failed to serve the request"
        return ApiError(status, message, param_of_message(message) if status < 500 else None)
    if delta.finish_reason is FinishReason.ABORT:
        return ApiError(503, "the request was aborted: the replica is shutting down; retry")
    return None


async def prepend(
    first: GenerateDelta, rest: AsyncGenerator[GenerateDelta, None]
) -> AsyncGenerator[GenerateDelta, None]:
    """``first`` then ``rest``; closing this closes ``rest`` (and so the Ray stream)."""
    async with contextlib.aclosing(rest):
        yield first
        if not first.finished:
            async for delta in rest:
                yield delta


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``; if the client disconnects first, cancel it and raise `ClientGone`."""
    work = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # a cancel of this caller still propagates
    if work.cancelled():
        raise ClientGone
    return work.result()


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"

"""The gateway's end of a delta channel, without Ray: a request's `PendingStream` merges
what waited for a consumer that fell behind, keeps errors apart, and cuts off a stream
whose backlog is full; a `DeltaChannel` whose actor is a stand-in on a real socket
delivers its deltas and fails its requests, never hangs, however the channel ends.
(The channel over Ray: test_gateway.py, test_slow_readers.py, test_replica_failures.py.)"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayError, RaySystemError

from specd.workers.pool.delta_channel import SLOW_READER_CODE, DeltaChannel, PendingStream
from specd.workers.pool.delta_outbox import DeltaOutbox
from specd.workers.pool.delta_socket import ChannelCommands, DeltaListener, send_batches
from specd.workers.pool.replica import ReplicaError
from specd.workers.types import FinishReason, GenerateDelta, GenerateRequest, TokenLogprob, Usage


def _token(i: int, *, logprob: bool = False) -> GenerateDelta:
    lp = (TokenLogprob(-0.5 * i),) if logprob else None
    return GenerateDelta(rid="r", token_ids=(i,), logprobs=lp, text=f"t{i}")


def test_deltas_that_waited_come_out_as_one():
    pending = PendingStream("r", max_backlog=16)
    first = GenerateDelta(rid="r", token_ids=(1,), text="t1", prompt_logprobs=(None,), logprobs=())
    for delta in (first, _token(2, logprob=True), _token(3, logprob=True)):
        assert pending.put(delta)
    usage = Usage(prompt_tokens=1, completion_tokens=4)
    last = GenerateDelta(
        rid="r",
        token_ids=(4,),
        text="t4",
        logprobs=(),
        finished=True,
        finish_reason=FinishReason.LENGTH,
        usage=usage,
    )
    pending.put(last)
    merged = asyncio.run(pending.next())
    assert merged.token_ids == (1, 2, 3, 4)
    assert merged.text == "t1t2t3t4"
    assert [lp.logprob for lp in merged.logprobs] == [-1.0, -1.5]
    assert merged.prompt_logprobs == (None,)
    assert merged.finished and merged.finish_reason is FinishReason.LENGTH
    assert merged.usage == usage
    assert pending.backlog == 0


def test_an_error_is_not_merged_into_the_text_before_it():
    pending = PendingStream("r", max_backlog=16)
    error = GenerateDelta(
        rid="r", finished=True, finish_reason=FinishReason.ERROR, error="boom", error_code=500
    )
    for delta in (_token(1), _token(2), error):
        pending.put(delta)

    async def both():
        return await pending.next(), await pending.next()

    text, failed = asyncio.run(both())
    assert text.text == "t1t2" and not text.finished
    assert failed is error


def test_a_full_backlog_cuts_the_stream_off():
    pending = PendingStream("r", max_backlog=3)
    assert all(pending.put(_token(i)) for i in range(3))
    assert not pending.put(_token(3))  # the fourth: cut off
    assert pending.cut_off
    assert pending.put(_token(4))  # after that, dropped quietly
    assert pending.backlog == 4

    async def drain():
        return await pending.next(), await pending.next()

    text, cut = asyncio.run(drain())
    assert text.token_ids == (0, 1, 2)
    assert cut.finished and cut.error_code == SLOW_READER_CODE
    assert "stopped reading" in cut.error


def test_a_channel_failure_reaches_the_consumer_after_what_was_queued():
    pending = PendingStream("r", max_backlog=8)
    pending.put(_token(1))
    pending.fail(ReplicaError("r0", "replica r0 died while serving the request", lost=True))

    async def read():
        first = await pending.next()
        with pytest.raises(ReplicaError, match="died"):
            await pending.next()
        return first

    assert asyncio.run(read()).token_ids == (1,)


def test_a_consumer_waits_for_the_next_delta():
    pending = PendingStream("r", max_backlog=8)

    async def later():
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, pending.put, _token(7))
        return await pending.next()

    assert asyncio.run(later()).token_ids == (7,)


# -- a DeltaChannel over a real socket, its actor a stand-in ------------------------------


class _Actor:
    """Stands in for the engine actor's ``deltas`` call: ``how`` is what it does with
    the address it is handed; the call's result (or failure) is what Ray would report."""

    def __init__(self, how):
        self.how = how
        self.deltas = self
        self.outbox = DeltaOutbox()

    def remote(self, channel, address):
        return asyncio.ensure_future(self.how(address, self.outbox))


@pytest.fixture()
async def listener():
    listener = DeltaListener()
    yield listener
    listener.close()


def _channel(actor: _Actor, listener: DeltaListener) -> tuple[DeltaChannel, list[RayError]]:
    errors: list[RayError] = []

    def on_error(err: RayError) -> ReplicaError:
        errors.append(err)
        return ReplicaError("r0", f"replica r0 failed: {err}", lost=True)

    channel = DeltaChannel("r0", actor, "c", listener, on_error, lambda _: None, lambda: None, 2.0)
    return channel, errors


async def test_a_channel_delivers_each_requests_deltas_to_it(listener):
    actor = _Actor(send_batches)
    channel, _ = _channel(actor, listener)
    a, b = channel.register("a", 8), channel.register("b", 8)
    actor.outbox.put(GenerateDelta(rid="a", token_ids=(1,)))
    actor.outbox.put(GenerateDelta(rid="b", token_ids=(2,), finished=True))
    async with asyncio.timeout(5):
        assert (await a.next()).token_ids == (1,)
        assert (await b.next()).finished
    channel._reader.cancel()  # the gateway goes: its socket closes, the actor's sender ends
    await asyncio.wait({channel._reader})


async def test_requests_and_cancels_reach_the_actor_one_frame_per_loop_pass(listener):
    """Requests submitted before the actor connected go once it has; those of one loop
    pass share a frame (a burst reaches the engine together), a cancel after its request."""
    frames: list[ChannelCommands] = []
    arrived = asyncio.Event()

    def record(commands: ChannelCommands) -> None:
        frames.append(commands)
        arrived.set()

    async def connects_late(address, outbox):
        await asyncio.sleep(0.05)
        await send_batches(address, outbox, record)

    channel, _ = _channel(_Actor(connects_late), listener)
    for rid in ("a", "b"):
        channel.register(rid, 8)
        channel.submit(GenerateRequest(rid=rid, prompt_ids=(1, 2)))
    async with asyncio.timeout(5):
        await arrived.wait()
        assert [[r.rid for r in f.submits] for f in frames] == [["a", "b"]]
        arrived.clear()
        for rid in ("c", "d", "e"):  # one loop pass: one frame
            channel.submit(GenerateRequest(rid=rid, prompt_ids=(3,)))
        channel.cancel("d")
        await arrived.wait()
    assert [r.rid for r in frames[1].submits] == ["c", "d", "e"]
    assert frames[1].cancels == ("d",) and len(frames) == 2
    channel._reader.cancel()
    await asyncio.wait({channel._reader})


async def test_an_actor_that_cannot_connect_fails_the_requests_with_rays_reason(listener):
    async def refused(address, outbox):
        raise RaySystemError("connection refused")

    channel, errors = _channel(_Actor(refused), listener)
    pending = channel.register("a", 8)
    async with asyncio.timeout(5):
        with pytest.raises(ReplicaError, match="connection refused"):
            await pending.next()
    assert len(errors) == 1


async def test_an_actor_that_dies_mid_stream_fails_the_requests_once_ray_says_so(listener):
    async def dies(address, outbox):
        _, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(address.secret.encode())
        await asyncio.sleep(0.05)
        writer.close()  # the process went: its socket closes...
        await asyncio.sleep(0.2)
        raise RaySystemError("the actor died")  # ...and Ray reports it a little later

    channel, errors = _channel(_Actor(dies), listener)
    pending = channel.register("a", 8)
    async with asyncio.timeout(5):
        with pytest.raises(ReplicaError, match="the actor died") as failed:
            await pending.next()
    assert failed.value.lost and len(errors) == 1


async def test_a_channel_that_ends_without_a_ray_error_still_fails_its_requests(listener):
    async def leaves(address, outbox):
        _, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(address.secret.encode())
        writer.close()

    channel, errors = _channel(_Actor(leaves), listener)
    pending = channel.register("a", 8)
    async with asyncio.timeout(5):
        with pytest.raises(ReplicaError, match="delta channel ended") as failed:
            await pending.next()
    assert not failed.value.lost and errors == []

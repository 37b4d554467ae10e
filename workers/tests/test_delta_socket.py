"""The delta channel's wire without Ray (`delta_socket`): batches cross in order, a
gateway that closes ends the actor's sender, and connections that do not know a
channel's secret, or break the frame format, are refused.  (The channel over Ray, with
actors that die: test_gateway.py, test_replica_failures.py, test_slow_readers.py.)"""

from __future__ import annotations

import asyncio
import pickle
import struct

import pytest

from specd.workers.pool.delta_outbox import DeltaOutbox
from specd.workers.pool.delta_socket import (
    ChannelCommands,
    DeltaListener,
    DeltaWireError,
    read_batches,
    send_batches,
    write_frame,
)
from specd.workers.types import GenerateDelta, GenerateRequest


def _delta(rid: str, token: int) -> GenerateDelta:
    return GenerateDelta(rid=rid, token_ids=(token,), text=f"t{token}")


async def _next(batches) -> list[tuple[str, tuple[int, ...]]]:
    async with asyncio.timeout(5):
        batch = await anext(batches)
    return [(d.rid, d.token_ids) for d in batch.deltas]


async def test_batches_cross_in_order_and_a_closing_gateway_ends_the_sender():
    listener = DeltaListener()
    address, connected = await listener.expect()
    outbox = DeltaOutbox()
    sender = asyncio.ensure_future(send_batches(address, outbox))
    async with asyncio.timeout(5):
        reader, writer = await connected
    batches = read_batches(reader)
    outbox.put(_delta("a", 1))
    assert await _next(batches) == [("a", (1,))]
    for rid, token in (("a", 2), ("b", 7), ("a", 3)):  # put before the next batch is taken
        outbox.put(_delta(rid, token))
    assert await _next(batches) == [("a", (2,)), ("b", (7,)), ("a", (3,))]
    writer.close()  # the gateway's process went
    await asyncio.wait({sender}, timeout=5)
    assert sender.done()
    listener.close()


async def test_the_gateways_commands_reach_the_actor_and_a_frame_out_of_format_ends_it():
    """The other way: the actor hands each `ChannelCommands` on; anything else from the
    gateway (here a pickled dict) ends the channel, and nothing of it is applied."""
    listener = DeltaListener()
    address, connected = await listener.expect()
    received: list[ChannelCommands] = []
    sender = asyncio.ensure_future(send_batches(address, DeltaOutbox(), received.append))
    async with asyncio.timeout(5):
        _, writer = await connected
        commands = ChannelCommands((GenerateRequest(rid="a", prompt_ids=(1,)),), ("z",))
        write_frame(writer, commands)
        while not received:
            await asyncio.sleep(0.01)
        assert received == [commands]
        write_frame(writer, {"submits": ()})
        await asyncio.wait({sender})
    assert received == [commands]
    writer.close()
    listener.close()


async def test_a_connection_without_the_channels_secret_is_closed():
    listener = DeltaListener()
    address, connected = await listener.expect()
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(b"0" * len(address.secret))  # a guess
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # closed by the gateway
    assert not connected.done()  # the channel still waits for its actor
    writer.close()
    listener.close()


async def test_a_connection_that_says_nothing_is_closed_after_the_hello_timeout():
    listener = DeltaListener(hello_timeout_s=0.2)
    address, connected = await listener.expect()
    reader, writer = await asyncio.open_connection(address.host, address.port)
    async with asyncio.timeout(5):
        assert await reader.read() == b""
    assert not connected.done()
    writer.close()
    listener.close()


@pytest.mark.parametrize(
    "frame,complaint",
    [
        (struct.pack("!I", (1 << 30) + 1), "bytes"),
        (struct.pack("!I", 3) + b"xyz", "does not unpickle"),
        (struct.pack("!I", len(p := pickle.dumps({"not": "a batch"}))) + p, "not DeltaBatch"),
    ],
)
async def test_a_frame_out_of_format_is_a_wire_error(frame, complaint):
    listener = DeltaListener()
    address, connected = await listener.expect()
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(address.secret.encode() + frame)
    async with asyncio.timeout(5):
        their_reader, their_writer = await connected
        with pytest.raises(DeltaWireError, match=complaint):
            await anext(read_batches(their_reader))
    their_writer.close()
    writer.close()
    listener.close()


async def test_channels_opened_together_share_one_listening_socket():
    listener = DeltaListener()
    first, second = await asyncio.gather(listener.expect(), listener.expect())
    assert first[0].port == second[0].port and first[0].secret != second[0].secret
    listener.close()

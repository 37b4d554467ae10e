"""The delta channel's wire: a TCP connection from the engine actor to its gateway.

A Ray call or streaming item costs each side about 1 ms of CPU and adds 2-3 ms of
latency (measured: docs/serving-path.md, "The delta socket"); a frame on a socket costs
microseconds.  So a channel's traffic travels on a plain socket both ways while Ray
keeps what it is good at: creating, calling, watching and killing the actors.  The
gateway listens (`DeltaListener`, one per pool); the actor connects to the
`DeltaAddress` it was handed (`send_batches`), proves it was handed it by sending its
secret first, then writes one frame per `DeltaBatch`; the gateway writes one frame per
`ChannelCommands` (the requests to start and to cancel) the other way.  A frame is a
4-byte big-endian length and the object pickled.  Frames are unpickled only on a
connection that sent a known secret, which only a Ray call of this gateway carries,
and the actor unpickles only what comes from the gateway it was sent to by a Ray call.
"""

from __future__ import annotations

import asyncio
import pickle
import secrets
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import ray

from specd.workers.pool.delta_outbox import DeltaBatch, DeltaOutbox
from specd.workers.types import GenerateRequest

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
F = TypeVar("F")
_LENGTH = struct.Struct("!I")
_SECRET_CHARS = 32  # hex characters: 128 random bits
MAX_FRAME_BYTES = 1 << 30  # a longer length prefix is a broken peer, not a batch


class DeltaWireError(Exception):
    """The wire broke its format (a length out of bounds, a frame that does not unpickle)."""


@dataclass(frozen=True, slots=True)
class ChannelCommands:
    """What one frame from the gateway carries: requests to start, then requests to
    cancel (a request cancelled in the frame that starts it is started, then cancelled)."""

    submits: tuple[GenerateRequest, ...] = ()
    cancels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeltaAddress:
    """Where a channel's actor connects, and the secret that names the channel there."""

    host: str
    port: int
    secret: str


class DeltaListener:
    """The gateway's end: accepts the actors' connections and hands each to the
    channel whose secret it sends; one that does not send it within ``hello_timeout_s``
    is closed."""

    def __init__(self, hello_timeout_s: float = 10.0) -> None:
        self.hello_timeout_s = hello_timeout_s
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()  # the first channels of a pool open together
        self._host = ""
        self._expected: dict[str, asyncio.Future[Connection]] = {}

    async def expect(self) -> tuple[DeltaAddress, asyncio.Future[Connection]]:
        """A new channel's address, and the future of its actor's connection."""
        async with self._starting:
            if self._server is None:
                self._host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
                self._server = await asyncio.start_server(self._accept, self._host, 0)
            port = self._server.sockets[0].getsockname()[1]
        secret = secrets.token_hex(_SECRET_CHARS // 2)
        connected = asyncio.get_running_loop().create_future()
        self._expected[secret] = connected
        connected.add_done_callback(lambda _: self._expected.pop(secret, None))
        return DeltaAddress(self._host, port, secret), connected

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.hello_timeout_s):
                secret = (await reader.readexactly(_SECRET_CHARS)).decode("ascii", "replace")
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        connected = self._expected.get(secret)
        if connected is None or connected.done():
            writer.close()  # not a channel of this gateway
            return
        connected.set_result((reader, writer))

    def close(self) -> None:
        """Stop accepting (open channels go on)."""
        if self._server is not None:
            self._server.close()
            self._server = None


def write_frame(writer: asyncio.StreamWriter, item: object) -> None:
    """``item`` as one frame (its length, then its pickle) on ``writer``, in one write: a
    write with nothing queued is a ``send`` at once, so two would be two system calls."""
    frame = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LENGTH.pack(len(frame)) + frame)


async def read_frames(reader: asyncio.StreamReader, kind: type[F]) -> AsyncIterator[F]:
    """The ``kind`` frames on ``reader`` until the peer closes it (a reset ends it the
    same way); anything else is a `DeltaWireError`."""
    while True:
        try:
            (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
            if length > MAX_FRAME_BYTES:
                raise DeltaWireError(f"a delta frame of {length} bytes (at most {MAX_FRAME_BYTES})")
            frame = await reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        try:
            item = pickle.loads(frame)
        except Exception as err:
            raise DeltaWireError(f"a delta frame that does not unpickle: {err}") from err
        if not isinstance(item, kind):
            raise DeltaWireError(f"a delta frame of {type(item).__name__}, not {kind.__name__}")
        yield item


def read_batches(reader: asyncio.StreamReader) -> AsyncIterator[DeltaBatch]:
    """The gateway's reading: the actor's batches."""
    return read_frames(reader, DeltaBatch)


async def send_batches(
    address: DeltaAddress,
    outbox: DeltaOutbox,
    on_commands: Callable[[ChannelCommands], None] = lambda _: None,
) -> None:
    """The actor's end: connect to ``address``, write ``outbox``'s batches and hand each
    of the gateway's `ChannelCommands` to ``on_commands``, until the gateway closes the
    connection (its process went), sends a frame out of format, or this task is
    cancelled."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    pump = asyncio.current_task()
    assert pump is not None

    async def read_commands() -> None:
        try:
            async for commands in read_frames(reader, ChannelCommands):
                on_commands(commands)
        except (ConnectionError, DeltaWireError):
            pass
        finally:
            pump.cancel()  # the gateway's EOF (or garbage): the channel is over

    commands = asyncio.ensure_future(read_commands())
    try:
        writer.write(address.secret.encode("ascii"))
        async for batch in outbox.batches():
            write_frame(writer, batch)
            await writer.drain()  # a gateway that lags: the outbox gathers meanwhile
    except ConnectionError:
        return
    finally:
        commands.cancel()
        writer.close()

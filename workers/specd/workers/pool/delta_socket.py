"""The delta channel's wire: a TCP connection from the engine actor to its gateway.

A Ray streaming call costs each side about 1 ms of CPU per item and adds 2-3 ms of
latency (measured: docs/serving-path.md, "The delta socket"); a frame on a socket costs
microseconds.  So the deltas travel on a plain socket while Ray keeps what it is good
at: creating, calling, watching and killing the actors.  The gateway listens
(`DeltaListener`, one per pool); the actor connects to the `DeltaAddress` it was handed
(`send_batches`), proves it was handed it by sending its secret first, then writes one
frame per `DeltaBatch`: a 4-byte big-endian length and the batch pickled.  Frames are
unpickled only on a connection that sent a known secret, which only a Ray call of this
gateway carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import secrets
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from specd.workers.pool.delta_outbox import DeltaBatch, DeltaOutbox

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_LENGTH = struct.Struct("!I")
_SECRET_CHARS = 32  # hex characters: 128 random bits
MAX_FRAME_BYTES = 1 << 30  # a longer length prefix is a broken peer, not a batch


class DeltaWireError(Exception):
    """The wire broke its format (a length out of bounds, a frame that does not unpickle)."""


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


async def read_batches(reader: asyncio.StreamReader) -> AsyncIterator[DeltaBatch]:
    """The batches on ``reader`` until the actor closes it (a reset ends it the same way)."""
    while True:
        try:
            (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
            if length > MAX_FRAME_BYTES:
                raise DeltaWireError(f"a delta frame of {length} bytes (at most {MAX_FRAME_BYTES})")
            frame = await reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        try:
            batch = pickle.loads(frame)
        except Exception as err:
            raise DeltaWireError(f"a delta frame that does not unpickle: {err}") from err
        if not isinstance(batch, DeltaBatch):
            raise DeltaWireError(f"a delta frame of {type(batch).__name__}, not DeltaBatch")
        yield batch


async def send_batches(address: DeltaAddress, outbox: DeltaOutbox) -> None:
    """The actor's end: connect to ``address`` and write ``outbox``'s batches until the
    gateway closes the connection (its process went) or this task is cancelled."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    pump = asyncio.current_task()
    assert pump is not None

    async def watch_gateway() -> None:
        with contextlib.suppress(ConnectionError):
            await reader.read()  # the gateway never writes: this returns at its EOF
        pump.cancel()

    watcher = asyncio.ensure_future(watch_gateway())
    try:
        writer.write(address.secret.encode("ascii"))
        async for batch in outbox.batches():
            frame = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
            writer.write(_LENGTH.pack(len(frame)))
            writer.write(frame)
            await writer.drain()  # a gateway that lags: the outbox gathers meanwhile
    except ConnectionError:
        return
    finally:
        watcher.cancel()
        writer.close()

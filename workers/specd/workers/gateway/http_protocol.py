"""The gateway's HTTP/1.1 parser: uvicorn's httptools protocol with a bound on a
request's header bytes and on the time its header and body take to arrive, or uvicorn's
h11 protocol where httptools is missing.

**Header bytes.** h11, uvicorn's pure-Python parser, refuses a request whose headers
outgrow 16 KiB (``h11_max_incomplete_event_size``).  httptools (llhttp) has no such
bound: a client could send megabytes of header and the gateway would hold them.
`BoundedHttpTools` counts the bytes of a request's header that arrive after the read
that began it, and answers 431 and closes the connection past `MAX_HEADER_BYTES`.
Headers that arrive in the read that began the request (a read is at most 256 KiB) are
not counted, so no header that h11 took is refused; what a connection can make the
gateway hold stays under the bound plus two reads.

**Read time** (``spec.gateway.requestReadTimeoutSeconds``, read live).  uvicorn times
only a keep-alive connection's wait between requests: a connection that opens and sends
nothing, or a header sent a byte at a time (slowloris), or a body that stops halfway,
would hold a socket and a handler for ever.  As nginx's ``client_header_timeout`` and
``client_body_timeout``: a request's whole header must arrive within the timeout of the
connection opening (or of its first byte, on a kept-alive connection), and its body may
pause for at most the timeout between two reads.  A pause while the gateway itself is
not reading (its handler has not taken the body so far, or has not yet sent the
``100 Continue`` that a client sending ``Expect: 100-continue`` waits for) does not
count.  Past either: 408 and the connection closed (closed alone once a response to the
request has begun); a handler waiting for the body sees the client gone.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_HEADER_BYTES = 16 * 1024  # h11's bound in uvicorn, kept


def http_protocol(read_timeout_s: Callable[[], float]) -> type | str:
    """What ``uvicorn.Config(http=...)`` takes: `BoundedHttpTools` whose read time is
    bounded by ``read_timeout_s()`` (read when each wait begins), or ``"h11"``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHttpTools(HttpToolsProtocol):
        """httptools with a request's header bytes and read time bounded (module
        docstring)."""

        _in_header = False  # between a request's first byte and its header's end
        _began_in_this_read = False
        _header_bytes = 0
        _read_timer = None  # asyncio.TimerHandle of the header's deadline or the body's pause

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._time_read(self._header_timed_out)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_read_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._began_in_this_read = False
            super().data_received(data)
            if not self._in_header or self._began_in_this_read:
                return
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                self._refuse(
                    b"431 Request Header Fields Too Large", b"request header fields too large"
                )

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_header, self._began_in_this_read, self._header_bytes = True, True, 0
            if self._read_timer is None:  # a kept-alive connection's next request
                self._time_read(self._header_timed_out)

        def on_headers_complete(self) -> None:
            self._in_header = False
            super().on_headers_complete()
            if self.parser.should_upgrade():  # the connection leaves HTTP: nothing to time
                self._stop_read_timer()
            else:
                self._time_read(self._body_paused)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._time_read(self._body_paused)

        def on_message_complete(self) -> None:
            self._stop_read_timer()
            super().on_message_complete()

        def _time_read(self, on_timeout: Callable[[], None]) -> None:
            self._stop_read_timer()
            self._read_timer = self.loop.call_later(read_timeout_s(), on_timeout)

        def _stop_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _header_timed_out(self) -> None:
            self._read_timer = None
            before = self.cycle  # the request before this one on the connection, if any
            self._time_out(
                before is not None and before.response_started and not before.response_complete
            )

        def _body_paused(self) -> None:
            self._read_timer = None
            cycle = self.cycle  # this request's
            if self.flow.read_paused or cycle.waiting_for_100_continue:
                # the gateway is not reading, or has not asked for the body: not the client's pause
                self._time_read(self._body_paused)
            else:
                self._time_out(cycle.response_started)

        def _time_out(self, answering: bool) -> None:
            """408 and close; close alone while a response is being (or has been) sent
            for this request, since a second status line would corrupt it."""
            if self.transport.is_closing():
                return
            if answering:
                self.transport.close()
            else:
                self._refuse(b"408 Request Timeout", b"request not received in time")

        def _refuse(self, status: bytes, message: bytes) -> None:
            self._stop_read_timer()
            self.transport.write(
                b"HTTP/1.1 " + status + b"\r\n"
                b"content-type: text/plain; charset=utf-8\r\n"
                b"content-length: " + str(len(message)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + message
            )
            self.transport.close()

    return BoundedHttpTools

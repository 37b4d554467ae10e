"""The gateway's HTTP/1.1 parser: uvicorn's httptools protocol with a bound on a
request's header bytes, or uvicorn's h11 protocol where httptools is missing.

h11, uvicorn's pure-Python parser, refuses a request whose headers outgrow 16 KiB
(``h11_max_incomplete_event_size``).  httptools (llhttp) has no such bound: a client
could send megabytes of header and the gateway would hold them.  `BoundedHttpTools`
counts the bytes of a request's header that arrive after the read that began it, and
answers 431 and closes the connection past `MAX_HEADER_BYTES`.  Headers that arrive in
the read that began the request (a read is at most 256 KiB) are not counted, so no
header that h11 took is refused; what a connection can make the gateway hold stays
under the bound plus two reads.
"""

from __future__ import annotations

MAX_HEADER_BYTES = 16 * 1024  # h11's bound in uvicorn, kept


def http_protocol() -> type | str:
    """What ``uvicorn.Config(http=...)`` takes: `BoundedHttpTools`, or ``"h11"``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHttpTools(HttpToolsProtocol):
        """httptools with a request's header bytes bounded (module docstring)."""

        _in_header = False  # between a request's first byte and its header's end
        _began_in_this_read = False
        _header_bytes = 0

        def data_received(self, data: bytes) -> None:
            self._began_in_this_read = False
            super().data_received(data)
            if not self._in_header or self._began_in_this_read:
                return
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                self._refuse_header()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_header, self._began_in_this_read, self._header_bytes = True, True, 0

        def on_headers_complete(self) -> None:
            self._in_header = False
            super().on_headers_complete()

        def _refuse_header(self) -> None:
            message = b"request header fields too large"
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\n"
                b"content-length: " + str(len(message)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + message
            )
            self.transport.close()

    return BoundedHttpTools

"""What one HTTP connection may hold: a deadline for its request headers, a bound on their size, and a
server-wide budget of request-body bytes. ``mlscale serve`` and ``mlscale ui`` both listen through it.

uvicorn closes an idle keep-alive connection, but has no deadline for headers: a connection that
never sends a byte, or trickles one header line every few seconds, is held for ever. ``HeaderDeadline``
is uvicorn's httptools protocol with one: from the connection's start, and from the first byte of each
later request, the headers must be complete within ``header_timeout_s`` or the connection is closed
(with a 408 when a request had begun). The body has its own deadline, in the app (``read_timeout_s``),
so that a request whose body never arrives is answered 408 without ever taking an admission slot; and
here, a second after that one, for a body nobody reads (a request answered before its body arrived, a
404 say), which uvicorn would otherwise go on receiving for as long as its client trickles it.

Headers are bounded in bytes too, as nginx's ``large_client_header_buffers`` and h11's
``max_incomplete_event_size`` bound them (httptools, uvicorn's fast parser, has no bound: a 48 MB header
is parsed whole, and the event loop stalls meanwhile): past ``max_one_header_bytes`` for one header, or
``max_header_bytes`` for a request's line and headers together, the request is answered 431 and the
connection closed, without the rest being parsed.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _response(status: bytes, message: bytes) -> bytes:
    body = b'{"error": "%s"}' % message
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(body), body))


_TIMED_OUT = _response(b"408 Request Timeout", b"request headers took too long")
_TOO_MANY = _response(b"503 Service Unavailable", b"too many connections (--max-connections); retry later")
_TOO_LARGE = _response(b"431 Request Header Fields Too Large", b"request headers too large")
MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers (nginx: 4 x 8 kB buffers; h11: 16 kB)
MAX_ONE_HEADER_BYTES = 16 * 1024  # one header's name and value


class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline on reading each request's headers, a bound on their
    bytes (431) and a cap on open connections (503)."""

    header_timeout_s = 5.0  # set per server by ``protocol_with``
    body_timeout_s = 11.0
    max_connections = 2048
    max_header_bytes = MAX_HEADER_BYTES
    max_one_header_bytes = MAX_ONE_HEADER_BYTES
    on_refused: Callable[[], None] = staticmethod(lambda: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._request_begun = False
        self._header_bytes = 0  # received while the current request's headers are incomplete
        self._parsed_bytes = 0  # the current request's line and headers, as parsed
        self._too_large = False

    def data_received(self, data: bytes) -> None:
        if self._too_large:
            return
        super().data_received(data)
        if self._header_timer is not None and not self._too_large:  # headers still incomplete after this
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._refuse_too_large()

    def _refuse_too_large(self) -> None:
        """431 and close, parsing nothing more of this connection."""
        self._too_large = True
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(_TOO_LARGE)
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self._parsed_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed_bytes += len(name) + len(value)
        if len(name) + len(value) > self.max_one_header_bytes or self._parsed_bytes > self.max_header_bytes:
            self._too_large = True  # answered when the parser reaches the headers' end
            return
        super().on_header(name, value)

    def on_body(self, body: bytes) -> None:
        if not self._too_large:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm_body()
        if not self._too_large:
            super().on_message_complete()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _disarm_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():  # whatever was answered was sent; the rest is not worth waiting for
            self.transport.close()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            if self._request_begun:  # a request had begun: tell its client why; a silent socket just closes
                self.transport.write(_TIMED_OUT)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Connections, not requests in flight (the queue limit and the body budget bound those): uvicorn's
        # own limit_concurrency counts both, and logs a line per refusal, which a flood turns into a flood.
        if len(self.connections) > self.max_connections:
            self.on_refused()
            transport.write(_TOO_MANY)
            transport.close()
            return
        self._arm()  # a connection that never sends its first request is closed too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        self._header_bytes = self._parsed_bytes = 0
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._request_begun = False
        if self._too_large:
            return self._refuse_too_large()
        self._disarm_body()
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        super().connection_lost(exc)


def protocol_with(header_timeout_s: float, read_timeout_s: float, max_connections: int,
                  on_refused: Callable[[], None] = lambda: None, *, max_header_bytes: int = MAX_HEADER_BYTES,
                  max_one_header_bytes: int = MAX_ONE_HEADER_BYTES) -> type[HeaderDeadline]:
    """The protocol class uvicorn instantiates per connection, with this server's limits: open
    connections, the time to send headers and their size, and a second past the app's own body deadline
    for a body nobody reads."""
    return type("HeaderDeadlineProtocol", (HeaderDeadline,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": read_timeout_s + 1.0,
                 "max_connections": max_connections, "on_refused": staticmethod(on_refused),
                 "max_header_bytes": max_header_bytes, "max_one_header_bytes": max_one_header_bytes})


def open_file_connection_limit(cap: int = 2048) -> int:
    """The connections the process's open-file limit allows (a socket is a file; room is left for
    models, logs and the registry), at most ``cap``: past it a connection is refused (503) instead of
    ``accept`` failing for every client alike."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(cap, (soft if soft != resource.RLIM_INFINITY else 4096) - 128))


class BodyBudget:
    """Request-body bytes held at once, across every request, bounded: a body that would take the total
    past the bound is refused at once (503) instead of being read, so many large or slow bodies cannot
    exhaust the server's memory. Single-threaded: used from the event loop only."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit, self.held = limit_bytes, 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size

    @property
    def room(self) -> int:
        return self.limit - self.held

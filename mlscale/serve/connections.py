"""What one HTTP connection may hold: a deadline for its request headers, and a server-wide budget of
request-body bytes.

uvicorn closes an idle keep-alive connection, but has no deadline for headers: a connection that
never sends a byte, or trickles one header line every few seconds, is held for ever. ``HeaderDeadline``
is uvicorn's httptools protocol with one: from the connection's start, and from the first byte of each
later request, the headers must be complete within ``header_timeout_s`` or the connection is closed
(with a 408 when a request had begun). The body has its own deadline, in the app (``read_timeout_s``),
so that a request whose body never arrives is answered 408 without ever taking an admission slot; and
here, a second after that one, for a body nobody reads (a request answered before its body arrived, a
404 say), which uvicorn would otherwise go on receiving for as long as its client trickles it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _response(status: bytes, message: bytes) -> bytes:
    body = b'{"error": "%s"}' % message
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(body), body))


_TIMED_OUT = _response(b"408 Request Timeout", b"request headers took too long")
_TOO_MANY = _response(b"503 Service Unavailable", b"too many connections (--max-connections); retry later")


class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline on reading each request's headers."""

    header_timeout_s = 5.0  # set per server by ``protocol_with``
    body_timeout_s = 11.0
    max_connections = 2048
    on_refused: Callable[[], None] = staticmethod(lambda: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._request_begun = False

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
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._request_begun = False
        self._disarm_body()
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm_body()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        super().connection_lost(exc)


def protocol_with(header_timeout_s: float, read_timeout_s: float, max_connections: int,
                  on_refused: Callable[[], None] = lambda: None) -> type[HeaderDeadline]:
    """The protocol class uvicorn instantiates per connection, with this server's limits: open
    connections, the time to send headers, and a second past the app's own body deadline for a body
    nobody reads."""
    return type("HeaderDeadlineProtocol", (HeaderDeadline,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": read_timeout_s + 1.0,
                 "max_connections": max_connections, "on_refused": staticmethod(on_refused)})


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

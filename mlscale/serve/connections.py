"""What one HTTP connection may hold: a deadline for its request headers, and a server-wide budget of
request-body bytes.

uvicorn closes an idle keep-alive connection, but has no deadline for headers: a connection that
never sends a byte, or trickles one header line every few seconds, is held for ever. ``HeaderDeadline``
is uvicorn's httptools protocol with one: from the connection's start, and from the first byte of each
later request, the headers must be complete within ``header_timeout_s`` or the connection is closed
(with a 408 when a request had begun). The body has its own deadline, in the app (``read_timeout_s``),
so that a request whose body never arrives is answered 408 without ever taking an admission slot.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_TIMED_OUT_BODY = b'{"error": "request headers took too long"}'
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(_TIMED_OUT_BODY), _TIMED_OUT_BODY))


class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline on reading each request's headers."""

    header_timeout_s = 5.0  # set per server by ``protocol_with``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_begun = False

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            if self._request_begun:  # a request had begun: tell its client why; a silent socket just closes
                self.transport.write(_TIMED_OUT)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends its first request is closed too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._request_begun = False
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_with(header_timeout_s: float) -> type[HeaderDeadline]:
    """The protocol class uvicorn instantiates per connection, with this server's header deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadline,), {"header_timeout_s": header_timeout_s})


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

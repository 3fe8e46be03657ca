"""Logs that a client cannot flood: a warning that a request (or a file someone else wrote) can cause is
written at most once an interval per kind, and the next line of that kind says how many were held back.

A server that logs one line per bad request hands its disk and its operator's attention to whoever sends
bad requests: an over-long ``traceparent`` (OpenTelemetry's propagator warns per request), a NUL in a
header (uvicorn's "Invalid HTTP request received."), a run folder planted with odd values (the UI).
"""

from __future__ import annotations

import logging
import threading
import time

INTERVAL_S = 10.0
# The loggers whose warnings a client's input causes, one line per request otherwise.
CLIENT_FED = ("uvicorn.error", "opentelemetry.trace.propagation.tracecontext", "mlscale.ui")


class RateLimit(logging.Filter):
    """Passes the first record of a kind (logger and message template) each ``interval_s``; drops the
    rest, counted, and appends the count to the next one that passes. Errors and worse always pass."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        kind = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self.interval_s) < self.interval_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._last[kind] = now
            held = self._held.pop(kind, 0)
            if len(self._last) > 1024:  # kinds are templates, few; bounded all the same
                self._last = {kind: now}
        if held:
            record.msg = f"{record.getMessage()} ({held} more like it in the last {self.interval_s:g} s)"
            record.args = ()
        return True


_installed = RateLimit()


def limit_client_fed_logs(names: tuple[str, ...] = CLIENT_FED) -> RateLimit:
    """Rate-limit the warnings of ``names`` (idempotent): what ``mlscale serve`` and ``mlscale ui`` call
    once at start."""
    for name in names:
        logger = logging.getLogger(name)
        if _installed not in logger.filters:
            logger.addFilter(_installed)
    return _installed

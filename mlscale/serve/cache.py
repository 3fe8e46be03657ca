"""The response cache: keyed by model content + canonical input + parameters, bounded in bytes, LRU,
successes only, with concurrent identical misses coalesced into one model call.

The key uses the decoded input (dtype, shape and bytes of the array the model would see, with -0.0
made 0.0), not the request's JSON, so ``1``, ``1.0`` and ``1e0`` are one entry; it includes the
model version's content identity (the SHA-256 of its artifact), so a new version can never be answered
from the old one's entries. On top of it, the encoded response to an exact request body is memoised
(key: version content + route + body bytes), so a repeated request skips decoding and encoding; it is
only ever filled from a successful answer of the canonical path, and shares the byte budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np


def cache_key(content_id: str, array: np.ndarray | dict[str, np.ndarray],
              params: dict[str, Any] | None = None) -> bytes:
    """The key of an input (one array, or one per input name in the signature's order) and parameters."""
    digest = hashlib.sha256()
    digest.update(content_id.encode())
    for name, value in (array.items() if isinstance(array, dict) else [(None, array)]):
        canonical = np.ascontiguousarray(value)
        if canonical.dtype.kind == "f":
            canonical = canonical + canonical.dtype.type(0)  # -0.0 -> 0.0
        if name is not None:
            digest.update(f"|{name}".encode())
        digest.update(f"|{canonical.dtype.str}|{canonical.shape}|".encode())
        digest.update(canonical.tobytes())
    digest.update(json.dumps(params or {}, sort_keys=True, default=str).encode())
    return digest.digest()


RawKey = tuple[str, str, bytes]
Key = bytes | RawKey


def raw_key(content_id: str, route: str, body: bytes) -> RawKey:
    """Key of the memoised encoded response to exactly this body (its ``id`` included) on this route.

    The body itself is the key: a dict compares it in full on a hash match, so no collision can answer
    one body with another's response, and no digest is computed on the hot path. Its bytes count
    against the cache's budget like the value's."""
    return content_id, route, body


def _size(key: Key, value: np.ndarray | bytes) -> int:
    """What an entry holds: the value's own bytes (values are owned copies, never views), the key's
    bytes and a fixed overhead for the dict entry and objects."""
    key_bytes = len(key) if isinstance(key, bytes) else sum(len(part) for part in key)
    return (value.nbytes if isinstance(value, np.ndarray) else len(value)) + key_bytes + 64


class ResponseCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[Key, np.ndarray | bytes] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[np.ndarray]] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> np.ndarray | bytes | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: Key, value: np.ndarray | bytes) -> None:
        if not self.enabled:
            return
        if isinstance(value, np.ndarray) and value.base is not None:
            # An answer is a slice of its batch's output: storing the view would keep the whole batch
            # alive while the budget counted only the slice. The cache keeps its own copy of the rows.
            value = value.copy()
        size = _size(key, value)
        if size > self.max_bytes:
            return
        if key in self._entries:
            self.bytes -= _size(key, self._entries.pop(key))
        self._entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            old_key, old = self._entries.popitem(last=False)
            self.bytes -= _size(old_key, old)

    async def get_or_compute(self, key: bytes, compute: Callable[[], Awaitable[np.ndarray]]) -> tuple[np.ndarray, str]:
        """(value, how): how is ``hit``, ``coalesced`` (waited for an identical miss) or ``miss``.

        The miss is computed in a task of its own that every caller awaits shielded: a caller that
        goes away (a cancelled gRPC call, a client past its deadline) must not cancel the work that
        the others wait for."""
        value = self.get(key)
        if value is not None:
            return value, "hit"  # type: ignore[return-value]
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending), "coalesced"
        task = asyncio.ensure_future(compute())
        self._inflight[key] = task
        task.add_done_callback(lambda done: self._finished(key, done))
        return await asyncio.shield(task), "miss"

    def _finished(self, key: bytes, task: asyncio.Future[np.ndarray]) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled() and task.exception() is None:  # exception(): retrieved, the waiters have it
            self.put(key, task.result())

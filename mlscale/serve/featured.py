"""Serving a model trained from a feature service: a request names entities instead of sending a
tensor, and the server builds the tensor the way training did.

``{"parameters": {"entities": [{"user_id": 7}, ...]}}`` on ``/v2/models/NAME/infer`` (no
``inputs``), or ``{"entities": [...]}`` on ``/predict``: the service's features are looked up in the
online store by entity key (TTL at the request's time), the on-demand transformations run (the same
functions as at training), and the model's input is built by ``mlscale.features.encoding``, as the
``features`` task built it. ``"return_features": true`` in the parameters adds the vectors used to the answer.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from mlscale.errors import UsageError
from mlscale.features import load_service
from mlscale.features.encoding import model_matrix
from mlscale.features.online import get_online_features, online_store
from mlscale.features.skew import FeatureLog, FeatureSkew
from mlscale.registry import ModelVersion
from mlscale.serve.protocol import MAX_ROWS, BadRequest

log = logging.getLogger("mlscale.serve")
T = TypeVar("T")


class StoreUnavailable(Exception):
    """The online store did not answer in time, or every thread waiting on it is still waiting."""


class StoreCalls:
    """Blocking store calls, off the event loop: a few threads of their own, each call under a deadline.

    A store that hangs must cost only the requests that need it: the loop never waits on it (liveness
    and other models stay fast), a call past ``timeout_s`` is answered 503 at once, and when every
    thread is still stuck in earlier calls, new ones are refused at once instead of queued behind them.
    """

    def __init__(self, timeout_s: float, threads: int = 4) -> None:
        self.timeout_s, self.threads = timeout_s, threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="store")
        self._busy = 0
        self._lock = threading.Lock()

    async def run(self, call: Callable[[], T]) -> T:
        with self._lock:
            if self._busy >= self.threads:
                raise StoreUnavailable(f"the online store is still busy with {self._busy} earlier lookups")
            self._busy += 1
        future = self._pool.submit(call)
        future.add_done_callback(self._done)  # the thread is free only when the call returns
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on
            raise StoreUnavailable(f"the online store did not answer within {self.timeout_s * 1e3:g} ms") from None
        except Exception as exc:
            if _store_failure(exc):  # the store is down or locked: not the request's fault, nor a bug
                log.warning("online store lookup failed: %s: %s", type(exc).__name__, exc)
                raise StoreUnavailable(f"the online store failed ({type(exc).__name__})") from None
            raise

    def _done(self, _: object) -> None:
        with self._lock:
            self._busy -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _store_failure(exc: BaseException) -> bool:
    """An error of the store itself: SQLite's (a locked or unreadable file), Redis's, or the network's."""
    return isinstance(exc, (sqlite3.Error, OSError)) or type(exc).__module__.split(".")[0] == "redis"


class FeatureLogWriter:
    """The feature log, best-effort: vectors are handed to a thread of its own through a bounded queue,
    so a slow or locked log never delays an answer; a vector that cannot be written (the queue is full,
    the write fails) is counted in ``failures`` and dropped."""

    def __init__(self, location: str, on_failure: Callable[[], None], capacity: int = 1024,
                 busy_timeout_s: float = 1.0) -> None:
        """``busy_timeout_s``: how long one write waits for a lock another process holds on the log."""
        self.location, self.on_failure, self.busy_timeout_s = location, on_failure, busy_timeout_s
        self._queue: queue.Queue[tuple[str, int, float, dict[str, list[Any]]] | None] = queue.Queue(capacity)
        self._thread = threading.Thread(target=self._write, name="feature-log", daemon=True)
        self._thread.start()

    def append(self, model: str, version: int, at: float, columns: dict[str, list[Any]]) -> None:
        try:
            self._queue.put_nowait((model, version, at, columns))
        except queue.Full:
            self.on_failure()

    def close(self) -> None:
        """Write what is queued, then stop the thread (a version replaced by a hot reload)."""
        self._queue.put(None)  # blocks only while the queue is full: the writer is draining it

    def _write(self) -> None:
        feature_log = None
        while True:
            entry = self._queue.get()
            if entry is None:
                if feature_log is not None:
                    feature_log.connection.close()
                return
            try:
                if feature_log is None:  # opened here: sqlite's connection belongs to this thread
                    feature_log = FeatureLog(self.location)
                    feature_log.connection.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1e3)}")
                feature_log.append(*entry)
            except Exception as exc:  # locked, full disk, gone: serving goes on, the metric says so
                log.warning("feature log %s: a vector was not written: %s", self.location, exc)
                self.on_failure()


class FeatureInputs:
    """The feature vectors of entity rows, for one model version trained from features."""

    def __init__(self, version: ModelVersion, store_location: str | None, log_location: str | None = None, *,
                 timeout_s: float = 0.5, on_log_failure: Callable[[], None] = lambda: None) -> None:
        options = version.config.get("task_options") or {}
        if store_location is None:
            raise UsageError(f"{version.uri} was trained from features ({options.get('service')}): give the online "
                             "store it reads them from with --online-store (a SQLite file or redis:// URL)")
        self.version = version
        self.repository, self.service = load_service(str(options.get("service")))
        self.store = online_store(store_location, timeout_s=timeout_s)
        self.calls = StoreCalls(timeout_s)
        self.fields = self.service.fields()
        self.names = [field.name for field in self.fields]
        recorded = version.metrics.get("features") or {}
        self.encoding = recorded.get("encoding") or {}  # the categories each categorical feature had
        self.skew = FeatureSkew(recorded.get("statistics") or {})  # /metrics, against the training statistics
        self.log = FeatureLogWriter(log_location, on_log_failure) if log_location else None

    def close(self) -> None:
        self.calls.close()
        if self.log is not None:
            self.log.close()

    async def vectors(self, entity_rows: list[dict[str, Any]]) -> np.ndarray:
        """The model's input for these entities: the store is read off the event loop, under the store
        timeout (``StoreUnavailable`` past it); the rest is cheap and stays on the loop."""
        try:
            columns = await self.calls.run(
                lambda: get_online_features(self.repository, self.store, self.service, entity_rows))
        except UsageError as exc:  # an entity row without a join key: the client's mistake
            raise BadRequest(str(exc)) from None
        self.skew.observe(columns)  # the values as served, missing ones not counted (as at training)
        if self.log is not None:
            self.log.append(self.version.name, self.version.version, time.time(), columns)
        return model_matrix(columns, self.fields, self.encoding, len(entity_rows))


def entity_rows(value: Any) -> list[dict[str, Any]]:
    """The request's entities: a non-empty list of objects of join keys."""
    if not isinstance(value, list) or not value or not all(isinstance(row, dict) for row in value):
        raise BadRequest("'entities' must be a non-empty list of objects of entity keys, like [{\"user_id\": 7}]")
    if len(value) > MAX_ROWS:
        raise BadRequest(f"'entities' holds {len(value)} rows; at most {MAX_ROWS}")
    return value

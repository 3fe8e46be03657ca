"""What both transports share: the server's state and lifecycle, admission, inference, and the errors
a request can end in (an HTTP status, which the gRPC service maps to its code: ``GRPC_CODES``).

``http.py`` (the HTTP app) and ``grpc.py`` (the gRPC service) each import this module and never each
other; this module imports neither. The gRPC service is started with the models by a hook
(``ServerState.start_grpc``) that ``server.py``, which wires both transports, passes in.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import numpy as np

from mlscale.common.connections import BodyBudget
from mlscale.serve import tracing
from mlscale.serve.batcher import DeadlineExceeded, Overloaded, Replaced
from mlscale.serve.cache import ResponseCache, cache_key
from mlscale.serve.featured import StoreUnavailable
from mlscale.serve.metrics import ServerMetrics
from mlscale.serve.models import ModelSlot, ServedModel
from mlscale.serve.options import ServeOptions
from mlscale.serve.peers import PUBLISH_S, Peers
from mlscale.serve.protocol import BadRequest
from mlscale.serve.rollout import Shadow, TrafficSplit
from mlscale.serve.runtime import Inputs

log = logging.getLogger("mlscale.serve")
T = TypeVar("T")
GRPC_GRACE_S = 30.0  # as uvicorn's timeout_graceful_shutdown: calls in flight at the end of the drain
# The gRPC status code of each HTTP status a request can end in (by name: this module imports no
# transport); any other status is INTERNAL.
GRPC_CODES = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
              503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
# True while the request being handled was routed by a traffic split (set by ``ServerState.route``,
# reset by ``ServerState.answering``): its outcome is also counted as the split's, which is all that
# ``mlscale models compare`` judges. A context variable, as the trace is: each request is its own task.
routed_by_split: ContextVar[bool] = ContextVar("mlscale_routed_by_split", default=False)


class HTTPError(Exception):
    """How a request fails, in either transport: an HTTP status (gRPC: ``GRPC_CODES``), a message for
    the client, and headers (HTTP only)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers


def internal_error(exc: BaseException, what: str) -> HTTPError:
    """A 500 that tells the client nothing internal: a generic message and a request id; the exception
    goes to the server's log under that id, where an operator can find it."""
    request_id = uuid.uuid4().hex[:16]
    log.error("request %s: %s: %s: %s", request_id, what, type(exc).__name__, exc, exc_info=exc)
    return HTTPError(500, f"internal error (request id {request_id})", {"X-Request-ID": request_id})


# The gRPC transport's start: (state, address, max message bytes, max calls) -> its server.
GrpcStarter = Callable[..., Awaitable[Any]]


class ServerState:
    """One server process's state, whole from its construction: the slots (every version the server
    loads, canary and shadow included), the options it runs under, the traffic splits, the shadow, the
    tracer, the other workers (``peers``) and the gRPC service's start. What changes later is what
    running changes: readiness, the drain, the gRPC server once started, the loop's lag."""

    def __init__(self, slots: list[ModelSlot], metrics: ServerMetrics, cache: ResponseCache, options: ServeOptions,
                 *, splits: dict[str, TrafficSplit] | None = None, shadow: Shadow | None = None,
                 tracer: tracing.Tracer | None = None, peers: Peers | None = None,
                 start_grpc: GrpcStarter | None = None) -> None:
        """``splits``: model name -> its traffic split with a canary; ``shadow``: copies of one model's
        requests, answered off the response path; ``peers``: the other workers of a server of several
        (readiness and metrics shared); ``start_grpc``: the gRPC service's start (core imports no
        transport), called with the models in ``start`` when ``options.grpc_port`` is set."""
        self.slots, self.metrics, self.cache = slots, metrics, cache
        self.max_body_bytes = options.max_body_bytes
        self.exec_timeout_s, self.read_timeout_s = options.exec_timeout_s, options.read_timeout_s
        self.bodies = metrics.body_bytes = BodyBudget(options.max_inflight_bytes or 32 * options.max_body_bytes)
        self.splits, self.shadow, self.tracer, self.peers = splits or {}, shadow, tracer, peers
        self.route_header = options.route_header.lower().encode()  # its value keeps a caller on one version
        self.expose_rollout_versions = options.expose_rollout_versions  # a request may name a canary's version
        self.reload_interval_s = options.reload_interval_s
        self.start_grpc = start_grpc
        self.grpc_address: str | None = None  # where the gRPC service listens, once the models are loaded
        if options.grpc_port is not None and start_grpc is not None:
            host = f"[{options.host}]" if ":" in options.host else options.host
            self.grpc_address = f"{host}:{options.grpc_port}"
        # calls in flight before new ones get RESOURCE_EXHAUSTED
        self.grpc_max_calls = options.connection_limit if self.grpc_address is not None else None
        self.grpc_shared_port = peers is not None  # every worker binds the gRPC port (SO_REUSEPORT)
        self.not_live: str | None = None  # why liveness fails; once set it stays: a restart is the cure
        self._ready = False
        self.draining = False  # set by the first SIGTERM: never ready again
        self.tasks: list[asyncio.Task[None]] = []
        self.grpc_server: Any = None
        self._grpc_stop: tuple[float, asyncio.Future[None]] | None = None  # (grace, the stop under way)
        self.loop_lag_s = 0.0  # how late the event loop runs what is ready: the server's own backlog

    @property
    def ready(self) -> bool:
        """Ready to serve: this process is, and so is every other worker of the server."""
        return self._ready and (self.peers is None or self.peers.all_ready())

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value
        if self.peers is not None:
            self.peers.set_ready(value)

    async def publish_metrics(self, period_s: float) -> None:
        """What only this worker knows of its metrics (its counters are in its cells, which the others
        read as they are), published for the others to merge into the whole server's."""
        assert self.peers is not None
        while True:
            self.peers.publish(self.metrics.local())
            await asyncio.sleep(period_s)

    async def start(self) -> None:
        """Start-up, in the server's event loop: watchers, models loaded (then followed), the gRPC
        service (when it has an address), GC frozen; then ready, unless a signal came meanwhile."""
        loop = asyncio.get_running_loop()
        self.tasks.append(loop.create_task(self.watch_loop_lag()))
        if self.exec_timeout_s is not None:
            self.tasks.append(loop.create_task(self.watch_exec()))
        if self.peers is not None:
            self.tasks.append(loop.create_task(self.publish_metrics(PUBLISH_S)))
        for slot in self.slots:
            await slot.load()
            if slot.follows:
                self.tasks.append(loop.create_task(slot.follow()))
        for split in self.splits.values():
            self.tasks.append(loop.create_task(split.follow(self.reload_interval_s)))
        if self.grpc_address is not None:
            assert self.start_grpc is not None, "a gRPC address without the service's start"
            self.grpc_server = await self.start_grpc(self, self.grpc_address, self.max_body_bytes,
                                                     max_calls=self.grpc_max_calls, shared=self.grpc_shared_port)
        gc.collect()
        gc.freeze()  # what start-up loaded lives as long as the server: keep it out of every collection
        self.ready = not self.draining

    async def stop(self) -> None:
        """Shutdown, once the HTTP server has drained: gRPC stopped, watchers cancelled, every model's
        queue drained and closed."""
        self.ready = False
        if self.grpc_server is not None:  # stopping since the drain ended (see server.py); wait for it
            await self.stop_grpc(GRPC_GRACE_S)
        for task in self.tasks:
            task.cancel()
        for slot in self.slots:
            if slot.current is not None:
                await slot.current.close()
        if self.peers is not None:
            self.peers.publish(self.metrics.local())  # the last word: nothing held once drained
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # the spans not yet exported

    def stop_grpc(self, grace_s: float) -> asyncio.Future[None]:
        """Stop the gRPC service: refuse new calls now, let calls in flight finish for ``grace_s``
        (0: cancel them). Called again, it returns the stop under way, unless asked for a shorter
        grace (a second signal)."""
        if self._grpc_stop is None or grace_s < self._grpc_stop[0]:
            self._grpc_stop = grace_s, asyncio.ensure_future(self.grpc_server.stop(grace_s))
        return self._grpc_stop[1]

    async def watch_loop_lag(self, period_s: float = 0.005) -> None:
        """EWMA of event-loop lag. Under overload requests wait in the server before any handler runs;
        the batcher cannot see that wait, the loop's lag measures it."""
        while True:  # perf_counter: uvloop's loop.time() ticks in whole milliseconds
            start = time.perf_counter()
            await asyncio.sleep(period_s)
            lag = max(0.0, time.perf_counter() - start - period_s)
            self.loop_lag_s = 0.8 * self.loop_lag_s + 0.2 * lag

    def check_live(self) -> str | None:
        """Why the server is not live (a model call has run past ``exec_timeout_s``), or None."""
        if self.not_live is None and self.exec_timeout_s is not None:
            now = time.perf_counter()
            for slot in self.slots:
                served = slot.current
                started = served.batcher.call_started if served else None
                if started is not None and now - started > self.exec_timeout_s:
                    self.not_live = (f"a call of model {served.name} version {served.number} has run "
                                     f"{now - started:.1f} s, past --exec-timeout-s {self.exec_timeout_s:g}")
                    log.error("not live: %s", self.not_live)
        return self.not_live

    async def watch_exec(self) -> None:
        """Check for a stuck model call even when nobody probes, so that the log says when it happened."""
        assert self.exec_timeout_s is not None
        while self.check_live() is None:
            await asyncio.sleep(min(1.0, self.exec_timeout_s / 4))

    def route(self, served: ServedModel, key: bytes | None) -> ServedModel:
        """The version a request by model name goes to: ``served`` (the model's primary version), or its
        canary for the split's share of requests (sticky per ``key`` when there is one)."""
        split = self.splits.get(served.name)
        if split is None or served is not split.primary.current:
            return served
        routed_by_split.set(True)
        return split.pick(key) or served

    def successor_of(self, served: ServedModel) -> ServedModel:
        for slot in self.slots:
            if (slot.name == served.name and slot.role == served.role and slot.current is not None
                    and slot.current is not served):
                return slot.current
        raise HTTPError(404, f"model '{served.name}' version {served.number} was replaced")

    def answering(self, name: str, version: str | None = None) -> ServedModel:
        """The version an inference request names (its model's primary when it names none). A canary
        answers only the share the split sends it and a shadow's answers are never returned: a request
        naming either's version would get around both (and skew what ``models compare`` judges), so it
        is refused (403) unless the operator allowed it (``--expose-rollout-versions``)."""
        routed_by_split.set(False)
        refused = None
        for slot in self.slots:
            served = slot.current
            if served is None or served.name != name or (version is not None and str(served.number) != version):
                continue
            if slot.role == "primary" or (version is not None and self.expose_rollout_versions):
                return served
            refused = refused or slot
        if refused is None:
            return self.lookup(name, version)  # the 404
        if version is None:  # only a canary or a shadow of it is loaded (its primary is not, yet)
            raise HTTPError(503, f"model '{name}' is not loaded yet; retry later", {"Retry-After": "1"})
        what = (f"answers only its share of the requests to /v2/models/{name}/infer" if refused.role == "canary"
                else "answers copies of requests, never returned to a client")
        raise HTTPError(403, f"model '{name}' version {version} is this server's {refused.role}: it {what}; "
                        "start the server with --expose-rollout-versions to let a request name it")

    def lookup(self, name: str, version: str | None = None) -> ServedModel:
        for slot in self.slots:
            served = slot.current
            if served is not None and served.name == name and (version is None or str(served.number) == version):
                return served
        known = ", ".join(sorted({f"{s.current.name}/{s.current.number}" for s in self.slots if s.current}))
        what = f"model '{name}'" + (f" version {version}" if version else "")
        raise HTTPError(404, f"unknown {what} (serving: {known})")


async def run_inference(state: ServerState, served: ServedModel, array: Inputs, params: dict[str, Any],
                        start: float) -> tuple[np.ndarray, ServedModel]:
    """The output and the version that computed it (which the response must name). ``start``: when the
    request's handling began, less the event loop's lag then (its wait before any handler ran)."""
    try:
        output = await _predict_once(state, served, array, params, start)
    except Replaced:
        # The version was swapped while this request was being read: its successor answers it, so a
        # hot reload fails nothing. (A request that named this exact version finds it gone: 404.)
        served = state.successor_of(served)
        output = await _predict_once(state, served, array, params, start)
    if state.shadow is not None and state.shadow.name == served.name:  # a copy, answered off this path
        state.shadow.copy(served, array, output, time.perf_counter() - start)
    trace = tracing.current.get()
    if trace is not None:
        trace.version = str(served.number)
    return output, served


async def _predict_once(state: ServerState, served: ServedModel, array: Inputs, params: dict[str, Any],
                        start: float) -> np.ndarray:
    stats = served.stats
    try:
        if state.cache.enabled:
            key = cache_key(served.content_id, array, params)
            looked_up = time.perf_counter()
            output, how = await state.cache.get_or_compute(key, lambda: served.batcher.submit(array))
            stats.cache[how].inc()
            trace = tracing.current.get()
            if trace is not None:
                trace.mark("cache", looked_up, time.perf_counter() if how == "hit" else looked_up,
                           **{"mlscale.cache.result": how})
        else:
            output = await served.batcher.submit(array)
    except Replaced:
        raise
    except Overloaded as exc:
        failed(served, "overloaded")
        raise HTTPError(503, f"overloaded: {exc}; retry later", {"Retry-After": "1"}) from None
    except DeadlineExceeded as exc:
        failed(served, "timeout")
        raise HTTPError(504, f"request timed out: {exc}") from None
    except Exception as exc:
        failed(served, "model")
        raise internal_error(exc, "the model call failed") from None
    answered(served, time.perf_counter() - start)
    return output


def answered(served: ServedModel, seconds: float) -> None:
    """A request answered in ``seconds``: counted, and as the split's too when it routed it."""
    stats = served.stats
    stats.success.inc()
    stats.duration.observe(seconds)
    if routed_by_split.get():
        stats.routed_success.inc()
        stats.routed_duration.observe(seconds)


def failed(served: ServedModel, reason: str) -> None:
    """A request the server failed (5xx): counted by ``reason``, and as the split's when it routed it."""
    served.stats.failure(reason)
    if routed_by_split.get():
        served.stats.routed_failed.inc()


@contextmanager
def bad_request_is_400(served: ServedModel) -> Iterator[None]:
    """A request that does not parse: counted, and a 400 with its message (every protocol)."""
    try:
        yield
    except BadRequest as exc:
        served.stats.client_error("bad_request")  # the client's mistake: never a failure of the version
        if routed_by_split.get():
            served.stats.routed_client_errors.inc()
        raise HTTPError(400, str(exc)) from None


def body_budget_full(state: ServerState, headers: dict[str, str] | None = None) -> HTTPError:
    """The 503 of a request (HTTP body or gRPC message) that would take the server's request bytes past
    ``--max-inflight-mb``; counted."""
    state.metrics.refused["body_budget"].inc()
    return HTTPError(503, f"the server holds {state.bodies.held} bytes of requests, its limit (--max-inflight-mb); "
                     "retry later", {"Retry-After": "1", **(headers or {})})


def refuse_if_overloaded(served: ServedModel) -> None:
    """503 now when the model's queue is full or, with an SLO, its queue would make a new request miss
    it. Takes nothing: cheap enough to refuse a request before its body is read."""
    try:
        served.batcher.admit(1)
    except Replaced:
        pass  # swapped out meanwhile: run_inference hands the request to the successor
    except Overloaded as exc:
        failed(served, "overloaded")
        raise HTTPError(503, f"overloaded: {exc}; retry later", {"Retry-After": "1"}) from None


async def admitted(state: ServerState, served: ServedModel, answer: Callable[[float], Awaitable[T]]) -> T:
    """``answer(start)`` for one inference request of any protocol whose body (message) has arrived
    whole, if admission control lets it in: refused (503) when the queue is full or, with an SLO, when
    more requests are in flight than keep p99 under it. ``start``: now, less the event loop's lag (how
    long the request waited unseen)."""
    start = time.perf_counter() - state.loop_lag_s
    refuse_if_overloaded(served)
    guard = served.batcher.guard
    trace = tracing.current.get()
    if trace is not None:
        trace.admitted = time.perf_counter()
    if guard is None:
        return await answer(start)
    if not guard.enter():
        failed(served, "overloaded")
        raise HTTPError(503, f"overloaded: {guard.limit} requests in flight, the most that keep p99 under "
                        f"the {guard.slo_s * 1e3:g} ms SLO; retry later", {"Retry-After": "1"})
    latency = None
    try:
        result = await answer(start)
        latency = time.perf_counter() - start
        return result
    finally:
        guard.leave(latency)
        served.stats.admission_limit.set(guard.limit)


async def entity_features(served: ServedModel, entities: Any) -> np.ndarray:
    """The model's input built from the online store; 503 with Retry-After when the store does not
    answer in time (only the requests that need it wait on it)."""
    started = time.perf_counter()
    try:
        return await served.feature_vectors(entities)
    except StoreUnavailable as exc:
        failed(served, "store_unavailable")
        raise HTTPError(503, f"{exc}; retry later", {"Retry-After": "1"}) from None
    finally:
        trace = tracing.current.get()
        if trace is not None:
            trace.mark("features", started, time.perf_counter())

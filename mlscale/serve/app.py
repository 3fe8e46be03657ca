"""The HTTP surface: Open Inference Protocol v2 REST endpoints, ``/predict`` and ``/metrics``.

Handlers decode and validate, then hand the tensor to the cache and the model's batcher. The app knows
models only as ``ServedModel`` objects (runtime + signature); nothing a client sends can make it load a
path or a model it was not started with.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlscale.serve import describe
from mlscale.serve.batcher import DeadlineExceeded, Overloaded, Replaced
from mlscale.serve.cache import ResponseCache, cache_key, raw_key
from mlscale.serve.connections import BodyBudget
from mlscale.serve.metrics import ServerMetrics
from mlscale.serve.models import ModelSlot, ServedModel
from mlscale.serve.protocol import (
    BadRequest,
    V2Request,
    check_json_cost,
    parse_predict,
    parse_v2,
    split_body,
    v2_response,
)

log = logging.getLogger("mlscale.serve")
T = TypeVar("T")
GRPC_GRACE_S = 30.0  # as uvicorn's timeout_graceful_shutdown: calls in flight at the end of the drain


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers


def internal_error(exc: BaseException, what: str) -> HTTPError:
    """A 500 that tells the client nothing internal: a generic message and a request id; the exception
    goes to the server's log under that id, where an operator can find it."""
    request_id = uuid.uuid4().hex[:16]
    log.error("request %s: %s: %s: %s", request_id, what, type(exc).__name__, exc, exc_info=exc)
    return HTTPError(500, f"internal error (request id {request_id})", {"X-Request-ID": request_id})


class ServerState:
    def __init__(self, slots: list[ModelSlot], metrics: ServerMetrics, cache: ResponseCache, max_body_bytes: int,
                 exec_timeout_s: float | None = None, read_timeout_s: float = 10.0,
                 max_inflight_bytes: int | None = None) -> None:
        self.slots, self.metrics, self.cache, self.max_body_bytes = slots, metrics, cache, max_body_bytes
        self.exec_timeout_s, self.read_timeout_s = exec_timeout_s, read_timeout_s
        self.bodies = metrics.body_bytes = BodyBudget(max_inflight_bytes or 32 * max_body_bytes)
        self.not_live: str | None = None  # why liveness fails; once set it stays: a restart is the cure
        self.ready = False
        self.draining = False  # set by the first SIGTERM: never ready again
        self.tasks: list[asyncio.Task[None]] = []
        self.grpc_address: str | None = None  # where the gRPC service listens, once the models are loaded
        self.grpc_max_calls: int | None = None  # calls in flight before new ones get RESOURCE_EXHAUSTED
        self.grpc_server: Any = None
        self._grpc_stop: tuple[float, asyncio.Future[None]] | None = None  # (grace, the stop under way)
        self.loop_lag_s = 0.0  # how late the event loop runs what is ready: the server's own backlog

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

    def successor_of(self, served: ServedModel) -> ServedModel:
        for slot in self.slots:
            if slot.name == served.name and slot.current is not None and slot.current is not served:
                return slot.current
        raise HTTPError(404, f"model '{served.name}' version {served.number} was replaced")

    def lookup(self, name: str, version: str | None = None) -> ServedModel:
        for slot in self.slots:
            served = slot.current
            if served is not None and served.name == name and (version is None or str(served.number) == version):
                return served
        known = ", ".join(sorted({f"{s.current.name}/{s.current.number}" for s in self.slots if s.current}))
        what = f"model '{name}'" + (f" version {version}" if version else "")
        raise HTTPError(404, f"unknown {what} (serving: {known})")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


_CLOSE = {"Connection": "close"}  # a refused body is not read: the connection cannot carry another request


@asynccontextmanager
async def request_body(state: ServerState, scope: dict[str, Any], receive: Any) -> AsyncIterator[bytes]:
    """The whole body, held for the ``with`` block: refused with 413 past ``max_body_bytes`` (declared
    or actual), with 503 when holding it would take the server's body bytes past ``--max-inflight-mb``,
    and with 408 when it has not all arrived ``--read-timeout-s`` after the headers. Nothing else (no
    admission slot, no queue place) is taken before it has arrived."""
    limit, bodies = state.max_body_bytes, state.bodies
    length = _header(scope, b"content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    if declared is not None and declared > limit:
        raise HTTPError(413, f"request body of {declared} bytes is over the {limit}-byte limit", _CLOSE)
    held = 0

    def refuse() -> HTTPError:
        return body_budget_full(state, _CLOSE)

    def hold(size: int) -> None:
        nonlocal held
        if not bodies.take(size):
            raise refuse()
        held += size

    async def read() -> bytes:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HTTPError(400, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body is over the {limit}-byte limit", _CLOSE)
            if size > held:
                hold(size - held)
            chunks.append(chunk)
            more = message.get("more_body", False)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    try:
        if declared and declared > bodies.room:  # refused before a byte is read; reserved only as bytes
            raise refuse()  # arrive, so that declaring a size and sending nothing holds nothing
        try:
            body = await _within(read(), state.read_timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on
            state.metrics.refused["read_timeout"].inc()
            raise HTTPError(408, f"the request body did not arrive within {state.read_timeout_s:g} s "
                            "(--read-timeout-s)", _CLOSE) from None
        yield body
    finally:
        bodies.give(held)


async def _within(work: Awaitable[T], seconds: float) -> T:
    """``work``, cancelled past ``seconds`` (TimeoutError). On 3.11+ a timer on the running task, not a
    task of its own as ``wait_for`` makes: this is on every request's path."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await work
    return await asyncio.wait_for(work, seconds)


def _decode(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"malformed JSON: {exc}") from None


async def run_inference(state: ServerState, served: ServedModel, array: np.ndarray, params: dict[str, Any],
                        start: float) -> tuple[np.ndarray, ServedModel]:
    """The output and the version that computed it (which the response must name). ``start``: when the
    request's handling began, less the event loop's lag then (its wait before any handler ran)."""
    try:
        return await _predict_once(state, served, array, params, start), served
    except Replaced:
        # The version was swapped while this request was being read: its successor answers it, so a
        # hot reload fails nothing. (A request that named this exact version finds it gone: 404.)
        successor = state.successor_of(served)
        return await _predict_once(state, successor, array, params, start), successor


async def _predict_once(state: ServerState, served: ServedModel, array: np.ndarray, params: dict[str, Any],
                        start: float) -> np.ndarray:
    stats = served.stats
    try:
        if state.cache.enabled:
            key = cache_key(served.content_id, array, params)
            output, how = await state.cache.get_or_compute(key, lambda: served.batcher.submit(array))
            stats.cache[how].inc()
        else:
            output = await served.batcher.submit(array)
    except Replaced:
        raise
    except Overloaded as exc:
        stats.failure("overloaded")
        raise HTTPError(503, f"overloaded: {exc}; retry later", {"Retry-After": "1"}) from None
    except DeadlineExceeded as exc:
        stats.failure("timeout")
        raise HTTPError(504, f"request timed out: {exc}") from None
    except Exception as exc:
        stats.failure("model")
        raise internal_error(exc, "the model call failed") from None
    stats.success.inc()
    stats.duration.observe(time.perf_counter() - start)
    return output


@contextmanager
def bad_request_is_400(served: ServedModel) -> Iterator[None]:
    """A request that does not parse: counted, and a 400 with its message (every protocol)."""
    try:
        yield
    except BadRequest as exc:
        served.stats.failure("bad_request")
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
        served.stats.failure("overloaded")
        raise HTTPError(503, f"overloaded: {exc}; retry later", {"Retry-After": "1"}) from None


async def admitted(state: ServerState, served: ServedModel, answer: Callable[[float], Awaitable[T]]) -> T:
    """``answer(start)`` for one inference request of any protocol whose body (message) has arrived
    whole, if admission control lets it in: refused (503) when the queue is full or, with an SLO, when
    more requests are in flight than keep p99 under it. ``start``: now, less the event loop's lag (how
    long the request waited unseen)."""
    start = time.perf_counter() - state.loop_lag_s
    refuse_if_overloaded(served)
    guard = served.batcher.guard
    if guard is None:
        return await answer(start)
    if not guard.enter():
        served.stats.failure("overloaded")
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


_PREDICT = ("", None)  # the /predict route: the first model the server was started with
_JSON = (b"content-type", b"application/json")
_OCTETS = (b"content-type", b"application/octet-stream")
HEADER_LENGTH = b"inference-header-content-length"


def inference_route(path: str) -> tuple[str, str | None] | None:
    """(model name, version or None) for the inference routes, ``_PREDICT`` for /predict, else None."""
    if path == "/predict":
        return _PREDICT
    parts = path.split("/")  # "", "v2", "models", NAME, ["versions", VERSION,] "infer"
    if len(parts) == 5 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "infer" and parts[3]:
        return parts[3], None
    if (len(parts) == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions"
            and parts[6] == "infer" and parts[3] and parts[5]):
        return parts[3], parts[5]
    return None


class InferenceFrontend:
    """The ASGI app the server runs. Requests to the inference routes are answered here, on bare ASGI:
    they are the hot path, and Starlette's router, middleware and request objects cost more than all
    the work of a cached answer (measured: a no-op endpoint answers ~14,000 requests/s on one core under
    Starlette, ~20,000 on bare ASGI). Every other route goes to the Starlette app ``control``."""

    def __init__(self, state: ServerState, control: Starlette) -> None:
        self.state, self.control = state, control

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        route = inference_route(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.control(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _send(send, 405, orjson.dumps({"error": "Method Not Allowed"}), {"Allow": "POST"})
            return
        try:
            answer = await self._infer(scope, receive, *route)
            status, headers = 200, None
        except HTTPError as exc:
            answer, status, headers = Answer(orjson.dumps({"error": str(exc)})), exc.status, exc.headers
        except Exception as exc:  # a bug, not the client's fault: log it under an id, keep serving
            error = internal_error(exc, "inference request failed")
            answer, status, headers = Answer(orjson.dumps({"error": str(error)})), 500, error.headers
        if self.state.draining:  # keep-alive clients reconnect, through the load balancer, to a server that stays
            headers = {**(headers or {}), "Connection": "close"}
        await _send(send, status, answer.payload, headers, answer.json_length)

    def _model(self, name: str, version: str | None) -> ServedModel:
        if (name, version) != _PREDICT:
            return self.state.lookup(name, version)
        slots = self.state.slots
        if not slots or slots[0].current is None:
            raise HTTPError(503, "no model loaded yet")
        return slots[0].current

    async def _infer(self, scope: dict[str, Any], receive: Any, name: str, version: str | None) -> Answer:
        served = self._model(name, version)
        predict = (name, version) == _PREDICT
        refuse_if_overloaded(served)  # under overload, a refusal costs as little as possible: no body read
        async with request_body(self.state, scope, receive) as body:  # the slot only once it has all arrived
            return await admitted(self.state, served, lambda start: self._answer(scope, body, served, predict, start))

    async def _answer(self, scope: dict[str, Any], body: bytes, served: ServedModel, predict: bool,
                      start: float) -> Answer:
        state = self.state
        header_length = _header(scope, HEADER_LENGTH)
        # The memo holds JSON answers to plain JSON bodies; binary framing goes the canonical way, and so
        # does a model fed from features (a body naming entities means other values as the store moves on).
        memo = state.cache.enabled and header_length is None and served.features is None
        key = raw_key(served.content_id, scope["path"], body) if memo else None
        cached = state.cache.get(key) if key is not None else None
        if isinstance(cached, bytes):  # this exact body was answered before: no decoding, no encoding
            served.stats.cache["hit"].inc()
            served.stats.success.inc()
            served.stats.duration.observe(time.perf_counter() - start)
            return Answer(cached)
        with bad_request_is_400(served):
            if len(body) > DECODE_INLINE_BYTES:  # decoding megabytes takes milliseconds: not on the loop
                request = await asyncio.to_thread(_parse, body, header_length, served, predict)
            else:
                request = _parse(body, header_length, served, predict)
            if request.array is None:
                request.array = await entity_features(served, request.entities)
        output, answered_by = await run_inference(state, served, request.array, request.parameters, start)
        raw = b""
        if predict:
            answer = {"model_name": answered_by.name, "model_version": str(answered_by.number), "outputs": output}
        else:
            answer, raw = v2_response(answered_by.name, answered_by.number, answered_by.output, output,
                                      request.request_id, binary=request.binary_output)
        if request.return_features:
            answer["parameters"] = {"features": served.features.names, "feature_vectors": request.array}
        payload = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
        if request.binary_output:
            return Answer(payload + raw, json_length=len(payload))
        if key is not None and answered_by is served:  # the memo is keyed by the version that answered
            state.cache.put(key, payload)
        return Answer(payload)


# Bodies up to this size are decoded on the event loop (tens of microseconds); larger ones in a thread,
# so a few clients sending megabytes of JSON cannot hold every other request up while they decode.
DECODE_INLINE_BYTES = 64 * 1024


def _parse(body: bytes, header_length: bytes | None, served: ServedModel, predict: bool) -> V2Request:
    header, binary = (body, b"") if predict else split_body(body, header_length)
    if len(header) > DECODE_INLINE_BYTES:
        check_json_cost(header, served.input)
    if predict:
        return parse_predict(_decode(header), served.input)
    return parse_v2(_decode(header), served.input, served.output, binary)


async def entity_features(served: ServedModel, entities: Any) -> np.ndarray:
    """The model's input built from the online store; 503 with Retry-After when the store does not
    answer in time (only the requests that need it wait on it)."""
    from mlscale.serve.featured import StoreUnavailable

    try:
        return await served.feature_vectors(entities)
    except StoreUnavailable as exc:
        served.stats.failure("store_unavailable")
        raise HTTPError(503, f"{exc}; retry later", {"Retry-After": "1"}) from None


@dataclass
class Answer:
    """A response body; ``json_length``: binary tensor data follows that many bytes of JSON."""

    payload: bytes
    json_length: int | None = None


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def _send(send: Any, status: int, payload: bytes, headers: dict[str, str] | None,
                json_length: int | None = None) -> None:
    if json_length is None:
        raw = [_JSON, (b"content-length", str(len(payload)).encode())]
    else:
        raw = [_OCTETS, (b"content-length", str(len(payload)).encode()),
               (HEADER_LENGTH, str(json_length).encode())]
    if headers:
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


def build_app(state: ServerState) -> InferenceFrontend:
    async def live(_: Request) -> Response:
        reason = state.check_live()
        if reason is not None:
            return JSONResponse({"live": False, "error": reason}, status_code=503)
        return JSONResponse({"live": True})

    async def ready(_: Request) -> Response:
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)

    async def server_metadata(_: Request) -> Response:
        return JSONResponse(describe.server_metadata())

    def _served(request: Request) -> ServedModel:
        return state.lookup(request.path_params["name"], request.path_params.get("version"))

    async def model_metadata(request: Request) -> Response:
        return JSONResponse(describe.model_metadata(state, _served(request)))

    async def model_config(request: Request) -> Response:
        return JSONResponse(describe.model_config(_served(request)))

    async def model_statistics(request: Request) -> Response:
        return JSONResponse(describe.statistics(state, request.path_params.get("name"),
                                                request.path_params.get("version")))

    async def repository_index(request: Request) -> Response:
        async with request_body(state, request.scope, request.receive) as body:
            options = _decode(body) if body else {}
        if not isinstance(options, dict) or not isinstance(options.get("ready", False), bool):
            raise HTTPError(400, 'the body must be {} or {"ready": true|false}')
        return JSONResponse(describe.repository_index(state, options.get("ready", False)))

    async def model_ready(request: Request) -> Response:
        served = _served(request)
        return JSONResponse({"name": served.name, "ready": state.ready}, status_code=200 if state.ready else 503)

    async def metrics(_: Request) -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPError)
        return _error(exc.status, str(exc), exc.headers)

    async def on_starlette_error(_: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        if status >= 500:
            error = internal_error(exc, "control request failed")
            return _error(500, str(error), error.headers)
        return _error(status, str(getattr(exc, "detail", exc)) or "error")

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        state.tasks.append(asyncio.get_running_loop().create_task(state.watch_loop_lag()))
        if state.exec_timeout_s is not None:
            state.tasks.append(asyncio.get_running_loop().create_task(state.watch_exec()))
        for slot in state.slots:
            await slot.load()
            if slot.follows:
                state.tasks.append(asyncio.get_running_loop().create_task(slot.follow()))
        if state.grpc_address is not None:
            from mlscale.serve.grpc_api import start_grpc

            state.grpc_server = await start_grpc(state, state.grpc_address, state.max_body_bytes,
                                                 max_calls=state.grpc_max_calls)
        gc.collect()
        gc.freeze()  # what start-up loaded lives as long as the server: keep it out of every collection
        state.ready = not state.draining
        yield
        state.ready = False
        if state.grpc_server is not None:  # stopping since the drain ended (see server.py); wait for it
            await state.stop_grpc(GRPC_GRACE_S)
        for task in state.tasks:
            task.cancel()
        for slot in state.slots:
            if slot.current is not None:
                await slot.current.close()

    model = "/v2/models/{name}"
    version = "/v2/models/{name}/versions/{version}"
    routes = [  # the inference routes are InferenceFrontend's
        Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server_metadata),
        Route("/v2/models/stats", model_statistics), Route(model, model_metadata), Route(version, model_metadata),
        Route(f"{model}/ready", model_ready), Route(f"{version}/ready", model_ready), Route("/metrics", metrics),
        Route(f"{model}/config", model_config), Route(f"{version}/config", model_config),
        Route(f"{model}/stats", model_statistics), Route(f"{version}/stats", model_statistics),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
    ]
    from starlette.exceptions import HTTPException

    control = Starlette(routes=routes, lifespan=lifespan,
                        exception_handlers={HTTPError: on_http_error, HTTPException: on_starlette_error})
    return InferenceFrontend(state, control)

"""The HTTP surface: Open Inference Protocol v2 REST endpoints, ``/predict`` and ``/metrics``.

Handlers decode and validate, then hand the tensor to the cache and the model's batcher. The app knows
models only as ``ServedModel`` objects (runtime + signature); nothing a client sends can make it load a
path or a model it was not started with. What the gRPC service shares with it (state, admission,
inference, errors) is in ``core.py``; the two transports never import each other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlscale.serve import describe, tracing
from mlscale.serve.cache import raw_key
from mlscale.serve.core import (
    HTTPError,
    ServerState,
    admitted,
    answered,
    bad_request_is_400,
    body_budget_full,
    entity_features,
    internal_error,
    refuse_if_overloaded,
    run_inference,
)
from mlscale.serve.generation import oip_generate, openai_api
from mlscale.serve.generation.responses import traced
from mlscale.serve.models import ServedModel
from mlscale.serve.protocol import (
    BadRequest,
    V2Request,
    check_json_cost,
    parse_predict,
    parse_v2,
    split_body,
    v2_response,
)
from mlscale.serve.rollout import compare

T = TypeVar("T")


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
        tracer, trace = self.state.tracer, None
        if tracer is not None:  # the caller's traceparent continued; this task's requests traced
            parent = _header(scope, b"traceparent")
            trace = tracer.begin(route[0] or "predict", "http", parent.decode("latin-1") if parent else None,
                                 time.perf_counter())
            tracing.current.set(trace)
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
        if trace is not None:
            tracer.finish(trace, status)
            headers = {**(headers or {}), "traceparent": tracer.traceparent(trace)}
        await _send(send, status, answer.payload, headers, answer.json_length)

    def _model(self, name: str, version: str | None) -> ServedModel:
        if (name, version) != _PREDICT:
            return self.state.answering(name, version)  # a canary or a shadow named: 403, unless exposed
        slots = self.state.slots
        if not slots or slots[0].current is None:
            raise HTTPError(503, "no model loaded yet")
        return slots[0].current

    async def _infer(self, scope: dict[str, Any], receive: Any, name: str, version: str | None) -> Answer:
        served = self._model(name, version)
        predict = (name, version) == _PREDICT
        by_entity = False  # routed once the body is read, by the entities it names
        if version is None and self.state.splits:  # by model name: the traffic split picks the version
            key = _header(scope, self.state.route_header)
            by_entity = key is None and served.features is not None
            if not by_entity:
                served = self.state.route(served, key)
        refuse_if_overloaded(served)  # under overload, a refusal costs as little as possible: no body read
        async with request_body(self.state, scope, receive) as body:  # the slot only once it has all arrived
            return await admitted(self.state, served,
                                  lambda start: self._answer(scope, body, served, predict, start, by_entity))

    async def _answer(self, scope: dict[str, Any], body: bytes, served: ServedModel, predict: bool,
                      start: float, by_entity: bool = False) -> Answer:
        state = self.state
        header_length = _header(scope, HEADER_LENGTH)
        # The memo holds JSON answers to plain JSON bodies; binary framing goes the canonical way, and so
        # does a model fed from features (a body naming entities means other values as the store moves on).
        memo = state.cache.enabled and header_length is None and served.features is None
        key = raw_key(served.content_id, scope["path"], body) if memo else None
        cached = state.cache.get(key) if key is not None else None
        if isinstance(cached, bytes):  # this exact body was answered before: no decoding, no encoding
            served.stats.cache["hit"].inc()
            answered(served, time.perf_counter() - start)
            return Answer(cached)
        with bad_request_is_400(served):
            if len(body) > DECODE_INLINE_BYTES:  # decoding megabytes takes milliseconds: not on the loop
                request = await asyncio.to_thread(_parse, body, header_length, served, predict)
            else:
                request = _parse(body, header_length, served, predict)
            if by_entity:  # sticky per entity: every request naming these entities goes to one version
                first = request.entities[0] if isinstance(request.entities, list) and request.entities else None
                served = state.route(served, orjson.dumps(first, option=orjson.OPT_SORT_KEYS)
                                     if first is not None else None)
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
    if len(header) > DECODE_INLINE_BYTES and len(served.inputs) == 1:  # several inputs: a sequence, unbounded
        check_json_cost(header, served.input)
    if predict:
        if len(served.inputs) > 1:
            raise BadRequest(f"model {served.name} takes several inputs ({', '.join(s.name for s in served.inputs)}): "
                             f"send an Open Inference Protocol request to /v2/models/{served.name}/infer")
        return parse_predict(_decode(header), served.input)
    return parse_v2(_decode(header), served.inputs, served.output, binary)


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

    async def compare_versions(request: Request) -> Response:
        return JSONResponse(compare(state, request.path_params["name"]))

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

    async def openai(request: Request) -> Response:
        """/v1/completions and /v1/chat/completions: every error in OpenAI's shape."""
        start = time.perf_counter()
        try:
            async with request_body(state, request.scope, request.receive) as body:
                decoded = _decode(body)
            model = decoded.get("model") if isinstance(decoded, dict) else None
            chat = request.url.path.endswith("/chat/completions")
            return await traced(state, model if isinstance(model, str) else "", _header(request.scope, b"traceparent"),
                                start, lambda: openai_api.answer(state, chat, decoded,
                                                                 _header(request.scope, state.route_header)))
        except HTTPError as exc:
            return openai_api.error_response(exc.status, str(exc), headers=exc.headers)

    async def openai_models(_: Request) -> Response:
        return JSONResponse(openai_api.list_models(state))

    async def generate(request: Request) -> Response:
        """The Open Inference Protocol's generate and generate_stream."""
        start, name = time.perf_counter(), request.path_params["name"]
        async with request_body(state, request.scope, request.receive) as body:
            decoded = _decode(body)
        return await traced(state, name, _header(request.scope, b"traceparent"), start, lambda: oip_generate.answer(
            state, name, request.path_params.get("version"), decoded, request.url.path.endswith("_stream"),
            _header(request.scope, state.route_header)))

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
        await state.start()  # models loaded, the gRPC service started: then ready
        yield
        await state.stop()

    model = "/v2/models/{name}"
    version = "/v2/models/{name}/versions/{version}"
    routes = [  # the inference routes are InferenceFrontend's
        Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server_metadata),
        Route("/v2/models/stats", model_statistics), Route(model, model_metadata), Route(version, model_metadata),
        Route(f"{model}/ready", model_ready), Route(f"{version}/ready", model_ready), Route("/metrics", metrics),
        Route(f"{model}/config", model_config), Route(f"{version}/config", model_config),
        Route(f"{model}/compare", compare_versions), Route(f"{model}/stats", model_statistics),
        Route(f"{version}/stats", model_statistics),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route("/v1/completions", openai, methods=["POST"]), Route("/v1/chat/completions", openai, methods=["POST"]),
        Route("/v1/models", openai_models),
        *(Route(f"{path}/{route}", generate, methods=["POST"]) for path in (model, version)
          for route in ("generate", "generate_stream")),
    ]

    control = Starlette(routes=routes, lifespan=lifespan,
                        exception_handlers={HTTPError: on_http_error, HTTPException: on_starlette_error})
    return InferenceFrontend(state, control)

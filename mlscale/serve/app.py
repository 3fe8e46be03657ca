"""The HTTP surface: Open Inference Protocol v2 REST endpoints, ``/predict`` and ``/metrics``.

Handlers decode and validate, then hand the tensor to the cache and the model's batcher. The app knows
models only as ``ServedModel`` objects (runtime + signature); nothing a client sends can make it load a
path or a model it was not started with.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlscale import __version__
from mlscale.serve.batcher import DeadlineExceeded, Overloaded
from mlscale.serve.cache import ResponseCache, cache_key
from mlscale.serve.metrics import ServerMetrics
from mlscale.serve.models import ModelSlot, ServedModel
from mlscale.serve.protocol import BadRequest, parse_predict, parse_v2, tensor_metadata, v2_response


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers


class ServerState:
    def __init__(self, slots: list[ModelSlot], metrics: ServerMetrics, cache: ResponseCache, max_body_bytes: int):
        self.slots, self.metrics, self.cache, self.max_body_bytes = slots, metrics, cache, max_body_bytes
        self.ready = False
        self.tasks: list[asyncio.Task[None]] = []

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


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"request body of {declared} bytes is over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body is over the {limit}-byte limit")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"malformed JSON: {exc}") from None


async def _predict(state: ServerState, served: ServedModel, array: np.ndarray,
                   params: dict[str, Any]) -> np.ndarray:
    labels, metrics = served.labels, state.metrics
    start = time.perf_counter()
    try:
        if state.cache.enabled:
            key = cache_key(served.content_id, array, params)
            output, how = await state.cache.get_or_compute(key, lambda: served.batcher.submit(array))
            {"hit": metrics.cache_hits, "miss": metrics.cache_misses,
             "coalesced": metrics.cache_coalesced}[how].labels(*labels).inc()
            metrics.cache_bytes.set(state.cache.bytes)
        else:
            output = await served.batcher.submit(array)
    except Overloaded as exc:
        metrics.request_failure.labels(*labels, "overloaded").inc()
        raise HTTPError(503, f"overloaded: {exc}; retry later", {"Retry-After": "1"}) from None
    except DeadlineExceeded as exc:
        metrics.request_failure.labels(*labels, "timeout").inc()
        raise HTTPError(504, f"request timed out: {exc}") from None
    except Exception as exc:
        metrics.request_failure.labels(*labels, "model").inc()
        raise HTTPError(500, f"model failed: {type(exc).__name__}: {exc}") from None
    metrics.request_success.labels(*labels).inc()
    metrics.request_duration.labels(*labels).observe(time.perf_counter() - start)
    return output


def build_app(state: ServerState) -> Starlette:
    async def live(_: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(_: Request) -> Response:
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)

    async def server_metadata(_: Request) -> Response:
        return JSONResponse({"name": "mlscale", "version": __version__, "extensions": []})

    def _served(request: Request) -> ServedModel:
        return state.lookup(request.path_params["name"], request.path_params.get("version"))

    async def model_metadata(request: Request) -> Response:
        served = _served(request)
        versions = sorted(str(s.current.number) for s in state.slots if s.current and s.current.name == served.name)
        platform = "onnxruntime_onnx" if served.runtime.kind == "onnx" else "pytorch_torch"
        return JSONResponse({"name": served.name, "versions": versions, "platform": platform,
                             "inputs": [tensor_metadata(served.input)], "outputs": [tensor_metadata(served.output)]})

    async def model_ready(request: Request) -> Response:
        served = _served(request)
        return JSONResponse({"name": served.name, "ready": state.ready}, status_code=200 if state.ready else 503)

    async def infer(request: Request) -> Response:
        served = _served(request)
        try:
            array, params, request_id = parse_v2(await _read_json(request, state.max_body_bytes), served.input,
                                                 served.output)
        except BadRequest as exc:
            state.metrics.request_failure.labels(*served.labels, "bad_request").inc()
            raise HTTPError(400, str(exc)) from None
        output = await _predict(state, served, array, params)
        return JSONResponse(v2_response(served.name, served.number, served.output, output, request_id))

    async def predict(request: Request) -> Response:
        if not state.slots or state.slots[0].current is None:
            raise HTTPError(503, "no model loaded yet")
        served = state.slots[0].current
        try:
            array = parse_predict(await _read_json(request, state.max_body_bytes), served.input)
        except BadRequest as exc:
            state.metrics.request_failure.labels(*served.labels, "bad_request").inc()
            raise HTTPError(400, str(exc)) from None
        output = await _predict(state, served, array, {})
        return JSONResponse({"model_name": served.name, "model_version": str(served.number),
                             "outputs": output.tolist()})

    async def metrics(_: Request) -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPError)
        return _error(exc.status, str(exc), exc.headers)

    async def on_starlette_error(_: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        return _error(status, str(getattr(exc, "detail", exc)) or "error")

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        for slot in state.slots:
            await slot.load()
            if slot.follows:
                state.tasks.append(asyncio.get_running_loop().create_task(slot.follow()))
        state.ready = True
        yield
        state.ready = False
        for task in state.tasks:
            task.cancel()
        for slot in state.slots:
            if slot.current is not None:
                await slot.current.batcher.close()

    model = "/v2/models/{name}"
    version = "/v2/models/{name}/versions/{version}"
    routes = [
        Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server_metadata),
        Route(model, model_metadata), Route(version, model_metadata),
        Route(f"{model}/ready", model_ready), Route(f"{version}/ready", model_ready),
        Route(f"{model}/infer", infer, methods=["POST"]), Route(f"{version}/infer", infer, methods=["POST"]),
        Route("/predict", predict, methods=["POST"]), Route("/metrics", metrics),
    ]
    from starlette.exceptions import HTTPException

    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPError: on_http_error, HTTPException: on_starlette_error})

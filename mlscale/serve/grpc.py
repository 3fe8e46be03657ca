"""The Open Inference Protocol's gRPC service, ``inference.GRPCInferenceService``, on grpcio's
asyncio server in the HTTP server's event loop: the same models, batchers, cache, admission control,
metrics and hot reload, and the same shutdown (it stops with the HTTP server, after the drain delay,
letting calls in flight finish).

Inference takes ``raw_input_contents`` (what tritonclient sends) or typed ``contents`` and answers
with ``raw_output_contents``, as Triton does. HTTP errors map to status codes (``core.GRPC_CODES``):
400 INVALID_ARGUMENT, 403 PERMISSION_DENIED (a canary's or a shadow's version named), 404 NOT_FOUND,
503 UNAVAILABLE (backpressure), 504 DEADLINE_EXCEEDED, 500 INTERNAL.

What it shares with the HTTP app is in ``core.py``; the two transports never import each other. (This
module is ``mlscale.serve.grpc``: ``import grpc`` below is absolute, so it is grpcio, not this file.)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from mlscale.errors import MlscaleError
from mlscale.serve import describe, tracing
from mlscale.serve.core import (
    GRPC_CODES,
    HTTPError,
    ServerState,
    admitted,
    bad_request_is_400,
    body_budget_full,
    internal_error,
    run_inference,
)
from mlscale.serve.models import ServedModel
from mlscale.serve.proto import inference_pb2 as pb
from mlscale.serve.protocol import (
    BadRequest,
    answer_parameters,
    array_from_bytes,
    array_to_bytes,
    as_array,
    by_signature,
    check_inputs,
    check_outputs,
    output_datatype,
)
from mlscale.serve.runtime import Inputs, TensorSpec

log = logging.getLogger("mlscale.serve")
SERVICE = "inference.GRPCInferenceService"  # the protocol's name for it on the wire
STATUS = {status: grpc.StatusCode[name] for status, name in GRPC_CODES.items()}
# Which typed field of InferTensorContents holds each datatype (FP16 and BF16 travel only raw).
TYPED_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                  "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                  "FP64": "fp64_contents"}


def _parameters(entries: Any) -> dict[str, Any]:
    """A protobuf map of InferParameter as plain values, those that change the answer (the cache key)."""
    values = {key: getattr(parameter, parameter.WhichOneof("parameter_choice"))
              for key, parameter in entries.items() if parameter.WhichOneof("parameter_choice") is not None}
    return answer_parameters(values)


def parse_infer(request: pb.ModelInferRequest, served: ServedModel) -> Inputs:
    """The request's inputs: one array for a model of one input, else a dict by name (every input given,
    as raw_input_contents entries in the order of ``inputs``, or as typed contents)."""
    tensors = list(request.inputs)
    checked = check_inputs(served.inputs, [(t.name, t.datatype, list(t.shape)) for t in tensors])
    check_outputs(served.output, [output.name for output in request.outputs])
    if request.raw_input_contents:
        if len(request.raw_input_contents) != len(checked) or any(t.HasField("contents") for t in tensors):
            if len(checked) == 1:
                raise BadRequest("give the input as one raw_input_contents entry or as typed contents, not both")
            raise BadRequest("give the inputs as raw_input_contents (one entry per input, in the order of "
                             "'inputs') or as typed contents, not both")
        arrays = [(spec, array_from_bytes(raw, spec, shape))
                  for raw, (spec, shape) in zip(request.raw_input_contents, checked)]
    else:
        arrays = [(spec, _typed(tensor, spec, shape)) for tensor, (spec, shape) in zip(tensors, checked)]
    return by_signature(served.inputs, arrays)


def _typed(tensor: pb.ModelInferRequest.InferInputTensor, spec: TensorSpec, shape: list[int]) -> np.ndarray:
    field = TYPED_CONTENTS.get(spec.datatype)
    if field is None:
        raise BadRequest(f"{spec.datatype} data must be sent as raw_input_contents")
    return as_array(list(getattr(tensor.contents, field)), spec, shape)


class InferenceService:
    """The calls of the service; each returns the response message or aborts with a status code."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.state.check_live() is None)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        self._served(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return json_format.ParseDict(describe.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        served = self._served(request.name, request.version)
        return json_format.ParseDict(describe.model_metadata(self.state, served), pb.ModelMetadataResponse())

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        served = self._served(request.name, request.version)
        return json_format.ParseDict({"config": describe.model_config(served)}, pb.ModelConfigResponse())

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest,
                              context: Any) -> pb.ModelStatisticsResponse:
        statistics = describe.statistics(self.state, request.name or None, request.version or None)
        # the traffic split's own fields (``parameters``) have no place in the protocol's message
        return json_format.ParseDict(statistics, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        index = describe.repository_index(self.state, request.ready)
        return json_format.ParseDict({"models": index}, pb.RepositoryIndexResponse())

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        tracer = self.state.tracer
        if tracer is None:
            return await self._model_infer(request, context)
        metadata = dict(context.invocation_metadata() or ())
        trace = tracer.begin(request.model_name, "grpc", metadata.get("traceparent"), time.perf_counter())
        tracing.current.set(trace)
        status = 500
        try:
            response = await self._model_infer(request, context)
            status = 200
            return response
        except HTTPError as exc:
            status = exc.status
            raise
        finally:
            tracer.finish(trace, status)
            with contextlib.suppress(Exception):  # a call cancelled or past its deadline takes no metadata
                await context.send_initial_metadata((("traceparent", tracer.traceparent(trace)),))

    async def _model_infer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        # a canary or a shadow named by model_version: PERMISSION_DENIED, unless --expose-rollout-versions
        served = self.state.answering(request.model_name, request.model_version or None)
        if not request.model_version and self.state.splits:  # by name: the traffic split picks the version
            header = self.state.route_header.decode()
            key = next((value for name, value in context.invocation_metadata() or () if name == header), None)
            served = self.state.route(served, key.encode() if isinstance(key, str) else key)
        size, bodies = request.ByteSize(), self.state.bodies
        if not bodies.take(size):  # the same budget as HTTP bodies: a message is held until it is answered
            raise body_budget_full(self.state)
        try:
            return await admitted(self.state, served, lambda start: self._infer(request, served, start))
        finally:
            bodies.give(size)

    async def _infer(self, request: pb.ModelInferRequest, served: ServedModel, start: float) -> pb.ModelInferResponse:
        with bad_request_is_400(served):
            array = parse_infer(request, served)
        output, answered_by = await run_inference(self.state, served, array, _parameters(request.parameters), start)
        datatype = output_datatype(output, answered_by.output)
        response = pb.ModelInferResponse(model_name=answered_by.name, model_version=str(answered_by.number),
                                         id=request.id)
        response.outputs.add(name=answered_by.output.name, datatype=datatype, shape=list(output.shape))
        response.raw_output_contents.append(array_to_bytes(output, datatype))
        return response

    def _served(self, name: str, version: str) -> ServedModel:
        return self.state.lookup(name, version or None)


def _unary(call: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    """The call, with an HTTPError (or a bug) turned into the matching status code."""

    async def handle(request: Any, context: Any) -> Any:
        try:
            return await call(request, context)
        except HTTPError as exc:
            await context.abort(STATUS.get(exc.status, grpc.StatusCode.INTERNAL), str(exc))
        except Exception as exc:  # a bug, not the client's fault: logged under an id, the server goes on
            await context.abort(grpc.StatusCode.INTERNAL, str(internal_error(exc, "gRPC call failed")))

    return handle


def service_handler(state: ServerState) -> grpc.GenericRpcHandler:
    service = InferenceService(state)
    calls = {"ServerLive": pb.ServerLiveRequest, "ServerReady": pb.ServerReadyRequest,
             "ModelReady": pb.ModelReadyRequest, "ServerMetadata": pb.ServerMetadataRequest,
             "ModelMetadata": pb.ModelMetadataRequest, "ModelInfer": pb.ModelInferRequest,
             "ModelConfig": pb.ModelConfigRequest, "ModelStatistics": pb.ModelStatisticsRequest,
             "RepositoryIndex": pb.RepositoryIndexRequest}
    return grpc.method_handlers_generic_handler(SERVICE, {
        name: grpc.unary_unary_rpc_method_handler(_unary(getattr(service, name)),
                                                  request_deserializer=message.FromString,
                                                  response_serializer=lambda response: response.SerializeToString())
        for name, message in calls.items()})


async def start_grpc(state: ServerState, address: str, max_message_bytes: int,
                     max_calls: int | None = None, shared: bool = False) -> grpc.aio.Server:
    """The gRPC server, listening on ``address`` in the running event loop. A call's handler runs (and
    takes an admission slot) only once its whole message has arrived; what unfinished calls may hold is
    bounded by the message size, the calls in flight (``max_calls``) and the streams per connection.
    ``shared``: the port is shared with the server's other workers (SO_REUSEPORT), else never shared."""
    server = grpc.aio.server(
        maximum_concurrent_rpcs=max_calls,
        options=[("grpc.max_receive_message_length", min(max_message_bytes, 2**31 - 1)),
                 ("grpc.max_send_message_length", -1),
                 ("grpc.max_concurrent_streams", 64),  # per connection
                 ("grpc.max_connection_idle_ms", 5 * 60 * 1000),  # an idle connection goes after 5 minutes
                 ("grpc.so_reuseport", 1 if shared else 0)])
    server.add_generic_rpc_handlers((service_handler(state),))
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:  # taken since start-up checked it
        raise MlscaleError(f"cannot serve gRPC on {address}: {exc}; choose another with --grpc-port") from None
    await server.start()
    return server

"""What the OpenAI and the Open Inference Protocol generation routes share: the language model a request
names, its choices started with the engine's refusals turned into HTTP errors, and server-sent events
that end the sequence when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.responses import Response

from mlscale.serve import tracing
from mlscale.serve.core import HTTPError, ServerState, answered, failed, routed_by_split
from mlscale.serve.generation.choices import Choice, collect, start_all
from mlscale.serve.generation.language_model import LanguageModel
from mlscale.serve.generation.params import GenerateRequest, ParamError
from mlscale.serve.models import ServedModel

RETRY_AFTER = {"Retry-After": "1"}


def language_models(state: ServerState) -> list[ServedModel]:
    """The primary versions served that generate, in the order they were given."""
    return [slot.current for slot in state.slots
            if slot.role == "primary" and slot.current is not None and slot.current.language_model is not None]


def pick(state: ServerState, name: str | None, version: str | None = None, route_key: bytes | None = None
         ) -> ServedModel:
    """The version that answers a request naming model ``name`` (None: the one language model served):
    404 for a model not served, 400 for one that does not generate; a canary takes its share."""
    if name is None:
        served = language_models(state)
        if len(served) != 1:
            names = ", ".join(s.name for s in served) or "none"
            raise ParamError("model", f"model is required: this server generates with {names}")
        name = served[0].name
    served = state.answering(name, version)
    if version is None:
        served = state.route(served, route_key)
    if served.language_model is None:
        raise ParamError("model", f"model {name} is not a causal language model: it answers /v2/models/{name}/infer")
    return served


async def start(served: ServedModel, request: GenerateRequest, prompts: list[list[int]], overloaded_status: int
                ) -> list[Choice]:
    """Every choice started: 400 when a prompt and max_tokens do not fit the context (naming both counts),
    ``overloaded_status`` (OpenAI: 429, the protocol: 503) with Retry-After when the engine is full."""
    from mlscale.serve.generation.engine import ContextTooLong, EngineFull

    lm = served.language_model
    assert lm is not None and request.sampling is not None
    trace = tracing.current.get()
    if trace is not None:
        trace.admitted = time.perf_counter()
    try:
        return await start_all(lm, prompts, request.sampling, uuid.uuid4().hex)
    except ContextTooLong as exc:
        raise ParamError("max_tokens", str(exc)) from None
    except ValueError as exc:  # a prompt the engine cannot take (no token, an id past the vocabulary)
        raise ParamError("prompt", str(exc)) from None
    except EngineFull as exc:
        failed(served, "overloaded")
        raise HTTPError(overloaded_status, f"overloaded: {exc}; retry later", RETRY_AFTER) from None


def client_error(served: ServedModel | None) -> None:
    """A request refused as the client's mistake: counted as such, never as a failure of the version."""
    if served is not None:
        served.stats.client_error("bad_request")
        if routed_by_split.get():
            served.stats.routed_client_errors.inc()


def finished(state: ServerState, served: ServedModel, request: GenerateRequest, choices: list[Choice], start: float,
             error: str | None) -> None:
    """A request's outcome counted: answered, and copied to the model's shadow when it is greedy; or
    failed by the model (an engine error). Its trace, if it has one, ends here."""
    _end_trace(state, served, choices, error)
    if error is not None:
        failed(served, "model")
        return
    seconds = time.perf_counter() - start
    answered(served, seconds)
    shadow, sampling = state.shadow, request.sampling
    if shadow is not None and shadow.name == served.name and sampling is not None and sampling.temperature == 0:
        outputs = [choice.token_ids for choice in choices]
        shadow.copy_call(served, lambda version: shadow_tokens(version, request),
                         lambda tokens: same_tokens(outputs, tokens), seconds)


async def traced(state: ServerState, model: str, traceparent: bytes | None, start: float,
                 answer: Callable[[], Awaitable[Response]]) -> Response:
    """``answer()`` in a trace of its own when the server traces (``--otlp-endpoint``): a server span
    ``generate MODEL`` from ``start``, continuing the caller's ``traceparent``, ended with the answer (a
    stream's: with the stream, or when its client goes), its own ``traceparent`` in the response."""
    tracer = state.tracer
    if tracer is None:
        return await answer()
    trace = tracer.begin(model, "http", traceparent.decode("latin-1") if traceparent else None, start, "generate")
    tracing.current.set(trace)
    try:
        response = await answer()
    except HTTPError as exc:
        tracer.finish(trace, exc.status)
        raise
    if isinstance(response, EventStream):
        inner = response.cleanup

        async def cleanup() -> None:
            try:
                if inner is not None:
                    await inner()
            finally:
                tracer.finish(trace, 499)  # the client went before the end (else ``finished`` ended it)

        response.cleanup = cleanup
    else:
        tracer.finish(trace, response.status_code)
    response.headers["traceparent"] = tracer.traceparent(trace)
    return response


def _end_trace(state: ServerState, served: ServedModel, choices: list[Choice], error: str | None) -> None:
    """The request's trace (if any) ended: each choice's queue, prefill and decode in the engine."""
    trace = tracing.current.get()
    if trace is None or state.tracer is None:
        return
    trace.version = str(served.number)
    for choice in choices:
        if choice.times is None:
            continue
        arrived, scheduled, first, last = choice.times
        labels = {"mlscale.choice": choice.index} if len(choices) > 1 else {}
        spans = (("queue", arrived, scheduled, {}),
                 ("prefill", scheduled, first, {"mlscale.prompt_tokens": choice.prompt_tokens}),
                 ("decode", first, last, {"mlscale.completion_tokens": choice.completion_tokens}))
        for name, begin, end, extra in spans:
            if begin and end:  # 0.0: never came (a sequence aborted before it was scheduled)
                trace.mark(name, begin, end, **labels, **extra)
    state.tracer.finish(trace, 500 if error is not None else 200)


async def shadow_tokens(version: ServedModel, request: GenerateRequest) -> list[list[int]]:
    """Each choice's token ids as the shadow ``version`` answers the request (its copy)."""
    lm = version.language_model
    if lm is None:
        raise RuntimeError(f"version {version.number} of {version.name} is not a causal language model")
    results = await collect(await start_all(lm, encode_prompts(lm, request), request.sampling, uuid.uuid4().hex))
    error = next((result.error for result in results if result.error is not None), None)
    if error is not None:
        raise RuntimeError(error)
    return [result.token_ids for result in results]


def same_tokens(served: list[list[int]], shadow: list[list[int]]) -> tuple[bool, float]:
    """How a shadow's greedy answer compares: (every choice has the served tokens, the share of token
    positions that differ, a choice's missing or extra tokens counted as differing)."""
    positions = differing = 0
    for ours, theirs in zip(served, shadow):
        positions += max(len(ours), len(theirs))
        differing += sum(a != b for a, b in zip(ours, theirs)) + abs(len(ours) - len(theirs))
    return served == shadow, differing / positions if positions else 0.0


def encode_prompts(lm: LanguageModel, request: GenerateRequest) -> list[list[int]]:
    if request.messages is not None:
        return [lm.encode(lm.chat_prompt(request.messages), "messages", special=False)]
    return [lm.encode(prompt) for prompt in request.prompts]


def sse(data: Any) -> bytes:
    """One server-sent event carrying ``data`` (JSON, or a literal such as ``[DONE]``)."""
    return b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


class EventStream(Response):
    """Server-sent events from an async iterator of encoded events. The client's disconnect is watched
    while they are sent: it cancels the iterator, whose choices then abort their sequences (the engine
    stops generating for nobody within a step)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 cleanup: Callable[[], Awaitable[None]] | None = None) -> None:
        """``cleanup``: run once the stream ends however it ends (the events may never have begun)."""
        self.events, self.cleanup = events, cleanup
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        sending = asyncio.ensure_future(self._send_all(send))
        watching = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, watching):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(sending, watching, return_exceptions=True)
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            raise sending.exception()  # type: ignore[misc]

    async def _send_all(self, send: Any) -> None:
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]
            if self.cleanup is not None:
                await self.cleanup()


async def _disconnected(receive: Any) -> None:
    """Returns when the client has gone (the request's body was read whole before the stream began)."""
    while (await receive())["type"] != "http.disconnect":
        pass

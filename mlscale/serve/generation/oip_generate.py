"""The Open Inference Protocol's text endpoints (KServe's and Triton's generate extension):
``POST /v2/models/NAME[/versions/V]/generate`` and ``/generate_stream``.

A request: ``{"text_input": "...", "parameters": {"max_tokens", "temperature", "top_p", "top_k", "seed",
"stop", "ignore_eos"}, "id": ...}`` (``input_ids`` for a version without a tokenizer). The answer:
``{"model_name", "model_version", "id", "text_output" (or "output_ids"), "details": {"finish_reason",
"prompt_tokens", "completion_tokens"}}``; streamed, one such event per piece with ``done`` false and a last
one with ``done`` true and the details. Errors as the protocol's ``{"error": "..."}``: 400, 404, 503 with
Retry-After when the engine is full; a failure while streaming is a last event ``{"error", "done": true}``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.responses import JSONResponse, Response

from mlscale.serve.core import HTTPError, ServerState, internal_error
from mlscale.serve.generation.choices import Choice, collect, merged
from mlscale.serve.generation.params import GenerateRequest, ParamError, parse_oip
from mlscale.serve.generation.responses import (
    EventStream,
    client_error,
    encode_prompts,
    finished,
    pick,
    sse,
    start,
)
from mlscale.serve.models import ServedModel


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def answer(state: ServerState, name: str, version: str | None, body: Any, stream: bool,
                 route_key: bytes | None) -> Response:
    """One generate (``stream`` False) or generate_stream request, parsed ``body`` in hand."""
    served: ServedModel | None = None
    try:
        served = pick(state, name, version, route_key)
        lm = served.language_model
        request = parse_oip(body, lm.defaults, lm.tokenizer is not None)
        choices = await start(served, request, encode_prompts(lm, request), overloaded_status=503)
    except ParamError as exc:
        client_error(served)
        return _error(400, str(exc))
    except HTTPError as exc:
        return _error(exc.status, str(exc), exc.headers)
    reply = _Reply(state, served, request, choices, body.get("id"))
    if stream:
        return EventStream(reply.stream(), cleanup=reply.choice.close)
    return await reply.whole()


class _Reply:
    def __init__(self, state: ServerState, served: ServedModel, request: GenerateRequest, choices: list[Choice],
                 request_id: Any) -> None:
        self.state, self.served, self.request, (self.choice,) = state, served, request, choices
        self.text = served.language_model.tokenizer is not None
        self.head: dict[str, Any] = {"model_name": served.name, "model_version": str(served.number)}
        if request_id is not None:
            self.head["id"] = request_id
        self.start = time.perf_counter()

    def _finished(self, error: str | None) -> None:
        finished(self.state, self.served, self.request, [self.choice], self.start, error)

    def _output(self, text: str, ids: list[int]) -> dict[str, Any]:
        return {"text_output": text} if self.text else {"output_ids": ids}

    def _details(self, finish_reason: str | None) -> dict[str, Any]:
        return {"finish_reason": finish_reason, "prompt_tokens": self.choice.prompt_tokens,
                "completion_tokens": self.choice.completion_tokens}

    async def whole(self) -> Response:
        (result,) = await collect([self.choice])
        self._finished(result.error)
        if result.error is not None:
            failure = internal_error(RuntimeError(result.error), "generation failed")
            return _error(500, str(failure), failure.headers)
        return JSONResponse({**self.head, **self._output(result.text, result.token_ids),
                             "details": self._details(result.finish_reason)})

    async def stream(self) -> AsyncIterator[bytes]:
        error = None
        try:
            async with aclosing(merged([self.choice])) as pieces:
                async for piece in pieces:
                    if piece.error is not None:  # logged under an id; the client gets the id
                        error = str(internal_error(RuntimeError(piece.error), "generation failed"))
                        break
                    event = {**self.head, **self._output(piece.text, piece.token_ids),
                             "done": piece.finish_reason is not None}
                    if piece.finish_reason is not None:
                        event["details"] = self._details(piece.finish_reason)
                    yield sse(event)
        except Exception as exc:  # a bug of ours: logged under an id, told to the client as an event
            error = str(internal_error(exc, "streaming failed"))
        self._finished(error)
        if error is not None:
            yield sse({**self.head, "error": error, "done": True})

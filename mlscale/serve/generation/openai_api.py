"""OpenAI's API for the language models served: ``POST /v1/completions``, ``POST /v1/chat/completions``
(for a version with a chat template), ``GET /v1/models``; answers and streamed chunks in OpenAI's
shapes (what the ``openai`` package parses), errors as ``{"error": {"message", "type", "param", "code"}}``.

A full engine answers 429 with Retry-After (OpenAI's rate-limit status, which its clients retry); a
failure while streaming ends the stream with an error event (which the ``openai`` client raises) and
``[DONE]``, never a hung connection.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.responses import JSONResponse, Response

from mlscale.serve.core import HTTPError, ServerState, internal_error
from mlscale.serve.generation.choices import Choice, Piece, collect, merged
from mlscale.serve.generation.params import GenerateRequest, ParamError, parse_chat, parse_completion
from mlscale.serve.generation.responses import (
    EventStream,
    client_error,
    encode_prompts,
    finished,
    language_models,
    pick,
    sse,
    start,
)
from mlscale.serve.generation.text import Tokenizer, token_text
from mlscale.serve.models import ServedModel

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_exceeded"}


def error_response(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def list_models(state: ServerState) -> dict[str, Any]:
    """``GET /v1/models``: the language models served, by name."""
    return {"object": "list", "data": [
        {"id": served.name, "object": "model", "created": 0, "owned_by": "mlscale",
         "version": str(served.number), "max_model_len": served.language_model.max_context}
        for served in language_models(state)]}


async def answer(state: ServerState, chat: bool, body: Any, route_key: bytes | None) -> Response:
    """One completions (``chat`` False) or chat completions request, parsed ``body`` in hand."""
    served: ServedModel | None = None
    try:
        model = body.get("model") if isinstance(body, dict) else None
        served = pick(state, model if isinstance(model, str) else None, route_key=route_key)
        lm = served.language_model
        request = (parse_chat if chat else parse_completion)(body, lm.defaults)
        choices = await start(served, request, encode_prompts(lm, request), overloaded_status=429)
    except ParamError as exc:
        client_error(served)
        return error_response(400, str(exc), exc.param)
    except HTTPError as exc:
        return error_response(exc.status, str(exc), "model" if exc.status == 404 else None, exc.headers)
    reply = _Reply(state, served, request, choices, chat)
    if request.stream:
        return EventStream(reply.stream(), cleanup=reply.close)
    return await reply.whole()


class _Reply:
    """The answer to one request whose choices have started: whole, or streamed chunk by chunk."""

    def __init__(self, state: ServerState, served: ServedModel, request: GenerateRequest, choices: list[Choice],
                 chat: bool) -> None:
        self.state, self.served, self.request, self.choices, self.chat = state, served, request, choices, chat
        self.tokenizer: Tokenizer | None = served.language_model.tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.object = "chat.completion" if chat else "text_completion"
        prompts: dict[int, int] = {}  # usage counts each prompt once, whatever n
        for choice in choices:
            prompts.setdefault(choice.index // request.sampling.n, choice.prompt_tokens)
        self.prompt_tokens = sum(prompts.values())

    async def close(self) -> None:
        """Every choice aborted if still running (a client gone before its stream began)."""
        for choice in self.choices:
            await choice.close()

    def _finished(self, error: str | None) -> None:
        finished(self.state, self.served, self.request, self.choices, self.start, error)

    def usage(self) -> dict[str, int]:
        completion = sum(choice.completion_tokens for choice in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.served.name}

    async def whole(self) -> Response:
        results = await collect(self.choices)
        error = next((r.error for r in results if r.error is not None), None)
        self._finished(error)
        if error is not None:
            failure = internal_error(RuntimeError(error), "generation failed")
            return error_response(500, str(failure), headers=failure.headers)
        return JSONResponse({**self._head(self.object), "choices": [self._choice(r) for r in results],
                             "usage": self.usage()})

    def _choice(self, piece: Piece, whole: bool = True) -> dict[str, Any]:
        """A choice of the answer (``whole``) or of a streamed chunk (chat: a delta, with no content on
        the last)."""
        choice: dict[str, Any] = {"index": piece.index}
        if not self.chat:
            choice["text"] = piece.text
        elif whole:
            choice["message"] = {"role": "assistant", "content": piece.text}
        else:
            choice["delta"] = {"content": piece.text} if piece.text or piece.finish_reason is None else {}
        choice["logprobs"] = self._logprobs(piece.logprobs)
        choice["finish_reason"] = piece.finish_reason
        if self.request.return_token_ids or self.tokenizer is None:
            choice["token_ids"] = piece.token_ids
        return choice

    def _logprobs(self, entries: list[Any]) -> dict[str, Any] | None:
        if self.request.sampling.logprobs is None:
            return None
        return chat_logprobs(entries, self.tokenizer) if self.chat else completion_logprobs(entries, self.tokenizer)

    async def stream(self) -> AsyncIterator[bytes]:
        """The chunks: (chat: a first one with the role), one per piece, each choice's last with its finish
        reason, the usage when asked for, ``[DONE]``; an engine failure: an error event, then ``[DONE]``."""
        head = self._head(f"{self.object}.chunk" if self.chat else self.object)
        usage_field = {"usage": None} if self.request.include_usage else {}
        if self.chat:
            for choice in self.choices:
                delta = {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield sse({**head, "choices": [delta], **usage_field})
        error = None
        try:
            async with aclosing(merged(self.choices)) as pieces:
                async for piece in pieces:
                    if piece.error is not None:  # logged under an id; the client gets the id
                        error = str(internal_error(RuntimeError(piece.error), "generation failed"))
                        break
                    yield sse({**head, "choices": [self._choice(piece, whole=False)], **usage_field})
        except Exception as exc:  # a bug of ours: logged under an id, told to the client as an event
            error = str(internal_error(exc, "streaming failed"))
        self._finished(error)
        if error is not None:
            yield sse({"error": {"message": error, "type": "server_error", "param": None, "code": 500}})
        elif self.request.include_usage:
            yield sse({**head, "choices": [], "usage": self.usage()})
        yield sse(b"[DONE]")


def completion_logprobs(entries: list[Any], tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    name: Callable[[int], str] = lambda token_id: token_text(tokenizer, token_id)
    tokens = [name(token_id) for token_id, _, _ in entries]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [{name(i): lp for i, lp in top} for _, _, top in entries], "text_offset": offsets}


def chat_logprobs(entries: list[Any], tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The chat shape: content, a list of {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_text(tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(token_id, logprob), "top_logprobs": [entry(i, lp) for i, lp in top]}
                        for token_id, logprob, top in entries]}

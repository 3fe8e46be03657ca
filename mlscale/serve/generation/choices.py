"""One choice of a generation request, from the engine's token events to the pieces a response is made
of (text, ids, logprobs, why it ended), for every route alike.

A choice is started before anything is sent (``start``): the engine refuses a prompt too long for the
context or a full queue before its first event, so the client gets a 400 or a 429/503, not a stream
that ends at once. Closing a choice (a stop string found, the client gone) closes the engine's
iterator, which aborts the sequence within one step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlscale.serve.generation.language_model import LanguageModel
from mlscale.serve.generation.text import Detokenizer, StopStrings


@dataclass
class Piece:
    """What one or more tokens of a choice add: text (held back while it may start a stop string), ids,
    per-token logprobs ((id, logprob, ((id, logprob), ...)) each), and the finish reason on the last."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class Choice:
    """One sequence in the engine, read as pieces (``pieces``); ``close`` aborts it."""

    def __init__(self, lm: LanguageModel, index: int, prompt_ids: list[int], events: AsyncIterator[Any],
                 first: Any, stops: Sequence[str]) -> None:
        self.lm, self.index, self.prompt_tokens = lm, index, len(prompt_ids)
        self.events, self.first = events, first
        self.detokenizer = Detokenizer(lm.tokenizer, prompt_ids) if lm.tokenizer is not None else None
        self.stops = StopStrings(stops if lm.tokenizer is not None else ())
        self.token_ids: list[int] = []  # every token generated, a stop string's included
        # perf_counter times of the sequence in the engine (arrived, first scheduled, first token, last
        # token), from its last event: what a trace's spans are made of
        self.times: tuple[float, float, float, float] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    async def start(cls, lm: LanguageModel, index: int, prompt_ids: list[int], params: Any, stops: Sequence[str],
                    request_id: str) -> Choice:
        """The choice with its first event in hand: ``ContextTooLong`` / ``EngineFull`` raise here."""
        events = lm.engine.generate(prompt_ids, params, request_id=request_id).__aiter__()
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await events.aclose()
            raise
        return cls(lm, index, prompt_ids, events, first, stops)

    async def close(self) -> None:
        """Abort the sequence (closing the engine's iterator); a no-op once it has ended."""
        with contextlib.suppress(RuntimeError):  # being read by another task: that task closes it
            await self.events.aclose()

    async def pieces(self) -> AsyncIterator[Piece]:
        """Pieces as the tokens come; the last one has the finish reason. A stop string ends the choice
        ("stop") and aborts the rest of the sequence."""
        try:
            event, self.first = self.first, None
            while event is not None:
                piece = self._piece(event)
                if piece.finish_reason is not None:
                    yield piece
                    return
                if piece.text or piece.token_ids:
                    yield piece
                event = await anext(self.events, None)
            yield Piece(self.index, finish_reason="error", error="the engine ended the sequence without a reason")
        finally:
            await self.close()

    def _piece(self, event: Any) -> Piece:
        piece = Piece(self.index, finish_reason=event.finish_reason, error=event.error)
        if event.finish_reason in ("abort", "error") and piece.error is None:
            piece.error = f"the sequence was ended ({event.finish_reason})"
        text = ""
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            piece.token_ids.append(event.token_id)
            if event.logprob is not None:
                piece.logprobs.append((event.token_id, event.logprob, tuple(event.top_logprobs)))
            if self.detokenizer is not None:
                text = self.detokenizer.add(event.token_id)
        if piece.finish_reason is not None:
            self.times = event.times
            if self.detokenizer is not None:
                text += self.detokenizer.flush()
        shown, stopped = self.stops.feed(text)
        if stopped:
            piece.finish_reason, piece.error = "stop", None
        elif piece.finish_reason is not None:
            shown += self.stops.flush()
        piece.text = shown
        return piece


async def start_all(lm: LanguageModel, prompts: list[list[int]], sampling: Any, request_id: str) -> list[Choice]:
    """Every choice of a request (n per prompt), started; if one is refused, those started are aborted."""
    from mlscale.serve.generation.engine import ContextTooLong

    choices: list[Choice] = []
    try:
        for number, prompt_ids in enumerate(prompts):
            max_tokens = sampling.max_tokens_for(lm.max_context - len(prompt_ids))
            if max_tokens < 1:  # a default that leaves nothing: named as the engine names an explicit one
                raise ContextTooLong(len(prompt_ids), 1, lm.max_context)
            for copy in range(sampling.n):
                index = number * sampling.n + copy
                choices.append(await Choice.start(lm, index, prompt_ids, sampling.engine_params(max_tokens, copy),
                                                  sampling.stop, f"{request_id}-{index}"))
    except BaseException:
        await asyncio.gather(*(choice.close() for choice in choices), return_exceptions=True)
        raise
    return choices


async def merged(choices: list[Choice]) -> AsyncIterator[Piece]:
    """The pieces of several choices as they come (one choice: its own, with no task in between). Leaving
    early (the client gone) closes every choice."""
    if len(choices) == 1:
        async for piece in choices[0].pieces():
            yield piece
        return
    queue: asyncio.Queue[Piece | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for piece in choice.pieces():
                await queue.put(piece)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        remaining = len(tasks)
        while remaining:
            piece = await queue.get()
            if piece is None:
                remaining -= 1
            else:
                yield piece
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def collect(choices: list[Choice]) -> list[Piece]:
    """Every choice run to its end, each as one piece (non-streaming answers); the first error (a failed
    engine step) ends them all."""
    results = [Piece(choice.index) for choice in choices]
    by_index = {choice.index: result for choice, result in zip(choices, results)}
    async with contextlib.aclosing(merged(choices)) as pieces:
        async for piece in pieces:
            result = by_index[piece.index]
            result.text += piece.text
            result.token_ids += piece.token_ids
            result.logprobs += piece.logprobs
            if piece.finish_reason is not None:
                result.finish_reason, result.error = piece.finish_reason, piece.error
                if piece.error is not None:
                    break
    return results

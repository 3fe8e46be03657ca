"""GenerationEngine: what the endpoints call to generate tokens.

A request becomes a sequence in the scheduler's waiting queue; one thread of the engine's own runs the
steps (the scheduler decides, the runner executes, sampling picks each next token) and hands every new
token to the asyncio loop of the request's caller as a TokenEvent. torch releases the GIL inside its
kernels, so the event loop keeps serving while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mlscale.serve.generation.kv_cache import BlockPool
from mlscale.serve.generation.runner import KVStore, ModelRunner, cached_model
from mlscale.serve.generation.sampling import Choice, SamplingParams, choose
from mlscale.serve.generation.scheduler import Scheduler, SchedulerOutput, Sequence

__all__ = ["ContextTooLong", "EngineFull", "EngineObserver", "EngineStats", "GenerationEngine", "SamplingParams",
           "TokenEvent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (or the final event of a sequence ended without one)."""

    token_id: int | None  # None only on a final event without a token (abort/error)
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]
    finish_reason: str | None  # None while running; "length" | "stop" | "abort" | "error"
    error: str | None = None
    # on the final event: the sequence's perf_counter times (arrived, first scheduled, first token, last
    # token; 0.0 for what never came), which a request's trace shows as its queue, prefill and decode
    times: tuple[float, float, float, float] | None = None


class ContextTooLong(ValueError):
    """The prompt plus max_tokens does not fit the model's context (the endpoint answers 400)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_context: int) -> None:
        super().__init__(
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is "
            f"{prompt_tokens + max_tokens} tokens, over the model's context of {max_context}"
        )
        self.prompt_tokens, self.max_tokens, self.max_context = prompt_tokens, max_tokens, max_context


class EngineFull(RuntimeError):
    """The waiting queue (or the KV pool, for a sequence that could never fit) is full: the endpoint
    answers 429 (OpenAI) / 503 with Retry-After."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (for /metrics and the UI)."""

    running: int
    waiting: int
    preemptions_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries_total: int  # full prompt blocks looked up in the prefix cache
    prefix_hits_total: int  # of those, found (blocks)
    prompt_tokens_total: int
    generated_tokens_total: int


class EngineObserver(Protocol):
    """What the engine reports as it goes (serving's metrics: ``series.GenerationSeries``), from its
    step thread: each sequence's token latencies, and its own counters and gauges after every step."""

    def first_token(self, seconds: float) -> None: ...  # from the sequence's arrival to its first token

    def next_token(self, seconds: float) -> None: ...  # since the sequence's previous token

    def finished(self, seconds_per_token: float) -> None: ...  # a sequence of 2+ tokens: after its first

    def engine(self, before: EngineStats, now: EngineStats) -> None: ...  # the stats since the last report


IDLE = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0)


@dataclass(eq=False)
class _Request:
    """A sequence's request: how its tokens are chosen and where its events go."""

    request_id: str
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    generated: int = 0
    arrived: float = field(default_factory=time.perf_counter)
    scheduled_at: float = 0.0  # perf_counter of the step that first computed some of it
    first_at: float = 0.0  # of its first token
    last_at: float = 0.0  # of its last token
    done: bool = False


class GenerationEngine:
    """Continuous batching over one model: sequences join the running batch at any step and leave it
    the step they finish; prefill and decode share each step under max_batch_tokens.

    ``kv_cache_mb`` sizes the pool of KV blocks (each ``block_size`` tokens of every layer's keys and
    values in the model's dtype); a request that could never fit in it is refused with EngineFull.
    ``observer`` is told the token latencies and the stats as they change (None: nobody listens).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: tuple[int, ...],
        max_context: int,
        kv_cache_mb: float = 64,
        block_size: int = 16,
        max_batch_tokens: int = 256,
        max_running: int = 64,
        max_waiting: int = 256,
        prefix_caching: bool = True,
        chunked_prefill: bool = True,
        observer: EngineObserver | None = None,
    ) -> None:
        if max_context < 2 or max_waiting < 1:
            raise ValueError(f"max_context ({max_context}) must be >= 2 and max_waiting ({max_waiting}) >= 1")
        model.eval()
        adapter = cached_model(model)
        num_blocks = int(kv_cache_mb * 2**20) // adapter.shape.block_bytes(block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_mb ({kv_cache_mb}) holds no block of {block_size} tokens of this model")
        self.eos_token_ids, self.max_context, self.max_waiting = frozenset(eos_token_ids), max_context, max_waiting
        self.vocab_size = adapter.vocab_size
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.pool, max_batch_tokens=max_batch_tokens, max_running=max_running,
                                   chunked_prefill=chunked_prefill)
        self.runner = ModelRunner(adapter, KVStore(adapter.shape, num_blocks, block_size))
        self._device = adapter.shape.device
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._inbox: list[_Request] = []
        self._aborts: set[str] = set()
        self._closing = self._drain = False
        self._requests: dict[str, _Request] = {}  # every request not yet ended, by its id
        self._active: dict[int, _Request] = {}  # the step thread's: those in the scheduler, by sequence
        self._prompt_tokens_total = self._generated_tokens_total = 0
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]] = {}
        self.observer, self._reported = observer, IDLE
        self._report()  # the pool's size, before any request
        self._thread = threading.Thread(target=self._run, name="mlscale-generation", daemon=True)
        self._thread.start()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Tokens as they are generated, the last event with its finish_reason. Raises ContextTooLong or
        EngineFull (or ValueError for a bad prompt) before the first event; closing the iterator aborts
        the sequence within one step."""
        request = self._submit(list(prompt_ids), params, request_id, asyncio.get_running_loop())
        try:
            while True:
                event = await request.events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not request.done:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """End a request (its stream gets a final "abort" event); unknown or finished ids are ignored."""
        with self._wake:
            if request_id in self._requests:
                self._aborts.add(request_id)
                self._wake.notify()

    def stats(self) -> EngineStats:
        with self._wake:
            inbox = len(self._inbox)
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + inbox,
            preemptions_total=self.scheduler.preemptions_total,
            kv_blocks_used=self.pool.used_blocks,
            kv_blocks_total=self.pool.num_blocks,
            prefix_queries_total=self.pool.queries_total,
            prefix_hits_total=self.pool.hits_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generated_tokens_total=self._generated_tokens_total,
        )

    async def close(self, drain: bool = True) -> None:
        """Stop taking requests; with drain the running and waiting sequences finish first, without it
        they end with "abort". The step thread is joined."""
        with self._wake:
            self._closing, self._drain = True, drain and not (self._closing and not self._drain)
            self._wake.notify()
        await asyncio.to_thread(self._thread.join)
        if self.observer is not None:  # a closed engine holds nothing: its gauges back to 0
            gone = dataclasses.replace(self.stats(), running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=0)
            self.observer.engine(self._reported, gone)
            self._reported = gone

    def _submit(
        self, prompt: list[int], params: SamplingParams, request_id: str | None, loop: asyncio.AbstractEventLoop
    ) -> _Request:
        """The request checked and queued for the step thread."""
        self._check_prompt(prompt, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        request_id = request_id or uuid.uuid4().hex
        request = _Request(request_id, Sequence(next(self._ids), prompt), params, generator, loop)
        with self._wake:
            if self._closing:
                raise EngineFull("the engine is closing")
            if len(self._inbox) + len(self.scheduler.waiting) >= self.max_waiting:
                raise EngineFull(f"{self.max_waiting} requests are already waiting")
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._requests[request_id] = request
            self._inbox.append(request)
            self._prompt_tokens_total += len(prompt)
            self._wake.notify()
        return request

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("the prompt has no tokens")
        bad = next((token for token in prompt if not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {self.vocab_size}")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ContextTooLong(len(prompt), params.max_tokens, self.max_context)
        needed = self.pool.blocks_for(len(prompt) + params.max_tokens)
        if needed > self.pool.num_blocks:
            raise EngineFull(
                f"the prompt and max_tokens need {needed} KV blocks, over the pool's {self.pool.num_blocks}"
            )

    def _run(self) -> None:
        """The step thread: take what arrived, then one step, until closed and (with drain) done. A
        failure ends the sequences it touched with an "error" event (all of them when it is not a
        step's), and the thread goes on."""
        while True:
            output = None
            try:
                closing = self._take_arrivals()
                if not self.scheduler.has_work():
                    if closing:
                        return
                    continue
                with torch.inference_mode():
                    output = self.scheduler.schedule()
                    self._step(output)
            except Exception as error:
                log.exception("generation step failed")
                self._fail(output, f"{type(error).__name__}: {error}")
            finally:
                self._report()  # before the events go: a client that has its tokens finds them counted
                self._flush()

    def _take_arrivals(self) -> bool:
        """New requests join the scheduler, aborted ones leave (all of them when closing without
        drain); waits while there is nothing to do. True once the engine is closing."""
        with self._wake:
            while not (self._inbox or self._aborts or self._closing or self.scheduler.has_work()):
                self._wake.wait()
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
            closing, drain = self._closing, self._drain
        for request in inbox:
            self._active[request.seq.seq_id] = request
            self.scheduler.add(request.seq)
        ending = [self._requests.get(request_id) for request_id in aborts]
        if closing and not drain:
            ending = list(self._active.values())
        for request in ending:
            if request is not None:
                self._end(request, TokenEvent(None, None, (), "abort"))
        return closing

    def _step(self, output: SchedulerOutput) -> None:
        """Run the scheduled chunks, then choose, send and check each sampled sequence's next token."""
        if not output.chunks:  # nothing fits this step (not expected: the pool holds any request)
            time.sleep(0.001)
            return
        started = time.perf_counter()
        for chunk in output.chunks:
            request = self._active[chunk.seq_id]
            request.scheduled_at = request.scheduled_at or started
        logits = self.runner.execute(output)
        self.scheduler.complete(output)
        sampled = [self._active[chunk.seq_id] for chunk in output.chunks if chunk.sample]
        choices = choose(logits, [request.params for request in sampled], [request.generator for request in sampled])
        now = time.perf_counter()
        for request, choice in zip(sampled, choices):
            self._append(request, choice, now)

    def _fail(self, output: SchedulerOutput | None, message: str) -> None:
        ids = [chunk.seq_id for chunk in output.chunks] if output is not None else list(self._active)
        for seq_id in ids:
            if seq_id in self._active:
                self._end(self._active[seq_id], TokenEvent(None, None, (), "error", message))

    def _append(self, request: _Request, choice: Choice, now: float) -> None:
        """The sequence's next token (sampled at ``now``): sent, and the sequence ended when it stops it."""
        request.seq.tokens.append(choice.token_id)
        request.generated += 1
        self._generated_tokens_total += 1
        self._timed(request, now)
        finish = None
        params, token = request.params, choice.token_id
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            finish = "stop"
        elif request.generated >= params.max_tokens:
            finish = "length"
        event = TokenEvent(choice.token_id, choice.logprob, choice.top_logprobs, finish)
        if finish is None:
            self._send(request, event)
        else:
            self._end(request, event)

    def _timed(self, request: _Request, now: float) -> None:
        """A token sampled at ``now``: its time kept (for the final event's ``times``), its latency told to
        the observer."""
        observer = self.observer
        if request.generated == 1:
            request.first_at = now
            if observer is not None:
                observer.first_token(now - request.arrived)
        elif observer is not None:
            observer.next_token(now - request.last_at)
        request.last_at = now

    def _report(self) -> None:
        """The stats, to the observer, when they changed since its last report."""
        if self.observer is not None:
            now = self.stats()
            if now != self._reported:
                self.observer.engine(self._reported, now)
                self._reported = now

    def _end(self, request: _Request, event: TokenEvent) -> None:
        """The sequence leaves the scheduler (its blocks back to the pool) and gets its final event;
        once only."""
        if self._active.pop(request.seq.seq_id, None) is None:
            return
        self.scheduler.remove(request.seq)
        with self._wake:
            self._requests.pop(request.request_id, None)
        request.done = True
        if self.observer is not None and request.generated > 1:
            self.observer.finished((request.last_at - request.first_at) / (request.generated - 1))
        times = (request.arrived, request.scheduled_at, request.first_at, request.last_at)
        self._send(request, dataclasses.replace(event, times=times))

    def _send(self, request: _Request, event: TokenEvent) -> None:
        self._outbox.setdefault(request.loop, []).append((request.events, event))

    def _flush(self) -> None:
        """The events of a step, handed to each caller's loop at once: one wake-up per loop, not one
        per token."""
        outbox, self._outbox = self._outbox, {}
        for loop, events in outbox.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_deliver, events)


def _deliver(events: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)

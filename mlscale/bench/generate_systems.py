"""The systems ``mlscale bench generate`` runs, each fed the same requests at the same times.

Every system returns, for each request, the times its tokens reached the client (seconds from the run's
start; ``None`` for a request that failed). The in-process anchors run in the caller's thread, their
arrivals replayed from the schedule (a request that arrives while the model is busy waits, its clock
running from its arrival); the continuous batchers run their own step thread and are fed by one asyncio
task per request, as a client would be.

- ``floor``: one request at a time through ``model.generate``;
- ``static``: a dynamic batcher's way: requests gathered until ``window_s`` after the oldest one (or until
  ``max_batch`` have come), then one ``generate`` on the left-padded batch, every row run to the batch's
  longest output;
- ``hf_cb``: transformers' own continuous batching (``init_continuous_batching``), streaming;
- ``mlscale``: mlscale's GenerationEngine, streaming.

The two ``generate`` anchors stream through a transformers streamer: a token's time is when ``generate``
produced it, what a streaming server built on ``generate`` would send (without the streamer their time to
first token would be the request's whole latency).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from mlscale.serve.generation.engine import GenerationEngine, SamplingParams

__all__ = ["Request", "TokenTimes", "replay", "run_engine", "run_floor", "run_hf_cb", "run_static", "solo"]

TokenTimes = list[float] | None  # a request's token times (s from the run's start); None: it failed


@dataclass(frozen=True)
class Request:
    """One request of a workload: when it arrives (s from the start), its prompt, how many tokens it wants."""

    arrival_s: float
    prompt: list[int]
    max_tokens: int


class _StepClock:
    """A transformers streamer that keeps the time of each generated step (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _generate(model: Any, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """``generate`` on the prompts left-padded with 0 (greedy, exactly ``max_tokens`` each); the step times."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                       do_sample=False, pad_token_id=0, streamer=clock)
    return clock.times


def _wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def solo(model: Any, request: Request) -> list[float]:
    """One request alone, its token times from the call (the unloaded figures the SLOs are scaled from)."""
    start = time.perf_counter()
    return [t - start for t in _generate(model, [request.prompt], request.max_tokens)]


def run_floor(model: Any, requests: list[Request]) -> list[TokenTimes]:
    start = time.perf_counter()
    times: list[TokenTimes] = []
    for request in requests:
        _wait_until(start + request.arrival_s)
        times.append([t - start for t in _generate(model, [request.prompt], request.max_tokens)])
    return times


def _next_batch(requests: list[Request], first: int, start: float, window_s: float, max_batch: int) -> int:
    """Waits as the batcher would; returns the end index of the batch that begins at ``first``."""
    _wait_until(start + requests[first].arrival_s)
    close = start + requests[first].arrival_s + window_s
    full = first + max_batch - 1
    if full < len(requests):  # the batch fills before its window closes: it goes then
        close = min(close, start + requests[full].arrival_s)
    _wait_until(close)
    now = time.perf_counter() - start
    end = first + 1
    while end < len(requests) and end - first < max_batch and requests[end].arrival_s <= now:
        end += 1
    return end


def run_static(model: Any, requests: list[Request], window_s: float, max_batch: int) -> list[TokenTimes]:
    start = time.perf_counter()
    times: list[TokenTimes] = []
    first = 0
    while first < len(requests):
        end = _next_batch(requests, first, start, window_s, max_batch)
        batch = requests[first:end]
        steps = _generate(model, [r.prompt for r in batch], max(r.max_tokens for r in batch))
        times.extend([t - start for t in steps[:r.max_tokens]] for r in batch)
        first = end
    return times


Stream = Callable[[Request], AsyncIterator[int]]  # a request's stream: how many tokens each chunk carries


async def replay(requests: list[Request], stream: Stream, timeout_s: float) -> list[TokenTimes]:
    """One task per request, sent at its arrival; the time each chunk of tokens came back."""
    start = time.perf_counter()

    async def client(request: Request) -> TokenTimes:
        await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
        times: list[float] = []
        async for count in stream(request):
            times.extend([time.perf_counter() - start] * count)
        return times if len(times) == request.max_tokens else None

    return list(await asyncio.wait_for(asyncio.gather(*(client(r) for r in requests)), timeout_s))


def run_engine(model: Any, requests: list[Request], *, max_batch: int, max_batch_tokens: int, kv_cache_mb: float,
               prefix_caching: bool = True, timeout_s: float = 600.0) -> list[TokenTimes]:
    """mlscale's GenerationEngine in this process, greedy, every request exactly its max_tokens."""
    async def run() -> list[TokenTimes]:
        engine = GenerationEngine(model, eos_token_ids=(), max_context=model.config.max_position_embeddings,
                                  kv_cache_mb=kv_cache_mb, max_batch_tokens=max_batch_tokens, max_running=max_batch,
                                  max_waiting=max(len(requests), 1), prefix_caching=prefix_caching)

        async def stream(request: Request) -> AsyncIterator[int]:
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
            async for event in engine.generate(request.prompt, params):
                if event.token_id is not None:
                    yield 1

        try:
            return await replay(requests, stream, timeout_s)
        finally:
            await engine.close(drain=False)

    return asyncio.run(run())


def hf_cb_config(model: Any, *, max_batch: int, max_batch_tokens: int, kv_cache_mb: float) -> Any:
    """transformers' continuous batching sized as the engine is: the same KV bytes (in its default pages of
    256 tokens), token budget and sequences per step; prefix sharing on (its default)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model.dtype.itemsize
    page = 256
    return ContinuousBatchingConfig(page_size=page, num_blocks=max(1, int(kv_cache_mb * 2**20) // (page * token_bytes)),
                                    max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_batch)


def run_hf_cb(model: Any, requests: list[Request], *, max_batch: int, max_batch_tokens: int, kv_cache_mb: float,
              timeout_s: float = 600.0) -> list[TokenTimes]:
    """transformers' ContinuousBatchingManager on a copy of the model (it may switch the attention), streaming
    each request's tokens back to the asyncio loop through ``register_result_handler``."""
    from transformers import GenerationConfig

    # on CPU it logs, at ERROR, that it cannot size memory without psutil: noise here (a request that
    # fails still counts, as failed)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    model = copy.deepcopy(model)
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=1)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=hf_cb_config(
        model, max_batch=max_batch, max_batch_tokens=max_batch_tokens, kv_cache_mb=kv_cache_mb))
    manager.warmup()  # its cache and batch buffers made before the clock starts, as the engine's are
    manager.start()
    ids = itertools.count()

    async def stream(request: Request) -> AsyncIterator[int]:
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        request_id = f"r{next(ids)}"
        manager.register_result_handler(request_id, outputs.put_nowait)
        manager.add_request(request.prompt, request_id=request_id, max_new_tokens=request.max_tokens, streaming=True)
        seen = 0
        while True:
            output = await outputs.get()
            if output.error is not None:
                return
            if len(output.generated_tokens) > seen:
                yield len(output.generated_tokens) - seen
                seen = len(output.generated_tokens)
            if output.is_finished():
                return

    try:
        return asyncio.run(replay(requests, stream, timeout_s))
    finally:
        manager.stop(block=True, timeout=10)

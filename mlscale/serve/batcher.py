"""Dynamic batching with a bounded queue, deadlines and an SLO-aware batch size.

Requests queue per model version. A request that finds the model idle is dispatched at once; requests
that arrive while a batch runs wait for it to finish, then for at most ``max_delay`` from the oldest
arrival, and go as one batch of up to the target size. With an SLO, the target is the largest batch
whose predicted cost fits in half the SLO, from a cost model ``cost(n) = a*n + b`` fitted online to the
measured batch times; a request whose predicted completion would miss the SLO is refused
at once (``Overloaded``) instead of queued, and ``LatencyGuard`` caps the requests in flight at what
keeps the measured p99 under the SLO. A failing batch is retried one request at a time, so one bad
request fails alone. Requests with inputs of different lengths are padded to the batch's longest or
batched only with requests of their own shapes, as the model's signature allows (``batching.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlscale.serve import tracing
from mlscale.serve.batching import Batching, rows_of
from mlscale.serve.metrics import ModelStats
from mlscale.serve.runtime import Inputs, Runtime

# A batch predicted to take less than this runs on the event loop itself. Handing it to the worker
# thread costs two GIL hand-offs, and under load those take longer than such a batch (digits at 2,000
# requests/s on one core: p50 1.35 ms through the thread, 0.48 ms inline). Longer batches go to the
# thread, so the loop keeps reading requests (and refusing the excess) while the model runs.
# With one core and no SLO, every batch runs inline: a thread buys no parallelism there, only switches
# and a model sharing the core with the loop mid-batch (the 2048-wide MLP: 3,600 -> 4,800 requests/s
# at p99 <= 50 ms). With --slo-ms long batches stay on the thread even on one core: the loop must keep
# reading requests during a batch to refuse the excess in time (inline, 2x overload left requests
# unseen in the kernel's socket queues for seconds).
INLINE_BELOW_S = 0.001
# A batch whose fixed cost is below this is not worth holding requests back for.
WORTH_WAITING_FOR_S = 200e-6
# One batch's time counts for at most this many times its prediction, plus the floor (CostModel.observe).
OUTLIER_FACTOR, OUTLIER_FLOOR_S = 10.0, 20e-6
log = logging.getLogger("mlscale.serve")
# This process may run on one core only: the default of ``DynamicBatcher``'s ``one_core``.
ONE_CORE = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1


class Overloaded(Exception):
    """The queue is full or the request could not finish within the SLO: answer 503 now."""


class Replaced(Overloaded):
    """This version is being swapped out; the request belongs to its successor."""


class DeadlineExceeded(Exception):
    """The request waited longer than its timeout: answer 504."""


@dataclass
class _Pending:
    array: Inputs
    future: asyncio.Future[np.ndarray]
    arrival: float
    deadline: float
    trace: tracing.RequestTrace | None = None
    key: Any = None  # what decides which requests may share its batch (Batching.key)

    @property
    def rows(self) -> int:
        return rows_of(self.array)


@dataclass
class CostModel:
    """Least squares of batch time on batch size with exponential forgetting (recent batches count most)."""

    decay: float = 0.98
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # sum w, w*n, w*t, w*n*n, w*n*t

    def observe(self, rows: int, seconds: float) -> None:
        """Counts one batch's time, at most ``OUTLIER_FACTOR`` times its prediction (plus ``OUTLIER_FLOOR_S``):
        one batch preempted by the OS or stalled by a garbage collection must not teach the model that
        every batch is slow (a 10 µs model would start holding requests back for batch-mates). A real
        change of cost still comes through: the fit can grow ~20% a batch (a 500x jump caught up in ~25 batches)."""
        predicted = self.cost(rows)
        if predicted is not None:
            seconds = min(seconds, OUTLIER_FACTOR * predicted + OUTLIER_FLOOR_S)
        self._s = [x * self.decay for x in self._s]
        for i, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            self._s[i] += value

    def coefficients(self) -> tuple[float, float] | None:
        w, wn, wt, wnn, wnt = self._s
        if w < 3:
            return None
        var = wnn / w - (wn / w) ** 2
        if var < 1e-9:
            return 0.0, wt / w
        slope = max(0.0, (wnt / w - (wn / w) * (wt / w)) / var)
        return slope, max(0.0, wt / w - slope * wn / w)

    def cost(self, rows: int) -> float | None:
        found = self.coefficients()
        return None if found is None else found[0] * rows + found[1]


class LatencyGuard:
    """Keeps the p99 of admitted requests under the SLO by capping how many are in the server at once.

    The queue-based prediction in ``DynamicBatcher.admit`` cannot see all of a request's latency (HTTP
    work, the kernel's socket queues, thread hand-offs), so under overload requests admitted on it alone
    finish past the SLO. The guard measures instead: admitted requests in flight are capped at ``limit``,
    and each window (``period_s`` and at least ``min_samples`` answers) adjusts it, AIMD as TCP does:
    a p99 over ``high`` x SLO cuts the limit by ``cut``; a p99 under ``low`` x SLO while the limit was
    reached grows it by ``step`` (at least 1). By Little's law the cap bounds the wait. The limit never
    goes under ``min_limit``, so a full batch can always form."""

    def __init__(self, slo_s: float, limit: int, min_limit: int, max_limit: int, period_s: float = 0.2,
                 min_samples: int = 20, high: float = 0.9, low: float = 0.7, cut: float = 0.8,
                 step: float = 0.05) -> None:
        self.slo_s, self.limit, self.min_limit, self.max_limit = slo_s, limit, min_limit, max_limit
        self.period_s, self.min_samples = period_s, min_samples
        self.high, self.low, self.cut, self.step = high, low, cut, step
        self.in_flight = 0
        self._reached = False
        self._seen: list[float] = []
        self._window_start = time.perf_counter()

    def enter(self) -> bool:
        """Admit one request (True) or refuse it (False: the cap is reached)."""
        self.tick()
        if self.in_flight >= self.limit:
            self._reached = True
            return False
        self.in_flight += 1
        return True

    def leave(self, seconds: float | None) -> None:
        """An admitted request is done; ``seconds``: its latency, None when it failed."""
        self.in_flight -= 1
        if seconds is not None:
            self._seen.append(seconds)

    def tick(self, now: float | None = None) -> None:
        """Close the window if it is due."""
        now = time.perf_counter() if now is None else now
        elapsed = now - self._window_start
        if elapsed < self.period_s or (len(self._seen) < self.min_samples and elapsed < 5 * self.period_s):
            return
        p99 = sorted(self._seen)[int(0.99 * len(self._seen))] if self._seen else 0.0
        if p99 > self.high * self.slo_s:
            self.limit = max(self.min_limit, int(self.limit * self.cut))
        elif p99 < self.low * self.slo_s and self._reached:
            self.limit = min(self.max_limit, self.limit + max(1, int(self.limit * self.step)))
        self._seen.clear()
        self._reached = False
        self._window_start = now


class DynamicBatcher:
    def __init__(self, runtime: Runtime, *, stats: ModelStats, max_batch_size: int, max_delay_s: float,
                 queue_limit: int, slo_s: float | None, timeout_s: float, inline: bool = True,
                 instances: int = 1, batching: Batching | None = None, one_core: bool = ONE_CORE) -> None:
        """``inline=False``: every batch runs on the execution thread, never on the event loop, so the
        loop can always answer a liveness probe while a model call runs (``--exec-timeout-s``).
        ``instances``: batches run at once, each on a thread of its own calling the one runtime (its
        weights shared: onnxruntime sessions and torch modules in inference mode may be called from
        several threads); while they run, the next batch forms from what arrives. ``batching``: how
        requests' inputs are put together (default: concatenated, every shape past the batch fixed).
        ``one_core``: the batcher has about one core to itself (a one-core host, or a worker of as many
        as there are cores), so without an SLO every batch runs inline (``INLINE_BELOW_S``'s note)."""
        self.runtime, self.stats, self.instances = runtime, stats, instances
        self.max_batch_size, self.max_delay_s = max_batch_size, max_delay_s
        self.queue_limit, self.slo_s, self.timeout_s = queue_limit, slo_s, timeout_s
        self.inline, self.one_core = inline, one_core
        self.batching = batching or Batching()
        self.cost_model = CostModel()
        self.guard = None if slo_s is None else LatencyGuard(
            slo_s, limit=min(queue_limit, 4 * max_batch_size), min_limit=min(queue_limit, max_batch_size),
            max_limit=queue_limit)
        self.executions = 0
        self.last_elapsed = 0.0  # seconds of the last model call
        self._queue: deque[_Pending] = deque()
        self._queued_rows = 0
        self._arrived = asyncio.Event()
        self._busy_until: float | None = None
        self._calls: dict[int, float] = {}  # perf_counter when each model call now running began
        self._call_ids = 0
        self.tracer: tracing.Tracer | None = None  # set when the server exports traces
        self._last_done = float("-inf")
        self._concurrent = False  # the last batch held several requests or left some queued
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=instances, thread_name_prefix="infer")
        self._free = asyncio.Semaphore(instances)  # instances not running a batch
        self._running: set[asyncio.Task[None]] = set()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    @property
    def call_started(self) -> float | None:
        """perf_counter when the oldest model call now running began (None: none runs)."""
        return min(self._calls.values(), default=None)

    # -- admission -----------------------------------------------------------------------------
    def batch_target(self) -> int:
        if self.slo_s is None:
            return self.max_batch_size
        found = self.cost_model.coefficients()
        if found is None:
            return self.max_batch_size
        slope, intercept = found
        budget = self.slo_s / 2
        if slope <= 0:
            return self.max_batch_size
        return int(max(1, min(self.max_batch_size, (budget - intercept) // slope)))

    def predicted_latency(self, rows: int) -> float | None:
        target = self.batch_target()
        cost = self.cost_model.cost(target)
        if cost is None:
            return None
        batches_ahead = math.ceil((self._queued_rows + rows) / target / self.instances)
        running = max(0.0, (self._busy_until or 0.0) - time.perf_counter())
        return running + batches_ahead * cost

    def admit(self, rows: int = 1) -> None:
        """Raise ``Overloaded`` now if a request of ``rows`` cannot be queued or would miss the SLO.

        Cheap enough to call before the request body is even read.
        """
        if self._closing:
            raise Replaced("model version is being replaced")
        if len(self._queue) >= self.queue_limit:
            raise Overloaded(f"queue full ({self.queue_limit} requests)")
        if self.slo_s is not None:
            predicted = self.predicted_latency(rows) or 0.0
            if predicted > self.slo_s:
                raise Overloaded(f"would finish in ~{predicted * 1e3:.0f} ms, past the {self.slo_s * 1e3:.0f} ms SLO")

    async def submit(self, array: Inputs) -> np.ndarray:
        self.admit(rows_of(array))
        now = time.perf_counter()
        trace = tracing.current.get()
        pending = _Pending(array, asyncio.get_running_loop().create_future(), now, now + self.timeout_s, trace,
                           self.batching.key(array))
        if trace is not None:
            trace.enqueued = now
        self._queue.append(pending)
        self._queued_rows += pending.rows
        self.stats.queue_depth.set(len(self._queue))
        self._arrived.set()
        return await pending.future

    # -- the loop ------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while not (self._closing and not self._queue):
            if self.instances > 1:
                await self._free.acquire()  # an instance to run the batch about to form
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                if not self._queue:
                    continue
                if self._busy_recently():  # under load: gather a batch worth running
                    await self._gather_more()
                # else idle: the first arrival goes at once
            else:
                await self._gather_more()
            batch = self._take_batch()
            if self.instances == 1:
                if batch:
                    await self._execute(batch)
            elif batch:  # runs beside the others; its instance is free again when it is done
                task = asyncio.get_running_loop().create_task(self._execute(batch))
                self._running.add(task)
                task.add_done_callback(self._finished)
            else:
                self._free.release()
        if self._running:
            await asyncio.wait(set(self._running))
        self._executor.shutdown(wait=False)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._free.release()

    def _busy_recently(self) -> bool:
        """Is the model under concurrent load: did a batch of several requests (or one that left others
        queued) finish within the last ``max_delay``? Then an arrival that finds the queue empty is
        the first of the next batch, and waiting for batch-mates pays (the 2048-wide MLP: 1.45 ms for
        1 row, 8.3 ms for 64). When one core runs both HTTP and the model, the queue is empty after
        every batch, so without this each batch would be only what one turn of the event loop had
        read. A lone client sending one request after another makes batches of one: never held."""
        return (self._concurrent and time.perf_counter() - self._last_done < self.max_delay_s
                and self._batching_pays())

    def _batching_pays(self) -> bool:
        """Is a batch's fixed cost (the cost model's intercept) big enough to be worth waiting to share?
        Digits' ~10 µs batches are not: waiting only added latency (p99 ~11 ms instead of 2–6 ms at
        low load); the 2048-wide MLP's ~1.4 ms are."""
        found = self.cost_model.coefficients()
        return found is not None and found[1] >= WORTH_WAITING_FOR_S

    async def _gather_more(self) -> None:
        target, give_up = self.batch_target(), self._queue[0].arrival + self.max_delay_s
        while self._queued_rows < target and not self._closing:
            left = give_up - time.perf_counter()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=left)
            except TimeoutError:
                return

    def _take_batch(self) -> list[_Pending]:
        target, now, batch, rows = self.batch_target(), time.perf_counter(), [], 0
        self.stats.batch_target.set(target)
        selective = self.batching.mode != "concat"  # not every request may join every batch
        left_out: list[_Pending] = []  # requests this batch may not take: first in line for the next
        while self._queue and (not batch or rows + self._queue[0].rows <= target):
            pending = self._queue.popleft()
            self._queued_rows -= pending.rows
            if pending.future.done():  # the client went away
                continue
            if now > pending.deadline:
                pending.future.set_exception(DeadlineExceeded(f"waited {now - pending.arrival:.3f} s in the queue"))
                continue
            if selective and batch and not self.batching.admits([p.key for p in batch], pending.key):
                left_out.append(pending)
                continue
            self.stats.queue.observe(now - pending.arrival)
            batch.append(pending)
            rows += pending.rows
        for pending in reversed(left_out):
            self._queue.appendleft(pending)
            self._queued_rows += pending.rows
        self.stats.queue_depth.set(len(self._queue))
        return batch

    async def _run(self, array: Inputs) -> np.ndarray:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        rows = rows_of(array)
        predicted = self.cost_model.cost(rows)
        self._busy_until = start + (predicted or 0.0)
        call = self._call_ids = self._call_ids + 1
        self._calls[call] = start
        self.stats.executing.set(len(self._calls))
        try:
            if self.inline and self.instances == 1 and ((self.one_core and self.slo_s is None) or (
                    predicted is not None and predicted < INLINE_BELOW_S)):
                output = self.runtime.run(array)
            else:
                output = await loop.run_in_executor(self._executor, self.runtime.run, array)
        finally:
            del self._calls[call]
            self._busy_until = None
            self.stats.executing.set(len(self._calls))
            self._last_done = time.perf_counter()
            self._concurrent = self._concurrent or bool(self._queue)
        self.last_call = start, time.perf_counter()
        elapsed = self.last_elapsed = self.last_call[1] - start
        self.cost_model.observe(rows, elapsed)
        self.executions += 1
        self.stats.executions.inc()
        self.stats.last_inference_ms = int(time.time() * 1e3)
        self.stats.compute.observe(elapsed)
        self.stats.batch_size.observe(rows)
        self.stats.inferences.inc(rows)
        return output

    async def _execute(self, batch: list[_Pending]) -> None:
        dispatched = time.perf_counter()
        try:
            self._concurrent = len(batch) > 1
            output = await self._run(self.batching.join([p.array for p in batch]))
        except Exception as exc:
            if len(batch) == 1:
                _resolve(batch[0], exc=exc)
                return
            for pending in batch:  # isolate the bad request: its batch-mates still get answers
                try:
                    _resolve(pending, value=await self._run(pending.array))
                    self._count_compute(1)
                except Exception as single_exc:
                    _resolve(pending, exc=single_exc)
            return
        self._count_compute(len(batch))
        start = 0
        for pending in batch:
            _resolve(pending, value=self.batching.answer(output, start, pending.array))
            start += pending.rows
        if self.tracer is not None:  # after the answers: a tracing failure never strands a batch
            try:
                self._trace(batch, dispatched)
            except Exception as exc:
                log.warning("a batch's trace was not recorded: %s", exc)

    def _trace(self, batch: list[_Pending], dispatched: float) -> None:
        """The batch's span, and its times on each traced request it carried."""
        traced = [pending.trace for pending in batch if pending.trace is not None]
        if not traced:
            return
        assert self.tracer is not None
        info = {"id": self.tracer.new_batch_id(), "rows": sum(p.rows for p in batch), "requests": len(batch)}
        exec_start, exec_end = self.last_call
        for trace in traced:
            trace.dispatched, trace.exec_start, trace.exec_end, trace.batch = dispatched, exec_start, exec_end, info
        self.tracer.batch(traced, info, dispatched, exec_end)

    def _count_compute(self, requests: int) -> None:
        self.stats.compute_requests.inc(requests)
        self.stats.compute_request_seconds.inc(requests * self.last_elapsed)

    async def close(self) -> None:
        """Finish what is queued, then stop (the drain of a replaced version)."""
        self._closing = True
        self._arrived.set()
        await self._task


def _resolve(pending: _Pending, value: np.ndarray | None = None, exc: BaseException | None = None) -> None:
    if pending.future.done():
        return
    if exc is not None:
        pending.future.set_exception(exc)
    else:
        pending.future.set_result(value)
